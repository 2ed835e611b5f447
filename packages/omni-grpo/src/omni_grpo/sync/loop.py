"""A private asyncio event loop on a daemon thread, for synchronous callers of async clients.

The trainer loop is synchronous, while ``omni_rollout_client`` is asyncio/httpx. Weight sync
needs HTTP requests in flight *while* the calling thread blocks in ``torch.distributed``
broadcasts (the server answers ``update_weights_from_distributed`` only after it has received
every tensor), so the coroutines must run on another thread. One long-lived loop also keeps the
httpx connection pools alive across steps, which ``asyncio.run`` per call would not.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """``submit`` schedules a coroutine and returns a ``concurrent.futures.Future``; ``run`` waits."""

    def __init__(self, name: str = "omni-grpo-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("BackgroundLoop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()
