"""The exact kernels' arithmetic on CPU, in Triton's interpreter (numpy), against torch's
references: values, masking (NaN garbage past a row's keys never leaks), gradients, and a GRPO
step of the tiny thinker in exact mode.

Run by ``test_exact.py::test_kernels_in_triton_interpreter`` in a process started with
``TRITON_INTERPRET=1`` (Triton reads it when first imported); skipped anywhere else. Bitwise
equality between a decode step and the trainer's forward is a property of the GPU's instructions
(``test_exact_gpu.py``): numpy's matmul rounds a row differently by its position in the matrix.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 from the process start (test_exact.py runs it so)",
)
interpreted = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the GPU runs the compiled kernels"
)


@pytest.fixture(scope="module", autouse=True)
def _patch_the_language_once_per_launch() -> Any:
    """Triton's interpreter (3.x) re-patches ``triton.language`` at every call of a ``@jit``
    helper inside a kernel (``tl.sum``, ``tl.max``, ...: one per program and call), walking the
    modules with ``inspect.getmembers`` each time: a third of this module's run (~7 minutes
    on 2 cores). Within one launch the modules are already patched by the launch itself or by an
    earlier helper, and patching is stateless (the same wrappers again), so a helper whose
    language modules this launch patched already skips it. The kernels' arithmetic, the
    numpy ops and the patched state are exactly those of the unmodified interpreter; with a
    Triton whose interpreter lacks these names nothing is changed."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as itp

    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(itp, name) for name in needed):
        yield
        return
    original, launch = itp._patch_lang, itp.GridExecutor.__call__
    patched: list[set[int]] = []  # the language modules patched in the running launch

    def patch_lang(fn: Any) -> Any:
        langs = {
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        }
        if patched and langs and langs <= patched[-1]:
            return itp._LangPatchScope()  # nothing to undo: nothing was changed
        scope = original(fn)
        if patched:
            patched[-1] |= langs
        return scope

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    itp._patch_lang, itp.GridExecutor.__call__ = patch_lang, call
    try:
        yield
    finally:
        itp._patch_lang, itp.GridExecutor.__call__ = original, launch


# ---------------------------------------------------------------------- kernels (interpreter)
@interpreted
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 40), (70, 96, 130), (130, 17, 8)])
def test_matmul_matches_torch_with_bias_and_tails(m: int, k: int, n: int) -> None:
    from omni_grpo.exact.matmul import linear

    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True)
    out = linear(x, w, b, torch.float32)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, b), g)
    want = torch.autograd.grad(ref, (x, w, b), g)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize(("m", "k", "n"), [(70, 1024, 16), (3, 2048, 130)])
def test_split_k_matmul_matches_torch(m: int, k: int, n: int) -> None:
    """Skinny products split K into chunks fixed by (K, N), summed in order by a second kernel."""
    from omni_grpo.exact.matmul import config, linear

    assert config(k, n)[2] == 4 and config(2048, 4096)[2] == 1
    x, w, b = torch.randn(m, k), torch.randn(n, k) / k**0.5, torch.randn(n)
    torch.testing.assert_close(
        linear(x, w, b, torch.float32), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5
    )


@interpreted
@pytest.mark.parametrize("tiling", [(64, 4, 1 << 16), (128, 8, 8), (64, 4, 2), (128, 4, 3)])
def test_every_row_tiling_and_launch_order_covers_each_tile_once(tiling: tuple) -> None:
    """``grouped_gemm.swizzle`` maps the programs onto the tiles in groups of row tiles (a last
    group short, column blocks of 128 with a tail): each output tile is computed exactly once,
    under every ``RowTiling`` — a tile missed or written twice would not match torch."""
    from omni_grpo.exact.matmul import mm
    from omni_grpo.models.grouped_gemm import RowTiling, gmm, tile_map

    row_tiles = RowTiling(*tiling)
    a, b = torch.randn(300, 64), torch.randn(64, 300)
    torch.testing.assert_close(mm(a, b, None, row_tiles), a @ b, rtol=1e-5, atol=1e-4)
    x, w = torch.randn(300, 32), torch.randn(5, 32, 260)
    offs = torch.tensor([0, 140, 140, 141, 300], dtype=torch.int32)
    plan = tile_map(offs, 300, row_tiles.block_m)
    bounds = [0, *offs.tolist()]
    pairs = enumerate(zip(bounds, bounds[1:], strict=False))
    ref = torch.cat([x[s:e] @ w[g] for g, (s, e) in pairs])
    torch.testing.assert_close(gmm(x, w, offs, plan, row_tiles), ref, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize(("m", "k", "n", "bias"), [(70, 1024, 16, True), (3, 2048, 130, False)])
def test_split_k_chunks_summed_in_the_program_are_the_partials_sum(
    m: int, k: int, n: int, bias: bool
) -> None:
    """``RowTiling.fuse_splits``: every ``K`` chunk computed by one program and added in chunk
    order — the fp32 arithmetic of the partials and ``_sum_chunks_kernel``, so the same bits."""
    from omni_grpo.exact.matmul import config, mm
    from omni_grpo.models.grouped_gemm import RowTiling

    assert config(k, n)[2] > 1
    a, b = torch.randn(m, k), torch.randn(k, n) / k**0.5
    c = torch.randn(n) if bias else None
    # the same tile rows in both (the interpreter's dot is numpy's: its blocking follows them)
    for rows, warps in ((64, 4), (128, 8)):
        partials = mm(a, b, c, RowTiling(rows, warps, 8))
        assert torch.equal(mm(a, b, c, RowTiling(rows, warps, 8, fuse_splits=True)), partials)


@interpreted
def test_a_bulk_narrow_product_sums_its_chunks_in_the_program(monkeypatch) -> None:
    """The default tiling of a training micro-batch's rank-sized split-K product (``N <=
    FUSED_SPLITS_MAX_N``) fuses the chunks (no partials kernel), with the partials' bits; a
    decode step's rows keep the partials."""
    from omni_grpo.exact import matmul
    from omni_grpo.models.grouped_gemm import BULK_ROWS, BULK_TILING

    a, b = torch.randn(BULK_ROWS, 1024), torch.randn(1024, 16) / 32
    partials = matmul.mm(a, b, None, BULK_TILING)
    with monkeypatch.context() as m:
        m.setattr(matmul, "_sum_chunks_kernel", None)  # taking it would fail
        assert torch.equal(matmul.mm(a, b), partials)
        with pytest.raises(TypeError):
            matmul.mm(a[:5], b)


@interpreted
@pytest.mark.parametrize("tiling", [(128, 8, 8, 256), (64, 4, 2, 256, 4)])
def test_a_wider_column_block_covers_each_tile_once(tiling: tuple) -> None:
    """``RowTiling.block_n``: 256-column tiles where the product has the columns (a tail block
    masked), the default 128 elsewhere; the matmul and the grouped GEMM still match torch."""
    from omni_grpo.exact.matmul import mm
    from omni_grpo.models.grouped_gemm import RowTiling, gmm, tile_map

    row_tiles = RowTiling(*tiling)
    assert row_tiles.column_block(64, 600) == 256 and row_tiles.column_block(64, 200) == 128
    a, b = torch.randn(150, 64), torch.randn(64, 600)
    torch.testing.assert_close(mm(a, b, None, row_tiles), a @ b, rtol=1e-5, atol=1e-4)
    x, w = torch.randn(200, 32), torch.randn(3, 32, 520)
    offs = torch.tensor([70, 70, 200], dtype=torch.int32)
    plan = tile_map(offs, 200, row_tiles.block_m)
    ref = torch.cat([x[:70] @ w[0], x[70:200] @ w[2]])
    torch.testing.assert_close(gmm(x, w, offs, plan, row_tiles), ref, rtol=1e-5, atol=1e-4)


@interpreted
def test_top_k_sum_over_expert_order_rows_matches_the_weighted_sum_and_its_gradients() -> None:
    from omni_grpo.exact.combine import topk_sum_kernel, unsort_topk_sum

    torch.manual_seed(0)
    tokens, top_k = 37, 3
    rows = torch.randn(tokens * top_k, 300, requires_grad=True)
    w = torch.rand(tokens, top_k, requires_grad=True)
    perm = torch.randperm(tokens * top_k)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    out = unsort_topk_sum(rows, inv, perm, w, torch.float32)
    pairs = rows[inv].view(tokens, top_k, -1)  # what Unsort gathered
    assert torch.equal(out, topk_sum_kernel(pairs.detach(), w.detach(), torch.float32))
    ref = (pairs * w[..., None]).sum(1)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    for a, e in zip(
        torch.autograd.grad(out, (rows, w), g), torch.autograd.grad(ref, (rows, w), g), strict=True
    ):
        # w's gradient is a 300-term fp32 dot product summed in another order than torch's:
        # ~300 * 2^-24 * sum |g p| (~250) ~ 4e-3 at worst, ~1e-5 typically (1.18e-5 was seen
        # once unseeded); a wrong weight or row is off by O(1)
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)


@interpreted
def test_grouped_gemm_residual_adds_the_product_with_its_gradients() -> None:
    from omni_grpo.exact.grouped import grouped_linear

    torch.manual_seed(0)
    x = torch.randn(150, 16, requires_grad=True)
    w = torch.randn(5, 16, 24, requires_grad=True)
    res = torch.randn(150, 24, requires_grad=True)
    offs = torch.tensor([0, 70, 70, 71, 150], dtype=torch.int32)
    out = grouped_linear(x, w, offs, residual=res)
    ref = res + grouped_linear(x, w, offs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, e in zip(
        torch.autograd.grad(out, (x, w, res), g),
        torch.autograd.grad(ref, (x, w, res), g),
        strict=True,
    ):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


@interpreted
def test_grouped_gemm_matches_per_group_products_with_empty_groups() -> None:
    from omni_grpo.exact.grouped import grouped_linear, tile_map

    x = torch.randn(150, 32, requires_grad=True)
    w = torch.randn(5, 32, 24, requires_grad=True)
    offs = torch.tensor([0, 70, 70, 71, 150], dtype=torch.int32)
    out = grouped_linear(x, w, offs)
    bounds = [0, *offs.tolist()]
    ref = torch.cat(
        [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(bounds, bounds[1:], strict=False))]
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    for a, e in zip(
        torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)
    expert, row = tile_map(offs, 150, block_m=64)
    used = expert >= 0
    # expert 1 (70 rows) takes two tiles, expert 3 (1 row) one, expert 4 (79 rows) two
    assert expert[used].tolist() == [1, 1, 3, 4, 4] and row[used].tolist() == [0, 64, 70, 71, 135]


@interpreted
@pytest.mark.parametrize("tiling", ["decode", "bulk"])
def test_grouped_gemm_reads_gathered_rows_as_the_gathered_copy(tiling: str) -> None:
    """``gmm(x, w, offs, gather=tokens)``: the product of ``x[tokens]`` read through the index,
    equal to the product of the gathered copy (the same values in the same order), empty
    groups, a token taken by several experts, and the residual epilogue alike."""
    from omni_grpo.models.grouped_gemm import DECODE_TILING, GROUPED_BULK_TILING, gmm

    tiles = GROUPED_BULK_TILING if tiling == "bulk" else DECODE_TILING
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    tokens = torch.randint(0, 40, (150,), generator=gen)
    w = torch.randn(5, 32, 300, generator=gen)  # a 256-column tile and a tail
    offs = torch.tensor([0, 70, 70, 71, 150], dtype=torch.int32)
    res = torch.randn(150, 300, generator=gen)
    for residual in (None, res):
        ref = gmm(x[tokens], w, offs, tiling=tiles, residual=residual)
        out = gmm(x, w, offs, tiling=tiles, residual=residual, gather=tokens)
        assert out.shape == (150, 300) and torch.equal(out, ref)
    strided = torch.randint(0, 40, (300,), generator=gen)[::2]  # ids that are a strided view
    assert torch.equal(
        gmm(x, w, offs, tiling=tiles, gather=strided), gmm(x[strided], w, offs, tiling=tiles)
    )


@interpreted
def test_the_default_decode_route_reads_the_pairs_rows_as_the_expanded_copy() -> None:
    """The option-off decode route (``grouped_experts._lora_linear`` with the Triton plan) reads
    each pair's token row through the ids, as exact mode does: the same values, so the same
    base and LoRA products as the expanded copy; without a plan the ids are gathered first."""
    from omni_grpo.models.grouped_experts import _lora_linear
    from omni_grpo.models.grouped_gemm import tile_map

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 32, generator=gen)
    tokens = torch.sort(torch.randint(0, 9, (27,), generator=gen)).values
    offs = torch.tensor([10, 10, 27], dtype=torch.int32)
    weight = torch.randn(3, 48, 32, generator=gen)  # [E, out, in], used transposed
    lora = (torch.randn(3, 32, 4, generator=gen), torch.randn(3, 4, 48, generator=gen))
    plan = tile_map(offs, 27)
    copy = _lora_linear(hidden[tokens], weight, False, offs, lora, plan)
    assert torch.equal(_lora_linear(hidden, weight, False, offs, lora, plan, tokens), copy)
    looped = _lora_linear(hidden, weight, False, offs, lora, None, tokens)
    torch.testing.assert_close(looped, _lora_linear(hidden[tokens], weight, False, offs, lora))


@interpreted
def test_rmsnorm_and_its_gradient_match_the_transformers_formula() -> None:
    from omni_grpo.exact.rowwise import _torch_rmsnorm, rmsnorm

    x = torch.randn(3, 5, 48, requires_grad=True)
    w = torch.rand(48, requires_grad=True)
    out = rmsnorm(x, w, 1e-6)
    ref = _torch_rmsnorm(x, w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    for a, e in zip(
        torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g), strict=True
    ):
        torch.testing.assert_close(a, e)
    with pytest.raises(ValueError, match="weight is torch.float64"):
        rmsnorm(x, w.double(), 1e-6)


@interpreted
@pytest.mark.parametrize(("batch", "heads", "length", "cos_batch"), [(2, 5, 7, 2), (3, 2, 1, 1)])
def test_rotary_kernel_is_transformers_composition(
    batch: int, heads: int, length: int, cos_batch: int
) -> None:
    """``models.rotary_kernel.rotate`` on the attention's transposed view (and a decode step's
    one position, cos broadcast over the batch) against transformers' ``q * cos +
    rotate_half(q) * sin``: in fp32 and in bf16 (torch's CPU ops) the same products and sum,
    bit for bit."""
    from omni_grpo.models.rotary_kernel import rotate
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import rotate_half

    x = (torch.randn(batch, length, heads, 32) * 3).transpose(1, 2)
    cos, sin = torch.randn(cos_batch, length, 32), torch.randn(cos_batch, length, 32)
    out = rotate(x, cos, sin)
    assert out.stride() == x.stride()  # the view's memory layout kept
    assert torch.equal(out, x * cos[:, None] + rotate_half(x) * sin[:, None])
    # bf16: each product and the sum rounded to nearest-even on the bits (the kernel's own
    # rounding, which the interpreter runs as the GPU does): torch's bf16 ops, bit for bit
    xb, cb, sb = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
    want = xb * cb[:, None] + rotate_half(xb) * sb[:, None]
    got = rotate(xb, cb, sb)
    assert torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16))


@interpreted
def test_token_logprobs_match_log_softmax_over_chunks() -> None:
    from omni_grpo.exact.rowwise import LOGPROB_BLOCK, token_logprobs

    z = torch.randn(4, 2 * LOGPROB_BLOCK + 77) * 4
    t = torch.tensor([0, 5, LOGPROB_BLOCK + 3, z.shape[1] - 1])
    ref = torch.log_softmax(z, -1).gather(-1, t[:, None])[:, 0]
    torch.testing.assert_close(token_logprobs(z, t), ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        token_logprobs(z.double(), t)


@interpreted
@pytest.mark.parametrize("normalize", [True, False])
def test_router_kernel_is_the_stable_sorted_softmax_top_k(normalize: bool) -> None:
    """The one-kernel router against the torch steps it replaces: the same experts in the same
    order (ties: the lower expert first), the same weights to fp32 rounding."""
    from omni_grpo.exact.router import route_rows
    from omni_grpo.exact.rowwise import softmax, tree_sum

    z = torch.randn(37, 128, generator=torch.Generator().manual_seed(0)) * 3
    z[0, [3, 9, 50, 100]] = 50.0  # a four-way tie at the top (above any drawn value)
    z[1] = 0.0  # every expert tied
    index, weights = route_rows(z, 8, normalize)
    probs = softmax(z)
    want_w, want_i = torch.sort(probs, dim=-1, descending=True, stable=True)
    want_w, want_i = want_w[:, :8], want_i[:, :8]
    if normalize:
        want_w = want_w / tree_sum(want_w)
    assert torch.equal(index, want_i)
    assert index[0, :4].tolist() == [3, 9, 50, 100] and index[1].tolist() == list(range(8))
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    head_i, head_w = route_rows(z[:5], 8, normalize)
    assert torch.equal(head_i, index[:5]) and torch.equal(head_w, weights[:5])
    with pytest.raises(ValueError, match="top_k 200 exceeds the 128 experts"):
        route_rows(z, 200, normalize)
    # the gradient (the router trains in full fine-tuning): torch's through the same steps
    from omni_grpo.exact.router import route

    g = torch.linspace(-1, 1, 37 * 8).view(37, 8)
    leaf = z.clone().requires_grad_()
    (got,) = torch.autograd.grad(route(leaf, 8, normalize)[1], leaf, g)
    ref = z.clone().requires_grad_()
    values = torch.softmax(ref, -1).gather(-1, want_i)
    values = values / values.sum(-1, keepdim=True) if normalize else values
    (want,) = torch.autograd.grad(values, ref, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _full_mask(starts: torch.Tensor, length: int) -> torch.Tensor:
    keys = torch.arange(length)
    ok = (keys[None, None] >= starts[:, None, None]) & (keys[None, None] <= keys[None, :, None])
    return ok[:, None]


@interpreted
def test_attention_matches_sdpa_and_decode_ignores_garbage_past_the_slot() -> None:
    from omni_grpo.exact.attention import attention_forward, row_bounds

    torch.manual_seed(0)
    b, h, kvh, length, d = 2, 4, 2, 90, 16
    q = torch.randn(b, h, length, d, requires_grad=True)
    k = torch.randn(b, kvh, length, d, requires_grad=True)
    v = torch.randn(b, kvh, length, d, requires_grad=True)
    starts = torch.tensor([0, 23])
    mask = _full_mask(starts, length)
    start, qoff = row_bounds(mask, b, length, length, q.device)
    assert start.tolist() == [0, 23] and qoff.tolist() == [0, 0]
    out, _ = attention_forward(None, q, k, v, mask, scaling=0.3)  # type: ignore[arg-type]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    real = torch.arange(length)[None] >= starts[:, None]
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding queries: 0
    g = torch.randn_like(out) * real[:, :, None, None]
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    # a decode step: a static buffer with NaN past the slot, masked as the decoder masks it
    kb = torch.cat([k.detach(), torch.full((b, kvh, 10, d), float("nan"))], 2)
    vb = torch.cat([v.detach(), torch.full((b, kvh, 10, d), float("nan"))], 2)
    for t in (30, 63, 64, 89):
        dmask = torch.zeros(b, 1, 1, length + 10, dtype=torch.bool)
        for row in range(b):
            dmask[row, 0, 0, int(starts[row]) : t + 1] = True
        assert row_bounds(dmask, b, 1, length + 10, q.device)[1].tolist() == [t, t]
        step, _ = attention_forward(None, q.detach()[:, :, t : t + 1], kb, vb, dmask, scaling=0.3)  # type: ignore[arg-type]
        torch.testing.assert_close(step[:, 0], out.detach()[:, t], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the thinker (interpreter)
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("exact"), max_new_tokens=3)


@interpreted
@pytest.mark.parametrize("lora", [False, True])
def test_exact_thinker_trains_and_leaves_other_models_alone(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.exact import install, precision
    from omni_grpo.models.generation import generate
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import GRPOBatch, SamplingParams

    monkeypatch.setattr(precision, "COMPUTE_DTYPE", torch.float32)
    monkeypatch.setattr(install, "check_supported", lambda model: None)
    plain = copy.deepcopy(world["base"])
    prompt = world["prompts"][0]
    ids = torch.tensor([prompt.input_ids])

    def sample(model: torch.nn.Module) -> Any:
        torch.manual_seed(3)
        return generate(model, ids, max_new_tokens=4, **prompt.mm)

    before = sample(plain)
    model = copy.deepcopy(world["base"])
    lora_cfg = LoraConfig(rank=4, targets=["attention", "experts"]) if lora else None
    backend = TorchBackend(
        model,
        TrainerConfig(device="cpu", lr=1e-2, lora=lora_cfg, micro_batch_size=8),
        AlgoConfig(kl_coef=0.01),
        pad_token_id=world["eos"],
    )
    counts = install.enable_exact_logprobs(model)
    assert counts["moe"] == 2 and counts["rmsnorm"] == 9 and counts["linear"] >= 9
    assert backend.exact and not install.is_exact(plain)
    engine = EmbeddedEngine(model, [world["eos"]], banned_token_ids=media_token_ids(model))
    torch.manual_seed(0)
    groups = engine.generate(world["prompts"], 4, SamplingParams(max_new_tokens=5))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(groups))
    metrics = backend.step(GRPOBatch(groups, adv))
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-5  # numpy's rounding only
    assert not metrics.get("skipped_step")
    assert set(backend.exact_watch.totals) == {p.sample.modality for p in world["prompts"]}
    after = sample(plain)  # the registry and decode path of an unswitched model are untouched
    assert torch.equal(before.tokens, after.tokens) and torch.equal(before.logprobs, after.logprobs)


@interpreted
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_exact_thinker_keeps_exact_logits_and_gets_torch_gradients(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    """Gradient checkpointing in exact mode: the training forward's logits are the exact ones
    (bitwise those of a no-grad exact forward), the recompute runs torch's kernels
    (``exact.switch``) and the gradients equal the option-off model's within rounding."""
    from omni_grpo.backends.torch_backend import TorchBackend, make_micro_batches
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.exact import install, precision

    monkeypatch.setattr(precision, "COMPUTE_DTYPE", torch.float32)
    monkeypatch.setattr(install, "check_supported", lambda model: None)

    def build(exact: bool) -> TorchBackend:
        torch.manual_seed(0)  # the same LoRA A in both
        lora_cfg = LoraConfig(rank=4, targets=["attention", "experts"]) if lora else None
        cfg = TrainerConfig(device="cpu", lora=lora_cfg, gradient_checkpointing=True)
        backend = TorchBackend(
            copy.deepcopy(world["base"]), cfg, AlgoConfig(), pad_token_id=world["eos"]
        )
        if exact:
            install.enable_exact_logprobs(backend.model)
        backend.model.train()
        return backend

    adv = torch.ones(len(world["groups"]), len(world["groups"][0]))
    mb = make_micro_batches(world["groups"], adv, 8, world["eos"], token_budget=4096)[0]
    grads = []
    for backend in (build(True), build(False)):
        params = [p for p in backend.model.parameters() if p.requires_grad]
        with torch.no_grad():
            no_grad = backend._logits(backend.model, mb)
        logits = backend._logits(backend.model, mb)
        if backend.exact:
            assert torch.equal(logits, no_grad)
        weights = torch.linspace(-1, 1, logits.shape[-1])
        grads.append(torch.autograd.grad((logits.float() * weights).sum(), params))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()) + 1e-6)


@interpreted
def test_default_decode_kernels_compute_as_transformers_and_peft(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default path's decode-step forwards (``models.decode_kernels``; on CUDA in bf16 only,
    forced here): each against the module's own forward, then a whole generation."""
    from omni_grpo.config import LoraConfig
    from omni_grpo.models import decode_kernels as dk
    from omni_grpo.models.generation import generate
    from omni_grpo.models.lora import apply_lora

    model = copy.deepcopy(world["base"])
    apply_lora(model, LoraConfig(rank=4, targets=["attention", "experts"]))
    for name, p in model.named_parameters():  # peft starts B at zero: make the adapters count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    text = model.model.language_model
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in text.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNorm"):
                x = torch.randn(7, module.weight.shape[0], generator=gen) * 3
                torch.testing.assert_close(dk.rmsnorm_forward(module, x), module(x))
            elif kind.endswith("TopKRouter"):
                x = torch.randn(9, module.hidden_dim, generator=gen)
                got, want = dk.router_forward(module, x), module(x)
                torch.testing.assert_close(got[0], want[0])
                assert torch.equal(got[2], want[2])
                torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    prompt = world["prompts"][0]
    ids = torch.tensor([prompt.input_ids])

    def sample(on: bool) -> Any:
        monkeypatch.setattr(dk, "enabled", lambda thinker: on)
        torch.manual_seed(3)
        return generate(model, ids, max_new_tokens=5, cuda_graph=False, **prompt.mm)

    plain, fused = sample(False), sample(True)
    assert torch.equal(plain.tokens, fused.tokens)
    torch.testing.assert_close(plain.logprobs, fused.logprobs, rtol=0, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in text.modules())  # swapped back


@interpreted
@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 8, 128), (37, 8, 128), (9, 2, 6)])
def test_route_plan_is_the_stable_sort_and_the_tile_map(tokens: int, top_k: int, experts: int):
    """The one-kernel routing bookkeeping (``models.route_plan``) against the torch steps it
    replaces: the same permutation (stable), inverse, offsets, token ids and tile map."""
    from omni_grpo.models.grouped_experts import sort_by_expert
    from omni_grpo.models.grouped_gemm import tile_map
    from omni_grpo.models.route_plan import route_plan

    gen = torch.Generator().manual_seed(tokens)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if tokens > 9:
        index[5:25, 0] = 3  # a crowded expert: 20+ pairs, several of them in one chunk
    got_perm, got_inv, got_offs, got_tokens, got_e, got_r = route_plan(index, experts)
    perm, inv, offs = sort_by_expert(index, experts, stable=True)
    assert torch.equal(got_perm, perm) and torch.equal(got_inv, inv)
    assert torch.equal(got_offs, offs) and torch.equal(got_tokens, perm // top_k)
    want_e, want_r = tile_map(offs, index.numel())
    assert torch.equal(got_e, want_e)
    used = want_e >= 0
    assert torch.equal(got_r[used], want_r[used])
