"""The text attention's rotary embedding, one layer's q and k at the released widths: transformers'
composition against ``models.rotary_kernel``, against the bytes it must move.

Shapes: a training micro-batch (``--rows`` x ``--length`` tokens, the attention's transposed
views) and a decode step (``--decode-rows`` x 1). Per shape: GPU seconds of each (CUDA events,
median), the bytes the rotation must read and write (q, k in and out, cos and sin) over the copy
bandwidth measured in the same run, the ratio, and whether the bits are transformers' (they
must be). A decode step's figure is launch-bound: it counts kernels more than bytes.

    python benchmarks/rotary.py                                       # one GPU
"""

import statistics

import harness
import torch
from omni_grpo.models.rotary_kernel import rotate
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import rotate_half

HEADS, KV_HEADS, DIM = 32, 4, 128


def composition(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb``, as written."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def fused(q, k, cos, sin):
    return rotate(q, cos, sin), rotate(k, cos, sin)


def shape_record(rows: int, length: int, limit: float) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(rows, length, HEADS, DIM, device=dev, dtype=bf16).transpose(1, 2)
    k = torch.randn(rows, length, KV_HEADS, DIM, device=dev, dtype=bf16).transpose(1, 2)
    angles = torch.rand(rows, length, DIM, device=dev) * 1000
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    moved = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
    out = {"rows": rows, "tokens": rows * length, "bytes": moved, "limit_s": moved / limit}
    with torch.no_grad():
        ref, ours = composition(q, k, cos, sin), fused(q, k, cos, sin)
        out["bitwise_equal"] = all(
            torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
            for a, b in zip(ref, ours, strict=True)
        )
        for name, fn in (("transformers", composition), ("fused", fused)):
            s = statistics.median(harness.gpu_seconds(lambda f=fn: f(q, k, cos, sin), 50))
            out[f"{name}_s"] = s
            out[f"{name}_of_limit"] = round(out["limit_s"] / s, 3)
    out["speedup"] = round(out["transformers_s"] / out["fused_s"], 2)
    return out


if __name__ == "__main__":
    ap = harness.parser(__doc__, rows=16, length=560, decode_rows=64)
    args = ap.parse_args()
    harness.cuda_device("rotary.py")
    limits = harness.device_limits("cuda", copy_gib=2)
    shapes = {
        "training_micro_batch": shape_record(args.rows, args.length, limits["copy_bytes_per_s"]),
        "decode_step": shape_record(args.decode_rows, 1, limits["copy_bytes_per_s"]),
    }
    record = {"device": torch.cuda.get_device_name(), "limits": limits, "shapes": shapes}
    record["what"] = "one layer's q [B, 32, T, 128] and k [B, 4, T, 128] rotated, bf16"
    harness.emit("rotary", record, args.save)
