"""``rollout.max_staleness: 1`` through ``omni_grpo.trainer.train`` with the sglang-omni engine and
the fake server, for both trainer backends: the torch backend on the CPU, the Megatron backend on
a GPU (skipped without CUDA or megatron-core). The Ray paths are in ``test_ray_run.py``.

What the loop must keep, whatever the timing: every request the server ran is trained on exactly
once (none resent, dropped, or generated past the last step); every step's samples are at most one
policy version behind the weights that train on them, with the histogram in ``metrics.jsonl``;
step 1 is on-policy (nothing was in flight before it) and later batches were generated while the
previous step trained (some samples one version old).
"""

from __future__ import annotations

import json

import pytest
import torch

STEPS, PROMPTS, SAMPLES = 3, 2, 4

BACKENDS = {
    "torch": [],
    "megatron": [
        "trainer.backend=megatron",
        "trainer.device=cuda",
        "trainer.megatron.precision=fp32",
    ],
}


def check_one_step_ahead(run) -> None:  # noqa: ANN001 - conftest.FakeServerRun
    ok = [r for r in run.records if r.outcome == "ok"]
    assert {r.outcome for r in run.records} == {"ok"}
    assert len(ok) == STEPS * PROMPTS * SAMPLES
    assert run.weight_version == f"step-{STEPS}"
    lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    for line in steps:
        assert line["staleness/frac_over_bound"] == 0.0, line["step"]
        assert line["staleness/max"] <= 1.0
        assert line["staleness/frac_0"] + line["staleness/frac_1"] == pytest.approx(1.0)
        assert torch.isfinite(torch.tensor(line["loss"]))
        assert "tis" in line  # the configured correction acted on the batch
    assert steps[0]["staleness/frac_0"] == 1.0  # on-policy: the first batch waited for nothing
    assert any(line["staleness/frac_1"] > 0 for line in steps[1:])  # the overlap happened
    # the server finished every sample under the weights of the step before or the one being
    # pushed while it ran: never two versions behind
    versions = {r.weight_version for r in ok}
    assert versions <= {"default", *(f"step-{k}" for k in range(1, STEPS))}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sglang_engine_one_step_ahead(train_against_fake_server, backend: str) -> None:
    if backend == "megatron":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        pytest.importorskip("megatron.core")
    run = train_against_fake_server(
        [
            f"run.steps={STEPS}",
            "rollout.max_staleness=1",
            "rollout.sglang.sync_mode=disk",
            "algo.tis={enabled: true, mode: truncate, clip_high: 2.0}",
            *BACKENDS[backend],
        ],
        letters="AB",
        prompts_per_step=PROMPTS,
        n_samples=SAMPLES,
        n_train=6,
        n_eval=2,
    )
    check_one_step_ahead(run)
