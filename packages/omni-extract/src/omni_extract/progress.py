"""A rich progress bar showing bytes and tensors written, for the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from omni_extract.plan import ExtractionPlan


@contextmanager
def rich_progress(plan: ExtractionPlan, label: str, stderr: bool = False) -> Iterator[callable]:
    """Yield a ``(bytes, tensors)`` callback that advances a bar sized to the plan.

    ``stderr``: draw on stderr, for commands whose stdout is a JSON result."""
    total_tensors = len(plan.outputs)
    done = {"tensors": 0}
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tensors]}/" + str(total_tensors) + " tensors"),
        TimeRemainingColumn(),
    )
    console = Console(stderr=True) if stderr else None
    with Progress(*columns, transient=False, console=console) as bar:
        task = bar.add_task(label, total=plan.total_bytes, tensors=0)

        def advance(nbytes: int, ntensors: int) -> None:
            done["tensors"] += ntensors
            bar.update(task, advance=nbytes, tensors=done["tensors"])

        yield advance
