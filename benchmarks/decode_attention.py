"""One decode step's attention at the released thinker's widths, against the bytes it must read.

Per row count and decode position, over ``--layers`` distinct layer buffers: packed-GQA SDPA over
the whole static buffer, cut at the next ``--bucket`` multiple, and the split-KV Triton kernel:
seconds per layer, and the bytes it must read per second over the copy bandwidth measured in the
same run (docs/benchmarks.md, "Methods").

    python benchmarks/decode_attention.py                     # H200
"""

import statistics
from functools import partial
from typing import Any

import harness
import torch
from omni_grpo.models.decode_kernel import decode_attention_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

HEADS, KV_HEADS, DIM = 32, 4, 128


def _sdpa(q: torch.Tensor, keys: list, values: list, mask: torch.Tensor, cut: int) -> None:
    """Packed-GQA SDPA of every layer's buffer, cut at ``cut`` positions."""
    m = mask[:, None, None, :cut]
    for k, v in zip(keys, values, strict=True):
        sdpa(q, k[:, :, :cut], v[:, :, :cut], attn_mask=m)


def _kernel(q: torch.Tensor, keys: list, values: list, start: Any, slot: Any) -> None:
    """The split-KV kernel over every layer's buffer (reads keys ``[start, slot]`` only)."""
    for k, v in zip(keys, values, strict=True):
        decode_attention_kernel(q, k, v, start, slot, DIM**-0.5)


if __name__ == "__main__":
    ap = harness.parser(__doc__, rows=[64, 256], positions=[1, 256, 511], prompt=411, max_new=512)
    args = harness.add_options(ap, bucket=128, layers=8).parse_args()
    limits = harness.device_limits("cuda", copy_gib=2)
    bw, total = limits["copy_bytes_per_s"], args.prompt + args.max_new
    out: dict[str, Any] = {"copy_bytes_per_s": bw, "limits": limits, "cases": []}
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    for rows in args.rows:
        keys = [torch.randn(rows, KV_HEADS, total, DIM, **bf16) for _ in range(args.layers)]
        values = [torch.randn_like(k) for k in keys]
        q = torch.randn(rows, KV_HEADS, HEADS // KV_HEADS, DIM, **bf16)
        for new in args.positions:
            length = args.prompt + new
            pad = torch.randint(0, args.prompt // 2, (rows,), device="cuda")
            pos = torch.arange(total, device="cuda")
            mask = (pos[None] >= pad[:, None]) & (pos[None] < length)
            bucket = min(total, args.prompt + -(-new // args.bucket) * args.bucket)
            must = rows * KV_HEADS * (length - pad.float().mean().item()) * DIM * 2 * 2
            start, slot = pad.to(torch.int32), torch.tensor([length - 1], device="cuda")
            case: dict[str, Any] = {"rows": rows, "length": length, "bucket": bucket}
            cut = partial(_sdpa, q, keys, values, mask)
            variants = {"sdpa_full": partial(cut, total), "sdpa_bucket": partial(cut, bucket)}
            variants["kernel"] = partial(_kernel, q, keys, values, start, slot)
            for name, fn in variants.items():
                s = statistics.median(harness.gpu_seconds(fn, 20)) / args.layers
                case[name] = {"s_per_layer": s, "ratio_to_copy_bw": must / s / bw}
            ref = sdpa(q, keys[0], values[0], attn_mask=mask[:, None, None], scale=DIM**-0.5)
            got = decode_attention_kernel(q, keys[0], values[0], start, slot, DIM**-0.5)
            case["kernel_max_abs_diff_vs_sdpa"] = float((got.float() - ref.float()).abs().max())
            out["cases"].append(case)
            harness.progress(case)
    harness.emit("decode_attention", out, args.save)
