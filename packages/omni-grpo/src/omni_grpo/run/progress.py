"""A rich progress bar for the training loop that shows the latest reward and loss."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainProgress:
    """``with TrainProgress(total, start) as p: p.update(step, metrics)``; disabled = silent."""

    def __init__(
        self, total: int, start: int = 0, *, enabled: bool = True, console: Console | None = None
    ) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[extra]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not enabled,
        )
        self.task = self.progress.add_task(
            "grpo", total=total, completed=start, reward="-", loss="-", extra=""
        )

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        acc = {
            k.rsplit("/", 1)[-1]: v for k, v in metrics.items() if k.startswith("eval/accuracy/")
        }
        extra = " ".join(f"{k} {v:.2f}" for k, v in sorted(acc.items()))
        fields: dict[str, Any] = {"completed": step}
        if metrics.get("reward_mean") is not None:
            fields["reward"] = f"{metrics['reward_mean']:.3f}"
        if metrics.get("loss") is not None:
            fields["loss"] = f"{metrics['loss']:+.4f}"
        if extra:
            fields["extra"] = "eval " + extra
        self.progress.update(self.task, **fields)

    def log(self, message: str) -> None:
        self.progress.console.print(message) if self.enabled else None
