"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), TensorBoard, optional W&B.

TensorBoard (the ``viz`` extra) and W&B (``wandb``) are side outputs: without their extra the
logger warns once and writes ``metrics.jsonl`` alone.

``metrics.jsonl`` is the run's record: on resume it is truncated to the steps the checkpoint
covers, so an interrupted-and-resumed run ends with exactly the lines an uninterrupted one writes.
Keys under ``time/`` are wall-clock measurements (not reproducible by nature); everything else is
a deterministic function of the seed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from omni_grpo.extras import optional

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _complete_lines(path: Path) -> tuple[list[str], int]:
    """The lines of ``path`` up to the first one that is not a whole JSON object (a kill in the
    middle of a write leaves a half line at the end), and how many lines were cut."""
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            return lines[:i], len(lines) - i
    return lines, 0


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines, _ = _complete_lines(path)
    return [json.loads(line) for line in lines if line.strip()]


def truncate_metrics(run_dir: str | os.PathLike[str], last_step: int) -> None:
    """Keep only complete lines with ``step <= last_step`` (atomically rewritten); a half-written
    line (and anything after it) is dropped with one log line."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    lines, cut = _complete_lines(path)
    if cut:
        log.warning(
            "%s: dropped %d incomplete line(s) at the end (an interrupted write)", path, cut
        )
    keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null says "not defined this step"
    return value


class MetricsLogger:
    """Writes each step's metrics to every configured sink."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_config: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(self.run_dir, resume_step)
        else:  # a fresh start in a directory the caller has claimed: no old steps may show
            if (self.run_dir / METRICS_FILE).exists():
                (self.run_dir / METRICS_FILE).unlink()
            shutil.rmtree(self.run_dir / "tensorboard", ignore_errors=True)
        # A long-lived append handle, closed in close(): one line per step, flushed each time.
        self._file = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115
        self._tb = None
        tb = optional("run.tensorboard") if tensorboard else None
        if tb is not None:
            # purge_step: TensorBoard drops the events of steps after the checkpoint that an
            # interrupted run had already written, so resumed steps do not show twice.
            self._tb = tb.SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard"),
                purge_step=None if resume_step is None else resume_step + 1,
            )
        self._wandb = None
        wandb_mod = optional("run.wandb") if wandb else None
        if wandb_mod is not None:
            self._wandb = wandb_mod.init(
                project="omni-grpo",
                dir=str(self.run_dir),
                config=wandb_config or {},
                resume="allow",
            )

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
