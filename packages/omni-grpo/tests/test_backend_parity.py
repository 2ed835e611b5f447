"""The same ``GRPOBatch`` through the torch and the Megatron backend: same loss, metrics, decision.

Two runs of one check:

* CPU (always): ``MegatronBackend.step`` runs its own code — rows with omni-rope positions,
  token-budget micro-batches, the reference swap, the shared loss, the shared step policy, the
  fp32-master AdamW — over the torch thinker (an adapter with the ``MegatronThinker`` call
  signature, given the Megatron rows' explicit positions). Only the four megatron-core kernels
  are replaced, by their tp = 1 definitions (vocab-parallel logprobs/entropy = the plain ones over
  the whole vocabulary; gradient reduction = nothing to reduce in one process; the global grad
  norm = the L2 norm of every gradient). So what differs between the backends' steps here is
  exactly their step code.
* GPU with megatron-core (``gpu``): the real Megatron thinker built from the same checkpoint,
  fp32, tp = ep = 1, against the torch backend on the same device.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omni_grpo.algo import entropy_from_logits, token_logprobs_from_logits
from omni_grpo.backends.megatron import backend as megatron_backend
from omni_grpo.backends.megatron.backend import MegatronBackend
from omni_grpo.backends.torch_backend import TorchBackend
from omni_grpo.config import AlgoConfig, TrainerConfig
from omni_grpo.types import GRPOBatch, RolloutEngine, TrainerBackend
from torch import nn

# means over tokens that are linear in the micro-batch split (the nonlinear ones — Pearson,
# quantiles, ESS — legitimately depend on how rows are grouped, which the backends do differently)
LINEAR_KEYS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "ois", "kl_loss", "entropy_loss")
POLICY_KEYS = ("skipped_step", "no_signal_step", "response_tokens")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    w = rollout_world(tmp_path_factory.mktemp("parity"))  # image, audio, video prompts
    assert isinstance(w["engine"], RolloutEngine)
    w["groups"][1][2].token_ids, w["groups"][1][2].logprobs = [], []  # an empty one counts too
    return w


class TorchThinkerAsMegatron(nn.Module):
    """The torch thinker behind ``MegatronThinker``'s interface: ``forward(ids, pos[3,B,S], mm)``."""

    def __init__(self, thinker: nn.Module) -> None:
        super().__init__()
        self.lm = thinker
        self.lm.config.sequence_parallel = False  # what the backend asks the LM config
        self.args = SimpleNamespace()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mm: dict[str, torch.Tensor]) -> Any:
        out = self.lm(
            input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos.long(), **mm
        )
        return out.logits

    def trainable_parameters(self) -> Any:
        return ((n, p) for n, p in self.lm.named_parameters() if p.requires_grad)


def _tp1_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        megatron_backend,
        "vocab_parallel_logprobs",
        lambda logits, targets: token_logprobs_from_logits(logits, targets),
    )
    monkeypatch.setattr(
        megatron_backend, "vocab_parallel_entropy", lambda logits: entropy_from_logits(logits)
    )
    monkeypatch.setattr(megatron_backend, "finalize_grads", lambda lm, sp: None)
    monkeypatch.setattr(
        megatron_backend,
        "global_grad_norm",
        lambda lm: torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in lm.parameters() if p.grad is not None])
        ),
    )


def _cfgs(**algo: Any) -> tuple[TrainerConfig, TrainerConfig, AlgoConfig]:
    common = dict(lr=1e-2, device="cpu", max_grad_norm=0.5)  # a norm that clips
    return (
        TrainerConfig(micro_batch_size=2, **common),
        TrainerConfig(backend="megatron", **common),
        AlgoConfig(**algo),
    )


def _vl_config(world: dict[str, Any]) -> dict[str, Any]:
    from omni_grpo.backends.megatron.model import read_vl_config

    return read_vl_config(world["vl"])


def _assert_same(a: dict[str, float], b: dict[str, float], tol: float) -> None:
    for key in LINEAR_KEYS:
        assert (key in a) == (key in b), key
        if key in a:
            assert a[key] == pytest.approx(b[key], abs=tol), key
    for key in POLICY_KEYS:
        assert a[key] == b[key], key
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=tol)
    assert a["lr"] == b["lr"]


@pytest.mark.parametrize(
    ("advantages", "algo"),
    [
        ("mixed", {}),
        ("mixed", {"kl_coef": 0.1, "kl_type": "low_var_kl", "entropy_coef": 0.01}),
        ("zero", {}),  # no group has signal: both skip, the weights stay
    ],
)
def test_same_batch_same_step_on_cpu(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, advantages: str, algo: dict
) -> None:
    _tp1_kernels(monkeypatch)
    torch_cfg, mega_cfg, algo_cfg = _cfgs(**algo)
    groups = world["groups"]
    adv = (
        torch.randn(len(groups), 4, generator=torch.Generator().manual_seed(3))
        if advantages == "mixed"
        else torch.zeros(len(groups), 4)
    )
    # the loop's schedule hands each step its lr: both backends must train (and report) with it
    batch = GRPOBatch(groups, adv, temperature=0.8, lr=0.5 * torch_cfg.lr)
    tb = TorchBackend(copy.deepcopy(world["base"]), torch_cfg, algo_cfg, pad_token_id=world["eos"])
    mb = MegatronBackend(
        TorchThinkerAsMegatron(copy.deepcopy(world["base"])), _vl_config(world), mega_cfg, algo_cfg
    )
    assert isinstance(tb, TrainerBackend) and isinstance(mb, TrainerBackend)  # the whole seam
    before = {n: p.detach().clone() for n, p in tb.model.named_parameters()}
    mt, mm = tb.step(batch), mb.step(batch)
    _assert_same(mt, mm, 1e-5)
    assert mt["lr"] == 0.5 * torch_cfg.lr
    assert mt["no_signal_step"] == (1.0 if advantages == "zero" else 0.0)
    # Adam's first update is lr * g / (|g| + eps): for the odd gradient element within a few eps
    # of zero, a 1e-10 difference in g (rows batched differently) moves it by ~1e-2 * lr; all
    # other elements agree to 1e-5.
    moved = off = total = 0
    for (name, p), (_, q) in zip(
        tb.model.named_parameters(), mb.thinker.lm.named_parameters(), strict=True
    ):
        d = (p - q).abs()
        assert float(d.max()) <= 0.02 * torch_cfg.lr, name
        off += int((d > 1e-5).sum())
        total += d.numel()
        moved += int(not torch.equal(p, before[name]))
    assert off <= 1e-4 * total
    assert (moved > 0) == (advantages != "zero")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_batch_same_step_with_megatron_core(world: dict[str, Any]) -> None:
    pytest.importorskip("megatron.core")
    from omni_grpo.backends.megatron.model import build_thinker, init_parallel
    from omni_grpo.config import MegatronConfig

    mcfg = MegatronConfig(precision="fp32")
    init_parallel(mcfg)
    torch_cfg, _, algo_cfg = _cfgs()
    torch_cfg = torch_cfg.model_copy(update={"device": "cuda"})
    mega_cfg = TrainerConfig(
        backend="megatron", lr=1e-2, device="cuda", max_grad_norm=0.5, megatron=mcfg
    )
    groups = world["groups"]
    batch = GRPOBatch(
        groups, torch.randn(len(groups), 4, generator=torch.Generator().manual_seed(3)), 0.8
    )
    model = copy.deepcopy(world["base"])
    tb = TorchBackend(model, torch_cfg, algo_cfg, pad_token_id=world["eos"])
    tb.autocast_dtype = None  # fp32 on both sides: the comparison is of step code, not precision
    thinker = build_thinker(world["vl"], mcfg, audio_dir=world["audio"])
    mb = MegatronBackend(thinker, _vl_config(world), mega_cfg, algo_cfg)
    _assert_same(tb.step(batch), mb.step(batch), 1e-4)
