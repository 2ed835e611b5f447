"""The default path's decode-step forwards (``models.decode_kernels``) on CPU: the LoRA linear's
three-product form against peft's forward, its factor cache, and the swap in and out of the
text model's modules. The Triton kernels' arithmetic: ``test_exact_interpreted.py`` (interpreter)
and ``tests/test_thinker_gpu.py`` (generation on CUDA)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from omni_grpo.config import LoraConfig
from omni_grpo.models import decode_kernels as dk
from omni_grpo.models.grouped_experts import invalidate_factor_caches
from omni_grpo.models.lora import apply_lora
from torch import nn


def _lora_linear(rank: int = 4) -> Any:
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(24, 40, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    torch.manual_seed(0)
    net = get_peft_model(Net(), PeftConfig(r=rank, lora_alpha=8, target_modules=["proj"]))
    layer = net.base_model.model.proj
    nn.init.normal_(layer.lora_B["default"].weight)  # peft starts B at zero: no adapter term
    return net.eval(), layer


def test_lora_linear_is_pefts_forward_in_three_products() -> None:
    net, layer = _lora_linear()
    x = torch.randn(3, 5, 24)
    want = layer(x)
    got = dk.lora_linear_forward(layer, x)
    assert got.shape == want.shape == (3, 5, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    adapter_term = want - layer.base_layer(x)
    assert adapter_term.abs().max() > 1e-2  # the comparison covers the adapter, not only W
    with net.disable_adapter():  # defers to peft: the base layer alone
        torch.testing.assert_close(dk.lora_linear_forward(layer, x), layer.base_layer(x))


def test_linear_factors_follow_the_adapter_and_the_invalidation() -> None:
    net, layer = _lora_linear()
    x = torch.randn(4, 24)
    first = dk.linear_factors(layer, torch.float32)
    assert dk.linear_factors(layer, torch.float32) is first  # cached
    with torch.no_grad():
        layer.lora_B["default"].weight.mul_(2.0)  # an in-place update bumps _version
    torch.testing.assert_close(dk.lora_linear_forward(layer, x), layer(x), rtol=1e-5, atol=1e-5)
    second = dk.linear_factors(layer, torch.float32)
    assert second is not first
    invalidate_factor_caches(net)  # what the backend calls after a fused optimizer step
    assert dk.linear_factors(layer, torch.float32) is not second


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path_factory.mktemp("decode"), n_prompts=1, n=1, max_new_tokens=1)
    return world["base"]


def test_decode_kernels_swap_in_and_out(thinker: Any) -> None:
    apply_lora(thinker, LoraConfig(rank=4, targets=["attention", "experts"]))
    text = thinker.model.language_model
    norms = [m for m in text.modules() if type(m).__name__.endswith("RMSNorm")]
    routers = [m for m in text.modules() if type(m).__name__.endswith("TopKRouter")]
    layers = len(text.layers)
    assert not dk.enabled(thinker)  # CPU: transformers' and peft's forwards
    with dk.decode_kernels(thinker) as n:
        assert n == 0
    with dk.decode_kernels(thinker, on=True) as n:
        assert n == len(norms) + len(routers) + 4 * layers  # q, k, v, o adapted
        assert all("forward" in m.__dict__ for m in norms + routers)
    assert not any("forward" in m.__dict__ for m in text.modules())
    exact_bound = norms[0]
    exact_bound.forward = lambda x: x  # a forward exact mode bound stays as it is
    with dk.decode_kernels(thinker, on=True) as n:
        assert n == len(norms) - 1 + len(routers) + 4 * layers
    assert exact_bound.forward(3) == 3


def test_enabled_needs_cuda_bf16_and_not_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    head = nn.Linear(2, 2)
    thinker = nn.Module()
    thinker.lm_head = head
    assert not dk.enabled(thinker)  # CPU, fp32
    if torch.cuda.is_available():
        thinker.lm_head = head.to("cuda", torch.bfloat16)
        assert dk.enabled(thinker)
        monkeypatch.setenv("OMNI_GRPO_DECODE_KERNELS", "0")
        assert not dk.enabled(thinker)
        monkeypatch.delenv("OMNI_GRPO_DECODE_KERNELS")
        thinker.exact_logprobs = True
        assert not dk.enabled(thinker)
