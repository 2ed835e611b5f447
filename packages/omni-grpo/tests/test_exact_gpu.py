"""rollout.exact_logprobs on the GPU: bitwise row invariance of each kernel, and a GRPO step of
the tiny thinker (image, audio and video prompts; LoRA and full fine-tuning) whose rollout
logprobs equal the trainer's for every completion token."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize(
    ("k", "n"), [(2048, 4096), (4096, 2048), (2048, 512), (2048, 128), (2048, 16), (16, 4096)]
)
def test_matmul_rows_do_not_depend_on_the_batch(k: int, n: int) -> None:
    from omni_grpo.exact.matmul import mm

    a, b, bias = _bf16(1000, k), _bf16(k, n) / k**0.5, _bf16(n)
    full, full_bias = mm(a, b), mm(a, b, bias)  # n <= 512: split-K, the chunks summed in order
    for lo, hi in ((0, 1), (3, 67), (500, 1000)):
        assert torch.equal(mm(a[lo:hi], b), full[lo:hi])
        assert torch.equal(mm(a[lo:hi], b, bias), full_bias[lo:hi])


@pytest.mark.parametrize(("k", "n"), [(2048, 4096), (2048, 512), (2048, 16), (16, 4096)])
def test_matmul_rows_do_not_depend_on_the_row_tiling(k: int, n: int) -> None:
    """A training micro-batch's 128-row tiles (and their launch order) give each row the bits of
    a decode step's 64-row tiles: only the reduction order makes the bits."""
    from omni_grpo.exact.matmul import mm
    from omni_grpo.models.grouped_gemm import BULK_ROWS, DECODE_TILING, RowTiling

    a, b = _bf16(BULK_ROWS + 77, k), _bf16(k, n) / k**0.5
    bulk = mm(a, b)  # row_tiling: past BULK_ROWS, the bulk tiling
    assert torch.equal(bulk, mm(a, b, None, DECODE_TILING))
    assert torch.equal(bulk, mm(a, b, None, RowTiling(64, 4, 8)))  # grouped launch, 64 rows
    assert torch.equal(bulk[5:12], mm(a[5:12], b))
    # wider column tiles, a deeper pipeline, split-K chunks summed in the program
    for other in (RowTiling(128, 8, 8, 256, 4), RowTiling(128, 8, 8, 0, 3, True)):
        assert torch.equal(bulk, mm(a, b, None, other)), other


def test_grouped_gemm_rows_do_not_depend_on_the_row_tiling() -> None:
    from omni_grpo.exact.grouped import gmm
    from omni_grpo.models.grouped_gemm import (
        BULK_TILING,
        DECODE_TILING,
        GROUPED_BULK_TILING,
        RowTiling,
        tile_map,
    )

    x, w = _bf16(8000, 2048), _bf16(16, 2048, 1536) / 45
    offs = torch.tensor([500 * (i + 1) for i in range(16)], device="cuda", dtype=torch.int32)
    offs[3] = offs[2]  # an empty expert
    plan = tile_map(offs, 8000, GROUPED_BULK_TILING.block_m)
    bulk = gmm(x, w, offs, plan, GROUPED_BULK_TILING)  # 256-column tiles
    assert torch.equal(bulk, gmm(x, w, offs, None, DECODE_TILING))
    assert torch.equal(bulk, gmm(x, w, offs, plan, BULK_TILING))  # 128-column tiles
    deeper = RowTiling(128, 8, 8, 256, 4)  # a deeper pipeline
    assert torch.equal(bulk, gmm(x, w, offs, plan, deeper))
    alone = torch.full_like(offs, 3)
    assert torch.equal(bulk[:3], gmm(x[:3], w, alone, None, DECODE_TILING))


@pytest.mark.parametrize("rows", [8000, 300])
def test_the_grouped_gemm_residual_is_torchs_add_of_the_product(rows: int) -> None:
    """The LoRA ``B`` product with the base product added in its epilogue (``exact.moe``): the
    bits of torch's bf16 add of the two stored tensors, under the bulk and the decode tiling."""
    from omni_grpo.exact.grouped import gmm, row_tiling, tile_map

    x, w, res = _bf16(rows, 16), _bf16(16, 16, 1536) / 4, _bf16(rows, 1536)
    offs = torch.linspace(rows // 16, rows, 16, device="cuda").to(torch.int32)
    offs[3] = offs[2]  # an empty expert
    tiling = row_tiling(rows, grouped=True)
    plan = tile_map(offs, rows, tiling.block_m)
    fused = gmm(x, w, offs, plan, tiling, res)
    assert torch.equal(fused, res + gmm(x, w, offs, plan, tiling))
    with pytest.raises(ValueError, match="residual"):
        gmm(x, w, offs, plan, tiling, res[:, :8])


def test_the_top_k_sum_reads_the_expert_order_rows_as_the_unsorted_copy() -> None:
    from omni_grpo.exact.combine import topk_sum_kernel, topk_sum_rows_kernel

    tokens, top_k = 3000, 8
    rows = _bf16(tokens * top_k, 2048)
    inv = torch.randperm(tokens * top_k, device="cuda")
    w = torch.rand(tokens, top_k, device="cuda").to(torch.bfloat16)
    want = topk_sum_kernel(rows.index_select(0, inv).view(tokens, top_k, -1), w, torch.bfloat16)
    assert torch.equal(topk_sum_rows_kernel(rows, inv, w, torch.bfloat16), want)


def _exact_lora_backend(world: dict[str, Any], compile_: bool = False) -> tuple[Any, Any]:
    """The tiny thinker in bf16 on CUDA, LoRA on attention and experts, checkpointed, KL 0.01,
    switched to exact mode: ``(model, backend)``."""
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.exact import enable_exact_logprobs

    model = copy.deepcopy(world["base"]).to("cuda", torch.bfloat16)
    cfg = TrainerConfig(
        device="cuda",
        lr=1e-3,
        micro_batch_size=8,
        gradient_checkpointing=True,
        compile=compile_,
        lora=LoraConfig(rank=4, targets=["attention", "experts"]),
    )
    backend = TorchBackend(model, cfg, AlgoConfig(kl_coef=0.01), pad_token_id=world["eos"])
    enable_exact_logprobs(model)
    return model, backend


def test_the_kl_reference_is_the_policy_at_untrained_adapters(world: dict[str, Any]) -> None:
    """Exact mode, LoRA: the reference (adapters off) runs the policy's exact kernels, so at the
    first step (B = 0) the KL term is exactly 0, not a difference of kernels."""
    from omni_grpo.types import GRPOBatch

    _, backend = _exact_lora_backend(world)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * len(world["groups"]))
    metrics = backend.step(GRPOBatch(world["groups"], adv))
    assert metrics["kl_loss"] == 0.0
    metrics = backend.step(GRPOBatch(world["groups"], adv))
    assert metrics["kl_loss"] > 0.0  # the adapters moved


def test_topk_sum_rows_do_not_depend_on_the_batch() -> None:
    from omni_grpo.exact.combine import topk_sum_kernel

    p, w = _bf16(3000, 8, 2048), torch.rand(3000, 8, device="cuda").to(torch.bfloat16)
    full = topk_sum_kernel(p, w, torch.bfloat16)
    for lo, hi in ((0, 1), (5, 69), (2000, 3000)):
        assert torch.equal(topk_sum_kernel(p[lo:hi], w[lo:hi], torch.bfloat16), full[lo:hi])


def test_grouped_gemm_rows_do_not_depend_on_the_other_rows() -> None:
    from omni_grpo.exact.grouped import gmm

    x, w = _bf16(4096, 2048), _bf16(16, 1536, 2048).transpose(1, 2) / 45
    offs = torch.tensor([256 * (i + 1) for i in range(16)], device="cuda", dtype=torch.int32)
    full = gmm(x, w, offs)
    few = torch.cat([x[256 * i : 256 * i + 3] for i in range(16)])
    offs_few = torch.tensor([3 * (i + 1) for i in range(16)], device="cuda", dtype=torch.int32)
    want = torch.cat([full[256 * i : 256 * i + 3] for i in range(16)])
    assert torch.equal(gmm(few, w, offs_few), want)


def test_attention_decode_step_equals_the_full_sequence_forward() -> None:
    from omni_grpo.exact.attention import attention_forward

    b, length, extra = 4, 700, 50
    starts = torch.tensor([0, 13, 64, 301], device="cuda")
    q = _bf16(b, 32, length, 128)
    k, v = _bf16(b, 4, length + extra, 128), _bf16(b, 4, length + extra, 128)
    keys = torch.arange(length, device="cuda")
    mask = (keys[None, None] >= starts[:, None, None]) & (keys[None, None] <= keys[None, :, None])
    full, _ = attention_forward(None, q, k[:, :, :length], v[:, :, :length], mask[:, None])  # type: ignore[arg-type]
    for t in (301, 363, 364, 365, 699):
        dmask = torch.zeros(b, 1, 1, length + extra, dtype=torch.bool, device="cuda")
        dmask[:, 0, 0, : t + 1] = keys[: t + 1][None] >= starts[:, None]
        step, _ = attention_forward(None, q[:, :, t : t + 1], k, v, dmask)  # type: ignore[arg-type]
        assert torch.equal(step[:, 0], full[:, t])


def test_rowwise_kernels_do_not_depend_on_the_batch() -> None:
    from omni_grpo.exact.rowwise import rmsnorm, token_logprobs

    x, w = _bf16(3000, 2048), torch.rand(2048, device="cuda").to(torch.bfloat16)
    assert torch.equal(rmsnorm(x[5:9], w, 1e-6), rmsnorm(x, w, 1e-6)[5:9])
    z = torch.randn(300, 152064, device="cuda") * 3
    t = torch.randint(0, 152064, (300,), device="cuda")
    assert torch.equal(token_logprobs(z[7:8], t[7:8]), token_logprobs(z, t)[7:8])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("exact_gpu"), n_prompts=3, max_new_tokens=3)


def _lengths(prompts: list[Any], n: int) -> list[int]:
    """Long-tailed budgets for the continuous decoder: most rows short, one to the limit."""
    return [[2, 5, 24, 9][j % 4] + i for i in range(len(prompts)) for j in range(n)]


@pytest.mark.parametrize(
    ("lora", "batching", "compile_"),
    [
        (False, "static", False),
        (True, "static", False),
        (True, "continuous", False),
        (True, "continuous", True),  # trainer.compile: the recompute compiled, the forward exact
        (False, "static", True),
    ],
)
def test_every_completion_token_is_exact_over_grpo_steps(
    world: dict[str, Any], lora: bool, batching: str, compile_: bool
) -> None:
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.exact import enable_exact_logprobs
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import GRPOBatch, SamplingParams

    model = copy.deepcopy(world["base"]).to("cuda", torch.bfloat16)
    cfg = TrainerConfig(
        device="cuda",
        lr=1e-3,
        micro_batch_size=8,
        micro_batch_tokens=4096,
        gradient_checkpointing=True,
        compile=compile_,
        lora=LoraConfig(rank=4, targets=["attention", "experts"]) if lora else None,
    )
    backend = TorchBackend(model, cfg, AlgoConfig(kl_coef=0.01), pad_token_id=world["eos"])
    enable_exact_logprobs(model)
    engine = EmbeddedEngine(
        model,
        [world["eos"]],
        device="cuda",
        autocast_dtype=torch.bfloat16,
        banned_token_ids=media_token_ids(model),
        batching=batching,
        max_batch_rows=5,  # continuous: 5 slots for 12 rows, refilled and re-packed
        length_plan=_lengths if batching == "continuous" else None,
    )
    torch.manual_seed(0)
    for _ in range(3):
        groups = engine.generate(world["prompts"], 4, SamplingParams(max_new_tokens=24))
        adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * len(groups))
        metrics = backend.step(GRPOBatch(groups, adv))
        assert metrics["train_rollout_logprob_exact_fraction"] == 1.0, backend.exact_watch.totals
        assert metrics["train_rollout_logprob_abs_diff"] == 0.0
    assert {m for m, (bad, _) in backend.exact_watch.totals.items() if bad} == set()
    if compile_:
        assert backend.compiled is not None and backend.compiled.exact


def test_exact_with_compile_trains_as_the_uncompiled_exact_step(world: dict[str, Any]) -> None:
    """The same groups, one step each: the loss is the same bits (the same exact forward and KL
    reference), the gradients those of a compiled recompute (bf16 rounding apart)."""
    from omni_grpo.types import GRPOBatch

    groups = world["groups"]
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * len(groups))
    out = []
    for compile_ in (False, True):
        torch.manual_seed(5)
        model, backend = _exact_lora_backend(world, compile_)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        metrics = backend.step(GRPOBatch(groups, adv))
        delta = torch.cat(
            [
                (p.detach() - start[n]).flatten().float()
                for n, p in model.named_parameters()
                if p.requires_grad
            ]
        )
        out.append((metrics, delta))
    (m0, d0), (m1, d1) = out
    assert m0["loss"] == m1["loss"]
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=0.05)
    assert torch.nn.functional.cosine_similarity(d0, d1, dim=0) > 0.98


def test_continuous_rows_are_bitwise_independent_of_their_batch(world: dict[str, Any]) -> None:
    """Exact kernels + row-keyed draws: a row's tokens and logprobs are the same bits with 12
    slots (every row at once) and 3 (rows refilled as others end, then re-packed)."""
    from omni_grpo.exact import enable_exact_logprobs
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import SamplingParams

    model = copy.deepcopy(world["base"]).to("cuda", torch.bfloat16)
    enable_exact_logprobs(model)
    runs = []
    for slots in (12, 3):
        engine = EmbeddedEngine(
            model,
            [],
            device="cuda",
            autocast_dtype=torch.bfloat16,
            banned_token_ids=media_token_ids(model),
            batching="continuous",
            max_batch_rows=slots,
            length_plan=_lengths,
        )
        torch.manual_seed(3)
        runs.append(engine.generate(world["prompts"], 4, SamplingParams(max_new_tokens=24)))
    for a, b in zip(*runs, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs


def test_partial_rollouts_continue_bitwise(world: dict[str, Any]) -> None:
    """Exact kernels + keyed draws: samples stopped after the first group ended and continued
    in a second call (their earlier tokens re-prefilled) have the same bits as the same samples
    decoded in one call."""
    from omni_grpo.exact import enable_exact_logprobs
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.testing.partial_rollouts import continued_and_one_go
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import SamplingParams

    model = copy.deepcopy(world["base"]).to("cuda", torch.bfloat16)
    enable_exact_logprobs(model)
    engine = EmbeddedEngine(
        model,
        [],
        device="cuda",
        autocast_dtype=torch.bfloat16,
        banned_token_ids=media_token_ids(model),
        batching="continuous",
        max_batch_rows=5,
    )
    sampling = SamplingParams(max_new_tokens=40)
    for x, y in continued_and_one_go(engine, world["prompts"], sampling):
        assert len(x.token_ids) == x.limit
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
