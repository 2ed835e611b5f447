"""Run a fake app with uvicorn on a loopback port in a background thread."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from .faults import Faults
from .generator import Generator
from .worker_app import FakeEngine, FakeWorkerApp, GenerationRecord


class BackgroundServer:
    """``with BackgroundServer(app) as s: s.url`` - uvicorn on 127.0.0.1, a free port."""

    def __init__(
        self, app: Any, *, log_level: str = "warning", host: str = "127.0.0.1", port: int = 0
    ):
        self._app = app
        self._log_level = log_level
        self._host = host
        self._port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    def start(self) -> None:
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say TCP (proto 0 does
        # not), and uvicorn binding host:port itself gets such a socket. Without it every reply
        # written as headers + body waits ~40 ms for a delayed ACK (Nagle), which a real server
        # does not do.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            log_level=self._log_level,
            lifespan="off",
            timeout_keep_alive=30,
            access_log=False,
        )
        self._server = uvicorn.Server(config)

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._server.serve(sockets=[sock]))
            self.loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-omni-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake server on port {port} did not start")
            time.sleep(0.01)
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def call(self, fn: Any, *args: Any, timeout: float = 10) -> Any:
        """Run ``fn(*args)`` on the server's loop (state is only touched there) and return it."""
        assert self.loop is not None

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeOmniServer(BackgroundServer):
    """A fake sglang-omni 0.1.9 worker on loopback.

    ``generator`` (optional) maps a ``FakeRequest`` to a ``FakeGeneration`` (token ids and
    logprobs); the default is a deterministic hash generator. ``token_delay_s`` makes generation
    take time so pause/abort/retract can interleave with it. ``faults`` injects 5xx bursts,
    dropped connections, slow responses and early aborts.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 4096,
        eos_token_id: int | None = None,
        max_seq_len: int = 65536,
        generator: Generator | None = None,
        token_delay_s: float = 0.0,
        max_inflight: int | None = None,
        tp_size: int = 1,
        speech: bool = False,
        admin_api_key: str | None = None,
        startup_delay_s: float = 0.0,
        model_path: str = "fake/Qwen3-Omni",
        log_level: str = "warning",
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.engine = FakeEngine(
            vocab_size=vocab_size,
            eos_token_id=vocab_size - 1 if eos_token_id is None else eos_token_id,
            max_seq_len=max_seq_len,
            generator=generator,
            token_delay_s=token_delay_s,
            max_inflight=max_inflight,
            tp_size=tp_size,
            speech=speech,
            model_path=model_path,
        )
        self.faults = Faults()
        self.worker = FakeWorkerApp(
            self.engine, self.faults, admin_api_key=admin_api_key, startup_delay_s=startup_delay_s
        )
        super().__init__(self.worker.app, log_level=log_level, host=host, port=port)

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kwargs: Any) -> FakeOmniServer:
        """Vocab size and EOS id read from a Qwen3-Omni checkpoint's config.json /
        generation_config.json (thinker text config)."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        text = config.get("thinker_config", {}).get("text_config", config)
        eos = None
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        eos = eos if eos is not None else text.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            vocab_size=int(text["vocab_size"]), eos_token_id=eos, model_path=str(path), **kwargs
        )

    # -- snapshots for assertions (read on the server loop)
    @property
    def records(self) -> list[GenerationRecord]:
        return self.call(lambda: list(self.engine.records))

    @property
    def admin_log(self) -> list[tuple[str, dict[str, Any]]]:
        return self.call(lambda: list(self.engine.admin_log))

    def active_count(self) -> int:
        return self.call(lambda: len(self.engine.active))

    @property
    def weight_version(self) -> str:
        return self.call(lambda: self.engine.weight_versions["thinker"])

    @property
    def engine_paused(self) -> bool:
        return self.call(lambda: self.engine.paused)
