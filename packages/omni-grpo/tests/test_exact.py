"""rollout.exact_logprobs on CPU: the refusals, the warning, the factor cache, and (in a
subprocess, ``test_exact_interpreted.py``) the kernels' arithmetic in Triton's interpreter."""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omni_grpo.config import ConfigError, load_config


# ----------------------------------------------------------------------------- config refusals
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["rollout.engine=sglang-omni", "rollout.sglang.urls=[http://127.0.0.1:1]"],
            "rollout.exact_logprobs needs rollout.engine embedded (got 'sglang-omni')",
        ),
        (["trainer.backend=megatron"], "rollout.exact_logprobs needs trainer.backend torch"),
        (["trainer.device=cpu"], "rollout.exact_logprobs needs a CUDA device"),
        (["model.dtype=float32"], "rollout.exact_logprobs needs model.dtype bfloat16"),
        (
            ["trainer.lora={dropout: 0.1}"],
            "rollout.exact_logprobs needs trainer.lora.dropout 0",
        ),
        (
            ["trainer.gradient_checkpointing=true", "trainer.checkpoint_policy=selective"],
            "rollout.exact_logprobs needs trainer.checkpoint_policy layer (got 'selective')",
        ),
        (
            ["trainer.compile=true", "trainer.gradient_checkpointing=false"],
            "rollout.exact_logprobs with trainer.compile needs trainer.gradient_checkpointing",
        ),
    ],
)
def test_config_refuses_where_exactness_cannot_hold(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        load_config(None, ["rollout.exact_logprobs=true", *overrides])
    assert "\n" not in str(err.value).strip()
    load_config(None, overrides)  # without the option the same settings are fine


def test_config_accepts_the_supported_setting() -> None:
    cfg = load_config(None, ["rollout.exact_logprobs=true", "trainer.lora={rank: 8}"])
    assert cfg.rollout.exact_logprobs and cfg.trainer.lora is not None
    # with trainer.compile: the policy's forward stays exact, the recompute is compiled
    on = [
        "rollout.exact_logprobs=true",
        "trainer.compile=true",
        "trainer.gradient_checkpointing=true",
    ]
    assert load_config(None, on).trainer.compile
    assert load_config(None, []).rollout.exact_logprobs == "auto"
    # the scale path: rollout actors hold bitwise copies (LoRA: the unmerged adapters)
    ray = ["rollout.exact_logprobs=true", "rollout.embedded.actors=1", "trainer.world_size=2"]
    assert load_config(None, [*ray, "trainer.lora={rank: 8}"]).trainer.world_size == 2


# ----------------------------------------------------------------------- the default: auto
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["trainer.compile=true", "trainer.gradient_checkpointing=false"],
            "with trainer.compile needs trainer.gradient_checkpointing",
        ),
        (
            ["trainer.gradient_checkpointing=true", "trainer.checkpoint_policy=selective"],
            "needs trainer.checkpoint_policy layer",
        ),
        (["trainer.device=cpu"], "needs a CUDA device"),
        (["rollout.max_staleness=1"], "rollout.max_staleness 1 samples with weights one version"),
        (["rollout.embedded.extra_groups=2"], "continues samples of earlier policies"),
    ],
)
def test_auto_is_off_with_its_reasons_where_it_cannot_hold(
    overrides: list[str], fragment: str
) -> None:
    from omni_grpo.loop.components import resolve_exact

    cfg = load_config(None, overrides)  # accepted: auto never refuses
    cuda_model = SimpleNamespace(lm_head=SimpleNamespace(weight=_cuda_bf16_weight()))
    on, line = resolve_exact(cfg, cuda_model)
    assert not on and line.startswith("rollout.exact_logprobs: off (auto): ")
    assert fragment in line and "\n" not in line


def test_auto_is_on_where_it_holds_and_says_so() -> None:
    from omni_grpo.loop.components import resolve_exact

    cfg = load_config(None, ["trainer.lora={rank: 8}"])
    on, line = resolve_exact(
        cfg, SimpleNamespace(lm_head=SimpleNamespace(weight=_cuda_bf16_weight()))
    )
    assert on and line.startswith("rollout.exact_logprobs: on (auto)")


def test_auto_on_a_cpu_model_is_off_and_on_ray_actors_follows_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from omni_grpo.exact import ExactLogprobsUnsupported
    from omni_grpo.loop.components import resolve_exact

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this test's machine: CPU

    cfg = load_config(None, [])
    on, line = resolve_exact(cfg, SimpleNamespace(lm_head=torch.nn.Linear(4, 4)))
    assert not on and "needs the model on a CUDA device (it is on cpu)" in line
    assert "turn the option off" not in line  # auto turned it off: no advice to do so
    ray = ["rollout.embedded.actors=1", "trainer.world_size=2"]
    on, line = resolve_exact(load_config(None, ray), None, distributed=True)
    assert not on and "the trainer ranks would run on the CPU" in line  # trainer.device auto
    on, line = resolve_exact(
        load_config(None, [*ray, "trainer.device=cuda"]), None, distributed=True
    )  # every actor checks its own device as it starts
    assert on and "in every trainer rank and rollout actor" in line
    on, line = resolve_exact(load_config(None, ["trainer.backend=megatron"]), None)
    assert not on and "needs trainer.backend torch" in line and "Ray" not in line
    assert resolve_exact(load_config(None, ["rollout.exact_logprobs=false"]), None) == (
        False,
        "rollout.exact_logprobs: off (false in the config)",
    )
    with pytest.raises(ExactLogprobsUnsupported, match="true, but the trainer ranks would run"):
        resolve_exact(load_config(None, ["rollout.exact_logprobs=true"]), None, distributed=True)


def test_the_run_states_it_in_its_first_lines(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from omni_grpo.trainer import log_first_lines

    parts = SimpleNamespace(exact=(False, "rollout.exact_logprobs: off (auto): a reason"))
    with caplog.at_level(logging.INFO, logger="omni_grpo.trainer"):
        log_first_lines(load_config(None, []), parts)  # type: ignore[arg-type]
    assert "rollout.exact_logprobs: off (auto): a reason" in caplog.text


class _FakeWeight:
    """What ``check_supported`` reads of a weight: a CUDA device, bf16 (no GPU needed)."""

    device = torch.device("cuda")
    dtype = torch.bfloat16


def _cuda_bf16_weight() -> Any:
    return _FakeWeight()


def test_enable_refuses_a_cpu_model_in_one_line() -> None:
    from omni_grpo.exact import ExactLogprobsUnsupported, enable_exact_logprobs

    model = SimpleNamespace(lm_head=torch.nn.Linear(4, 4))
    with pytest.raises(ExactLogprobsUnsupported, match="needs the model on a CUDA device"):
        enable_exact_logprobs(model)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ warning
def _mb(train: list[list[float]], rollout: list[list[float]], modalities: list[str]) -> Any:
    prompts = [SimpleNamespace(sample=SimpleNamespace(modality=m)) for m in modalities]
    t = torch.tensor(train)
    return t, SimpleNamespace(
        prompts=prompts,
        mask=torch.tensor([[True, True, False]] * len(modalities)),
        rollout_logp=torch.tensor(rollout),
    )


def test_watch_warns_once_per_modality_naming_step_and_modality(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from omni_grpo.exact.watch import ExactnessWatch

    watch = ExactnessWatch()
    same, mb = _mb([[-1.0, -2.0, 0.0]] * 2, [[-1.0, -2.0, 5.0]] * 2, ["image", "audio"])
    with caplog.at_level(logging.WARNING, logger="omni_grpo.exact"):
        # a difference outside the mask (the padding) is no difference
        assert watch.check(same, mb, step=1) == {"audio": (0, 2), "image": (0, 2)}
        assert not caplog.records
        train, mb = _mb(
            [[-1.0, -2.0, 0.0], [-1.0, -2.0, 0.0]],
            [[-1.0, -2.0000002, 0.0], [-1.0, -2.0, 0.0]],
            ["video", "audio"],
        )
        assert watch.check(train, mb, step=3) == {"audio": (0, 2), "video": (1, 2)}
        watch.check(train, mb, step=4)
    (record,) = caplog.records
    assert "at step 3, 1 of 2 video completion tokens" in record.getMessage()
    assert watch.totals == {"audio": (0, 6), "image": (0, 2), "video": (2, 4)}
    stale = ExactnessWatch()  # rollout.max_staleness 1: samples differ by design, no warning
    stale.enabled = False
    with caplog.at_level(logging.WARNING, logger="omni_grpo.exact"):
        stale.check(train, mb, step=2)
    assert len(caplog.records) == 1 and stale.totals["video"] == (1, 2)


def test_watch_queues_on_the_device_and_reads_once_at_flush(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The trainer queues each micro-batch (no host read between its forward and backward) and
    flushes at the step's end: the same counts, totals and one warning as checking each."""
    from omni_grpo.exact.watch import ExactnessWatch

    same, mb_same = _mb([[-1.0, -2.0, 0.0]] * 2, [[-1.0, -2.0, 5.0]] * 2, ["image", "audio"])
    train, mb = _mb([[-1.0, -2.0, 0.0]], [[-1.0, -2.5, 0.0]], ["video"])
    watch = ExactnessWatch()
    with caplog.at_level(logging.WARNING, logger="omni_grpo.exact"):
        watch.queue(same, mb_same, step=5)
        watch.queue(train, mb, step=5)
        assert watch.totals == {} and not caplog.records  # nothing read yet
        per_mb = watch.flush()
    assert per_mb == [{"audio": (0, 2), "image": (0, 2)}, {"video": (1, 2)}]
    assert watch.totals == {"audio": (0, 2), "image": (0, 2), "video": (1, 2)}
    (record,) = caplog.records
    assert "at step 5, 1 of 2 video completion tokens" in record.getMessage()
    assert watch.flush() == []


def test_tree_sum_and_softmax_are_elementwise_per_row() -> None:
    from omni_grpo.exact.rowwise import softmax, tree_sum

    x = torch.randn(9, 6)
    s = tree_sum(x)
    assert s.shape == (9, 1)
    pairs = [(x[:, 0] + x[:, 4]) + (x[:, 2] + 0.0), (x[:, 1] + x[:, 5]) + (x[:, 3] + 0.0)]
    assert torch.equal(s[:, 0], pairs[0] + pairs[1])
    assert torch.equal(tree_sum(x[:2]), s[:2]) and torch.equal(softmax(x[3:5]), softmax(x)[3:5])
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))


def test_towers_concat_joins_every_structure() -> None:
    from omni_grpo.models.item_cache import concat_outputs

    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    assert torch.equal(concat_outputs([a, b]), torch.cat([a, b]))
    joined = concat_outputs([(a, [a, a]), (b, [b, b])])
    assert isinstance(joined, tuple) and torch.equal(joined[1][1], torch.cat([a, b]))
    assert concat_outputs([None, None]) is None


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("exact"), max_new_tokens=3)


def test_lora_factor_cache_follows_fused_adamw_steps(world: dict[str, Any]) -> None:
    """torch's fused AdamW updates in place without bumping ``_version``: the grouped experts'
    no-grad factor cache must be dropped after every optimizer step, or the next rollout samples
    with the previous adapters (seen on the H200: exact on LoRA broke from the second step)."""
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.models.grouped_experts import lora_factors

    model = copy.deepcopy(world["base"])
    cfg = TrainerConfig(device="cpu", lr=1e-2, lora=LoraConfig(rank=4, targets=["experts"]))
    backend = TorchBackend(model, cfg, AlgoConfig(), pad_token_id=world["eos"])
    wrapper = next(m for m in model.modules() if hasattr(m, "parameter_name"))
    b_w = wrapper.lora_B["default"].weight
    fused = torch.optim.AdamW([b_w], lr=0.5, fused=True)
    with torch.no_grad():
        before = lora_factors(wrapper, torch.float32)[1].clone()
    b_w.grad = torch.ones_like(b_w)
    version = b_w._version
    fused.step()
    assert b_w._version == version  # the torch behaviour the cache cannot see
    with torch.no_grad():
        assert torch.equal(lora_factors(wrapper, torch.float32)[1], before)  # stale, as feared
    b_w.grad = torch.zeros_like(b_w)
    backend.optimizer.step()  # the backend's post-step hook drops every cache
    with torch.no_grad():
        fresh = lora_factors(wrapper, torch.float32)[1]
    assert not torch.equal(fresh, before)
    torch.testing.assert_close(fresh, lora_factors(wrapper, torch.float32)[1])


def test_the_kl_reference_forward_runs_on_the_exact_kernels(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With LoRA the reference is the live module with its adapters off, run on the exact kernels
    (not under ``exact.switch.torch_kernels``): the KL term measures the adapters' effect, never
    a difference of kernels (the GPU test: 0 at the untrained adapters). Here the forward is
    stubbed (the kernels need a GPU) and asked which kernels it was given."""
    from omni_grpo.backends.torch_backend import TorchBackend, make_micro_batches
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.exact import install
    from omni_grpo.exact.switch import torch_kernels_on

    monkeypatch.setattr(install, "check_supported", lambda model: None)
    model = copy.deepcopy(world["base"])
    cfg = TrainerConfig(device="cpu", lora=LoraConfig(rank=4, targets=["attention", "experts"]))
    backend = TorchBackend(model, cfg, AlgoConfig(kl_coef=0.01), pad_token_id=world["eos"])
    install.enable_exact_logprobs(model)
    seen: list[tuple[bool, bool]] = []

    def logits(module: Any, mb: Any) -> torch.Tensor:
        experts = next(m for m in model.modules() if hasattr(m, "disable_adapters"))
        seen.append((torch_kernels_on(), bool(experts.disable_adapters)))
        vocab = model.lm_head.weight.shape[0]
        return torch.zeros(mb.input_ids.shape[0], mb.mask.shape[1], vocab)

    monkeypatch.setattr(backend, "_logits", logits)
    adv = torch.ones(len(world["groups"]), len(world["groups"][0]))
    for mb in make_micro_batches(world["groups"], adv, 8, world["eos"], token_budget=4096):
        backend._reference_logits(mb)  # (its log-softmax is the exact Triton kernel: GPU test)
    assert seen and all(s == (False, True) for s in seen), seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the compiled kernels")
def test_kernels_in_triton_interpreter() -> None:
    """``test_exact_interpreted.py`` in a fresh process: Triton takes TRITON_INTERPRET when it is
    first imported, and in this one something imported it long before."""
    here = Path(__file__).resolve()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(here.with_name("test_exact_interpreted.py")),
        ],
        cwd=here.parents[3],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], res.stdout[
        -500:
    ]


def test_item_cache_matches_exactly_and_evicts() -> None:
    """Tower outputs are reused only for inputs equal to the stored ones (never on probes
    alone), the least recently used go first, and nothing is cached while a tower trains."""
    from omni_grpo.models.item_cache import ItemCache

    x = torch.zeros(1000)
    twin = x.clone()
    twin[1] = 1.0  # the probes (every 15th value) agree, the items do not
    cache = ItemCache(capacity_bytes=3 * 4000 + 3 * 4)
    cache.put((x,), torch.ones(1))
    assert cache.get((x.clone(),)) is not None and cache.get((twin,)) is None
    assert cache.get((x,), tag="other call") is None  # the call's arguments are part of the key
    cache.put((twin,), torch.zeros(1))
    assert torch.equal(cache.get((twin,)), torch.zeros(1))
    cache.get((x,))  # x is now the most recently used
    cache.put((torch.full((1000,), 2.0),), torch.ones(1))
    cache.put((torch.full((1000,), 3.0),), torch.ones(1))  # over capacity: twin goes
    assert cache.get((twin,)) is None and cache.get((x,)) is not None
    tower = torch.nn.Linear(1, 1)
    cache = ItemCache(tower)
    assert cache.enabled() is False
    tower.requires_grad_(False)
    assert cache.enabled() is True
    tower.adapter = torch.nn.Linear(1, 1)  # a trainable part added after the cache (LoRA)
    assert cache.enabled() is False


def test_towers_encode_each_item_once_per_step(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The rollout's prefill encodes a prompt's image / audio; the trainer's forwards of the step
    find them in the cache: the same logits as encoding again, and no tower call."""
    from omni_grpo.exact.switch import torch_kernels
    from omni_grpo.exact.towers import encode_towers_per_item
    from omni_grpo.testing.rollouts import rollout_world

    world = rollout_world(tmp_path_factory.mktemp("towers"), n_prompts=6, n=2, max_new_tokens=2)
    plain = world["base"]
    model = copy.deepcopy(plain)
    encode_towers_per_item(model)
    visual, audio = model.model.visual, model.audio.tower
    rows = {}
    for group in world["groups"]:
        mm = group[0].prompt.mm
        kind = "image" if "pixel_values" in mm else "audio" if "input_features" in mm else None
        if kind and kind not in rows:
            rows[kind] = group[0]
    assert set(rows) == {"image", "audio"}

    def logits(m: torch.nn.Module, c: Any) -> torch.Tensor:
        ids = torch.tensor([c.prompt.input_ids + c.token_ids])
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=torch.ones_like(ids), **c.prompt.mm).logits

    firsts = {}
    for kind, c in rows.items():
        cache = (visual if kind == "image" else audio).omni_item_cache
        want = logits(plain, c)
        first = logits(model, c)  # the rollout's prefill: encoded, kept
        misses = cache.misses
        again = logits(model, c)  # the policy forward: found
        with torch_kernels():
            reference = logits(model, c)  # the KL reference: found too
        assert cache.misses == misses and cache.hits >= 2, kind
        torch.testing.assert_close(first, want, rtol=0, atol=1e-5)
        assert torch.equal(again, first) and torch.equal(reference, first), kind
        firsts[kind] = first
    # a benchmark's next step with the same prompts: cleared caches encode again
    from omni_grpo.models.item_cache import clear_item_caches

    kept = len(visual.omni_item_cache.entries) + len(audio.omni_item_cache.entries)
    assert kept >= 2 and clear_item_caches(model) == kept
    for kind, c in rows.items():
        cache = (visual if kind == "image" else audio).omni_item_cache
        assert not cache.entries, kind
        misses = cache.misses
        assert torch.equal(logits(model, c), firsts[kind]), kind
        assert cache.misses > misses, kind


def test_the_trainers_forwards_find_the_rollouts_tower_items(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The real flow, not a direct call: the engine's prefill (``use_cache=True``) encodes a
    step's images, videos and audios; the backend's policy and KL-reference forwards over packed
    micro-batches (``use_cache=None``) find every one of them and encode nothing again."""
    from omni_grpo.exact.towers import encode_towers_per_item
    from omni_grpo.testing.rollouts import rollout_world
    from omni_grpo.testing.towers import rollout_then_step

    world = rollout_world(tmp_path_factory.mktemp("flow"), n_prompts=6, n=2, max_new_tokens=2)
    caches, encoded, after = rollout_then_step(world, install=encode_towers_per_item)
    assert all(misses > 0 for misses, _ in encoded.values()), encoded
    assert after == encoded  # no item encoded a second time
    assert all(c.hits >= 2 * n for c, (_, n) in zip(caches.values(), encoded.values(), strict=True))


def test_grouped_linear_reads_gathered_rows_only_without_a_graph() -> None:
    """``gather=`` has no backward (the rows are never materialised): recording a graph through
    it is refused by name, not silently given wrong gradients."""
    from omni_grpo.exact.grouped import grouped_linear

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(2, 8, 3)
    offs, ids = torch.tensor([3, 6], dtype=torch.int32), torch.tensor([0, 1, 1, 2, 3, 3])
    with pytest.raises(ValueError, match="gather"):
        grouped_linear(x, w, offs, gather=ids)
