"""Rollouts one step ahead (``rollout.max_staleness: 1``): in-flight samples across a weight sync,
the staleness each sample records, the single-process policy snapshot, and the loop end to end."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from omni_grpo.config import SamplingParams, SglangOmniConfig
from omni_grpo.rollout.overlap import (
    AheadEngine,
    PolicySnapshot,
    staleness_metrics,
    version_step,
)
from omni_grpo.rollout.sglang_omni import SglangOmniEngine
from omni_grpo.sync import WeightSyncError, make_weight_sync
from omni_grpo.types import Completion, PromptInputs, Sample
from omni_rollout_client.testing import FakeGeneration, FakeOmniServer, FakeRequest

VOCAB = 1000
LONG = 40  # tokens of a "long" prompt's samples: still running when the sync pauses the server


def oracle(req: FakeRequest) -> FakeGeneration:
    """Deterministic in (prompt, seed), distinct per sample; prompts ending in 1 answer in one
    token (done before the sync), the others in ``LONG`` (in flight during it)."""
    h = hashlib.shake_256(repr((req.input_ids, req.seed)).encode()).digest(2 * LONG)
    n = 1 if req.input_ids[-1] == 1 else LONG
    return FakeGeneration(
        token_ids=[10 + h[i] % 900 for i in range(n)],
        logprobs=[-(h[LONG + i] + 1) / 64 for i in range(n)],
    )


def prompt(uid: str, short: bool) -> PromptInputs:
    ids = [3, 4, 5, 6 + len(uid), 1 if short else 2]
    return PromptInputs(sample=Sample(uid=uid, prompt="p", label="A"), input_ids=ids)


def wait_until(predicate, what: str, deadline_s: float = 60.0) -> None:
    """Poll a server condition (a deadline against hangs, not a timed assertion)."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def thinker_state(tiny_omni_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        str(tiny_omni_dir), dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_no_sample_lost_or_duplicated_across_a_sync_with_requests_in_flight(
    tmp_path: Path, thinker_state
) -> None:
    prompts = [prompt("s0", True), prompt("l0", False), prompt("s1", True), prompt("l1", False)]
    n, short_rows = 3, 6
    sampling = SamplingParams(temperature=1.0, max_new_tokens=LONG, seed=5)
    with FakeOmniServer(vocab_size=VOCAB, generator=oracle, token_delay_s=0.05) as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="disk", sync_dir=tmp_path / "sync")
        engine = SglangOmniEngine(cfg, vocab_size=VOCAB)
        sync = make_weight_sync(cfg, run_dir=tmp_path)
        ahead = AheadEngine(engine)
        try:
            batch = ahead.submit(lambda: prompts, n, sampling)
            # the short samples are done, the long ones are being generated: sync now
            wait_until(
                lambda: (
                    sum(r.outcome == "ok" for r in server.records) == short_rows
                    and server.active_count() == len(prompts) * n - short_rows
                ),
                "short samples finished and long ones in flight",
            )
            sync.push(thinker_state, "step-1", layout="hf_memory")
            groups = batch.result(timeout=120)
        finally:
            ahead.close()
            sync.close()
            engine.close()
        records = list(server.records)
        admin_log = list(server.admin_log)
    admin = [route for route, _ in admin_log]

    # the sync really interleaved with the batch: paused with retract while requests ran
    pause = [body for route, body in admin_log if route == "/pause_generation"]
    assert pause and pause[-1]["mode"] == "retract"
    assert admin.index("/update_weights_from_disk") > admin.index("/pause_generation")
    # every request the server executed came back exactly once; none was resent or dropped
    assert len(records) == len(prompts) * n and {r.outcome for r in records} == {"ok"}
    assert [len(g) for g in groups] == [n] * len(prompts)
    got = Counter(
        (tuple(c.prompt.input_ids), tuple(c.token_ids), c.weight_version) for g in groups for c in g
    )
    sent = Counter((tuple(r.input_ids), tuple(r.token_ids), r.weight_version) for r in records)
    assert got == sent and max(got.values()) == 1
    # the version each sample records is the one the server reported when it finished it
    for g, p in zip(groups, prompts, strict=True):
        assert [c.prompt.sample.uid for c in g] == [p.sample.uid] * n
        want = "default" if p.input_ids[-1] == 1 else "step-1"
        assert {c.weight_version for c in g} == {want}, p.sample.uid
        assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in g)
    assert staleness_metrics(groups, 1, 1)["staleness/frac_1"] == pytest.approx(0.5)


def _completion(version: str) -> Completion:
    return Completion(
        prompt=prompt("x", True),
        token_ids=[1],
        logprobs=[-1.0],
        finish_reason="stop",
        weight_version=version,
    )


def test_staleness_counts_versions_and_flags_samples_beyond_the_bound() -> None:
    assert [version_step(v) for v in ("default", "warmup", "step-0", "step-12", "step-x")] == [
        0,
        0,
        0,
        12,
        0,
    ]
    groups = [
        [_completion("step-4"), _completion("step-3")],
        [_completion("step-2"), _completion("step-4")],
    ]
    m = staleness_metrics(groups, 4, 1)
    assert m["staleness/frac_0"] == 0.5 and m["staleness/frac_1"] == 0.25
    assert m["staleness/frac_over_bound"] == 0.25 and m["staleness/max"] == 2.0
    assert m["staleness/mean"] == pytest.approx(0.75)


class _Recording:
    """An engine over a module that records the weight it saw and when it ran."""

    def __init__(self, module: torch.nn.Module, version_fn) -> None:
        self.module, self.version_fn = module, version_fn
        self.started = threading.Event()
        self.release = threading.Event()

    def generate(self, prompts, n, sampling):
        self.started.set()
        seen = float(self.module.weight.sum())
        self.release.wait(30)
        assert float(self.module.weight.sum()) == seen  # nobody changed it mid-batch
        c = Completion(
            prompt=prompts[0],
            token_ids=[1],
            logprobs=[seen],
            finish_reason="stop",
            weight_version=self.version_fn(),
        )
        return [[c] * n for _ in prompts]

    def close(self) -> None:
        pass


def test_policy_snapshot_is_a_copy_updated_only_between_batches() -> None:
    policy = torch.nn.Linear(3, 2)
    snap = PolicySnapshot(policy, _Recording)
    engine = snap.engine
    assert snap.module is not policy and snap.module.weight.data_ptr() != policy.weight.data_ptr()
    with torch.no_grad():
        policy.weight.add_(1.0)  # the optimizer moves the trainer's weights; the copy stays
    assert not torch.equal(snap.module.weight, policy.weight)
    ahead = AheadEngine(snap)
    try:
        batch = ahead.submit(lambda: [prompt("a", True)], 2, SamplingParams())
        assert engine.started.wait(30)
        pushed = threading.Thread(target=snap.push, args=(dict(policy.state_dict()), "step-1"))
        pushed.start()
        pushed.join(0.2)
        assert pushed.is_alive()  # the push waits for the batch in flight
        engine.release.set()
        (group,) = batch.result(30)
        pushed.join(30)
    finally:
        ahead.close()
    assert {c.weight_version for c in group} == {"default"}
    assert snap.version == "step-1" and torch.equal(snap.module.weight, policy.weight)
    (again,) = snap.generate([prompt("b", True)], 1, SamplingParams())
    assert again[0].weight_version == "step-1"
    with pytest.raises(WeightSyncError, match="no weights named"):
        snap.push({"nope": torch.zeros(1)}, "step-2")
    with pytest.raises(WeightSyncError, match="shape"):
        snap.push({"bias": torch.zeros(5)}, "step-2")
    assert snap.version == "step-1"


def test_single_process_run_one_step_ahead_records_staleness_and_resumes(tmp_path: Path) -> None:
    from omni_grpo.config import load_config
    from omni_grpo.run.checkpoint import latest_checkpoint, load_checkpoint
    from omni_grpo.run.metrics import read_metrics
    from omni_grpo.trainer import train

    model = tmp_path / "model"
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=3",
            "run.save_every=0",
            "run.tensorboard=false",
            "run.plots=false",
            "model.make_tiny={vocab: small, seed: 0}",
            f"model.omni_checkpoint={model / 'omni'}",
            f"model.extracted_dir={model / 'vl'}",
            f"model.audio_dir={model / 'audio'}",
            "data.synthetic={tasks: [image, audio], n_train: 4, n_eval: 1, seed: 0}",
            "rollout.n_samples=3",
            "rollout.prompts_per_step=2",
            "rollout.sampling.max_new_tokens=3",
            "rollout.max_staleness=1",
            "algo.tis={enabled: true, mode: icepop}",
            "trainer.device=cpu",
            "trainer.lr=1e-3",
            "eval.every=0",
        ],
    )
    train(cfg, progress=False, stop_after=2)
    state, *_ = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    # the batch drawn ahead for step 3 is not in the checkpoint: resume draws it again
    assert state.step == 2 and state.cursor.position == 2 * cfg.rollout.prompts_per_step
    train(cfg, progress=False, resume=True)
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["staleness/frac_0"] == 1.0  # the first batch cannot be generated ahead
    assert steps[1]["staleness/frac_1"] == 1.0  # sampled by the snapshot of step 0's weights
    # after a resume the first batch is again generated on-policy
    assert steps[2]["staleness/frac_0"] == 1.0
    assert all(r["staleness/frac_over_bound"] == 0.0 for r in steps)


def test_policy_snapshot_refuses_a_lora_policy() -> None:
    policy = torch.nn.Module()
    policy.q = torch.nn.Module()
    policy.q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 1)})
    with pytest.raises(ValueError, match="trainer.lora"):
        PolicySnapshot(policy, _Recording)
