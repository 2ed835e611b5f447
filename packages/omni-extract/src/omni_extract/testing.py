"""Deprecated alias of :mod:`omni_extract.tiny` (the tiny-checkpoint factory's old name).

The factory is a product feature (``omni-extract make-tiny``, ``examples/tiny.yaml``), not a test
rig, so it now lives under a product name. This module keeps old imports working, with a
``DeprecationWarning``, and forwards every name to :mod:`omni_extract.tiny`.
"""

from __future__ import annotations

import warnings
from typing import Any

from omni_extract import tiny as _tiny

warnings.warn(
    "omni_extract.testing is deprecated; import omni_extract.tiny instead",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_tiny, name)
