"""The exact path's row-invariant GEMMs at a training micro-batch's size, by rows per tile.

``rollout.exact_logprobs`` runs the trainer's policy forward on ``exact.matmul`` and the grouped
GEMM (``models.grouped_gemm``), whose reduction is a function of ``(K, N)`` only. How many rows a
program's tile takes (``RowTiling``: 64 rows and 4 warps, as a decode step runs them, or more)
leaves each element's arithmetic alone. Per product of the 48-layer thinker's micro-batch (16k
tokens, 8 routed experts each) and per tiling: the time, the FLOP rate against the matmul rate
measured in the same run and against torch's own kernel on the same operands (cuBLAS,
``torch._grouped_mm``: not row-invariant), and whether every row has the bits of the 64-row
tiling in the launch order it had before (``64x4_m_first``) and of the same rows computed alone
(7 rows: a decode step's). Then the MoE block's gather folded into the grouped GEMM's loads
against the gathered copy (``gathered``). docs/exact-logprobs.md.

    python benchmarks/exact_tiles.py            # needs CUDA
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import harness
import torch
from omni_grpo.models.grouped_gemm import ROW_TILES_FIRST

HIDDEN, Q_WIDTH, KV_WIDTH, EXPERTS, TOP_K, EXPERT_FFN, VOCAB = 2048, 4096, 512, 128, 8, 768, 152064
TOKENS, COMPLETION, RANK, ALONE = 16384, 8192, 16, 7
# (rows per tile, warps, row tiles per launch group, ...); "m_first": the launch order before the
# grouping (every row tile of a column block, then the next block: GROUP_M past the row tiles)
M_FIRST = ROW_TILES_FIRST
TILINGS = {"64x4_m_first": (64, 4, M_FIRST), "128x4": (128, 4, 8), "128x8": (128, 8, 8)}
# (..., BLOCK_N where the product has the columns (0: the default), pipeline stages, split-K
# chunks summed in one program): the same per-element arithmetic, other schedules. Session 42
# (exact_tiles_h100.json) also ran 64x4, 128x8_m_first, 256x8, 128x8_g4 and _g16: none beat
# 128x4 or 128x8 by more than 4 % on any product.
TILINGS |= {"128x8_n256": (128, 8, 8, 256), "128x8_s4": (128, 8, 8, 0, 4)}
TILINGS |= {"128x4_s4": (128, 4, 8, 0, 4), "128x8_n256_s4": (128, 8, 8, 256, 4)}
TILINGS |= {"128x8_fused": (128, 8, 8, 0, 3, True), "128x4_fused": (128, 4, 8, 0, 3, True)}


def _ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _compare(
    flops: float,
    rate: float,
    torch_fn: Callable[[], Any],
    exact_fn: Callable[[Any], torch.Tensor],
    alone_fn: Callable[[], torch.Tensor],
) -> dict[str, Any]:
    """Every tiling of one product: ms, TFLOP/s, share of the matmul rate, x torch, equality."""
    from omni_grpo.models.grouped_gemm import RowTiling

    torch_ms = _ms(torch_fn)
    rec: dict[str, Any] = {"torch_ms": round(torch_ms, 4)}
    rec["torch_tflops"] = round(flops / torch_ms / 1e9, 1)
    base = exact_fn(RowTiling(64, 4, M_FIRST))
    alone = alone_fn()
    for name, tiling in TILINGS.items():
        out = exact_fn(RowTiling(*tiling))
        ms = _ms(lambda t=tiling: exact_fn(RowTiling(*t)))
        rec[name] = {
            "ms": round(ms, 4),
            "tflops": round(flops / ms / 1e9, 1),
            "of_matmul_rate": round(flops / (ms / 1e3) / rate, 3),
            "torch_over_this": round(torch_ms / ms, 3),
            "bitwise_equal_to_64x4_m_first": bool(torch.equal(out, base)),
            "alone_rows_equal": bool(torch.equal(out[:ALONE], alone)),
        }
    return rec


def dense(dev: torch.device, rate: float) -> dict[str, Any]:
    from omni_grpo.exact.matmul import mm
    from omni_grpo.models.grouped_gemm import DECODE_TILING

    shapes = {"q_proj": (HIDDEN, Q_WIDTH, TOKENS), "o_proj": (Q_WIDTH, HIDDEN, TOKENS)}
    shapes |= {"kv_proj": (HIDDEN, KV_WIDTH, TOKENS), "router": (HIDDEN, EXPERTS, TOKENS)}
    shapes |= {"lora_a": (HIDDEN, RANK, TOKENS), "lora_b": (RANK, Q_WIDTH, TOKENS)}
    shapes["lm_head"] = (HIDDEN, VOCAB, COMPLETION)
    out: dict[str, Any] = {}
    for name, (k, n, m) in shapes.items():
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        out[name] = _compare(
            2.0 * m * n * k,
            rate,
            lambda a=a, w=w: torch.nn.functional.linear(a, w),
            lambda tiling, a=a, w=w: mm(a, w.t(), None, tiling),
            lambda a=a, w=w: mm(a[:ALONE], w.t(), None, DECODE_TILING),
        )
        harness.progress({name: out[name]})
    return out


def grouped(dev: torch.device, rate: float) -> dict[str, Any]:
    from omni_grpo.models.grouped_gemm import DECODE_TILING, gmm

    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, device=dev, generator=gen)
    experts = torch.topk(logits, TOP_K, dim=-1).indices.reshape(-1)
    order = torch.sort(experts, stable=True)
    offs = torch.cumsum(torch.bincount(order.values, minlength=EXPERTS), 0).to(torch.int32)
    pairs = experts.numel()
    first = int(offs[0])  # expert 0's rows, taken alone (a decode step's few rows of one expert)
    shapes = {"gate_up": (HIDDEN, 2 * EXPERT_FFN), "down": (EXPERT_FFN, HIDDEN)}
    shapes |= {"lora_a": (HIDDEN, RANK), "lora_b": (RANK, 2 * EXPERT_FFN)}
    out: dict[str, Any] = {"pairs": pairs, "rows_per_expert_mean": pairs / EXPERTS}
    for name, (k, n) in shapes.items():
        x = torch.randn(pairs, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(EXPERTS, k, n, device=dev, dtype=torch.bfloat16) / k**0.5
        alone_offs = torch.full_like(offs, min(ALONE, first))
        out[name] = _compare(
            2.0 * pairs * n * k,
            rate,
            lambda x=x, w=w: torch._grouped_mm(x, w, offs=offs),
            lambda tiling, x=x, w=w: gmm(x, w, offs, None, tiling),
            lambda x=x, w=w, o=alone_offs: gmm(x[: min(ALONE, first)], w, o, None, DECODE_TILING),
        )
        harness.progress({f"grouped_{name}": out[name]})
    return out


def _copy_then_gmm(h: Any, ids: Any, w: Any, offs: Any, plan: Any, tiling: Any) -> Any:
    from omni_grpo.models.grouped_gemm import gmm

    return gmm(h.index_select(0, ids), w, offs, plan, tiling)


def _gather_gmm(h: Any, ids: Any, w: Any, offs: Any, plan: Any, tiling: Any) -> Any:
    from omni_grpo.models.grouped_gemm import gmm

    return gmm(h, w, offs, plan, tiling, gather=ids)


def gathered(dev: torch.device) -> dict[str, Any]:
    """The MoE block's gate_up and LoRA A products as a no-grad forward runs them: reading each
    pair's token row through the index (``gmm(..., gather=)``) against gathering the rows into
    a ``[pairs, H]`` copy first, at a micro-batch's tokens (bulk tiling) and a decode step's."""
    from omni_grpo.models.grouped_gemm import row_tiling, tile_map

    out: dict[str, Any] = {}
    for tokens in (TOKENS, ALONE):
        gen = torch.Generator(device=dev).manual_seed(0)
        logits = torch.randn(tokens, EXPERTS, device=dev, generator=gen)
        order = torch.sort(torch.topk(logits, TOP_K, dim=-1).indices.reshape(-1), stable=True)
        ids = order.indices // TOP_K  # each pair's token, in expert order
        offs = torch.cumsum(torch.bincount(order.values, minlength=EXPERTS), 0).to(torch.int32)
        tiling = row_tiling(ids.numel(), grouped=True)
        plan = tile_map(offs, ids.numel(), tiling.block_m)
        h = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        for name, n in (("gate_up", 2 * EXPERT_FFN), ("lora_a", RANK)):
            w = torch.randn(EXPERTS, HIDDEN, n, device=dev, dtype=torch.bfloat16) / HIDDEN**0.5

            operands = (h, ids, w, offs, plan, tiling)
            copy, read = partial(_copy_then_gmm, *operands), partial(_gather_gmm, *operands)
            rec = {"equal": bool(torch.equal(copy(), read()))}
            rec |= {"copy_then_gmm_ms": round(_ms(copy), 4), "gather_gmm_ms": round(_ms(read), 4)}
            rec["speedup"] = round(rec["copy_then_gmm_ms"] / rec["gather_gmm_ms"], 3)
            out[f"{name}_{tokens}_tokens"] = rec
            harness.progress({f"gathered_{name}_{tokens}": rec})
    return out


if __name__ == "__main__":
    args = harness.parser(__doc__).parse_args()
    dev = harness.cuda_device("exact_tiles.py")
    torch.manual_seed(0)
    limits = harness.device_limits(dev)
    rate = limits["matmul_flops_per_s"]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "limits": limits}
    result["shapes"] = {"tokens": TOKENS, "completion_tokens": COMPLETION, "top_k": TOP_K}
    result["dense"] = dense(dev, rate)
    result["grouped"] = grouped(dev, rate)
    result["gathered"] = gathered(dev)
    harness.emit("exact_tiles", result, args.save)
