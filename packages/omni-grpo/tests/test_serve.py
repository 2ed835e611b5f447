"""``omni-grpo serve`` / ``omni_grpo.serve``: the launcher the driver's server actors use, run on
the project's fake server (the same code path as sglang-omni, a different argv row)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
from omni_grpo.serve import SERVER_ARGV, ServerLaunchError, launch, server_argv


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("omni") / "omni"
    make_tiny_omni(out, TinyOmniSpec(with_talker=False))
    return out


def test_argv_table_rows() -> None:
    argv = server_argv("sglang-omni", "/ckpt", "0.0.0.0", 8008, ["--mem-fraction-static", "0.8"])
    assert argv[1:4] == ["-m", "sglang_omni.cli", "serve"] and "--text-only" in argv
    assert argv[-2:] == ["--mem-fraction-static", "0.8"] and "8008" in argv
    assert set(SERVER_ARGV) == {"sglang-omni", "fake"}
    with pytest.raises(ValueError, match="expected one of"):
        server_argv("vllm", "/ckpt", "h", 1, [])


def test_launch_waits_for_readiness_and_tears_down(omni_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "server-0.log"
    server = launch("fake", omni_dir, log, ready_timeout_s=120, name="rollout server 0")
    try:
        info = httpx.get(f"{server.url}/model_info", trust_env=False).json()
        assert info["success"] and str(omni_dir) in json.dumps(info)
        pid = server.proc.pid
    finally:
        server.stop()
    assert server.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "fake sglang-omni server at" in log.read_text()


def test_server_that_exits_fails_fast_with_its_log(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ServerLaunchError, match=r"exited with code \d+ before serving") as err:
        launch("fake", tmp_path / "missing", tmp_path / "s.log", ready_timeout_s=120)
    assert time.monotonic() - t0 < 60
    assert "config.json" in str(err.value)  # the server's own last log lines are quoted


def test_serve_command_prints_url_and_stops_on_sigterm(omni_dir: Path, tmp_path: Path) -> None:
    exe = [sys.executable, "-m", "omni_grpo.cli", "serve", "--kind", "fake"]
    proc = subprocess.Popen(
        [*exe, "--model-path", str(omni_dir), "--log-file", str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        got = json.loads(line)
        assert httpx.get(f"{got['url']}/model_info", trust_env=False).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(got["pid"], 0)
