"""Grouped low-rank experts (issue 27) equal peft's parametrisation: fp32 forward and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from omni_grpo.config import LoraConfig
from omni_grpo.models.grouped_experts import grouped_mm
from omni_grpo.models.lora import adapters_disabled, apply_lora, lora_layers, merged_weights

TOL = 1e-6


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("grouped"), max_new_tokens=3)


def _adapted(world: dict, path: str) -> torch.nn.Module:
    """The tiny thinker with LoRA on attention + experts, B drawn non-zero (same for every path)."""
    model = copy.deepcopy(world["base"]).float()
    torch.manual_seed(0)
    apply_lora(
        model, LoraConfig(rank=4, alpha=8, targets=["attention", "experts"], expert_path=path)
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _loss_and_grads(model: torch.nn.Module, world: dict) -> tuple[torch.Tensor, dict]:
    c = world["groups"][0][0]
    ids = torch.tensor([c.prompt.input_ids + c.token_ids] * 2)
    model.train()
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **_mm(c, 2)).logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _mm(completion: object, n: int) -> dict:
    from omni_grpo.data.collate import repeat_mm

    return repeat_mm(completion.prompt.mm, n)


def test_grouped_class_is_swapped_only_on_the_experts(world: dict) -> None:
    model = _adapted(world, "grouped")
    kinds = {type(m).__name__ for n, m in lora_layers(model) if n.endswith("mlp.experts")}
    assert kinds == {"GroupedLoraExperts"}
    inner = [m for n, m in lora_layers(model) if n.endswith("mlp.experts.base_layer")]
    assert inner and all(type(m).__name__ == "ParamWrapper" for m in inner)


def test_forward_and_gradients_equal_peft_parametrisation(world: dict) -> None:
    grouped, peft_path = _adapted(world, "grouped"), _adapted(world, "peft")
    names = {n for n, p in grouped.named_parameters() if p.requires_grad}
    assert names == {n for n, p in peft_path.named_parameters() if p.requires_grad}
    logits_g, grads_g = _loss_and_grads(grouped, world)
    logits_p, grads_p = _loss_and_grads(peft_path, world)
    assert (logits_g - logits_p).abs().max() <= TOL * max(1.0, float(logits_p.abs().max()))
    expert_grads = [n for n in grads_p if "experts" in n]
    assert expert_grads and set(grads_g) == set(grads_p)
    for name, g in grads_p.items():
        scale = max(1.0, float(g.abs().max()))
        assert (grads_g[name] - g).abs().max() <= TOL * scale, name
    # not trivially equal: the adapters move the logits away from the base
    with torch.no_grad(), adapters_disabled(grouped):
        grouped.eval()
        c = world["groups"][0][0]
        ids = torch.tensor([c.prompt.input_ids + c.token_ids] * 2)
        base = grouped(input_ids=ids, attention_mask=torch.ones_like(ids), **_mm(c, 2)).logits
    assert (base - logits_g).abs().max() > 1e-3


def test_merged_weights_unchanged_by_the_expert_path(world: dict) -> None:
    grouped, peft_path = _adapted(world, "grouped"), _adapted(world, "peft")
    merged_g, merged_p = merged_weights(grouped), merged_weights(peft_path)
    assert merged_g.keys() == merged_p.keys()
    for name in merged_p:
        assert torch.equal(merged_g[name], merged_p[name]), name


def test_no_grad_cache_follows_adapter_updates(world: dict) -> None:
    """Generation caches the casted factors; an in-place optimizer step must invalidate them."""
    grouped = _adapted(world, "grouped")
    c = world["groups"][0][0]
    ids = torch.tensor([c.prompt.input_ids + c.token_ids])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **_mm(c, 1)}
    grouped.eval()
    with torch.no_grad():
        before = grouped(**kw).logits  # fills the cache
        for name, p in grouped.named_parameters():
            if "experts" in name and ".lora_B" in name:
                p.add_(0.5)  # in place, as AdamW's step
        cached = grouped(**kw).logits
    fresh = grouped(**kw).logits.detach()  # grad enabled: factors recomputed, never cached
    assert torch.equal(cached, fresh)
    assert (cached - before).abs().max() > 1e-3


def test_grouped_mm_fallback_matches_per_group_matmul() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=gen)
    w = torch.randn(4, 6, 5, generator=gen)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # group 1 empty
    out = grouped_mm(x, w, offs)
    expect = torch.cat([x[:3] @ w[0], x[3:7] @ w[2], x[7:] @ w[3]])
    assert torch.allclose(out, expect, atol=1e-6)


def test_padding_to_16_bytes_keeps_the_product() -> None:
    """torch's CUDA grouped GEMM needs 16-byte strides, which a LoRA rank of 4 breaks (found on
    the H200): the operands are zero-padded to multiples of 8 and the product cut back."""
    from omni_grpo.models.grouped_experts import pad_to_16_bytes

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 12, generator=gen)
    w = torch.randn(3, 12, 4, generator=gen)
    offs = torch.tensor([2, 5, 7], dtype=torch.int32)
    xp, wp, n = pad_to_16_bytes(x, w)
    assert xp.shape == (7, 16) and wp.shape == (3, 16, 8) and n == 4
    torch.testing.assert_close(grouped_mm(xp, wp, offs)[:, :n], grouped_mm(x, w, offs))
    aligned = torch.randn(3, 16, 8, generator=gen)
    assert pad_to_16_bytes(xp, aligned)[1] is aligned  # nothing to pad: the same tensors


def test_the_triton_decode_route_is_taken_only_where_nothing_backpropagates() -> None:
    """``takes_decode_route``: the Triton kernels for generation's routing and grouped products
    on CUDA bf16 up to ``DECODE_ROWS`` routed pairs; torch's (or the CPU loop) for the rest."""
    from omni_grpo.models.grouped_experts import DECODE_ROWS, expert_order, takes_decode_route

    bf16 = torch.bfloat16
    with torch.no_grad():
        assert not takes_decode_route(torch.randn(7, 8), bf16, 7)  # CPU
    index = torch.tensor([[0, 2], [1, 2]])
    assert expert_order(index, 3, fused=True).tiles is None  # CPU: torch's sort, no tile map
    if not torch.cuda.is_available():
        return
    x = torch.randn(7, 8, device="cuda")
    assert not takes_decode_route(x, bf16, 7)  # grad enabled: the training forward
    with torch.no_grad():
        assert takes_decode_route(x, bf16, 7)
        assert not takes_decode_route(x, torch.float32, 7)
        assert not takes_decode_route(x, bf16, DECODE_ROWS + 1)
    assert expert_order(index.cuda(), 3, fused=True).tiles is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_the_triton_decode_route_equals_torchs_grouped_gemm(tokens: int) -> None:
    """Generation's expert products through the Triton kernel equal torch's grouped GEMM (same
    fp32 accumulation, bf16 out: within one bf16 rounding), base and rank-16 adapters, the
    model's layouts (``[E, 2I, H]`` and ``[E, H, I]`` used transposed), empty experts included."""
    from omni_grpo.models.grouped_experts import _lora_linear, sort_by_expert
    from omni_grpo.models.grouped_gemm import tile_map

    torch.manual_seed(0)
    experts, hidden, inter, rank = 32, 256, 96, 16
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda").bfloat16() * 0.05
    down = torch.randn(experts, hidden, inter, device="cuda").bfloat16() * 0.05
    lora_gu = (
        torch.randn(experts, hidden, rank, device="cuda").bfloat16() * 0.05,
        torch.randn(experts, rank, 2 * inter, device="cuda").bfloat16() * 0.05,
    )
    index = torch.stack([torch.randperm(experts // 2, device="cuda")[:4] for _ in range(tokens)])
    pairs_in_order, _, offs = sort_by_expert(index, experts)
    x = torch.randn(tokens * 4, hidden, device="cuda").bfloat16()
    with torch.no_grad():
        plan = tile_map(offs, x.shape[0])
        for w, lora in ((gate_up, lora_gu), (down, None)):
            xi = x if w is gate_up else torch.randn(tokens * 4, inter, device="cuda").bfloat16()
            got = _lora_linear(xi, w, False, offs, lora, plan)
            want = _lora_linear(xi, w, False, offs, lora, None)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
        # the rows read through the pairs' token ids (the decode route's gather): the same bits
        h = torch.randn(tokens, hidden, device="cuda").bfloat16()
        ids = pairs_in_order // 4  # each sorted pair's token
        read = _lora_linear(h, gate_up, False, offs, lora_gu, plan, ids)
        assert torch.equal(read, _lora_linear(h[ids], gate_up, False, offs, lora_gu, plan))
