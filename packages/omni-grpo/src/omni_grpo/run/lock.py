"""A run directory is owned by one process at a time.

Two ``omni-grpo train`` processes into one ``run.dir`` both finished "successfully": each
replaced the other's ``metrics.jsonl`` while it wrote and their checkpoints overwrote each other.
The owner now holds an OS lock (``fcntl.flock``) on ``<run.dir>/run.lock`` for as long as it
trains. The kernel releases it when the process ends however it ends (kill -9 included), so a
dead run leaves nothing to clean up: ``--resume`` just takes the lock again. The file itself
stays; it holds the owner's pid, host and start time for the refusal message of the next one.

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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusyError(
                f"run.dir {run_dir} is in use by {_holder(fd)} ({path} is locked): wait for that "
                "run to end or stop it, or choose another run.dir"
            ) from None
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
        os.close(fd)  # releases the lock (the kernel does the same when the process dies)
