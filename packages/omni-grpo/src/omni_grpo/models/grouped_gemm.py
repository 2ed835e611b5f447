"""A grouped GEMM in Triton for the MoE experts: ``out[rows of e] = x[rows of e] @ w[e]``.

Two users, one kernel. Exact mode (``omni_grpo.exact.grouped``) needs it row-invariant: every
expert's rows are cut into ``BLOCK_M``-row tiles with the tiling a function of ``(K, N)`` only
(:func:`tiles`), so each output row is one in-order fp32 accumulation over ``K`` whatever the
rows around it. The default path's generation (``grouped_experts.takes_decode_route``) takes it
for speed: in a decode step an expert sees a few rows, and on the H200 torch's grouped GEMM
(torch 2.11) read the experts at 0.5-0.7 of the copy bandwidth and took 18-56 us for a rank-16
adapter product that reads almost nothing, where this kernel ran at 0.87-1.0 and in 4-7 us
(ops alone; the 48-layer decode step gained 4 %: ``benchmarks/results/grouped_decode_h200.json``).

The tile -> (expert, first row) map is computed on the device from the group offsets (no host
sync: the decode step stays CUDA-graph capturable; a decode step gets it from the one-kernel
routing plan, ``models.route_plan``); the grid is sized for the worst case and spare tiles exit
at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# One config per (K, N) class; BLOCK_M never depends on M (64 rows: one warpgroup's wgmma).
NUM_WARPS = 4
NUM_STAGES = 3


def tiles(k: int, n: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` for a product with reduction ``k`` and ``n`` output columns."""
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return block_n, block_k


BLOCK_M = 64


class RowTiling(NamedTuple):
    """How many rows a program's tile takes (``block_m``), its warps, and how many row tiles
    run side by side over every column block before the next ones (``group_m``, the launch
    order: :func:`swizzle`); optionally a wider column tile (``block_n``, 0: :func:`tiles`'),
    the software pipeline's depth (``stages``) and, for :func:`omni_grpo.exact.matmul.mm`'s
    split-``K`` products, the chunks summed inside each program instead of through fp32
    partials in memory (``fuse_splits``). None of them touches an output element's arithmetic
    — the same ``BLOCK_K`` chunks of ``K`` in order, each through ``m64 x n x k16`` tensor-core
    instructions (a 128-row tile is two of them side by side), the split chunks added in chunk
    order in fp32 — so a row has the same bits under every tiling (GPU-tested:
    ``packages/omni-grpo/tests/test_exact_gpu.py``); only the speed differs
    (``benchmarks/exact_tiles.py``)."""

    block_m: int
    warps: int
    group_m: int
    block_n: int = 0
    stages: int = NUM_STAGES
    fuse_splits: bool = False

    def column_block(self, k: int, n: int) -> int:
        """``BLOCK_N`` for a product with ``n`` columns: the override where ``n`` fills it."""
        default = tiles(k, n)[0]
        return self.block_n if self.block_n > default and n >= self.block_n else default


# A GROUP_M past any grid's row tiles: every row tile of a column block, then the next block —
# the launch order the decode steps were measured with (benchmarks/results/decode_kernels_h200.json)
ROW_TILES_FIRST = 1 << 16
# a decode step's few rows: more, smaller tiles, in the order they always ran
DECODE_TILING = RowTiling(BLOCK_M, NUM_WARPS, ROW_TILES_FIRST)
# a prefill or a training micro-batch: 128-row tiles, 8 row tiles at a time over every column
# block (benchmarks/exact_tiles.py: 1.3-1.6x on the 48-layer micro-batch's large products)
BULK_TILING = RowTiling(128, 8, 8)
# the grouped GEMM's bulk products take 256-column tiles where they have the columns: on an H100
# at 16k tokens x 8 experts (benchmarks/results/exact_tiles_schedules_h100.json) the experts'
# gate_up ran at 0.74 of the matmul rate against 0.62 (1.19x) and down 0.58 against 0.52 (1.12x),
# the same bits; the dense products lost with them (o_proj 0.90x), so they keep 128
GROUPED_BULK_TILING = BULK_TILING._replace(block_n=256)
# From here on the bulk tiling: a training micro-batch's tokens or routed pairs; a decode step of
# 512 rows routes 4,096 pairs and keeps its one-kernel route's 64-row tile map.
BULK_ROWS = 8192


def row_tiling(rows: int, grouped: bool = False) -> RowTiling:
    """The row tiling for a product of ``rows`` rows: ``exact.matmul``'s, or (``grouped``) the
    grouped GEMM's."""
    if rows < BULK_ROWS:
        return DECODE_TILING
    return GROUPED_BULK_TILING if grouped else BULK_TILING


@triton.jit
def swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid``: ``GROUP_M`` row tiles at a time, each group over
    every column block, so the programs in flight share their rows' and their columns' tiles in
    L2. Row-tile-fastest over the whole grid (``GROUP_M >= num_m``), a training micro-batch's
    16k rows were read once per column block: the grouped GEMM ran at half torch's rate."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit(do_not_specialize=["num_tiles"])  # the grid's size varies with the rows
def _gmm_kernel(
    x_ptr,
    w_ptr,
    c_ptr,
    r_ptr,
    rows_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    ends_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_cm,
    stride_cn,
    stride_rm,
    stride_rn,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,
):
    pid_t, pid_n = swizzle(tl.program_id(0), num_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= 0:
        row0 = tl.load(tile_row_ptr + pid_t)
        end = tl.load(ends_ptr + e)
        rm = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        src = rm  # the A rows: x's own, or (GATHER) the tokens these sorted rows take
        if GATHER:
            src = tl.load(rows_ptr + rm, mask=rm < end, other=0).to(tl.int64)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                x_ptr + src[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=(rm[:, None] < end) & (kk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_base + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                mask=(kk[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(a, b, acc)
        keep = (rm[:, None] < end) & (rn[None, :] < N)
        c = acc.to(c_ptr.dtype.element_ty)
        if HAS_RESIDUAL:  # residual + c, rounded as torch's add of the two stored tensors
            r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=keep)
            c = (r.to(tl.float32) + c.to(tl.float32)).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=keep)


def tile_map(offs: torch.Tensor, rows: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, ...]:
    """``(tile_expert, tile_row)`` for every tile slot of the worst-case grid (device ops only).

    ``offs`` are the groups' cumulative row ends. A slot past the last real tile gets expert -1.
    """
    experts = offs.numel()
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per = (ends - starts + block_m - 1) // block_m
    tile_end = torch.cumsum(per, 0)
    slots = torch.arange(triton.cdiv(rows, block_m) + experts, device=offs.device)
    expert = torch.searchsorted(tile_end, slots, right=True)
    used = expert < experts
    e = expert.clamp(max=experts - 1)
    row = starts[e] + (slots - (tile_end[e] - per[e])) * block_m
    return torch.where(used, e, -1).to(torch.int32), row.to(torch.int32)


TileMap = tuple[torch.Tensor, torch.Tensor]  # (tile_expert, tile_row): tile_map's result


def gmm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    plan: TileMap | None = None,
    tiling: RowTiling = DECODE_TILING,
    residual: torch.Tensor | None = None,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, K]`` rows grouped by ``offs`` times ``w [E, K, N]`` (any strides), in ``x``'s dtype.

    ``gather [R]``: the product of ``x[gather]`` (the MoE block's tokens in expert order, each
    once per routed expert) read through the index in the kernel's loads instead of gathered
    into an ``[R, K]`` copy first — the same values, so the same bits, one write and read of
    the block's largest input less (the gather was 25 ms of each 20-layer exact forward on one
    H100: ``benchmarks/results/one_gpu_thinker_phases_20l_h100.json``).

    ``plan``: ``tile_map(offs, T, tiling.block_m)`` when the caller has it already. A MoE
    block makes six grouped products over the same rows and offsets (gate_up, down and their
    LoRA A and B), and the map is ~20 small kernels: the H200 generation profile showed its
    index, searchsorted and scan kernels 6 times per layer and decode step, so ``exact.moe``
    computes it once per block. ``tiling``: ``row_tiling(rows, grouped=True)`` (the tiles' rows, warps, columns,
    never the reduction; the plan must be cut for its ``block_m``).

    ``residual [T, N]`` (``x``'s dtype): ``residual + x @ w`` with the product rounded to the
    dtype first — the bits of ``residual + gmm(x, w, offs)`` in torch, in one pass. Why: a LoRA
    adapter's ``B`` product is added to the base product's output (``exact.moe``); as two kernels
    the rank-16 product writes a full ``[pairs, N]`` tensor that the add reads back with the
    residual and writes again, two of the four passes over the MoE block's largest tensors."""
    k = x.shape[1]
    if gather is not None:  # the kernel reads the ids densely
        gather = gather.reshape(-1).contiguous()
    rows = x.shape[0] if gather is None else gather.numel()
    experts, k2, n = w.shape
    if k != k2 or offs.numel() != experts:
        raise ValueError(f"gmm: x {tuple(x.shape)}, w {tuple(w.shape)}, {offs.numel()} offsets")
    if residual is not None and (residual.shape != (rows, n) or residual.dtype != x.dtype):
        raise ValueError(
            f"gmm: residual {tuple(residual.shape)} {residual.dtype} for a ({rows}, {n}) "
            f"{x.dtype} product"
        )
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, warps, group_m = tiling.block_m, tiling.warps, tiling.group_m
    tile_expert, tile_row = plan if plan is not None else tile_map(offs, rows, block_m)
    block_k = tiles(k, n)[1]
    block_n = tiling.column_block(k, n)
    grid = (tile_expert.numel() * triton.cdiv(n, block_n),)
    res = out if residual is None else residual  # not read without a residual
    _gmm_kernel[grid](
        x,
        w,
        out,
        res,
        gather if gather is not None else tile_row,  # not read without GATHER
        tile_expert,
        tile_row,
        offs.to(torch.int32),
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        res.stride(0),
        res.stride(1),
        tile_expert.numel(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        HAS_RESIDUAL=residual is not None,
        GATHER=gather is not None,
        num_warps=warps,
        num_stages=tiling.stages,
    )
    return out
