"""``omni-grpo serve``: start one rollout server, wait until it serves, tear it down cleanly.

A thin launcher over the server's own CLI, shared by the command and by the driver's Ray server
actors (``omni_grpo.ray.actors.ServerActor``), so a server started by hand and one started by a
run go through the same code:

* the argv comes from :data:`SERVER_ARGV` (a table: sglang-omni's ``sglang_omni.cli serve
  --text-only`` for the thinker-only pipeline, contract §6; ``fake`` = the project's
  contract-faithful fake server, ``omni_grpo.testing.fake_server``, for CPU tests only) plus the
  configured ``extra_args``;
* stdout and stderr go to one log file (in the run directory when a run launches it);
* readiness is ``GET /model_info`` answering 200 (the upstream e2e tests' probe; 0.1.9's
  ``/health`` answers 503 while starting) within a deadline; a server that exits first fails at
  once with its last log lines;
* teardown sends SIGTERM to the server's whole process group (sglang spawns scheduler and
  detokeniser children), then SIGKILL after a grace period: no orphan holds a GPU afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import click
import httpx

#: argv templates per server kind; ``{python}``, ``{model_path}``, ``{host}``, ``{port}`` are filled in.
SERVER_ARGV: dict[str, tuple[str, ...]] = {
    "sglang-omni": (
        "{python}",
        "-m",
        "sglang_omni.cli",
        "serve",
        "--model-path",
        "{model_path}",
        "--text-only",
        "--host",
        "{host}",
        "--port",
        "{port}",
    ),  # fmt: skip
    "fake": (
        "{python}",
        "-m",
        "omni_grpo.testing.fake_server",
        "--model-path",
        "{model_path}",
        "--host",
        "{host}",
        "--port",
        "{port}",
    ),  # fmt: skip
}


class ServerLaunchError(RuntimeError):
    """A rollout server did not come up; the message names it and quotes its last log lines."""


def server_argv(
    kind: str, model_path: str | os.PathLike[str], host: str, port: int, extra_args: list[str]
) -> list[str]:
    """The command line that starts a ``kind`` server (see :data:`SERVER_ARGV`)."""
    if kind not in SERVER_ARGV:
        raise ValueError(f"server kind {kind!r}: expected one of {sorted(SERVER_ARGV)}")
    fill = {"python": sys.executable, "model_path": str(model_path), "host": host, "port": port}
    return [part.format(**fill) for part in SERVER_ARGV[kind]] + list(extra_args)


#: the sglang-omni flag that sets the thinker's tensor parallel size
TP_FLAG = "--thinker.tp_size"


def thinker_tp_args(kind: str, tp: int) -> list[str]:
    """Server arguments that run the thinker at tensor parallel ``tp`` (none for ``tp`` 1).

    sglang-omni 0.1.9's text-only pipeline puts every stage on GPU 0 in one process
    (``sglang_omni/models/qwen3_omni/config.py:text_stages``), and a TP stage needs ``tp`` GPU ids
    and a process of its own (``sglang_omni/config/schema.py``: "TP placement requires a list of
    N unique GPU ids", "Process 'pipeline' holds TP stage 'thinker' and cannot be shared"). So a
    server given 8 GPUs without these flags runs the thinker at TP 1 on one of them. GPU ids are
    indices into the GPUs the server sees (Ray sets ``CUDA_VISIBLE_DEVICES`` for its actor); the
    audio and image encoders stay unsharded on GPU 0 (see ``omni_grpo.layout``). The fake server
    takes ``--tp-size`` (what its ``/model_info`` reports).
    """
    if tp <= 1:
        return []
    if kind == "fake":
        return ["--tp-size", str(tp)]
    gpus = "[" + ",".join(str(i) for i in range(tp)) + "]"
    return [TP_FLAG, str(tp), "--thinker.gpu", gpus, "--thinker.process", "thinker"]


def _tp_in(extra_args: list[str]) -> int | None:
    """The thinker TP that ``extra_args`` set themselves (``--thinker.tp_size N`` or ``=N``)."""
    for i, arg in enumerate(extra_args):
        if arg == TP_FLAG and i + 1 < len(extra_args):
            return int(extra_args[i + 1])
        if arg.startswith(TP_FLAG + "="):
            return int(arg.split("=", 1)[1])
    return None


def launched_thinker_tp(launch_cfg: Any) -> int:
    """The thinker TP of a server the driver launches: its ``--thinker.tp_size`` if
    ``extra_args`` set one, else one rank per GPU (``gpus_per_server``; 1 for a CPU fake)."""
    return _tp_in(list(launch_cfg.extra_args)) or max(1, int(launch_cfg.gpus_per_server))


def launch_args(launch_cfg: Any) -> list[str]:
    """The server arguments of a launched server: the TP flags for its GPUs, then ``extra_args``
    (which win: when they set ``--thinker.tp_size`` themselves, no TP flags are added)."""
    extra = list(launch_cfg.extra_args)
    if _tp_in(extra) is not None or launch_cfg.kind == "fake":
        return extra
    return thinker_tp_args(launch_cfg.kind, launched_thinker_tp(launch_cfg)) + extra


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the server binds it a moment later; a lost race fails loud)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist yet)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except FileNotFoundError:
        return ""


class LaunchedServer:
    """One server process: started by :meth:`start`, probed by :meth:`wait_ready`, ended by :meth:`stop`."""

    def __init__(
        self,
        kind: str,
        model_path: str | os.PathLike[str],
        log_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        name: str = "server",
    ) -> None:
        self.name = name
        self.host = host
        self.port = int(port) if port else free_port(host)
        self.argv = server_argv(kind, model_path, host, self.port, extra_args or [])
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> LaunchedServer:
        if self.argv[1:3] == ["-m", "sglang_omni.cli"]:
            import importlib.util

            if importlib.util.find_spec("sglang_omni") is None:  # else: a log that says only that
                from omni_grpo.extras import MissingExtraError, missing_message

                raise MissingExtraError(missing_message("an sglang-omni rollout server"))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: stop() ends its children too
            )
        return self

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout_s: float, poll_s: float = 0.25) -> str:
        """Block until ``/model_info`` answers 200; returns the URL. Fails on exit or deadline."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                code = self.returncode()
                if code is not None:
                    raise ServerLaunchError(
                        f"{self.name} exited with code {code} before serving ({self.log_path}):\n"
                        f"{tail(self.log_path)}"
                    )
                try:
                    if client.get(f"{self.url}/model_info").status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerLaunchError(
                        f"{self.name} at {self.url} not ready after {timeout_s:.0f}s "
                        f"(rollout.sglang.launch.ready_timeout_s; log {self.log_path}):\n"
                        f"{tail(self.log_path)}"
                    )
                time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def launch(
    kind: str,
    model_path: str | os.PathLike[str],
    log_path: Path,
    *,
    ready_timeout_s: float,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: list[str] | None = None,
    name: str = "server",
) -> LaunchedServer:
    """Start a server and wait until it serves (stopping it again if it never does)."""
    server = LaunchedServer(
        kind, model_path, log_path, host=host, port=port, extra_args=extra_args, name=name
    ).start()
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


@click.command("serve", context_settings={"ignore_unknown_options": True})
@click.option(
    "--kind",
    type=click.Choice(sorted(SERVER_ARGV)),
    default="sglang-omni",
    show_default=True,
    help="sglang-omni (GPU), or the project's fake server (CPU tests only).",
)
@click.option(
    "--model-path", type=click.Path(path_type=Path), required=True, help="Omni checkpoint."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=None, help="Default: a free port.")
@click.option(
    "--log-file", type=click.Path(path_type=Path), default=None, help="Default: ./server-PORT.log"
)
@click.option("--ready-timeout", type=float, default=900.0, show_default=True)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Thinker tensor parallel size: one rank per visible GPU 0..TP-1 (sglang-omni: "
    "--thinker.tp_size TP --thinker.gpu [0..TP-1] --thinker.process thinker).",
)
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(
    kind: str,
    model_path: Path,
    host: str,
    port: int | None,
    log_file: Path | None,
    ready_timeout: float,
    tp: int,
    extra_args: tuple[str, ...],
) -> None:
    """Start one rollout server, print {"url", "pid", "log"} once it serves, stop it on Ctrl-C/SIGTERM.

    Arguments after ``--`` go to the server's own CLI unchanged.
    """
    extra_args = (*thinker_tp_args(kind, tp), *extra_args)
    port = port or free_port(host)
    log = log_file or Path(f"server-{port}.log")
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        server = launch(
            kind,
            model_path,
            log,
            ready_timeout_s=ready_timeout,
            host=host,
            port=port,
            extra_args=list(extra_args),
            name=f"{kind} server",
        )
    except ServerLaunchError as err:
        raise click.ClickException(str(err)) from None
    assert server.proc is not None
    click.echo(json.dumps({"url": server.url, "pid": server.proc.pid, "log": str(log)}), err=False)
    try:
        while not stop["now"]:
            code = server.returncode()
            if code is not None:
                raise click.ClickException(
                    f"{kind} server at {server.url} exited with code {code}:\n{tail(log)}"
                )
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
