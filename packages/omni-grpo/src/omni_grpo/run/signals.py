"""SIGTERM / SIGINT stop a run with one line and a resumable run directory, on Ray too.

During ``train`` both signals raise :class:`RunInterrupted` in the main thread, so every
``finally`` runs: rollout and trainer actors are killed, the placement group released, a local
Ray shut down, files closed. What was written stays resumable as after a kill (checkpoints are
atomic, ``metrics.jsonl`` is cut back to the checkpoint on resume). A second signal while the
first is being handled ends the process at once, as the default action would.

``ray.init`` replaces the process's SIGTERM handler twice: with a Python handler that calls
``sys.exit`` (and, for a Ray it starts, one that kills its processes and exits 1), then, when
its C++ core worker starts, with absl's failure-signal handler, which prints a native stack
(``*** SIGTERM received ...``, ``PC: @ ...``) and aborts (exit 134). :func:`keep_signal_handlers`
around ``ray.init`` puts the run's handlers back; a Ray the driver started is still shut down
by the ``finally`` of the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(BaseException):  # noqa: N818 - a stop request, like KeyboardInterrupt
    """A stop signal reached the run; a BaseException (like ``KeyboardInterrupt``) so that no
    ``except Exception`` of the loop mistakes it for a failure to handle. ``where`` is filled
    in by ``train`` (the step reached, the checkpoint a ``--resume`` continues from)."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.where = ""
        super().__init__(signal.Signals(self.signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"stopped by {self.name}{self.where}"


def find_interrupt(exc: BaseException | None) -> RunInterrupted | None:
    """The :class:`RunInterrupted` behind ``exc``, if any. Raised inside a C extension's call
    (Ray's ``CoreWorker.wait``) it comes back wrapped, as the cause of a ``SystemError``
    ("returned a result with an exception set"), and code cleaning up after it may raise again
    with it as the context: the whole chain is searched."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        if isinstance(err, RunInterrupted):
            return err
        seen.add(id(err))
        todo += [err.__cause__, err.__context__]
    return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the body runs, SIGTERM and SIGINT raise :class:`RunInterrupted` (main thread only:
    Python delivers signals there; elsewhere the body runs unchanged)."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    seen: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        if seen:  # already stopping: a second signal ends the process now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        seen.append(signum)
        raise RunInterrupted(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Restore the SIGTERM / SIGINT handlers the body (``ray.init``) replaced. ``signal.signal``
    installs the Python-level handler again at the C level too, over any native one."""
    if not _in_main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
