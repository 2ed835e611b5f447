"""LoRA on the torch backend (issue 21): exact base at init, only adapters train, merged weights."""

from __future__ import annotations

import copy

import pytest
import torch
from omni_grpo.backends.torch_backend import TorchBackend
from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
from omni_grpo.models.lora import is_adapter_name, lora_layers
from omni_grpo.types import GRPOBatch

ALL_TARGETS = ["attention", "experts", "visual", "lm_head"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("lora"), max_new_tokens=3)


def _backend(
    world: dict, targets: list[str] = ALL_TARGETS, algo: AlgoConfig | None = None, **kw: object
) -> TorchBackend:
    torch.manual_seed(0)
    cfg = TrainerConfig(
        device="cpu", lr=1e-2, lora=LoraConfig(rank=4, alpha=8, targets=targets), **kw
    )
    return TorchBackend(
        copy.deepcopy(world["base"]), cfg, algo or AlgoConfig(), pad_token_id=world["eos"]
    )


def _row_logits(model: torch.nn.Module, world: dict) -> torch.Tensor:
    """Logits of one prompt + completion row, through the thinker's forward (media included)."""
    c = world["groups"][0][0]
    ids = torch.tensor([c.prompt.input_ids + c.token_ids])
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **c.prompt.mm).logits


def _trained(world: dict, targets: list[str] = ALL_TARGETS) -> TorchBackend:
    backend = _backend(world, targets)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(world["groups"]))
    metrics = backend.step(GRPOBatch(world["groups"], adv))
    assert metrics["skipped_step"] == 0 and metrics["grad_norm"] > 0
    return backend


def test_zero_b_reproduces_the_base_logits_exactly(world: dict) -> None:
    backend = _backend(world)
    assert {n for n, _ in lora_layers(backend.model)}  # something was adapted
    for group in ("self_attn.q_proj", "mlp.experts", "visual.blocks.0.attn.qkv", "lm_head"):
        assert any(group in n for n, _ in lora_layers(backend.model)), group
    assert torch.equal(_row_logits(backend.model, world), _row_logits(world["base"], world))


def test_only_adapters_train_and_checkpoint(world: dict) -> None:
    backend = _trained(world)
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert set(backend.trainable_state()) == trainable
    params = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    assert params == {id(p) for p in backend.params} and len(params) == len(trainable)
    base = world["base"].state_dict()
    changed = 0
    for name, value in backend.model.state_dict().items():
        plain = name.replace(".base_layer", "").replace(".parametrizations.", ".")
        if is_adapter_name(name):
            changed += int("lora_B" in name and bool(value.abs().sum() > 0))
            continue
        assert torch.equal(value, base[plain]), name
    assert changed > 0
    # the embedded engine samples the adapted module itself: it moved
    assert not torch.equal(_row_logits(backend.policy, world), _row_logits(world["base"], world))


def test_merged_weights_are_w_plus_scale_ba_and_compute_the_adapted_model(world: dict) -> None:
    backend = _trained(world)
    merged, layout = backend.weights_for_sync()
    assert layout == "hf_memory"
    base = world["base"].state_dict()
    assert set(merged) <= set(base)
    assert any("experts.gate_up_proj" in n for n in merged) and "lm_head.weight" in merged
    scale = 8 / 4
    state = backend.model.state_dict()
    for name in merged:
        if name.endswith(".weight") and "experts" not in name:  # linear layers: independent formula
            stem = name.removesuffix(".weight")
            a = state[f"{stem}.lora_A.default.weight"]
            b = state[f"{stem}.lora_B.default.weight"]
            assert torch.equal(merged[name], base[name] + (b @ a) * scale), name
    # all tensors (the experts' per-expert factors included): the base model carrying the merged
    # weights computes what the adapted model computes
    plain = copy.deepcopy(world["base"])
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(
        _row_logits(plain, world), _row_logits(backend.model, world), rtol=0, atol=1e-5
    )
    # sync bytes scale with what LoRA touches: attention only -> the q/k/v/o weights alone
    attn, _ = _trained(world, ["attention"]).weights_for_sync()
    assert attn and all(".self_attn." in n for n in attn)
    assert sum(t.numel() for t in attn.values()) < sum(t.numel() for t in merged.values())


def test_lora_with_megatron_is_refused_at_config_time() -> None:
    with pytest.raises(ValueError, match="trainer.lora needs trainer.backend: torch"):
        TrainerConfig(backend="megatron", lora=LoraConfig())
    with pytest.raises(ValueError, match="extra"):
        LoraConfig(rnk=4)


def _mbs(world: dict) -> list:
    from omni_grpo.backends.torch_backend import make_micro_batches

    adv = torch.zeros(len(world["groups"]), len(world["groups"][0]))
    return make_micro_batches(world["groups"], adv, 8, world["eos"])


def _logps(backend: TorchBackend, world: dict, *, reference: bool) -> list[torch.Tensor]:
    backend.model.train()  # as in step()
    with torch.no_grad():
        if reference:
            return [backend._reference_logp(mb, 1.0) for mb in _mbs(world)]
        return [backend._token_logp(backend.model, mb, 1.0).float() for mb in _mbs(world)]


def test_kl_reference_is_the_live_module_not_a_copy(world: dict) -> None:
    """LoRA + KL keeps no second model: before the anchor the reference is the adapters-disabled
    base (bit-equal to the base model's logprobs), after it the anchored adapter values stand in
    for one forward (bit-equal to a model that holds them); the live adapters are untouched."""
    backend = _backend(world, algo=AlgoConfig(kl_coef=0.1, kl_type="k3"))
    assert backend.reference is None and backend.has_reference
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(world["groups"]))
    backend.step(GRPOBatch(world["groups"], adv))  # the adapters moved: policy != base
    live = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    full = TorchBackend(
        copy.deepcopy(world["base"]), TrainerConfig(device="cpu"), AlgoConfig(), pad_token_id=0
    )
    base_logps = _logps(full, world, reference=False)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(_logps(backend, world, reference=False), base_logps, strict=True)
    )
    for got, want in zip(_logps(backend, world, reference=True), base_logps, strict=True):
        assert torch.equal(got, want)
    anchored = {n: v + 0.01 for n, v in backend.trainable_state().items()}
    backend.set_reference(anchored)
    holder = _backend(world)
    holder.load_trainable_state(anchored)
    for got, want in zip(
        _logps(backend, world, reference=True), _logps(holder, world, reference=False), strict=True
    ):
        assert torch.equal(got, want)
    for n, p in backend.model.named_parameters():
        assert torch.equal(p, live[n]), n
        assert p.requires_grad == is_adapter_name(n), n


def test_gradient_checkpointing_gives_the_same_step(world: dict) -> None:
    """trainer.gradient_checkpointing recomputes the layers in the backward: same loss, same
    updated adapters (fp32), and the adapters still get their gradients (non-reentrant)."""
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(world["groups"]))
    plain, ckpt = _backend(world), _backend(world, gradient_checkpointing=True)
    a = plain.step(GRPOBatch(world["groups"], adv))
    b = ckpt.step(GRPOBatch(world["groups"], adv))
    assert b["skipped_step"] == 0 and b["grad_norm"] > 0
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    sa, sb = plain.trainable_state(), ckpt.trainable_state()
    for n in sa:
        torch.testing.assert_close(sb[n], sa[n], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing is the torch backend"):
        TrainerConfig(backend="megatron", gradient_checkpointing=True)


def _count_products(backend: TorchBackend, batch: GRPOBatch) -> tuple[dict, int]:
    """One step's metrics and the number of matmul / attention-core ops it ran."""
    from omni_grpo.models.selective_checkpoint import SAVED_OPS
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.n += func in SAVED_OPS
            return func(*args, **(kwargs or {}))

    with Count():
        metrics = backend.step(batch)
    return metrics, Count.n


def test_selective_checkpointing_gives_the_same_step_with_less_recompute(world: dict) -> None:
    """trainer.checkpoint_policy selective keeps the attention's products: the same loss and
    adapters as whole-layer recompute (fp32), and fewer matmul / attention ops run in the step
    (the attention's are not recomputed); the experts' still are."""
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(world["groups"]))
    batch = GRPOBatch(world["groups"], adv)
    targets = ["attention", "experts"]
    plain = _backend(world, targets)
    layer = _backend(world, targets, gradient_checkpointing=True)
    selective = _backend(world, targets, gradient_checkpointing=True, checkpoint_policy="selective")
    p, n_plain = _count_products(plain, batch)
    a, n_layer = _count_products(layer, batch)
    b, n_selective = _count_products(selective, batch)
    assert b["skipped_step"] == 0 and b["grad_norm"] > 0
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    sa, sb = layer.trainable_state(), selective.trainable_state()
    for n in sa:
        torch.testing.assert_close(sb[n], sa[n], rtol=0, atol=1e-6)
    assert n_plain < n_selective < n_layer  # the experts' products are still recomputed
    with pytest.raises(ValueError, match="checkpoint_policy 'selective' needs"):
        TrainerConfig(checkpoint_policy="selective")


def test_exact_kl_with_lora_reference(world: dict) -> None:
    """kl_type full takes the reference's logits from the adapters-disabled live module."""
    backend = _backend(world, algo=AlgoConfig(kl_coef=0.1, kl_type="full"))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(world["groups"]))
    first = backend.step(GRPOBatch(world["groups"], adv))
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # policy == base before the update
    second = backend.step(GRPOBatch(world["groups"], adv))
    assert second["kl_loss"] > 0 and second["skipped_step"] == 0
    assert all(p.requires_grad == is_adapter_name(n) for n, p in backend.model.named_parameters())


def test_compiled_layers_give_the_same_step(world: dict) -> None:
    """trainer.compile: the decoder layers' parts compiled for the step (checkpointing and the
    adapters-disabled KL reference included) give the eager step's loss, KL and adapters (fp32),
    and hand the eager modules back to generation afterwards."""
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.types import SamplingParams

    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(world["groups"]))
    algo = AlgoConfig(kl_coef=0.1, kl_type="k3")
    kw = {"gradient_checkpointing": True, "micro_batch_size": 4, "micro_batch_tokens": 4096}
    eager = _backend(world, ["attention", "experts"], algo, **kw)
    compiled = _backend(world, ["attention", "experts"], algo, compile=True, **kw)
    assert compiled.compiled is not None and len(compiled.compiled.parts) == 4 * len(
        [m for m in compiled.model.modules() if type(m).__name__.endswith("TextDecoderLayer")]
    )
    for _ in range(2):  # the second step: KL against the moved policy, adapters non-zero
        a = eager.step(GRPOBatch(world["groups"], adv))
        b = compiled.step(GRPOBatch(world["groups"], adv))
        assert b["skipped_step"] == 0 and b["grad_norm"] > 0
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["kl_loss"] == pytest.approx(a["kl_loss"], abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    sa, sb = eager.trainable_state(), compiled.trainable_state()
    for n in sa:
        torch.testing.assert_close(sb[n], sa[n], rtol=0, atol=1e-5)
    assert all("forward" not in part.__dict__ for part, _ in compiled.compiled.parts)
    torch.manual_seed(3)
    engine = EmbeddedEngine(compiled.model, [world["eos"]])
    (group,) = engine.generate(world["prompts"][:1], 2, SamplingParams(max_new_tokens=3))
    assert len(group) == 2 and all(len(c.token_ids) == 3 for c in group)
    with pytest.raises(ValueError, match="trainer.compile is the torch backend"):
        TrainerConfig(backend="megatron", compile=True)
