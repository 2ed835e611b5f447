"""A real short GRPO run, then ``omni-grpo export RUN --dst OUT``, checked with transformers' classes.

What a user does after training: export with the defaults (newest checkpoint, the run's own base
from its stored ``config.yaml``), then load the directory as Qwen3-Omni. The exported thinker's
logits equal those of the run's model with its checkpoint loaded, and the weights the run changed
are exactly the ones that differ from the base.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.config import load_config
from omni_grpo.models import load_thinker
from omni_grpo.run.checkpoint import latest_checkpoint, load_checkpoint
from omni_grpo.testing.models import Ids, build_batch
from omni_grpo.trainer import train
from safetensors import safe_open

SAMPLES = [
    [
        ("text", [5, 6]),
        ("image", (1, 4, 4)),
        ("audio", 200),
        ("video", (2, 4, 4), 1.0),
        ("text", [7]),
    ],
    [("text", [5]), ("audio", 120), ("text", [6, 7])],
]


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(d.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_train_then_export_loads_as_qwen3_omni(tmp_path: Path) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}",
        "run.steps=2",
        "run.seed=3",
        "eval.every=0",
        "run.tensorboard=false",
        "run.plots=false",
        "model.make_tiny={vocab: small, seed: 0}",
        "data.synthetic={tasks: [image, audio, video], n_train: 2, n_eval: 1, seed: 0}",
        "rollout.n_samples=3",
        "rollout.prompts_per_step=2",
        "rollout.sampling.max_new_tokens=3",
        "trainer.device=cpu",
        "trainer.lr=1e-2",
    ]
    cfg = load_config(None, overrides)
    train(cfg, progress=False)
    assert (run_dir / "config.yaml").is_file()
    out = tmp_path / "exported"
    result = CliRunner().invoke(main, ["export", str(run_dir), "--dst", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["step"] == 2  # bar on stderr

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = load_thinker(cfg.model.extracted_dir, audio_dir=cfg.model.audio_dir, dtype="float32")
    _, weights, _, _ = load_checkpoint(latest_checkpoint(run_dir))
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    side = json.loads((Path(cfg.model.extracted_dir) / "config.json").read_text())["omni_sideband"]
    gen = json.loads((Path(cfg.model.extracted_dir) / "generation_config.json").read_text())
    batch = build_batch(SAMPLES, Ids.from_sideband(side, pad=gen["pad_token_id"]), "left", seed=1)
    with torch.no_grad():
        want = ours.eval()(**batch).logits
        got = model.thinker.eval()(**batch).logits
    valid = batch["attention_mask"].bool()
    assert (want - got)[valid].abs().max().item() <= 1e-5
    base, exported = _tensors(run_dir / "model" / "omni"), _tensors(out)
    changed = {k for k in base if not torch.equal(base[k], exported[k])}
    assert changed and all(k.startswith(("thinker.model.", "thinker.lm_head.")) for k in changed)

    # ``eval --exported`` measures the exported directory: the same greedy accuracies as the
    # run's checkpoint, through the same evaluation path
    sets = [a for o in overrides for a in ("--set", o)]
    from_ckpt = CliRunner().invoke(main, ["eval", *sets])
    from_export = CliRunner().invoke(main, ["eval", *sets, "--exported", str(out)])
    assert from_ckpt.exit_code == 0 and from_export.exit_code == 0, from_export.output
    a = json.loads(from_ckpt.stdout.strip().splitlines()[-1])
    b = json.loads(from_export.stdout.strip().splitlines()[-1])
    assert b.pop("exported") == str(out) and a.pop("checkpoint") and b.pop("checkpoint") is None
    assert a == b and a
    # and the trainer's own layout, evaluated with the run's audio tower
    vl = tmp_path / "exported-vl"
    assert (
        CliRunner()
        .invoke(main, ["export", str(run_dir), "--dst", str(vl), "--format", "vl"])
        .exit_code
        == 0
    )
    from_vl = CliRunner().invoke(main, ["eval", *sets, "--exported", str(vl)])
    assert from_vl.exit_code == 0, from_vl.output
    c = json.loads(from_vl.stdout.strip().splitlines()[-1])
    assert c.pop("exported") == str(vl) and c.pop("checkpoint") is None and c == a
