"""``export_run``: a run's checkpoint as a full Qwen3-Omni (or pseudo-VL) checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

from omni_extract.export import ExportFormat, ExportResult, ProgressFn, export_trained
from omni_extract.plan import DtypeChoice
from omni_extract.source import open_source
from omni_extract.trained import NoTrained, TrainedWeights

from omni_grpo.export.run import (
    ExportError,
    RunCheckpoint,
    check_complete,
    default_base,
    find_checkpoint,
    holds_lora,
    lora_trained,
    open_trained,
)
from omni_grpo.output_guard import refuse_output_over_input
from omni_grpo.run.stored_config import CONFIG_FILE


def export_run(
    run_dir: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    step: int | None = None,
    fmt: ExportFormat = "omni",
    base: str | os.PathLike[str] | None = None,
    dtype: DtypeChoice = "keep",
    shard_size: int | None = None,
    overwrite: bool = False,
    progress: bool | ProgressFn = False,
) -> tuple[ExportResult, RunCheckpoint]:
    """Export checkpoint ``step`` of ``run_dir`` (default: the newest complete one) to ``dst``.

    ``base`` defaults to the run's own ``model.omni_checkpoint``. Raises
    :class:`omni_grpo.export.run.ExportError` or an ``omni_extract`` error naming what is wrong.
    """
    ckpt = find_checkpoint(Path(run_dir), step)
    run = ckpt.run_dir
    base_dir = Path(base) if base is not None else default_base(run)
    # the run (its checkpoints, its prepared model) and the base are what the export reads
    refuse_output_over_input(dst, [run], output_name="--dst", input_name="the run directory")
    refuse_output_over_input(dst, [base_dir], output_name="--dst", input_name="the base")
    if base is None and not (base_dir / "config.json").is_file():
        raise ExportError(
            f"the run's base {base_dir} (model.omni_checkpoint in {run / CONFIG_FILE}) has no "
            "config.json; pass --base with the Qwen3-Omni checkpoint the run started from"
        )
    source = open_source(base_dir)
    trained: TrainedWeights
    if ckpt.path is None:
        trained = NoTrained()
    elif holds_lora(ckpt.files):  # adapters only: merged into the run's base, the rest is base
        trained = lora_trained(run, ckpt.files)
    else:
        trained = open_trained(ckpt.files, source)
        check_complete(trained, source, ckpt.path)
    provenance = {
        "run_dir": str(run.resolve()),
        "step": ckpt.step,
        "checkpoint": str(ckpt.path.resolve()) if ckpt.path else None,
        "checkpoint_format": type(trained).__name__ if ckpt.path else None,
    }
    result = export_trained(
        base_dir,
        dst,
        trained,
        fmt=fmt,
        dtype=dtype,
        shard_size=shard_size,
        overwrite=overwrite,
        provenance=provenance,
        progress=progress,
    )
    return result, ckpt
