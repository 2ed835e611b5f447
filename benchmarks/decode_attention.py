"""One decode step's attention at the released thinker's widths, against the bytes it must read.

The decode step attends every row's one new query (32 heads, packed as 8 rows per KV group) to its
KV cache (4 KV heads x 128, bf16). What it must read per layer: each row's keys and values up to
its current length — ``rows x kv_heads x length x head_dim x 2 (K, V) x 2 bytes``. The decoder
keeps a static, left-padded buffer of ``prompt + max_new_tokens`` positions; reading the whole
buffer at every step is up to twice what a step needs early in the decode.

Variants, each timed over ``--layers`` distinct layer buffers (so the cache is read from HBM, not
L2), per row count and decode position:
- ``sdpa_full``: ``models.decode_attention``'s packed-GQA SDPA over the whole buffer, with a mask;
- ``sdpa_bucket``: the same over the buffer cut at the next multiple of ``--bucket`` past the
  current length (what per-bucket decode graphs would read);
- ``kernel``: ``omni_grpo.models.decode_kernel.decode_attention_kernel``, the split-KV Triton
  kernel the decoder uses on CUDA (its largest difference to SDPA is reported too).

Prints one JSON object: seconds per layer, achieved bytes/s of what must be read, and the ratio to
the copy bandwidth measured in the same run.

    python benchmarks/decode_attention.py                     # H200
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import torch
from omni_grpo.models.decode_kernel import decode_attention_kernel


def _timed(fn: Any, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _timed(lambda: dst.copy_(src))


def _sdpa(q: torch.Tensor, keys: list, values: list, mask: torch.Tensor, cut: int) -> None:
    """Packed-GQA SDPA of every layer's buffer, cut at ``cut`` positions."""
    m = mask[:, None, None, :cut]
    for k, v in zip(keys, values, strict=True):
        torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, :cut], v[:, :, :cut], attn_mask=m
        )


def _kernel(
    q: torch.Tensor, keys: list, values: list, start: torch.Tensor, slot: torch.Tensor
) -> None:
    """The split-KV kernel over every layer's buffer (reads keys ``[start, slot]`` only)."""
    for k, v in zip(keys, values, strict=True):
        decode_attention_kernel(q, k, v, start, slot, q.shape[-1] ** -0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    bw = copy_bandwidth()
    heads, kv_heads, dim = 32, 4, 128
    total = args.prompt + args.max_new
    out: dict[str, Any] = {"copy_bytes_per_s": bw, "cases": []}
    for rows in args.rows:
        keys = [
            torch.randn(rows, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(args.layers)
        ]
        values = [torch.randn_like(k) for k in keys]
        q = torch.randn(rows, kv_heads, heads // kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        for new in args.positions:
            length = args.prompt + new
            pad = torch.randint(0, args.prompt // 2, (rows,), device="cuda")
            pos = torch.arange(total, device="cuda")
            mask = (pos[None] >= pad[:, None]) & (pos[None] < length)
            bucket = min(total, args.prompt + -(-new // args.bucket) * args.bucket)
            must = rows * kv_heads * (length - pad.float().mean().item()) * dim * 2 * 2

            case: dict[str, Any] = {"rows": rows, "length": length, "bucket": bucket}
            for name, cut in (("sdpa_full", total), ("sdpa_bucket", bucket)):
                s = _timed(functools.partial(_sdpa, q, keys, values, mask, cut)) / args.layers
                case[name] = {"s_per_layer": s, "ratio_to_copy_bw": must / s / bw}
            start = pad.to(torch.int32)
            slot = torch.tensor([length - 1], device="cuda")
            s = _timed(functools.partial(_kernel, q, keys, values, start, slot)) / args.layers
            case["kernel"] = {"s_per_layer": s, "ratio_to_copy_bw": must / s / bw}
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, keys[0], values[0], attn_mask=mask[:, None, None], scale=dim**-0.5
            )
            got = decode_attention_kernel(q, keys[0], values[0], start, slot, dim**-0.5)
            case["kernel_max_abs_diff_vs_sdpa"] = float((got.float() - ref.float()).abs().max())
            out["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--positions", type=int, nargs="+", default=[1, 256, 511])
    ap.add_argument("--prompt", type=int, default=411)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    print(json.dumps(run(ap.parse_args())))


if __name__ == "__main__":
    main()
