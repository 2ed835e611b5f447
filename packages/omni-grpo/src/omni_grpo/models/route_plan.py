"""A decode step's MoE bookkeeping in one kernel: the routed pairs sorted by expert, and the tiles.

Why: between the router and the experts' products a MoE block sorts its ``tokens x top_k``
(token, slot) pairs by expert, inverts the permutation, counts each expert's rows and maps the
grouped GEMM's tiles to (expert, first row). In torch that is ~25 small kernels (a radix sort,
an arange and a scatter for the inverse, ``histc``, ``cumsum``, a division for the token ids and
the tile map's fifteen), each a few microseconds inside a decode step's CUDA graph, for every
layer and token. Here one program does all of it (``grouped_experts.expert_order`` sends it up
to ``DECODE_ROWS`` pairs: a decode step's, a short prefill's; one program is slow for more): a
counting sort over one-hot chunks, kept stable (a pair's place among its expert's pairs is its
place in the input), so the result is ``sort_by_expert(..., stable=True)`` and ``tile_map``
exactly, as the exact path needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_grpo.models.grouped_gemm import BLOCK_M

CHUNK = 64  # pairs per one-hot pass: [CHUNK, experts] int32 in registers


@triton.jit
def _route_plan_kernel(
    ids_ptr,
    perm_ptr,
    inv_ptr,
    offs_ptr,
    tok_ptr,
    tile_e_ptr,
    tile_r_ptr,
    R,
    E,
    S,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    live = experts < E
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, R, CHUNK):  # each expert's pairs
        ids = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < R, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(hit, axis=0)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    tl.store(offs_ptr + experts, ends, mask=live)
    seen = tl.zeros((BLOCK_E,), tl.int32)  # pairs of each expert placed so far
    for c0 in range(0, R, CHUNK):  # each pair's place: its expert's start + its rank there
        pair = c0 + lanes
        ok = pair < R
        ids = tl.load(ids_ptr + pair, mask=ok, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1 + seen[None, :] + starts[None, :]
        pos = tl.sum(tl.where(hit > 0, rank, 0), axis=1)
        tl.store(inv_ptr + pair, pos.to(tl.int64), mask=ok)
        tl.store(perm_ptr + pos, pair.to(tl.int64), mask=ok)
        tl.store(tok_ptr + pos, (pair // K).to(tl.int64), mask=ok)
        seen += tl.sum(hit, axis=0)
    per = (counts + BLOCK_M - 1) // BLOCK_M  # each expert's tiles
    tile_end = tl.cumsum(per, axis=0)
    tile_start = tile_end - per
    for s0 in range(0, S, CHUNK):  # slot -> the expert whose tiles hold it, and its first row
        slot = s0 + lanes
        before = (tile_end[None, :] <= slot[:, None]) & live[None, :]
        owner = tl.sum(before.to(tl.int32), axis=1)
        used = owner < E
        mine = experts[None, :] == owner[:, None]
        row = tl.sum(
            tl.where(mine, starts[None, :] + (slot[:, None] - tile_start[None, :]) * BLOCK_M, 0),
            axis=1,
        )
        tl.store(tile_e_ptr + slot, tl.where(used, owner, -1), mask=slot < S)
        tl.store(tile_r_ptr + slot, tl.where(used, row, 0), mask=slot < S)


def route_plan(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """``(perm, inv, offs, tokens, tile_expert, tile_row)`` of ``top_k_index [T, k]`` in one
    launch: ``grouped_experts.ExpertOrder``'s fields (the last two its tile map)."""
    tokens, top_k = top_k_index.shape
    pairs = tokens * top_k
    device = top_k_index.device
    ids = top_k_index.reshape(-1).contiguous()
    slots = triton.cdiv(pairs, BLOCK_M) + num_experts  # tile_map's worst-case grid
    perm = torch.empty(pairs, dtype=torch.int64, device=device)
    inv, tok = torch.empty_like(perm), torch.empty_like(perm)
    offs = torch.empty(num_experts, dtype=torch.int32, device=device)
    tile_e = torch.empty(slots, dtype=torch.int32, device=device)
    tile_r = torch.empty(slots, dtype=torch.int32, device=device)
    _route_plan_kernel[(1,)](
        ids,
        perm,
        inv,
        offs,
        tok,
        tile_e,
        tile_r,
        pairs,
        num_experts,
        slots,
        K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        CHUNK=CHUNK,
        BLOCK_M=BLOCK_M,
        num_warps=8,
    )
    return perm, inv, offs, tok, tile_e, tile_r
