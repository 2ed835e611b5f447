"""Benchmark: composed thinker (load_thinker) vs transformers' Qwen3-Omni thinker, one forward.

Tiny factory checkpoint, extracted to ``vl`` + ``audio``. Batch of 8 left-padded prompts, each
mixing text, an image, a separate audio and a video with its soundtrack interleaved
(``use_audio_in_video``). Both models get the same tensors; the outputs are checked to agree
(max abs logit difference is reported), then each forward is timed. Prints one JSON object.

    uv run python benchmarks/thinker_forward.py [--repeats 20] [--device cpu|cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omni_extract import extract
from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
from omni_grpo.models import load_thinker
from omni_grpo.testing.models import Ids, build_batch
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration


def samples(batch: int) -> list[list[tuple]]:
    txt = [5, 6, 7, 8, 9]
    return [
        [
            ("text", txt * (1 + i % 3)),
            ("image", (1, 8, 8)),
            ("audio", 400 + 50 * i),
            ("av", (4, 8, 8), 1.0, 300),
            ("text", txt),
        ]
        for i in range(batch)
    ]


def timed(fn, repeats: int, device: str) -> tuple[float, float]:
    fn()  # warm-up (also loads the lazy audio tower)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        omni = make_tiny_omni(root / "omni", TinyOmniSpec())
        extract(omni, root / "vl", variant="vl")
        extract(omni, root / "audio", variant="audio")
        ref = (
            Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(omni).to(args.device).eval()
        )
        thinker = load_thinker(root / "vl", dtype="float32", device=args.device)
        side = json.loads((root / "vl" / "config.json").read_text())["omni_sideband"]
        pad = json.loads((root / "vl" / "generation_config.json").read_text())["pad_token_id"]
        batch = build_batch(samples(args.batch), Ids.from_sideband(side, pad), "left")
        batch = {k: v.to(args.device) for k, v in batch.items()}
        with torch.no_grad():
            ours_logits = thinker(**batch, use_audio_in_video=True).logits
            ref_logits = ref(**batch, use_audio_in_video=True).logits
            valid = batch["attention_mask"].bool()
            diff = (ours_logits - ref_logits)[valid].abs().max().item()
            ours_best, ours_med = timed(
                lambda: thinker(**batch, use_audio_in_video=True), args.repeats, args.device
            )
            ref_best, ref_med = timed(
                lambda: ref(**batch, use_audio_in_video=True), args.repeats, args.device
            )
    print(
        json.dumps(
            {
                "benchmark": "thinker_forward",
                "device": args.device,
                "threads": torch.get_num_threads(),
                "batch": args.batch,
                "seq_len": int(batch["input_ids"].shape[1]),
                "max_abs_logit_diff": diff,
                "ours_ms_best": round(ours_best * 1e3, 3),
                "ours_ms_median": round(ours_med * 1e3, 3),
                "baseline": "transformers Qwen3OmniMoeThinkerForConditionalGeneration.forward",
                "baseline_ms_best": round(ref_best * 1e3, 3),
                "baseline_ms_median": round(ref_med * 1e3, 3),
                "speedup_best": round(ref_best / ours_best, 3),
                "speedup_median": round(ref_med / ours_med, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
