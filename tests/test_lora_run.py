"""Cross-package: a LoRA GRPO run (issue 21) — sync of merged weights, checkpoint, export, resume.

* the fake sglang-omni server receives, bit for bit, ``W + scale * B A`` of the trained adapters
  under the server names of the adapted tensors, and nothing else;
* a checkpoint holds the adapters alone, plus the adapter in peft's format (loadable by peft);
* ``omni-grpo export`` of a LoRA run equals the adapted model's logits (1e-5, fp32);
* kill-and-resume reproduces the straight run's metrics line for line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.config import load_config
from omni_grpo.models.lora import is_adapter_name
from omni_grpo.run.checkpoint import latest_checkpoint, load_checkpoint
from omni_grpo.run.metrics import read_metrics
from omni_grpo.testing.models import Ids, build_batch
from omni_grpo.testing.sync import read_hub_tensors
from omni_grpo.trainer import train

LORA = "trainer.lora={rank: 4, alpha: 8, targets: [attention, experts, lm_head]}"
SAMPLES = [
    [("text", [5, 6]), ("image", (1, 4, 4)), ("audio", 200), ("video", (2, 4, 4), 1.0)],
    [("text", [5]), ("audio", 120), ("text", [6, 7])],
]


def test_lora_sync_pushes_merged_adapted_tensors_bit_exact(train_against_fake_server) -> None:
    run = train_against_fake_server(
        [
            "rollout.sglang.sync_mode=disk",
            "trainer.device=cpu",
            "trainer.lr=0.01",
            "trainer.lora={rank: 4, alpha: 8, targets: [attention, lm_head]}",
        ]
    )
    assert run.weight_version == "step-2"
    got = read_hub_tensors(run.run_dir / "weight_sync" / "step-2")
    hub = read_hub_tensors(run.omni)
    adapters = load_checkpoint(latest_checkpoint(run.run_dir))[1]
    assert adapters and all(is_adapter_name(n) for n in adapters)
    want = {}
    for a_name, a in adapters.items():
        if ".lora_A." not in a_name:
            continue
        stem = a_name.split(".lora_A.")[0]
        b = adapters[a_name.replace(".lora_A.", ".lora_B.")]
        server = "thinker." + stem.replace("model.language_model.", "model.") + ".weight"
        want[server] = hub[server] + (b @ a) * (8 / 4)
    assert sorted(got) == sorted(want)  # the adapted tensors only: sync bytes follow LoRA
    assert any(".self_attn.q_proj." in n for n in want) and "thinker.lm_head.weight" in want
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
        assert not torch.equal(got[name], hub[name]), name


def _cfg(run_dir: Path, model_dir: Path, steps: int) -> object:
    return load_config(
        None,
        [
            f"run.dir={run_dir}",
            f"run.steps={steps}",
            "run.seed=7",
            "run.save_every=0",
            "run.tensorboard=false",
            "run.plots=false",
            "model.make_tiny={vocab: small, seed: 0}",
            "model.dtype=float32",
            f"model.omni_checkpoint={model_dir / 'omni'}",
            f"model.extracted_dir={model_dir / 'vl'}",
            f"model.audio_dir={model_dir / 'audio'}",
            "data.synthetic={tasks: [image, audio, video], n_train: 2, n_eval: 1, seed: 0}",
            "rollout.prompts_per_step=2",
            "rollout.sampling.max_new_tokens=3",
            "rollout.eval_sampling.max_new_tokens=2",
            "trainer.device=cpu",
            "trainer.lr=1e-2",
            "trainer.warmup={steps: 1, lr: 1e-2}",  # a format step: the adapters surely move
            "rollout.n_samples=4",
            "eval.every=0",
            LORA,
        ],
    )


def _deterministic(records: list[dict]) -> list[dict]:
    """Without wall-clock metrics: the loop's ``time/*`` and the torch backend's ``time_*_s``."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "time_"))} for r in records]


def test_lora_run_checkpoint_export_and_resume(tmp_path: Path) -> None:
    from omni_grpo.backends import create_backend
    from peft import PeftModel
    from transformers import (
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    model_dir = tmp_path / "model"
    straight = tmp_path / "straight"
    cfg = _cfg(straight, model_dir, 3)
    train(cfg, progress=False)
    ckpt = latest_checkpoint(straight)
    _, adapters, optim, _ = load_checkpoint(ckpt)
    assert adapters and all(is_adapter_name(n) for n in adapters)
    assert len(optim["optimizer"]["state"]) == len(adapters)  # AdamW moments of the adapters only

    # peft's own format: PeftModel loads it onto the run's VL model with our trained values
    vl = Qwen3VLMoeForConditionalGeneration.from_pretrained(cfg.model.extracted_dir)
    peft_model = PeftModel.from_pretrained(vl, ckpt)
    loaded = {n: p for n, p in peft_model.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(adapters)
    for name, value in adapters.items():
        assert torch.equal(loaded[f"base_model.model.{name}"], value), name

    # export merges the adapters: the exported Qwen3-Omni computes the adapted model's logits
    out = tmp_path / "exported"
    result = CliRunner().invoke(main, ["export", str(straight), "--dst", str(out)])
    assert result.exit_code == 0, result.output
    exported = Qwen3OmniMoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    backend = create_backend("torch", cfg.model, cfg.trainer, cfg.algo, pad_token_id=0)
    backend.load_trainable_state(adapters)
    side = json.loads((Path(cfg.model.extracted_dir) / "config.json").read_text())
    gen = json.loads((Path(cfg.model.extracted_dir) / "generation_config.json").read_text())
    ids = Ids.from_sideband(side["omni_sideband"], pad=gen["pad_token_id"])
    batch = build_batch(SAMPLES, ids, "left", seed=1)
    with torch.no_grad():
        want = backend.policy.eval()(**batch).logits
        got = exported.thinker.eval()(**batch).logits
        base = model_dir / "omni"
        plain = Qwen3OmniMoeForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
        untrained = plain.thinker.eval()(**batch).logits
    valid = batch["attention_mask"].bool()
    assert (want - got)[valid].abs().max().item() <= 1e-5
    assert (want - untrained)[valid].abs().max().item() > 1e-3  # the adapters did move it

    # kill after step 1, resume: the same metrics, line for line
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "data", resumed / "data")
    assert train(_cfg(resumed, model_dir, 3), progress=False, stop_after=1).steps == 1
    assert train(_cfg(resumed, model_dir, 3), resume=True, progress=False).steps == 3
    assert _deterministic(read_metrics(resumed)) == _deterministic(read_metrics(straight))
