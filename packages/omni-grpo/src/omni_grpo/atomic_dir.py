"""Build a directory under a hidden temporary sibling and rename it into place at the end.

Model saves, synthetic datasets and checkpoints all promise the same thing: an interrupted write
never leaves a half-finished directory at the destination. Building in a sibling (same filesystem)
makes the final ``os.replace`` atomic; on any error the sibling is removed and the error re-raised.
"""

from __future__ import annotations

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
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            if replace_existing:
                shutil.rmtree(dst)
            else:
                dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["staged_dir"]
