"""The ``omni-extract`` script and the ``make-tiny`` command, driven through click."""

from __future__ import annotations

import json

from click.testing import CliRunner
from omni_extract.cli import extract_command, make_tiny_command
from transformers import AutoConfig


def test_extract_cli_writes_each_variant(tiny_omni_dir, tmp_path):
    runner = CliRunner()
    for variant, model_type in (
        ("text", "qwen3_moe"),
        ("vl", "qwen3_vl_moe"),
        ("audio", "qwen3_omni_moe_audio_encoder"),
    ):
        dst = tmp_path / variant
        res = runner.invoke(
            extract_command,
            [
                "--src",
                str(tiny_omni_dir),
                "--dst",
                str(dst),
                "--variant",
                variant,
                "--shard-size",
                "300KB",
                "--dtype",
                "bf16",
                "--quiet",
            ],
        )
        assert res.exit_code == 0, res.output
        assert "wrote" in res.output
        assert json.loads((dst / "config.json").read_text())["model_type"] == model_type
    assert AutoConfig.from_pretrained(tmp_path / "vl").model_type == "qwen3_vl_moe"


def test_extract_cli_errors_are_one_line_and_refuse_existing(tiny_omni_dir, tmp_path):
    runner = CliRunner()
    dst = tmp_path / "x"
    args = ["--src", str(tiny_omni_dir), "--dst", str(dst), "--variant", "audio"]
    assert runner.invoke(extract_command, args).exit_code == 0
    res = runner.invoke(extract_command, args)
    assert (
        res.exit_code == 1
        and "DestinationExistsError" in res.output
        and "Traceback" not in res.output
    )
    assert runner.invoke(extract_command, [*args, "--overwrite"]).exit_code == 0
    res = runner.invoke(extract_command, [*args, "--overwrite", "--shard-size", "big"])
    assert res.exit_code == 2 and "--shard-size" in res.output
    res = runner.invoke(
        extract_command, ["--src", str(tmp_path), "--dst", str(tmp_path / "y"), "--variant", "vl"]
    )
    assert res.exit_code == 1 and "config.json" in res.output


def test_make_tiny_cli(tmp_path):
    res = CliRunner().invoke(
        make_tiny_command,
        [str(tmp_path / "t"), "--shards", "2", "--seed", "3", "--dtype", "bfloat16", "--no-talker"],
    )
    assert res.exit_code == 0, res.output
    index = json.loads((tmp_path / "t" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not any(k.startswith("talker.") for k in index["weight_map"])
    res = CliRunner().invoke(make_tiny_command, [str(tmp_path / "t")])
    assert res.exit_code == 1 and "exists" in res.output


def test_extract_cli_refuses_a_destination_inside_its_source(tiny_omni_dir, tmp_path):
    """Issue 30: no command writes into what it reads (equal / containing were refused already)."""
    import shutil

    src = tmp_path / "omni"
    shutil.copytree(tiny_omni_dir, src)
    for dst, needle in ((src / "vl", "is inside the source"), (src, "is (or contains) the source")):
        res = CliRunner().invoke(
            extract_command, ["--src", str(src), "--dst", str(dst), "--variant", "vl"]
        )
        assert res.exit_code == 1 and needle in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (src / "vl").exists()
