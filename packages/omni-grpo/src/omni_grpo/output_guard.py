"""No command writes over its own input.

``prepare-data`` with OUT equal to SRC replaced the source with its own conversion (the original
records were gone), and an export written into the run or checkpoint it reads from mixes its
output into its input. Every command that reads some paths and writes another checks, before it
reads anything, that the output is not one of its inputs, does not contain one and is not inside
one (symlinks resolved, hard links to the same file caught by ``samefile``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


class OutputOverInputError(ValueError):
    """The output path of a command overlaps one of its inputs; the message names both."""


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def overlap(output: Path, source: Path) -> str | None:
    """How ``output`` overlaps ``source`` (``"is"``, ``"is inside"``, ``"contains"``), or None."""
    out, src = Path(output).resolve(), Path(source).resolve()
    if out == src or _same(Path(output), Path(source)):
        return "is"
    if out.is_relative_to(src):
        return "is inside"
    if src.is_relative_to(out):
        return "contains"
    return None


def refuse_output_over_input(
    output: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    *,
    output_name: str = "the output",
    input_name: str = "the input",
) -> None:
    """Raise :class:`OutputOverInputError` when ``output`` is, is inside or contains an input.

    ``output_name`` / ``input_name`` say which argument each is (``OUT``, ``--dst``, ``SRC``).
    """
    for source in inputs:
        how = overlap(Path(output), Path(source))
        if how is not None:
            raise OutputOverInputError(
                f"{output_name} {output} {how} {input_name} {source}: the command would write "
                f"over what it reads; choose another {output_name}"
            )
