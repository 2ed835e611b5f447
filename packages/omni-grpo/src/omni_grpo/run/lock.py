"""A run directory is owned by one process at a time.

Two ``omni-grpo train`` processes into one ``run.dir`` both finished "successfully": each
replaced the other's ``metrics.jsonl`` while it wrote and their checkpoints overwrote each other.
The owner now holds an OS lock (``fcntl.flock``) on ``<run.dir>/run.lock`` for as long as it
trains; the file holds the owner's pid, host and start time for the refusal message of the next
one. The kernel releases the lock when the process ends however it ends (kill -9 included), so a
dead run leaves nothing to clean up: ``--resume`` just takes the lock again (the file a killed
owner left is reused). An owner that ends normally removes the file while it still holds the
lock, so a directory looks as it did before; a process that opened the removed file finds, once
it gets the lock, that the path no longer names it, and starts over on the path's new file.

Where ``fcntl`` does not exist (Windows) the directory is not locked, with one warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omni_grpo.run.rundir import RunDirError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunDirBusyError(RunDirError):
    """Another live process owns the run directory; the message names its pid."""


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file (it may not have written yet)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process (pid not recorded yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info['pid']} on {info.get('host', '?')}, since {since}"


@contextlib.contextmanager
def own_run_dir(run_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the body (the directory is created if needed); a directory
    held by another live process raises :class:`RunDirBusyError` naming its pid."""
    run_dir = Path(run_dir)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        log.warning("no fcntl on this platform: %s is not locked against a second run", run_dir)
        yield run_dir
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _lock(path, run_dir, fcntl)
    try:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "argv": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield run_dir
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # still locked: a waiter that opened it retries on a new file
        os.close(fd)  # releases the lock (the kernel does the same when the process dies)


def _lock(path: Path, run_dir: Path, fcntl: Any) -> int:
    """An fd of ``path`` holding its exclusive lock, the path still naming that file."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusyError(
                f"run.dir {run_dir} is in use by {holder} ({path} is locked): wait for that run "
                "to end or stop it, or choose another run.dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # the owner removed it as we waited: take the path's new file
