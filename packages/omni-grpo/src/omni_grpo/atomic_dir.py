"""Build a directory under a hidden temporary sibling and rename it into place at the end.

Model saves, synthetic datasets and checkpoints all promise the same thing: an interrupted write
never leaves a half-finished directory at the destination. Building in a sibling (same filesystem)
makes the final ``os.replace`` atomic; on any error the sibling is removed and the error re-raised.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(dst: Path, *, replace_existing: bool = False) -> Iterator[Path]:
    """Yield an empty ``.<dst.name>.tmp-*`` sibling of ``dst``; move it to ``dst`` on a clean exit.

    An existing ``dst`` must be empty (callers check and name it first) unless
    ``replace_existing``, which removes the old directory only once the new one is complete.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # The writer's pid in the name lets a later run tell an abandoned sibling from a live one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-p{os.getpid()}-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            if replace_existing:
                shutil.rmtree(dst)
            else:
                dst.rmdir()
        os.replace(tmp, dst)
    except BaseException as exc:
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, DiskFullError) and is_disk_full(exc):
            # Every staged writer (checkpoints, model saves, datasets) reports a full disk alike.
            raise DiskFullError(
                disk_full_message(str(dst.name), dst.parent, written, at_least=True)
            ) from exc
        raise


def _tree_bytes(path: Path) -> int:
    try:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


# How the libraries we save with report a full disk: ENOSPC as an OSError, torch's C++ stream
# ("basic_ios::clear: iostream error", "file write failed"), safetensors' Rust IoError.
_DISK_FULL_TEXT = (
    "no space left",
    "storagefull",
    "iostream error",
    "file write failed",
    "errno 28",
)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (from a write) means the filesystem ran out of space or quota."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(t in str(exc).lower() for t in _DISK_FULL_TEXT)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def disk_full_message(what: str, where: Path, needed: int, *, at_least: bool = False) -> str:
    """``disk full while writing <what>: <where> has X free, about Y needed`` (``at least`` when
    the total is not known in advance, e.g. a streamed write)."""
    free = shutil.disk_usage(_existing(where)).free
    amount = "at least" if at_least else "about"
    return (
        f"disk full while writing {what}: {where} has {_size(free)} free, "
        f"{amount} {_size(needed)} needed"
    )


def check_free_space(what: str, where: Path, needed: int) -> None:
    """Raise ``DiskFullError`` before writing ``needed`` bytes where they cannot fit."""
    if shutil.disk_usage(_existing(where)).free < needed:
        raise DiskFullError(disk_full_message(what, where, needed))


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class DiskFullError(OSError):
    """No space for a save; the message says what, where, and how much it needed."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.args[1])


__all__ = ["DiskFullError", "check_free_space", "disk_full_message", "is_disk_full", "staged_dir"]
