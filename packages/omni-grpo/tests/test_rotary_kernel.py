"""The fused rotary embedding (``models.rotary_kernel``): where it is installed and where it
stands aside. Its arithmetic: ``test_exact_interpreted.py`` (Triton's interpreter, fp32) and
``test_rotary_kernel_gpu.py`` (CUDA bf16, bit for bit against transformers)."""

from __future__ import annotations

import sys

import pytest
import torch
from omni_grpo.models import rotary_kernel as rk


def test_the_thinker_routes_its_text_attention_through_it_once(tmp_path) -> None:
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path, max_new_tokens=2)
    layers = world["base"].model.language_model.layers
    module = sys.modules[type(layers[0].self_attn).__module__]
    wrapper = getattr(module, rk.FUNCTION)
    assert getattr(wrapper, rk._FUSED, False)
    assert rk.install_fused_rotary(layers) and getattr(module, rk.FUNCTION) is wrapper  # once
    assert not rk.install_fused_rotary(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))


def test_it_stands_aside_off_cuda_under_autograd_and_unless_switched_on(monkeypatch) -> None:
    """Every call it does not take goes to transformers' function with the same arguments."""
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as vl

    calls: list[int] = []

    def original(q, k, cos, sin, unsqueeze_dim=1, **kw):
        calls.append(unsqueeze_dim)
        return q, k

    monkeypatch.setenv(rk.SWITCH, "1")
    monkeypatch.setattr(rk, "rotate", lambda *a: pytest.fail("took the kernel"))
    wrapped = rk.fused_rotary(original)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos = sin = torch.randn(1, 3, 8)
    assert not rk.fused_applies(q, k, cos, sin)  # CPU
    assert wrapped(q, k, cos, sin) == (q, k)
    assert wrapped(q, k, cos, sin, unsqueeze_dim=2) == (q, k) and calls == [1, 2]
    with torch.enable_grad():
        assert not rk.fused_applies(q.requires_grad_(), k, cos, sin)
    monkeypatch.delenv(rk.SWITCH)  # opt-in: off by default
    assert not rk.fused_applies(q.detach(), k, cos, sin)
    # where it would apply, any argument the attention does not pass still goes to the original
    monkeypatch.setattr(rk, "fused_applies", lambda *a: True)
    for extra, kw in (((2,), {}), ((), {"unsqueeze_dim": 2}), ((), {"position_ids": None})):
        calls.clear()
        assert wrapped(q, k, cos, sin, *extra, **kw) is not None and len(calls) == 1, (extra, kw)
    assert vl.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"  # functools.wraps


def test_rotate_refuses_a_dtype_whose_roundings_it_does_not_reproduce() -> None:
    x = torch.zeros(1, 2, 3, 8, dtype=torch.float16)
    cos = torch.zeros(1, 3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        rk.rotate(x, cos, cos)
