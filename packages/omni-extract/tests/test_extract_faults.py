"""Bad input to ``extract`` (issue 15, item 18): every case is one error naming the file (never a
hidden temp path), nothing is written, nothing of the user's is replaced."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from omni_extract import extract
from omni_extract.cli import extract_command
from omni_extract.errors import DestinationExistsError, ExtractError
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def _edit_config(root: Path, edit) -> None:  # noqa: ANN001
    path = root / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(extract_command, ["--quiet", *args])
    return res.exit_code, res.output


def _one_line_naming(out: str, *fragments: str) -> None:
    assert out.count("\n") == 1 and out.startswith("Error: "), out
    assert ".tmp-" not in out and "Traceback" not in out
    for f in fragments:
        assert f in out, out


def _no_output(tmp_path: Path) -> None:
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden == [] and not (tmp_path / "out").exists()


def _index(root: Path) -> Path:
    """The shard index of the (three-shard) tiny checkpoint."""
    index = root / "model.safetensors.index.json"
    assert index.is_file()
    return index


@pytest.mark.parametrize(
    ("corrupt", "fragments"),
    [
        (
            lambda r: _index(r).write_text("not json{"),
            ["model.safetensors.index.json", "not valid JSON"],
        ),
        (
            lambda r: _index(r).write_text('{"weight_map": ["model.safetensors"]}'),
            ["model.safetensors.index.json", "'weight_map' must be a non-empty object", "list"],
        ),
        (
            lambda r: _index(r).write_text('{"weight_map": {"thinker.lm_head.weight": 3}}'),
            ["weight_map['thinker.lm_head.weight'] must be a shard file name, got 3"],
        ),
        (
            lambda r: (r / "config.json").write_text("[1, 2]"),
            ["config.json", "expected a JSON object, got list"],
        ),
        (lambda r: (r / "config.json").write_bytes(b"\xff\xfe{"), ["config.json"]),
        (
            lambda r: _edit_config(
                r, lambda c: c["thinker_config"]["text_config"].update(num_experts="four")
            ),
            ["thinker_config.text_config.num_experts must be a positive integer, got 'four'"],
        ),
        (
            lambda r: _edit_config(
                r, lambda c: c["thinker_config"]["text_config"].update(head_dim=0)
            ),
            ["thinker_config.text_config.head_dim must be a positive integer, got 0"],
        ),
        (
            lambda r: _edit_config(
                r, lambda c: c["thinker_config"]["text_config"].pop("hidden_size")
            ),
            ["thinker_config.text_config.hidden_size is missing"],
        ),
        (
            lambda r: _edit_config(
                r, lambda c: c["thinker_config"]["audio_config"].pop("output_dim")
            ),
            ["thinker_config.audio_config.output_dim is missing"],
        ),
        (
            lambda r: (r / "generation_config.json").write_text("{"),
            ["generation_config.json", "not valid JSON"],
        ),
    ],
    ids=[
        "non-json-index",
        "list-weight-map",
        "int-in-weight-map",
        "list-config",
        "binary-config",
        "num-experts-four",
        "head-dim-zero",
        "no-hidden-size",
        "no-output-dim",
        "bad-generation-config",
    ],
)
def test_broken_checkpoint_files_are_one_line_errors(tiny_omni_dir, tmp_path, corrupt, fragments):
    src = _copy(tiny_omni_dir, tmp_path)
    corrupt(src)
    variant = "text" if "generation" in str(fragments) else "vl"
    code, out = _cli("--src", str(src), "--dst", str(tmp_path / "out"), "--variant", variant)
    assert code == 1
    _one_line_naming(out, *fragments)
    with pytest.raises(ExtractError):
        extract(src, tmp_path / "out", variant=variant)
    _no_output(tmp_path)


def test_missing_hidden_size_is_not_reported_as_a_wrong_lm_head(tiny_omni_dir, tmp_path):
    src = _copy(tiny_omni_dir, tmp_path)
    _edit_config(src, lambda c: c["thinker_config"]["text_config"].pop("hidden_size"))
    with pytest.raises(ExtractError) as info:
        extract(src, tmp_path / "out", variant="vl")
    assert "lm_head" not in str(info.value) and "hidden_size is missing" in str(info.value)


@pytest.mark.parametrize("size", ["0", "0B", "0.1", "-5", "five"])
def test_bad_shard_size_is_a_usage_error(tiny_omni_dir, tmp_path, size):
    code, out = _cli(
        "--src",
        str(tiny_omni_dir),
        "--dst",
        str(tmp_path / "out"),
        "--variant",
        "vl",
        "--shard-size",
        size,
    )
    assert code == 2 and "--shard-size" in out and "Traceback" not in out
    _no_output(tmp_path)


def test_dst_under_a_file_is_named(tiny_omni_dir, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, out = _cli(
        "--src",
        str(tiny_omni_dir),
        "--dst",
        str(tmp_path / "afile" / "sub" / "out"),
        "--variant",
        "vl",
    )
    assert code == 1
    _one_line_naming(out, f"{tmp_path / 'afile'} is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "x"


def test_unwritable_dst_parent_is_named(tiny_omni_dir, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    code, out = _cli("--src", str(tiny_omni_dir), "--dst", str(ro / "out"), "--variant", "vl")
    assert code == 1
    _one_line_naming(out, f"no permission to write into {ro}")


@pytest.mark.parametrize("kind", ["file", "foreign-dir", "symlink"])
def test_overwrite_refuses_what_we_did_not_write(tiny_omni_dir, tmp_path, kind):
    dst = tmp_path / "dst"
    if kind == "file":
        dst.write_text("precious")
    elif kind == "foreign-dir":
        dst.mkdir()
        (dst / "notes.txt").write_text("precious")
    else:
        (tmp_path / "target.txt").write_text("precious")
        dst.symlink_to(tmp_path / "target.txt")
    code, out = _cli(
        "--src", str(tiny_omni_dir), "--dst", str(dst), "--variant", "vl", "--overwrite"
    )
    assert code == 1
    _one_line_naming(out, str(dst))
    with pytest.raises(DestinationExistsError):
        extract(tiny_omni_dir, dst, variant="vl", overwrite=True)
    kept = dst / "notes.txt" if kind == "foreign-dir" else dst
    assert kept.read_text() == "precious"


def test_disk_full_names_dst_free_and_needed(tiny_omni_dir, tmp_path, monkeypatch):
    import omni_extract.convert as convert

    real = shutil.disk_usage
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    code, out = _cli("--src", str(tiny_omni_dir), "--dst", str(tmp_path / "out"), "--variant", "vl")
    assert code == 1
    _one_line_naming(out, "disk full", str(tmp_path / "out"), "GB free")
    _no_output(tmp_path)


def test_disk_full_mid_write_names_dst_not_the_temp_dir(tiny_omni_dir, tmp_path, monkeypatch):
    import omni_extract.convert as convert

    def full(*args, **kwargs):  # noqa: ANN002, ANN003
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "copy_processor_artifacts", full)
    with pytest.raises(ExtractError) as info:
        extract(tiny_omni_dir, tmp_path / "out", variant="vl")
    assert "disk full" in str(info.value) and ".tmp-" not in str(info.value)
    _no_output(tmp_path)


def test_other_write_errors_name_dst_not_the_temp_dir(tiny_omni_dir, tmp_path, monkeypatch):
    import omni_extract.convert as convert

    def denied(src, dst):  # noqa: ANN001
        raise PermissionError(13, "Permission denied", str(dst / "tokenizer.json"))

    monkeypatch.setattr(convert, "copy_processor_artifacts", denied)
    with pytest.raises(ExtractError) as info:
        extract(tiny_omni_dir, tmp_path / "out", variant="vl")
    assert str(tmp_path / "out" / "tokenizer.json") in str(info.value)
    assert ".tmp-" not in str(info.value)


def _mixed(src: Path, declared: str | None) -> str:
    for shard in sorted(src.glob("*.safetensors")):
        weights = load_file(str(shard))
        names = [n for n in weights if n.startswith("thinker.model.") and "norm" in n]
        if names:
            weights[names[0]] = weights[names[0]].to(torch.bfloat16)
            save_file(weights, str(shard), metadata={"format": "pt"})
            name = names[0]
            break

    def set_dtype(cfg: dict) -> None:
        for holder in (cfg, cfg["thinker_config"]):
            holder.pop("dtype", None)
            holder.pop("torch_dtype", None)
        if declared is not None:
            cfg["dtype"] = declared

    _edit_config(src, set_dtype)
    return name


def test_mixed_dtype_input_is_cast_to_the_declared_dtype(tiny_omni_dir, tmp_path, caplog):
    src = _copy(tiny_omni_dir, tmp_path)
    _mixed(src, "float32")
    with caplog.at_level("WARNING"):
        extract(src, tmp_path / "out", variant="vl")
    dtypes = set()
    for shard in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"F32"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    assert "mixed dtypes" in caplog.text and "casting all to float32" in caplog.text


def test_mixed_dtype_input_without_a_declared_dtype_is_refused(tiny_omni_dir, tmp_path):
    src = _copy(tiny_omni_dir, tmp_path)
    _mixed(src, None)
    code, out = _cli("--src", str(src), "--dst", str(tmp_path / "out"), "--variant", "vl")
    assert code == 1
    _one_line_naming(out, "mixed dtypes", "--dtype bf16 or --dtype fp32")
    extract(src, tmp_path / "out", variant="vl", dtype="bf16")  # choosing one works


def test_stale_temp_dirs_of_a_killed_extraction_are_removed(tiny_omni_dir, tmp_path, caplog):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / f".out.tmp-p{proc.pid}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    live = tmp_path / f".out.tmp-p{os.getppid()}-def"
    live.mkdir()
    with caplog.at_level("WARNING"):
        extract(tiny_omni_dir, tmp_path / "out", variant="audio")
    assert not stale.exists() and live.exists()
    assert "removed 1 stale temporary dir" in caplog.text
