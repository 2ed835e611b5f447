"""Config tree: YAML loading, field-naming errors, dotted overrides, path resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
from omni_grpo.config import (
    AlgoConfig,
    ConfigError,
    OmniGRPOConfig,
    apply_overrides,
    dump_config,
    load_config,
)


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_are_valid_and_sensible() -> None:
    cfg = OmniGRPOConfig()
    assert cfg.algo.clip_eps_low == 0.2 and cfg.algo.clip_eps_high == 0.28
    assert cfg.algo.kl_type == "k1" and cfg.algo.kl_coef == 0.0
    assert cfg.algo.advantage.std_normalize is True and cfg.algo.advantage.eps == 1e-6
    assert cfg.rollout.eval_sampling.temperature == 0.0
    assert cfg.model.freeze_visual is True
    assert cfg.model.extracted_dir == cfg.run.dir / "model" / "vl"
    assert cfg.model.audio_dir == cfg.run.dir / "model" / "audio"


def test_unknown_key_names_dotted_path(tmp_path: Path) -> None:
    p = _write(tmp_path, "rollout:\n  n_sample: 4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "rollout.n_sample" in msg and "Extra inputs are not permitted" in msg and str(p) in msg


def test_bad_value_names_field_and_constraint(tmp_path: Path) -> None:
    p = _write(tmp_path, "rollout:\n  n_samples: 1\n")
    with pytest.raises(
        ConfigError, match=r"rollout\.n_samples: Input should be greater than 1 \(got 1\)"
    ):
        load_config(p)


def test_nested_bad_literal(tmp_path: Path) -> None:
    p = _write(tmp_path, "algo:\n  tis:\n    mode: clip\n")
    with pytest.raises(
        ConfigError, match=r"algo\.tis\.mode: Input should be 'truncate' or 'icepop'"
    ):
        load_config(p)


def test_overrides_are_yaml_typed() -> None:
    out = apply_overrides(
        {"rollout": {"n_samples": 4}},
        [
            "rollout.n_samples=8",
            "algo.dual_clip_c=3",
            "trainer.betas=[0.9, 0.95]",
            "run.wandb=true",
            "algo.tis.enabled=yes",
            "model.make_tiny.vocab=real",
            "rollout.sampling.stop_token_ids=[1,2]",
        ],
    )
    cfg = OmniGRPOConfig.model_validate(out)
    assert cfg.rollout.n_samples == 8
    assert cfg.algo.dual_clip_c == 3.0
    assert cfg.trainer.betas == (0.9, 0.95)
    assert cfg.run.wandb is True and cfg.algo.tis.enabled is True
    assert cfg.model.make_tiny is not None and cfg.model.make_tiny.vocab == "real"
    assert cfg.rollout.sampling.stop_token_ids == [1, 2]


def test_override_does_not_mutate_input() -> None:
    src = {"rollout": {"n_samples": 4}}
    apply_overrides(src, ["rollout.n_samples=8"])
    assert src == {"rollout": {"n_samples": 4}}


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("rollout.n_sampels=8", "rollout.n_sampels"),
        ("algo.tis.foo=1", "algo.tis.foo"),
        ("nope=1", "'nope'"),
    ],
)
def test_unknown_override_path(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="unknown config key") as ei:
        apply_overrides({}, [override])
    assert fragment in str(ei.value)


def test_override_without_equals() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["rollout.n_samples"])


def test_override_into_free_form_dict() -> None:
    out = apply_overrides(
        {}, ["model.make_tiny.sizes.text={hidden_size: 32}", "rewards.by_modality.video=math"]
    )
    cfg = OmniGRPOConfig.model_validate(out)
    assert cfg.model.make_tiny.sizes == {"text": {"hidden_size": 32}}
    assert cfg.rewards.by_modality == {"video": "math"}


def test_paths_resolve_relative_to_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = tmp_path / "configs"
    sub.mkdir()
    p = _write(
        sub, "run:\n  dir: ../runs/a\ndata:\n  train: data/train.jsonl\n  eval: /abs/eval.jsonl\n"
    )
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_config(p)
    assert cfg.run.dir == tmp_path / "runs/a"  # normalised: printed and stored without ".."
    assert cfg.data.train == sub / "data/train.jsonl"
    assert cfg.data.eval == Path("/abs/eval.jsonl")
    assert cfg.data.root == sub / "data"  # default: the train file's directory
    assert cfg.model.extracted_dir == tmp_path / "runs/a" / "model" / "vl"


def test_path_fields_come_from_the_annotations() -> None:
    """Every ``Path``-annotated field is resolved, found by walking the models (nothing hand-kept)."""
    from omni_grpo.config import PATH_FIELDS, path_fields
    from pydantic import BaseModel

    assert set(PATH_FIELDS) >= {
        ("run", "dir"),
        ("model", "extracted_dir"),
        ("data", "train"),
        ("data", "root"),
        ("rollout", "sglang", "sync_dir"),
        ("rollout", "sglang", "launch", "model_path"),
    }

    class Inner(BaseModel):
        where: Path | None = None
        many: list[Path] = []
        name: str = ""

    class Outer(BaseModel):
        inner: Inner | None = None
        out: Path = Path(".")

    assert list(path_fields(Outer)) == [("inner", "where"), ("inner", "many"), ("out",)]


def test_list_of_paths_resolves_each_entry(tmp_path: Path) -> None:
    p = _write(tmp_path, "data:\n  train: [a/t1.jsonl, /abs/t2.jsonl]\n")
    cfg = load_config(p)
    assert cfg.data.train == [tmp_path / "a/t1.jsonl", Path("/abs/t2.jsonl")]


def test_override_paths_also_resolve(tmp_path: Path) -> None:
    p = _write(tmp_path, "")
    cfg = load_config(p, ["data.train=x/t.jsonl"])
    assert cfg.data.train == tmp_path / "x/t.jsonl"


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "a: [1,\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- 1\n"))


def test_cross_field_rules() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        AlgoConfig(use_rollout_logprobs=True, tis={"enabled": True})
    with pytest.raises(ValueError, match="clip_low"):
        AlgoConfig(tis={"clip_low": 3.0, "clip_high": 2.0})
    with pytest.raises(ConfigError, match="sglang.urls"):
        load_config(None, ["rollout.engine=sglang-omni"])
    with pytest.raises(ConfigError, match="sp: true"):
        load_config(None, ["trainer.megatron.tp=2"])


def test_secret_not_dumped(tmp_path: Path) -> None:
    cfg = load_config(
        None, ["rollout.sglang.admin_api_key=hunter2", "rollout.sglang.urls=[http://x]"]
    )
    assert cfg.rollout.sglang.admin_api_key.get_secret_value() == "hunter2"
    assert "hunter2" not in dump_config(cfg)


def test_dump_roundtrip(tmp_path: Path) -> None:
    cfg = load_config(None, ["algo.kl_coef=0.01", "run.dir=/tmp/r"])
    again = load_config(_write(tmp_path, dump_config(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    ("override", "field", "known"),
    [
        ("rollout.engine=vllm", "rollout.engine", "sglang-omni"),
        ("trainer.backend=fsdp", "trainer.backend", "megatron"),
    ],
)
def test_engines_and_backends_are_entry_point_names(override, field, known):
    """Engines/backends are plugins: any registered name is valid, a typo lists the real ones."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and known in str(err.value)


# ------------------------------------------------------------------ formerly dead fields (issue 16)
@pytest.mark.parametrize(
    ("yaml_text", "override", "pointer"),
    [
        (
            "run:\n  eval_every: 5\n",
            "run.eval_every=5",
            "eval.every is the one evaluation interval",
        ),
        ("trainer:\n  grad_accum: 4\n", "trainer.grad_accum=4", "trainer.micro_batch_size"),
        (
            "eval:\n  per_modality: false\n",
            "eval.per_modality=false",
            "always reported per modality",
        ),
    ],
)
def test_removed_fields_are_refused_with_a_pointer(
    tmp_path: Path, yaml_text: str, override: str, pointer: str
) -> None:
    p = _write(tmp_path, yaml_text)
    with pytest.raises(ConfigError, match="was removed") as ei:
        load_config(p)
    assert pointer in str(ei.value) and str(p) in str(ei.value)
    assert "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match="was removed") as ei:
        load_config(None, [override])
    assert pointer in str(ei.value)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["model.freeze_visual=false"],
            "model.freeze_visual: false is not supported by the megatron",
        ),
        (
            ["model.dtype=float32"],
            "model.dtype float32 disagrees with trainer.megatron.precision bf16",
        ),
        (["trainer.micro_batch_size=4"], "trainer.micro_batch_size 4 is not used by the megatron"),
        (["trainer.warmup={steps: 2}"], "trainer.warmup"),
        (["algo.kl_coef=0.1", "algo.kl_type=full"], "algo.kl_type full is not implemented"),
    ],
)
def test_megatron_refuses_what_it_would_ignore(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, ["trainer.backend=megatron", *overrides])
    load_config(None, ["trainer.backend=torch", *overrides])  # the torch backend honours them


def test_megatron_accepts_what_it_honours() -> None:
    cfg = load_config(
        None,
        [
            "trainer.backend=megatron",
            "model.dtype=float32",
            "trainer.megatron.precision=fp32",
            "model.freeze_visual=true",
            "trainer.micro_batch_size=1",
        ],
    )
    assert cfg.model.dtype == "float32"
    assert load_config(None, ["trainer.backend=megatron", "model.dtype=bfloat16"]).model.dtype


def test_tiny_model_and_data_seeds_follow_run_seed() -> None:
    cfg = load_config(
        None, ["run.seed=3", "model.make_tiny={vocab: small}", "data.synthetic={n_train: 2}"]
    )
    assert cfg.model.make_tiny is not None and cfg.model.make_tiny.seed == 3
    assert cfg.data.synthetic is not None and cfg.data.synthetic.seed == 3
    pinned = load_config(
        None,
        ["run.seed=3", "model.make_tiny={vocab: small, seed: 1}", "data.synthetic={seed: 2}"],
    )
    assert pinned.model.make_tiny.seed == 1 and pinned.data.synthetic.seed == 2


def test_eval_ablations_are_modality_names() -> None:
    assert load_config(None, ["eval.ablations=[audio, all]"]).eval.ablations == ["audio", "all"]
    with pytest.raises(ConfigError, match="eval.ablations.0"):
        load_config(None, ["eval.ablations=[text]"])


def test_extends_merges_over_the_base_and_resolves_each_files_paths(tmp_path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "base.yaml").write_text(
        "run: {dir: runs/x, steps: 7}\nrollout: {n_samples: 4, prompts_per_step: 3}\n"
    )
    (tmp_path / "child.yaml").write_text(
        "extends: base/base.yaml\nrollout: {n_samples: 6}\ndata: {train: rows.jsonl}\n"
    )
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.run.steps == 7 and cfg.run.dir == base / "runs" / "x"
    assert (cfg.rollout.n_samples, cfg.rollout.prompts_per_step) == (6, 3)
    assert cfg.data.train == tmp_path / "rows.jsonl"
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")
