"""Cross-package: ``omni-grpo train`` with ``rollout.engine: sglang-omni`` against the fake server.

Two GRPO steps on the tiny model: rollouts go over HTTP to the fake sglang-omni server, and after
each step the trainer pushes its weights through the disk sync. Checks that step 2's rollouts
were generated under the version pushed after step 1, that the server ends on the last version,
and that the pushed directory holds exactly the server names of the trained text weights (the
trained ones changed, the shapes/dtypes are those of the hub checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omni_extract.testing import TinyOmniSpec, make_tiny_omni
from omni_grpo.config import load_config
from omni_grpo.sync.testing import expected_server_tensors
from omni_grpo.trainer import train
from omni_rollout_client.testing import FakeGeneration, FakeOmniServer, FakeRequest
from safetensors import safe_open


def test_train_two_steps_with_sglang_omni_engine_and_disk_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    omni = make_tiny_omni(run_dir / "model" / "omni", TinyOmniSpec(with_talker=False))
    config = json.loads((omni / "config.json").read_text())
    im_end = int(config["im_end_token_id"])
    vocab = int(config["thinker_config"]["text_config"]["vocab_size"])

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(omni))
    letters = [tok.encode(c, add_special_tokens=False) for c in "ABCD"]
    assert all(len(ids) == 1 for ids in letters)
    seen: dict[tuple[int, ...], int] = {}

    def answer_tokens(req: FakeRequest) -> FakeGeneration:
        # the k-th sample of a prompt answers letter k % 4 (never a media marker), then <|im_end|>:
        # each group holds right and wrong answers, so advantages (and the update) are non-zero
        key = tuple(req.input_ids)
        k = seen[key] = seen.get(key, -1) + 1
        ids = [*letters[k % 4], im_end][: req.max_new_tokens]
        return FakeGeneration(token_ids=ids, logprobs=[-1.0] * len(ids))

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
                "data.synthetic.n_train=4",
                "data.synthetic.n_eval=2",
                "rollout.engine=sglang-omni",
                f"rollout.sglang.urls=[{server.url}]",
                "rollout.sglang.sync_mode=disk",
                "rollout.n_samples=4",
                "rollout.prompts_per_step=2",
                "rollout.sampling.max_new_tokens=3",
                "trainer.device=cpu",
                "trainer.lr=0.01",
            ],
        )
        train(cfg, progress=False)
        records = server.records
        assert server.weight_version == "step-2"
    versions = [r.weight_version for r in records if r.outcome == "ok"]
    assert (
        len(versions) == 16 and versions[:8] == ["default"] * 8 and versions[8:] == ["step-1"] * 8
    )
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
    synced = [line["weight_sync/tensors"] for line in lines if line.get("step", 0) >= 1]
    assert synced == [len(hub)] * 2
