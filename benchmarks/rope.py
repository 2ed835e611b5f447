"""Benchmark: omni_rope.get_rope_index vs transformers' Qwen3-Omni reference, same inputs, same run.

Batch of 8 prompts, each a 32-frame video (16 temporal grids of 8x8 merged patches = 1024 video
tokens) with its 16 s soundtrack interleaved (use_audio_in_video, 208 audio tokens), chat text around
it, left padding with varied prompt lengths. Asserts identical outputs, prints one JSON object.

    uv run python benchmarks/rope.py [--repeats 40] [--device cpu|cuda] [--threads N]

Both sides run with 1 torch thread by default: the reference is a Python loop, and our tensors
(~11k tokens) are too small to gain from intra-op threads, which on an oversubscribed machine (a
shared 2-core box) only add barrier waits. ``--threads 0`` keeps torch's default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from omni_extract.tiny import TinyOmniSpec, build_config
from omni_extract.tokens import REAL_IDS
from omni_rope import OmniRopeConfig, audio_in_video_segment_ids, get_rope_index
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

FRAMES, TEMPORAL_PATCH, FPS = 32, 2, 2.0
GRID = (FRAMES // TEMPORAL_PATCH, 16, 16)  # patches; 8x8 after the 2x2 merge
MEL_FRAMES_PER_SECOND = 100  # 16 kHz audio, hop 160


def build_batch(config: OmniRopeConfig, batch: int, device: str) -> tuple[torch.Tensor, ...]:
    seconds = FRAMES / FPS
    spg = TEMPORAL_PATCH / FPS
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(batch):
        prefix = torch.randint(0, 5000, (20 + 7 * i,), generator=gen)
        suffix = torch.randint(0, 5000, (30 + 3 * i,), generator=gen)
        seg = audio_in_video_segment_ids(config, GRID, spg, int(seconds * MEL_FRAMES_PER_SECOND))
        rows.append(torch.cat([prefix, seg, suffix]))
    width = max(len(r) for r in rows)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    grids = torch.tensor([GRID] * batch)
    spgs = torch.full((batch,), spg)
    frames = torch.full((batch,), int(seconds * MEL_FRAMES_PER_SECOND))
    return tuple(t.to(device) for t in (ids, mask, grids, spgs, frames))


def timed(fn, repeats: int, device: str) -> tuple[float, float, object]:
    """(best, median) wall time of ``repeats`` calls after a warm-up; best is the least noisy on a
    shared machine, the median is reported too."""
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    omni = build_config(TinyOmniSpec(), REAL_IDS, vocab_size=1024)
    config = OmniRopeConfig.from_omni_config(omni)
    reference = Qwen3OmniMoeThinkerForConditionalGeneration(omni.thinker_config).eval()
    ids, mask, grids, spgs, frames = build_batch(config, args.batch, args.device)

    def ours():
        return get_rope_index(
            ids,
            mask,
            config,
            video_grid_thw=grids,
            second_per_grids=spgs,
            audio_seqlens=frames,
            use_audio_in_video=True,
        )

    def ref():
        return reference.get_rope_index(ids, None, grids, mask, True, frames, spgs)

    t_ours, med_ours, (pos, delta) = timed(ours, args.repeats, args.device)
    t_ref, med_ref, (rpos, rdelta) = timed(ref, max(5, args.repeats // 4), args.device)
    assert torch.equal(pos, rpos) and torch.equal(delta, rdelta), "differs from the reference"
    extra = {}
    if args.device != "cpu":
        # Small accelerator batches run on the host by default; time the all-on-device path too.
        import omni_rope.positions as core

        saved, core.HOST_MAX_TOKENS = core.HOST_MAX_TOKENS, 0
        t_dev, _, (dpos, ddelta) = timed(ours, args.repeats, args.device)
        core.HOST_MAX_TOKENS = saved
        assert torch.equal(dpos, rpos) and torch.equal(ddelta, rdelta), "on-device results differ"
        extra = {"omni_rope_on_device_ms": round(t_dev * 1e3, 3)}
    print(
        json.dumps(
            {
                "benchmark": "rope",
                "device": args.device,
                "torch_threads": torch.get_num_threads(),
                "batch": args.batch,
                "seq_len": ids.shape[1],
                "video_tokens_per_row": int((ids[0] == config.video_token_id).sum()),
                "audio_tokens_per_row": int((ids[0] == config.audio_token_id).sum()),
                "omni_rope_ms": round(t_ours * 1e3, 3),
                "reference_ms": round(t_ref * 1e3, 3),
                "speedup": round(t_ref / t_ours, 1),
                "omni_rope_median_ms": round(med_ours * 1e3, 3),
                "reference_median_ms": round(med_ref * 1e3, 3),
                "speedup_median": round(med_ref / med_ours, 1),
                "identical": True,
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
