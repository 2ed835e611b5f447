"""The fused rotary embedding on CUDA in bf16 is transformers' composition bit for bit, at a
training micro-batch's shapes and a decode step's, and the thinker's forwards take it when
switched on (``OMNI_GRPO_FUSED_ROTARY=1``: opt-in until these tests have run on a GPU)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _composition(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` as written (not the installed wrapper)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import rotate_half

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize(
    ("batch", "length", "cos_batch", "scale"),
    [(4, 557, 4, 1.0), (64, 1, 64, 1.0), (3, 33, 1, 1.0), (2, 129, 2, 300.0), (2, 17, 2, 1e-3)],
)
def test_the_kernel_is_transformers_rotary_bit_for_bit(
    batch: int, length: int, cos_batch: int, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_grpo.models.rotary_kernel import SWITCH, fused_applies, rotate

    monkeypatch.setenv(SWITCH, "1")

    gen = torch.Generator(device="cuda").manual_seed(length)
    dev, bf16 = "cuda", torch.bfloat16
    # the attention's views: [B, T, H, D] projections transposed to [B, H, T, D]
    q = (torch.randn(batch, length, 32, 128, device=dev, generator=gen) * scale).to(bf16)
    k = (torch.randn(batch, length, 4, 128, device=dev, generator=gen) * scale).to(bf16)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    angles = torch.rand(cos_batch, length, 128, device=dev, generator=gen) * 1000
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    with torch.no_grad():
        assert fused_applies(q, k, cos, sin)
        ref_q, ref_k = _composition(q, k, cos, sin)
        out_q, out_k = rotate(q, cos, sin), rotate(k, cos, sin)
    assert torch.equal(_bits(out_q), _bits(ref_q)) and torch.equal(_bits(out_k), _bits(ref_k))
    assert out_q.stride() == q.stride()


def test_the_thinkers_no_grad_forwards_take_it_and_keep_their_logits(tmp_path, monkeypatch):
    """A prefill of the tiny thinker in bf16 on CUDA: the kernel runs in every layer, and the
    logits are those of transformers' function (switched off) bit for bit."""
    from omni_grpo.models import rotary_kernel as rk
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path, max_new_tokens=2)
    model = copy.deepcopy(world["base"]).to("cuda", torch.bfloat16).eval()
    c = world["groups"][0][0]
    ids = torch.tensor([c.prompt.input_ids + c.token_ids], device="cuda")
    mm = {k: v.to("cuda") for k, v in c.prompt.mm.items()}
    mm["attention_mask"] = torch.ones_like(ids)
    calls: list[int] = []
    real = rk.rotate

    def counting(x, cos, sin):
        calls.append(x.shape[1])
        return real(x, cos, sin)

    monkeypatch.setattr(rk, "rotate", counting)
    monkeypatch.setenv(rk.SWITCH, "1")
    with torch.no_grad():
        fused = model(input_ids=ids, **mm).logits
        layers = len(model.model.language_model.layers)
        assert len(calls) == 2 * layers
        monkeypatch.setenv(rk.SWITCH, "0")
        plain = model(input_ids=ids, **mm).logits
    assert len(calls) == 2 * layers
    assert torch.equal(_bits(fused), _bits(plain))
    module = sys.modules[type(model.model.language_model.layers[0].self_attn).__module__]
    assert getattr(getattr(module, rk.FUNCTION), rk._FUSED, False)
