"""GPU: ``omni-grpo train`` end to end with ``trainer.backend: megatron``.

The scale path's loop top to bottom on one GPU: tiny Omni checkpoint -> extraction -> synthetic
image/audio/video data -> rollouts over HTTP from the fake sglang-omni server (the Megatron
backend holds no HF module, so rollouts are remote) -> GRPO steps in the megatron-core thinker
with the shared loss -> disk weight sync after each step. Checks that step 2's rollouts carry the
version pushed after step 1 and that every pushed tensor has the hub name, shape and dtype.
Skips without CUDA or megatron-core.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_train_two_steps_with_megatron_backend(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from omni_extract.testing import TinyOmniSpec, make_tiny_omni
    from omni_grpo.config import load_config
    from omni_grpo.sync.testing import expected_server_tensors
    from omni_grpo.trainer import train
    from omni_rollout_client.testing import FakeGeneration, FakeOmniServer, FakeRequest
    from safetensors import safe_open
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    omni = make_tiny_omni(run_dir / "model" / "omni", TinyOmniSpec(with_talker=False))
    config = json.loads((omni / "config.json").read_text())
    im_end = int(config["im_end_token_id"])
    vocab = int(config["thinker_config"]["text_config"]["vocab_size"])
    tok = AutoTokenizer.from_pretrained(str(omni))
    letters = [tok.encode(c, add_special_tokens=False) for c in "AB"]
    seen: dict[tuple[int, ...], int] = {}

    def answer_tokens(req: FakeRequest) -> FakeGeneration:
        # alternate right and wrong letters inside each group so the advantages are non-zero
        key = tuple(req.input_ids)
        k = seen[key] = seen.get(key, -1) + 1
        ids = [*letters[k % 2], im_end][: req.max_new_tokens]
        return FakeGeneration(token_ids=ids, logprobs=[-0.7] * len(ids))

    with FakeOmniServer(vocab_size=vocab, eos_token_id=im_end, generator=answer_tokens) as server:
        cfg = load_config(
            None,
            [
                f"run.dir={run_dir}",
                "run.steps=2",
                "run.eval_every=0",
                "eval.every=0",
                "run.save_every=0",
                "run.tensorboard=false",
                "run.plots=false",
                f"model.omni_checkpoint={omni}",
                "model.dtype=float32",
                "data.synthetic.n_train=6",
                "data.synthetic.n_eval=3",
                "rollout.engine=sglang-omni",
                f"rollout.sglang.urls=[{server.url}]",
                "rollout.sglang.sync_mode=disk",
                "rollout.n_samples=4",
                "rollout.prompts_per_step=3",
                "rollout.sampling.max_new_tokens=3",
                "trainer.backend=megatron",
                "trainer.device=cuda",
                "trainer.megatron.precision=fp32",
                "trainer.lr=0.01",
            ],
        )
        train(cfg, progress=False)
        records = server.records
        assert server.weight_version == "step-2"
    versions = [r.weight_version for r in records if r.outcome == "ok"]
    assert versions[:12] == ["default"] * 12 and versions[12:] == ["step-1"] * 12
    pushed = run_dir / "weight_sync" / "step-2"
    got = {}
    for file in sorted(pushed.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                got[k] = f.get_tensor(k)
    hub = expected_server_tensors(omni)
    assert sorted(got) == sorted(hub)
    for name, tensor in hub.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
    assert not torch.equal(got["thinker.lm_head.weight"], hub["thinker.lm_head.weight"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(line["loss"])) for line in steps)
