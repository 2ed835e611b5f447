"""Our megatron building blocks against transformers' Qwen3-VL-MoE reference modules (CPU, no megatron)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_grpo.backends.megatron.batching import padded_length, plan_micro_batches
from omni_grpo.backends.megatron.layers import (
    GroupedExperts,
    InterleavedMRope,
    RMSNorm,
    SdpaAttention,
)


def _cfg(**kw: object) -> SimpleNamespace:
    base = dict(
        params_dtype=torch.float32,
        sequence_parallel=False,
        use_cpu_initialization=True,
        hidden_size=32,
        moe_ffn_hidden_size=8,
        init_method_std=0.02,
    )
    return SimpleNamespace(**{**base, **kw})


def test_rmsnorm_matches_hf_and_tags_sp() -> None:
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRMSNorm

    ours = RMSNorm(_cfg(sequence_parallel=True), 32, eps=1e-6)
    ref = Qwen3VLMoeTextRMSNorm(32, eps=1e-6)
    w = torch.randn(32)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = torch.randn(5, 3, 32)
    assert torch.equal(ours(x), ref(x))
    assert ours.weight.sequence_parallel is True


@pytest.mark.parametrize("section", [[2, 3, 3], [24, 20, 20]])
def test_interleaved_mrope_matches_hf(section: list[int]) -> None:
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding

    head_dim = 2 * sum(section)
    cfg = Qwen3VLMoeTextConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
    )
    ref = Qwen3VLMoeTextRotaryEmbedding(cfg)
    pos = torch.stack([torch.arange(40.0) * 1.5, torch.arange(40.0) % 7, torch.arange(40.0) // 3])[
        :, None
    ].expand(3, 2, 40)
    cos_ref, sin_ref = ref(torch.zeros(1, dtype=torch.float32), pos)  # [B, S, D]
    emb = InterleavedMRope(head_dim, 1e6, tuple(section), True)(pos)  # [S, B, 1, D]
    emb = emb[:, :, 0].transpose(0, 1)
    torch.testing.assert_close(emb.cos(), cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.sin(), sin_ref, rtol=0, atol=1e-6)


def test_mrope_refuses_implicit_positions() -> None:
    with pytest.raises(ValueError, match=r"\[3, B, S\]"):
        InterleavedMRope(16, 1e6, (2, 3, 3), True)(torch.arange(8)[None])


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (8, 2)])
def test_sdpa_attention_matches_explicit_causal_softmax(heads: int, groups: int) -> None:
    s, b, d = 11, 2, 8
    q, k, v = (
        torch.randn(s, b, heads, d),
        torch.randn(s, b, groups, d),
        torch.randn(s, b, groups, d),
    )
    out = SdpaAttention(None, 1, None, "self")(q, k, v)
    rep = heads // groups
    kk, vv = (t.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3) for t in (k, v))
    qq = q.permute(1, 2, 0, 3)
    scores = qq @ kk.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ vv).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_grouped_experts_match_per_token_reference() -> None:
    """Hub-layout weights: token t of expert e -> p * (silu(x@G_e) * (x@U_e)) @ D_e."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, _cfg())
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 32)
    probs = torch.rand(int(counts.sum()))
    out, bias = experts(x, counts, probs)
    assert bias is None
    ref, row = [], 0
    for e, n in enumerate(counts.tolist()):
        for _ in range(n):
            h = x[row] @ experts.fc1_weight[e]
            gate, up = h[:8], h[8:]
            ref.append(probs[row] * (F.silu(gate) * up) @ experts.fc2_weight[e])
            row += 1
    torch.testing.assert_close(out, torch.stack(ref), rtol=1e-5, atol=1e-6)
    assert all(p.allreduce is False for p in experts.parameters())


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=30), budget=st.integers(100, 400))
def test_micro_batch_plan_covers_every_sample_within_budget(
    lengths: list[int], budget: int
) -> None:
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in plan)


def test_too_long_sample_is_refused() -> None:
    with pytest.raises(
        ValueError, match="sample 1 has 50 tokens > trainer.megatron.max_tokens_per_gpu=40"
    ):
        plan_micro_batches([10, 50], 40)
    assert padded_length(61, 2) == 62 and padded_length(60, 4) == 60
