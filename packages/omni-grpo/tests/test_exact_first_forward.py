"""Exact mode with ``trainer.compile``: each decoder layer's forward runs without a graph and its
backward recomputes the layer on a twin (``models.compiled_layers.ExactFirstForward``).

On the CPU exact mode itself cannot run (its kernels are Triton GPU kernels), so this checks
the mechanism with eager twins: a GRPO step through it is bitwise the step through torch's own
checkpoint (same kernels in both), the adapters' gradients included (they come from inside the
recompute). The GPU test (``test_exact_gpu.py``) runs it with exact kernels and compiled twins.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("exact_first"), n_prompts=3, max_new_tokens=4)


@pytest.mark.parametrize("lora", [True, False])
def test_a_step_through_the_twin_recompute_is_the_checkpointed_step(
    world: dict[str, Any], lora: bool
) -> None:
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.models.compiled_layers import CompiledLayers
    from omni_grpo.types import GRPOBatch

    cfg = TrainerConfig(
        device="cpu",
        lr=1e-3,
        micro_batch_size=4,
        gradient_checkpointing=True,
        lora=LoraConfig(rank=4, targets=["attention", "experts"]) if lora else None,
    )
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * len(world["groups"]))
    results = []
    for twin in (False, True):
        torch.manual_seed(3)  # the same adapters' initial values
        model = copy.deepcopy(world["base"])
        backend = TorchBackend(model, cfg, AlgoConfig(kl_coef=0.01), pad_token_id=world["eos"])
        calls: list[int] = []
        if twin:
            backend.compiled = CompiledLayers(model)
            backend.compiled.exact_mode(compile_twins=False)
            for layer in backend.compiled.twins:  # the twins run only in the backward
                layer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        metrics = backend.step(GRPOBatch(world["groups"], adv))
        after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        if twin:
            assert calls, "the twin's recompute never ran"
        assert any(not torch.equal(before[n], after[n]) for n in before)
        results.append((metrics, after))
    (m0, p0), (m1, p1) = results
    assert m0["loss"] == m1["loss"] and m0["grad_norm"] == m1["grad_norm"]
    changed = [n for n in p0 if not torch.equal(p0[n], p1[n])]
    assert not changed, changed[:5]
    if lora:  # the adapters moved in both (their gradients come from inside the recompute)
        assert any("lora_" in n for n in p0)


def test_the_twin_shares_parameters_not_attributes(world: dict[str, Any]) -> None:
    from omni_grpo.models.compiled_layers import text_decoder_layers, twin_layer

    layer = text_decoder_layers(world["base"])[0]
    twin = twin_layer(layer)
    assert all(a is b for a, b in zip(layer.parameters(), twin.parameters(), strict=True))
    assert twin.self_attn is not layer.self_attn
    assert twin.self_attn.config is not layer.self_attn.config  # exact mode rebinds the original's
    assert twin.self_attn.config._attn_implementation == layer.self_attn.config._attn_implementation
    assert twin.gradient_checkpointing is False
