"""Benchmark: composed thinker (load_thinker) vs transformers' Qwen3-Omni thinker, one forward.

Tiny factory checkpoint extracted to ``vl`` + ``audio``; a batch of 8 left-padded prompts, each
mixing text, an image, a separate audio and a video with its soundtrack interleaved. Both models
get the same tensors; the max logit difference is reported, then each forward is timed.

    uv run python benchmarks/thinker_forward.py [--repeats 20] [--device cpu|cuda] [--threads 1]
"""

import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

import harness
import torch
from omni_extract import extract
from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
from omni_grpo.models import load_thinker
from omni_grpo.testing.models import Ids, build_batch
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

if __name__ == "__main__":
    args = harness.parser(__doc__, repeats=20, batch=8, device="cpu", threads=1).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        omni = make_tiny_omni(root / "omni", TinyOmniSpec())
        extract(omni, root / "vl", variant="vl")
        extract(omni, root / "audio", variant="audio")
        ref = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(omni)
        ref = ref.to(args.device).eval()
        thinker = load_thinker(root / "vl", dtype="float32", device=args.device)
        side = json.loads((root / "vl" / "config.json").read_text())["omni_sideband"]
        pad = json.loads((root / "vl" / "generation_config.json").read_text())["pad_token_id"]
        txt, image, av = [5, 6, 7, 8, 9], ("image", (1, 8, 8)), ("av", (4, 8, 8), 1.0, 300)
        rows = [
            [("text", txt * (1 + i % 3)), image, ("audio", 400 + 50 * i), av, ("text", txt)]
            for i in range(args.batch)
        ]
        batch = build_batch(rows, Ids.from_sideband(side, pad), "left")
        batch = {k: v.to(args.device) for k, v in batch.items()}
        with torch.no_grad():
            ours_logits = thinker(**batch, use_audio_in_video=True).logits
            ref_logits = ref(**batch, use_audio_in_video=True).logits
            diff = (ours_logits - ref_logits)[batch["attention_mask"].bool()].abs().max().item()
            forwards = [partial(m, **batch, use_audio_in_video=True) for m in (thinker, ref)]
            ours, base = (harness.seconds(f, args.repeats, args.device) for f in forwards)
    record = {"device": args.device, "threads": torch.get_num_threads(), "batch": args.batch}
    record |= {"seq_len": int(batch["input_ids"].shape[1]), "max_abs_logit_diff": diff}
    record["baseline"] = "transformers Qwen3OmniMoeThinkerForConditionalGeneration.forward"
    for tag, stat in (("best", min), ("median", statistics.median)):
        ms = [stat(ours) * 1e3, stat(base) * 1e3]
        record |= {f"ours_ms_{tag}": round(ms[0], 3), f"baseline_ms_{tag}": round(ms[1], 3)}
        record[f"speedup_{tag}"] = round(ms[1] / ms[0], 3)
    harness.emit("thinker_forward", record, args.save)
