"""Benchmark: omni_rope.get_rope_index vs transformers' Qwen3-Omni reference, same inputs, same run.

Batch of 8 prompts, each a 32-frame video (1024 video tokens) with its 16 s soundtrack interleaved
(use_audio_in_video, 208 audio tokens), chat text around it, left-padded; outputs asserted
identical. One torch thread by default: the reference is a Python loop, and ~11k tokens gain
nothing from intra-op threads on a shared box (``--threads 0``: torch's default).

    uv run python benchmarks/rope.py [--repeats 40] [--device cpu|cuda] [--threads N]
"""

import statistics
from functools import partial

import harness
import torch
from omni_extract.tiny import TinyOmniSpec, build_config
from omni_extract.tokens import REAL_IDS
from omni_rope import OmniRopeConfig, audio_in_video_segment_ids, get_rope_index
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

FRAMES, TEMPORAL_PATCH, FPS = 32, 2, 2.0
GRID = (FRAMES // TEMPORAL_PATCH, 16, 16)  # patches; 8x8 after the 2x2 merge
MEL_FRAMES = int(FRAMES / FPS * 100)  # 16 kHz audio, hop 160: 100 mel frames a second


if __name__ == "__main__":
    args = harness.parser(__doc__, repeats=40, batch=8, device="cpu", threads=1).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    omni = build_config(TinyOmniSpec(), REAL_IDS, vocab_size=1024)
    config = OmniRopeConfig.from_omni_config(omni)
    reference = Qwen3OmniMoeThinkerForConditionalGeneration(omni.thinker_config).eval()
    spg, batch = TEMPORAL_PATCH / FPS, args.batch
    gen, rows = torch.Generator().manual_seed(0), []
    for i in range(batch):  # each row: text, a 32-frame video with its soundtrack, text
        prefix = torch.randint(0, 5000, (20 + 7 * i,), generator=gen)
        suffix = torch.randint(0, 5000, (30 + 3 * i,), generator=gen)
        seg = audio_in_video_segment_ids(config, GRID, spg, MEL_FRAMES)
        rows.append(torch.cat([prefix, seg, suffix]))
    ids = pad_sequence(rows, batch_first=True, padding_side="left")
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
    grids, spgs = torch.tensor([GRID] * batch), torch.full((batch,), spg)
    batch_tensors = (ids, mask, grids, spgs, torch.full((batch,), MEL_FRAMES))
    ids, mask, grids, spgs, frames = (t.to(args.device) for t in batch_tensors)
    kw = {"video_grid_thw": grids, "second_per_grids": spgs, "audio_seqlens": frames}
    ours = partial(get_rope_index, ids, mask, config, **kw, use_audio_in_video=True)
    ref = partial(reference.get_rope_index, ids, None, grids, mask, True, frames, spgs)
    t_ours = harness.seconds(ours, args.repeats, args.device)
    t_ref = harness.seconds(ref, max(5, args.repeats // 4), args.device)
    (pos, delta), (rpos, rdelta) = ours(), ref()
    assert torch.equal(pos, rpos) and torch.equal(delta, rdelta), "differs from the reference"
    extra = {}
    if args.device != "cpu":
        # Small accelerator batches run on the host by default; time the all-on-device path too.
        import omni_rope.positions as core

        saved, core.HOST_MAX_TOKENS = core.HOST_MAX_TOKENS, 0
        t_dev = harness.seconds(ours, args.repeats, args.device)
        dpos, ddelta = ours()
        core.HOST_MAX_TOKENS = saved
        assert torch.equal(dpos, rpos) and torch.equal(ddelta, rdelta), "on-device results differ"
        extra = {"omni_rope_on_device_ms": round(min(t_dev) * 1e3, 3)}
    record = {"device": args.device, "torch_threads": torch.get_num_threads(), "batch": args.batch}
    record["seq_len"] = ids.shape[1]
    for kind in ("video", "audio"):
        token = getattr(config, f"{kind}_token_id")
        record[f"{kind}_tokens_per_row"] = int((ids[0] == token).sum())
    for tag, stat in (("", min), ("_median", statistics.median)):
        ms = [stat(t_ours) * 1e3, stat(t_ref) * 1e3]
        record |= {f"omni_rope{tag}_ms": round(ms[0], 3), f"reference{tag}_ms": round(ms[1], 3)}
        record[f"speedup{tag}"] = round(ms[1] / ms[0], 1)
    record |= {"identical": True, **extra}
    harness.emit("rope", record, args.save)
