"""A private asyncio event loop on a daemon thread, for synchronous callers of async clients.

Shared by the sglang-omni rollout engine and weight sync (neither owns it, so it lives below both).

The trainer loop is synchronous, while ``omni_rollout_client`` is asyncio/httpx. Weight sync
needs HTTP requests in flight *while* the calling thread blocks in ``torch.distributed``
broadcasts (the server answers ``update_weights_from_distributed`` only after it has received
every tensor), so the coroutines must run on another thread. One long-lived loop also keeps the
httpx connection pools alive across steps, which ``asyncio.run`` per call would not.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Coroutine, Iterable, Iterator
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


async def gather(coros: Iterable[Awaitable[T]], return_exceptions: bool = False) -> list[T]:
    """``asyncio.gather`` over an iterable of coroutines, consumed inside the loop's thread.

    Callers pass a generator (``gather(c.model_info() for c in clients)``) so the coroutine objects
    are created on the thread that awaits them, and none is left un-awaited if building fails.
    """
    return await asyncio.gather(*list(coros), return_exceptions=return_exceptions)


_DONE = object()


class Prefetch:
    """Run an iterator ``depth`` items ahead on a helper thread (torch ops release the GIL).

    Errors raised by the source are re-raised in the consumer at the point they occurred. Use as a
    context manager: leaving early stops the producer after its current item.
    """

    def __init__(self, source: Iterator[T], depth: int = 1) -> None:
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, name="omni-grpo-prefetch", daemon=True
        )

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self._source:
                if not self._put((item, None)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put((None, exc))
            return
        self._put((_DONE, None))

    def __enter__(self) -> Iterator[T]:
        self._thread.start()
        return self._consume()

    def _consume(self) -> Iterator[T]:
        while True:
            item, exc = self._queue.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                return
            yield item  # type: ignore[misc]

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
