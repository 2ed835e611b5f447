"""The torch backend's GRPO step: direction of the update, micro-batching, freezing, NaN skip, KL."""

from __future__ import annotations

import copy

import pytest
import torch
from omni_grpo.backends import available_backends, backend_factory
from omni_grpo.backends.torch_backend import TorchBackend, make_micro_batches
from omni_grpo.config import AlgoConfig, SamplingParams, TrainerConfig
from omni_grpo.rollout.embedded import EmbeddedEngine
from omni_grpo.trainer import media_token_ids
from omni_grpo.types import GRPOBatch


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("backend"), max_new_tokens=3)


def _backend(world: dict, **trainer_kw: object) -> TorchBackend:
    algo_kw = trainer_kw.pop("algo", {})
    model = copy.deepcopy(world["base"])
    model.set_frozen(visual=trainer_kw.pop("freeze_visual", True))
    cfg = TrainerConfig(device="cpu", lr=1e-2, **trainer_kw)
    return TorchBackend(model, cfg, AlgoConfig(**algo_kw), pad_token_id=world["eos"])


def _seq_logp(backend: TorchBackend, groups: list, advantages: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        mbs = make_micro_batches(groups, advantages, 64, backend.pad_token_id)
        return torch.cat(
            [(backend._token_logp(backend.model, mb, 1.0) * mb.mask).sum(-1) for mb in mbs]
        )


def _record_applied_grads(*backends: TorchBackend) -> list[dict[str, torch.Tensor]]:
    """Per backend, the accumulated gradient its optimizer step would apply (the step is stubbed)."""
    grads: list[dict[str, torch.Tensor]] = []
    for backend in backends:
        named = [(n, p) for n, p in backend.model.named_parameters() if p.requires_grad]
        record: dict[str, torch.Tensor] = {}
        backend.optimizer.step = lambda named=named, record=record: record.update(  # type: ignore[method-assign]
            {n: p.grad.clone() for n, p in named if p.grad is not None}
        )
        grads.append(record)
    return grads


def test_registry_has_torch() -> None:
    assert "torch" in available_backends()
    with pytest.raises(ValueError, match="no backend named 'nope'"):
        backend_factory("nope")


def test_step_moves_towards_positive_advantages(world: dict) -> None:
    backend = _backend(world)
    groups = world["groups"]
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(groups))
    before = _seq_logp(backend, groups, adv)
    metrics = backend.step(GRPOBatch(groups, adv))
    after = _seq_logp(backend, groups, adv)
    delta = (after - before).view(len(groups), 4)
    assert (delta[:, [0, 2]].mean() > 0) and (delta[:, [1, 3]].mean() < 0)
    # recompute == rollout logprobs (same weights, cached vs full forward)
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-4
    assert metrics["skipped_step"] == 0 and metrics["grad_norm"] > 0
    for key in ("loss", "pg_loss", "pg_clipfrac", "train_rollout_logprob_pearson", "ess_ratio"):
        assert key in metrics


def test_packed_micro_batches_span_prompts_and_give_the_same_update(world: dict) -> None:
    """trainer.micro_batch_tokens (issue 27): rows of several prompts, with their media, in one
    left-padded micro-batch; loss and gradients equal the per-prompt step."""
    groups = world["groups"]
    adv = torch.randn(len(groups), 4, generator=torch.Generator().manual_seed(2))
    widths = {len(c.prompt.input_ids) for g in groups for c in g}
    assert len(widths) > 1  # prompts of different lengths: the packed rows are really padded
    packed = make_micro_batches(groups, adv, 64, world["eos"], token_budget=10_000)
    assert len(packed) == 1 and len({p.sample.uid for p in packed[0].prompts}) == len(groups)
    assert (packed[0].attention_mask == 0).any()
    rows = sum(len(g) for g in groups)
    budget = max(len(c.prompt.input_ids) + len(c.token_ids) for g in groups for c in g) * 5
    split = make_micro_batches(groups, adv, 64, world["eos"], token_budget=budget)
    assert sum(m.input_ids.shape[0] for m in split) == rows and len(split) > 1
    assert all(m.input_ids.numel() <= budget for m in split)
    per_prompt, pack = (
        _backend(world, micro_batch_size=8),
        _backend(world, micro_batch_size=8, micro_batch_tokens=budget),
    )
    grads = _record_applied_grads(per_prompt, pack)
    a = per_prompt.step(GRPOBatch(groups, adv))
    b = pack.step(GRPOBatch(groups, adv))
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert b["train_rollout_logprob_abs_diff"] < 1e-4  # left padding changes no logprob
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-4, atol=1e-6), name


def test_positions_come_from_the_host_once_per_micro_batch_and_step(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend positions each micro-batch's rows from its CPU tensors once per step (not
    from the GPU's ids at every forward): the same logits, bit for bit, as the model positioning
    packed rows of image, video and audio prompts itself; one computation per micro-batch for
    the KL reference's and the policy's forwards together."""
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path_factory.mktemp("positions"), n_prompts=6, n=2, max_new_tokens=2)
    groups = world["groups"]
    adv = torch.randn(len(groups), 2, generator=torch.Generator().manual_seed(3))
    backend = _backend(world, micro_batch_size=8, micro_batch_tokens=10_000, algo={"kl_coef": 0.1})
    mbs = make_micro_batches(groups, adv, 8, world["eos"], token_budget=10_000)
    kinds = {k for mb in mbs for k in mb.mm}
    assert {"image_grid_thw", "video_grid_thw", "feature_attention_mask"} <= kinds
    model = backend.model

    def unpositioned(**kw: object) -> object:
        kw.pop("position_ids")
        return model(**kw)

    with torch.no_grad():
        for mb in mbs:
            own = backend._logits(model, mb)  # positions from the host
            assert mb.position_ids is not None and mb.position_ids.device.type == "cpu"
            mb.position_ids = None
            assert torch.equal(own, backend._logits(unpositioned, mb))
    calls = []
    compute = type(backend.model).compute_position_ids
    monkeypatch.setattr(
        type(backend.model),
        "compute_position_ids",
        lambda self, *a, **kw: calls.append(1) or compute(self, *a, **kw),
    )
    backend.step(GRPOBatch(groups, adv))
    assert len(calls) == len(make_micro_batches(groups, adv, 8, world["eos"], token_budget=10_000))


@pytest.mark.parametrize("budget", [10_000, None])
def test_media_cross_to_the_device_once_per_distinct_tensor_and_join_there(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    """``media_on``: a micro-batch's media built on the device from each distinct prompt's
    tensors, copied once each, equal (values, dtypes, keys) to the host's ``mb.mm`` whose rows
    repeat them; packed rows of image, video and audio prompts, and one prompt's rows."""
    from omni_grpo.backends.torch_backend import media_on
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path_factory.mktemp("media"), n_prompts=6, n=3, max_new_tokens=2)
    groups = world["groups"]
    adv = torch.zeros(len(groups), 3)
    mbs = make_micro_batches(groups, adv, 8, world["eos"], token_budget=budget)
    kinds = {k for mb in mbs for k in mb.mm}
    assert {"pixel_values", "pixel_values_videos", "input_features"} <= kinds
    copies: list[int] = []
    to = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor, "to", lambda t, *a, **k: copies.append(id(t)) or to(t, *a, **k)
    )
    for mb in mbs:
        copies.clear()
        built = media_on(mb, torch.device("cpu"))
        distinct = {id(v) for p in mb.prompts for v in p.mm.values()}
        assert sorted(copies) == sorted(distinct)  # each once, none of mb.mm's repeats
        assert built.keys() == mb.mm.keys()
        for key, value in mb.mm.items():
            assert built[key].dtype == value.dtype and torch.equal(built[key], value), key


def test_micro_batching_gives_the_same_update(world: dict) -> None:
    groups = world["groups"]
    adv = torch.randn(len(groups), 4, generator=torch.Generator().manual_seed(1))
    big, small = _backend(world, micro_batch_size=8), _backend(world, micro_batch_size=1)
    grads = _record_applied_grads(big, small)
    mb = big.step(GRPOBatch(groups, adv))
    ms = small.step(GRPOBatch(groups, adv))
    assert mb["loss"] == pytest.approx(ms["loss"], abs=1e-5)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-4, atol=1e-7), name


def test_visual_tower_frozen_by_default(world: dict) -> None:
    backend = _backend(world)
    visual = {
        n: p.detach().clone()
        for n, p in backend.model.named_parameters()
        if n.startswith("model.visual.")
    }
    assert visual and not any(
        p.requires_grad for n, p in backend.model.named_parameters() if n in visual
    )
    backend.step(GRPOBatch(world["groups"], torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 3)))
    for n, p in backend.model.named_parameters():
        if n in visual:
            assert torch.equal(p, visual[n]), n
    unfrozen = _backend(world, freeze_visual=False)
    assert any(
        p.requires_grad
        for n, p in unfrozen.model.named_parameters()
        if n.startswith("model.visual.")
    )


def test_non_finite_gradient_skips_the_step(world: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend(world)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 3)
    adv[0, 0] = float("nan")
    metrics = backend.step(GRPOBatch(world["groups"], adv))
    assert metrics["skipped_step"] == 1
    for n, p in backend.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not backend.optimizer.state  # AdamW never stepped


def test_reference_only_with_kl(world: dict) -> None:
    assert _backend(world).reference is None
    backend = _backend(world, algo={"kl_coef": 0.1, "kl_type": "low_var_kl"})
    assert backend.reference is not None
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 3)
    first = backend.step(GRPOBatch(world["groups"], adv))
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the update
    second = backend.step(GRPOBatch(world["groups"], adv))
    assert second["kl_loss"] > 0


def test_full_kl_pulls_towards_the_reference(world: dict) -> None:
    """kl_type full: zero at the reference, positive after an update, and with no policy
    gradient (all advantages 0) the KL-only step lowers the exact KL it reports."""
    backend = _backend(world, algo={"kl_coef": 1.0, "kl_type": "full"})
    groups = world["groups"]
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(groups))
    first = backend.step(GRPOBatch(groups, adv))
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    moved = backend.step(GRPOBatch(groups, adv))["kl_loss"]
    assert moved > 0
    backend.optimizer = torch.optim.SGD(backend.params, lr=0.5)  # no AdamW momentum from above
    kls = [backend.step(GRPOBatch(groups, torch.zeros_like(adv)))["kl_loss"] for _ in range(3)]
    assert kls[0] > kls[1] > kls[2], kls


def test_checkpoint_state_round_trip(world: dict) -> None:
    a = _backend(world)
    a.step(GRPOBatch(world["groups"], torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 3)))
    b = _backend(world)
    b.load_trainable_state(a.trainable_state())
    b.load_optimizer_state(a.optimizer_state())
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="missing"):
        b.load_trainable_state({})


def test_supervised_warmup_step_learns_targets(world: dict) -> None:
    backend = _backend(world)
    prompts = world["prompts"]
    targets = [[5, world["eos"]]] * len(prompts)
    first = backend.supervised_step(prompts, targets, lr=1e-2)
    for _ in range(5):
        last = backend.supervised_step(prompts, targets, lr=1e-2)
    assert last < first
    assert backend.optimizer.param_groups[0]["lr"] == backend.cfg.lr  # restored after warm-up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_on_gpu_with_bf16_autocast(world: dict) -> None:
    model = copy.deepcopy(world["base"])
    cfg = TrainerConfig(device="cuda", lr=1e-3)
    backend = TorchBackend(model, cfg, AlgoConfig(), pad_token_id=world["eos"])
    assert backend.autocast_dtype == torch.bfloat16 and backend.device.type == "cuda"
    engine = EmbeddedEngine(
        model,
        [world["eos"]],
        device="cuda",
        autocast_dtype=torch.bfloat16,
        banned_token_ids=media_token_ids(model),
    )
    groups = engine.generate(world["prompts"], 4, SamplingParams(max_new_tokens=3))
    metrics = backend.step(GRPOBatch(groups, torch.tensor([[1.0, -1.0, 1.0, -1.0]] * len(groups))))
    assert metrics["skipped_step"] == 0
    # cached bf16 decoding vs the trainer's bf16 recompute: close, not bit-identical
    assert metrics["train_rollout_logprob_abs_diff"] < 0.1


def test_no_signal_batch_does_not_replay_momentum(world: dict) -> None:
    backend = _backend(world)
    backend.step(GRPOBatch(world["groups"], torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 3)))
    assert backend.optimizer.state  # AdamW now has momentum
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    metrics = backend.step(GRPOBatch(world["groups"], torch.zeros(3, 4)))
    assert metrics["no_signal_step"] == 1 and metrics["grad_norm"] == 0
    for n, p in backend.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_kl_reference_is_anchored_after_the_warmup_and_survives_resume(
    world: dict, tmp_path
) -> None:
    """With kl_coef > 0 the reference becomes the warmed-up policy (saved in the run dir) and a
    resumed backend reloads the same one; without a KL term nothing is stored."""
    from omni_grpo.trainer import REFERENCE_FILE, anchor_reference

    algo = AlgoConfig(kl_coef=0.05, kl_type="k3")
    backend = _backend(world, algo=algo.model_dump())
    prompts = world["prompts"]
    backend.supervised_step(prompts, [[world["eos"]]] * len(prompts), 1e-2)  # "warm-up"
    trained = backend.trainable_state()
    ref = dict(backend.reference.named_parameters())
    assert any(not torch.equal(ref[n], v) for n, v in trained.items())  # still the untrained copy
    anchor_reference(backend, tmp_path, algo, save=True)
    assert all(torch.equal(ref[n], v) for n, v in trained.items())
    fresh = _backend(world, algo=algo.model_dump())  # a resumed run: reference from the file
    anchor_reference(fresh, tmp_path, algo, save=False)
    fresh_ref = dict(fresh.reference.named_parameters())
    assert all(torch.equal(fresh_ref[n], v) for n, v in trained.items())
    anchor_reference(_backend(world), tmp_path / "nokl", AlgoConfig(), save=True)
    assert not (tmp_path / "nokl" / REFERENCE_FILE).exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_to_device_gives_the_same_values_from_a_strided_host_view(device: str) -> None:
    """``torch_backend.to_device``: the trainer's host-to-device copy (pinned staging on CUDA)
    keeps the values of a strided view, as the completion-token slice of ``input_ids`` is."""
    from omni_grpo.backends.torch_backend import to_device

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    host = torch.arange(40).view(4, 10)[:, 3:]
    moved = to_device(host, torch.device(device))
    assert moved.device.type == device and torch.equal(moved.cpu(), host)
