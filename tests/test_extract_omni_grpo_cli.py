"""``omni-grpo extract`` / ``omni-grpo make-tiny`` reach omni-extract through the entry-point group."""

from __future__ import annotations

import json

from click.testing import CliRunner
from omni_grpo.cli import main


def test_omni_grpo_lists_and_runs_extract(tmp_path):
    runner = CliRunner()
    listing = runner.invoke(main, ["--help"])
    assert listing.exit_code == 0 and "extract" in listing.output and "make-tiny" in listing.output
    src = tmp_path / "omni"
    res = runner.invoke(main, ["make-tiny", str(src), "--shards", "2", "--seed", "5"])
    assert res.exit_code == 0, res.output
    dst = tmp_path / "vl"
    res = runner.invoke(
        main, ["extract", "--src", str(src), "--dst", str(dst), "--variant", "vl", "--quiet"]
    )
    assert res.exit_code == 0, res.output
    cfg = json.loads((dst / "config.json").read_text())
    assert (
        cfg["model_type"] == "qwen3_vl_moe"
        and cfg["omni_sideband"]["position_id_per_seconds"] == 13
    )
    res = runner.invoke(
        main, ["extract", "--src", str(src), "--dst", str(dst), "--variant", "vl", "--quiet"]
    )
    assert res.exit_code == 1 and "exists" in res.output
