"""Fault injection for the fake server, armed from the test thread, consumed on the server loop."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    kind: str  # "status" | "drop" | "delay" | "abort_finish" | "slow"
    status: int = 503
    seconds: float = 0.0
    after_tokens: int = 0


class Faults:
    """Per-route queues of one-shot faults; each matching request consumes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Fault]] = defaultdict(deque)
        self.fired: list[tuple[str, str]] = []

    def _arm(self, route: str, fault: Fault, count: int) -> None:
        with self._lock:
            self._queues[route].extend([fault] * count)

    def fail_next(self, count: int = 1, *, status: int = 503, route: str = "/generate") -> None:
        """Answer the next ``count`` requests with ``status`` (a 5xx burst), before executing."""
        self._arm(route, Fault("status", status=status), count)

    def drop_next(self, count: int = 1) -> None:
        """Execute the next ``count`` /generate requests, then cut the connection mid-response
        (the work is done server-side but the client never sees the result)."""
        self._arm("/generate", Fault("drop"), count)

    def delay_next(self, count: int = 1, *, seconds: float, route: str = "/generate") -> None:
        """Sleep ``seconds`` before handling each of the next ``count`` requests (slow server)."""
        self._arm(route, Fault("delay", seconds=seconds), count)

    def slow_next(self, count: int = 1, *, seconds: float, route: str) -> None:
        """The next ``count`` admin calls of ``route`` take ``seconds`` on the stage's scheduler.

        As on sglang-omni 0.1.9, the coordinator waits at most the request's ``timeout_s`` (or
        the route's default): past it the reply is a plain-text 500, but the work is already
        queued and is still applied when the ``seconds`` are up.
        """
        self._arm(route, Fault("slow", seconds=seconds), count)

    def abort_finish_next(self, count: int = 1, *, after_tokens: int = 1) -> None:
        """Finish the next ``count`` generations early with ``finish_reason.type == "abort"``
        after ``after_tokens`` tokens (a 200 with a partial sample, for resume tests)."""
        self._arm("/generate", Fault("abort_finish", after_tokens=after_tokens), count)

    def take(self, route: str) -> Fault | None:
        with self._lock:
            queue = self._queues.get(route)
            if not queue:
                return None
            fault = queue.popleft()
            self.fired.append((route, fault.kind))
            return fault

    def pending(self, route: str = "/generate") -> int:
        with self._lock:
            return len(self._queues.get(route, ()))
