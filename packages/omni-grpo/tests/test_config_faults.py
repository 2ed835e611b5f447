"""Config and CLI faults of issue 15 (items 15-17): secrets never echoed, silently ignored keys
refused, missing inputs caught at config time, one line per error from the CLI."""

from __future__ import annotations

import errno
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from omni_grpo import cli
from omni_grpo.config import ConfigError, check_paths, load_config

SECRET = "SUPERSECRET-456"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def _config_error(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text), overrides)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------------- 15. secrets never echoed
@pytest.mark.parametrize(
    "yaml_text",
    [
        "rollout:\n  sglang:\n    admin_api_key: 12345678\n",  # numeric
        f"rollout:\n  sglang:\n    admin_api_key: [{SECRET}, b]\n",  # a list
        f"rollout:\n  sglang:\n    admin_api_key: {{k: {SECRET}}}\n",  # a mapping
        f"rollout:\n  admin_api_key: {SECRET}\n",  # misplaced one level up
        f"admin_api_key: {SECRET}\n",  # misplaced at the top
        f"sglang:\n  admin_api_key: {SECRET}\n",  # misplaced section
        f"rollout:\n  sglang:\n    api_token: {SECRET}\n",  # another secret-looking name
        # the same value elsewhere, where it is not a secret-looking key
        f"rollout:\n  sglang:\n    admin_api_key: {SECRET}\n    urls: {SECRET}\n",
    ],
)
def test_secret_values_are_never_echoed(tmp_path: Path, yaml_text: str) -> None:
    msg = _config_error(tmp_path, yaml_text)
    assert SECRET not in msg and "12345678" not in msg
    assert "invalid config" in msg


def test_secret_in_overrides_and_broken_yaml_is_not_echoed(tmp_path: Path) -> None:
    for override in (
        f"rollout.sglang.admin_api_key=[{SECRET}]",
        f"rollout.sglang.admin_api_key:{SECRET}",
    ):
        msg = _config_error(tmp_path, "{}\n", (override,))
        assert SECRET not in msg
    msg = _config_error(tmp_path, f'rollout:\n  sglang:\n    admin_api_key: "{SECRET}\n')
    assert SECRET not in msg and "not valid YAML" in msg and "line" in msg


def test_plain_values_are_still_echoed(tmp_path: Path) -> None:
    msg = _config_error(tmp_path, "rollout:\n  n_samples: 1\n")
    assert "rollout.n_samples" in msg and "(got 1)" in msg


def test_cli_never_prints_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_OMNI_ADMIN_KEY", "ENV-SECRET-789")
    res = CliRunner().invoke(
        cli.main,
        ["show-config", "--set", f"rollout.sglang.admin_api_key=[{SECRET}, ENV-SECRET-789]"],
    )
    assert res.exit_code == 2
    assert SECRET not in res.output and "ENV-SECRET-789" not in res.output
    assert [line for line in res.output.splitlines() if line.startswith("Error")] != []


# ------------------------------------------------------------- 16. silently ignored keys refused
@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("model.make_tiny.sizes.text.num_layers=2", "text: unknown key(s) ['num_layers']"),
        ("model.make_tiny.sizes.vision.dpeth=1", "vision: unknown key(s) ['dpeth']"),
        ("model.make_tiny.sizes.audio.output_dim=8", "audio: unknown key(s) ['output_dim']"),
        ("model.make_tiny.sizes.talker.x=1", "unknown tower(s) ['talker']"),
        ("model.make_tiny.sizes.text=3", "model.make_tiny.sizes.text"),
    ],
)
def test_unknown_tiny_size_keys_are_refused(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


def test_known_tiny_size_keys_pass() -> None:
    cfg = load_config(None, ["model.make_tiny.sizes.text.num_hidden_layers=1"])
    assert cfg.model.make_tiny.sizes["text"]["num_hidden_layers"] == 1


def test_factory_refuses_unknown_size_keys_before_writing(tmp_path: Path) -> None:
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    with pytest.raises(ValueError, match="num_layers"):
        make_tiny_omni(tmp_path / "t", TinyOmniSpec(text={"num_layers": 1}))
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("key", ["run.dir", "data.train", "model.omni_checkpoint"])
@pytest.mark.parametrize("value", ['""', "'  '"])
def test_empty_paths_are_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}: Value error, empty path"):
        load_config(None, [f"{key}={value}"])


# ------------------------------------------------------- 17. missing inputs fail at config time
def test_missing_inputs_are_named_at_config_time(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            f"data.train={tmp_path / 'nope.jsonl'}",
            f"data.eval={tmp_path / 'nope-eval.jsonl'}",
            f"model.omni_checkpoint={tmp_path / 'no-model'}",
        ],
    )
    with pytest.raises(ConfigError) as info:
        check_paths(cfg)
    msg = str(info.value)
    assert f"data.train: {tmp_path / 'nope.jsonl'} does not exist" in msg
    assert f"data.eval: {tmp_path / 'nope-eval.jsonl'} does not exist" in msg
    assert f"model.omni_checkpoint: {tmp_path / 'no-model'} does not exist" in msg
    globbed = load_config(
        None, [f"data.train=[{tmp_path / 'a.jsonl'}, {tmp_path / 'shards-*.parquet'}]"]
    )
    with pytest.raises(ConfigError) as info:
        check_paths(globbed)
    assert f"no file matches {tmp_path / 'shards-*.parquet'}" in str(info.value)
    assert f"data.train: {tmp_path / 'a.jsonl'} does not exist" in str(info.value)
    unset = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="data.train is not set"):
        check_paths(unset)


def test_train_cli_is_one_line_for_missing_inputs(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        cli.main,
        ["train", "--set", f"run.dir={tmp_path}/run", "--set", f"data.train={tmp_path}/x.jsonl"],
    )
    assert res.exit_code == 1, res.output
    assert res.output.count("\n") == 1 and res.output.startswith("Error: data.train:")
    assert "Traceback" not in res.output
    assert not (tmp_path / "run").exists()  # nothing was made


# ------------------------------------------------------------ the CLI's one error-handling layer
def _raising(exc: BaseException) -> click.Command:
    @click.command("boom")
    def boom() -> None:
        raise exc

    return boom


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "/x/y"), "OSError: [Errno 28]"),
        (FileNotFoundError(errno.ENOENT, "No such file", "/missing"), "/missing"),
        (ValueError("data.train: bad row\nsecond line"), "data.train: bad row; second line"),
        (RuntimeError("basic_ios::clear: iostream error"), "iostream error"),
        (KeyError("thing"), "internal error (KeyError: 'thing'); rerun with --debug"),
    ],
)
def test_every_error_is_one_line_without_traceback(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException, expected: str
) -> None:
    monkeypatch.setattr(cli.EntryPointGroup, "get_command", lambda self, ctx, name: _raising(exc))
    res = CliRunner().invoke(cli.main, ["boom"])
    assert res.exit_code == 1
    assert res.output.count("\n") == 1 and expected in res.output, res.output
    debug = CliRunner().invoke(cli.main, ["--debug", "boom"])
    assert debug.exception is exc  # --debug lets the traceback through


# ---------------------------------------------- 15 (re-probed): other secret spellings and places
@pytest.mark.parametrize(
    "yaml_text",
    [
        # a secret-looking name in camelCase / with dashes / upper case, in a free-form field
        f"model:\n  make_tiny:\n    sizes:\n      text: {{apiKey: {SECRET}}}\n",
        f"model:\n  make_tiny:\n    sizes:\n      text: {{hf-token: [{SECRET}]}}\n",
        f"model:\n  make_tiny:\n    sizes:\n      text: {{HF_TOKEN: {SECRET}}}\n",
        f"model:\n  make_tiny:\n    sizes:\n      text: {{accessToken: {SECRET}}}\n",
        # a password in a URL's userinfo, under a key that is not secret-looking
        f"rollout:\n  sglang:\n    urls: http://user:{SECRET}@host:1\n",
        f"rollout:\n  sglang:\n    router_url: [https://u:{SECRET}@h]\n",
    ],
)
def test_other_secret_spellings_are_never_echoed(tmp_path: Path, yaml_text: str) -> None:
    msg = _config_error(tmp_path, yaml_text)
    assert SECRET not in msg and "invalid config" in msg


def test_url_passwords_are_masked_when_the_config_is_shown(tmp_path: Path) -> None:
    from omni_grpo.config import dump_config

    cfg = load_config(None, [f"rollout.sglang.urls=[http://user:{SECRET}@host:1]"])
    shown = dump_config(cfg)
    assert SECRET not in shown and "http://user:<redacted>@host:1" in shown


def test_a_key_given_twice_is_refused_not_silently_overwritten(tmp_path: Path) -> None:
    msg = _config_error(tmp_path, "trainer:\n  lr: 1.0e-4\n  lr: 3.0e-3\n")
    assert "duplicate key 'lr'" in msg and "line 3" in msg


# ------------------------------------------------ 16-17 (re-probed): other silently accepted input
@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("trainer.lr=.inf", "trainer.lr: Input should be a finite number"),
        ("algo.kl_coef=.nan", "algo.kl_coef: Input should be a finite number"),
        ("model.make_tiny.sizes.text.num_attention_heads=7", "must be a multiple of"),
        ("model.make_tiny.sizes.text.hidden_size=big", "text.hidden_size: expected a positive"),
        ("model.make_tiny.sizes.audio.encoder_attention_heads=0", "expected a positive integer"),
    ],
)
def test_non_finite_numbers_and_unbuildable_tiny_sizes_are_refused(
    override: str, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, ["model.make_tiny={vocab: small}", override])


def test_synthetic_data_and_files_together_are_refused(tmp_path: Path) -> None:
    """``data.synthetic`` writes its own train/eval: a given ``data.train`` was ignored."""
    with pytest.raises(ConfigError, match=r"data\.train would be ignored"):
        load_config(None, ["data.synthetic={n_train: 2}", f"data.train={tmp_path}/t.jsonl"])


def test_a_binary_config_file_is_named(tmp_path: Path) -> None:
    p = tmp_path / "weights.safetensors"
    p.write_bytes(b"\x80\x00binary")
    with pytest.raises(ConfigError, match=r"weights\.safetensors: not a UTF-8 text file"):
        load_config(p)


# ------------------------------------------- issue 30: values that make another one meaningless
@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ("run.steps=10", "trainer.lr_schedule.warmup_steps=20"),
            ("trainer.lr_schedule.warmup_steps (20) is longer than run.steps (10)",),
        ),
        (
            ("run.steps=10", "trainer.lr_schedule={kind: cosine, warmup_steps: 9}"),
            ("warmup_steps (9) leaves no step of run.steps (10) for the cosine decay",),
        ),
        (("run.steps=10", "run.log_every=11"), ("run.log_every (11) is longer than run.steps",)),
        (
            ("ray.address=10.0.0.1:6379", "ray.num_cpus=4"),
            ("ray.num_cpus sizes a local Ray only", "ray.address"),
        ),
        (
            ("rollout.sglang.launch={kind: fake, gpus_per_server: 0}",),
            ("rollout.sglang.launch starts servers for rollout.engine sglang-omni",),
        ),
    ],
)
def test_contradicting_values_are_refused_naming_both(
    tmp_path: Path, overrides: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    msg = _config_error(tmp_path, "{}\n", overrides)
    for needle in needles:
        assert needle in msg, msg


def test_values_that_still_mean_something_are_accepted(tmp_path: Path) -> None:
    for overrides in (
        ("run.steps=10", "trainer.lr_schedule.warmup_steps=10"),  # constant: lr reached at 10
        ("run.steps=10", "trainer.lr_schedule={kind: linear, warmup_steps: 8}"),  # 2 decay steps
        ("run.steps=10", "run.log_every=10"),
        ("run.steps=0", "run.log_every=5"),  # nothing to log anyway
        ("ray.address=10.0.0.1:6379",),
    ):
        load_config(_write(tmp_path, "{}\n"), overrides)
    res = CliRunner().invoke(
        cli.main,
        ["show-config", "--set", "run.steps=3", "--set", "trainer.lr_schedule.warmup_steps=5"],
    )
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "warmup_steps (5) is longer than run.steps (3)" in res.output.splitlines()[-1]


def test_extracted_parts_train_without_the_omni_checkpoint(tmp_path: Path) -> None:
    """A user who ran ``omni-grpo extract`` (or a benchmark that writes the parts) needs only
    them; one part missing still names the checkpoint it would be extracted from."""
    from omni_grpo.trainer import prepare_model

    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    vl, audio = tmp_path / "vl", tmp_path / "audio"
    overrides = [
        f"run.dir={tmp_path / 'run'}",
        f"data.train={rows}",
        f"model.extracted_dir={vl}",
        f"model.audio_dir={audio}",
    ]
    vl.mkdir()
    (vl / "config.json").write_text("{}")
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=r"model.omni_checkpoint \(unset\): .* does not exist"):
        check_paths(cfg)  # the audio part is missing: it would come from the checkpoint
    audio.mkdir()
    (audio / "config.json").write_text("{}")
    check_paths(cfg)
    assert prepare_model(cfg.model, tmp_path / "run") == (vl, audio)
    assert not (tmp_path / "run" / "model").exists()  # nothing extracted, nothing made
