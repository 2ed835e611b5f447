"""``omni-grpo export RUN_DIR --dst OUT``: the trained model out of the run, as Qwen3-Omni."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dst", required=True, type=click.Path(path_type=Path), help="Output directory.")
@click.option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="Checkpoint step (default: the newest complete one; 0: the untrained model).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["omni", "vl"]),
    default="omni",
    show_default=True,
    help="omni: the full Qwen3-Omni hub layout (thinker + towers + talker + code2wav); "
    "vl: the pseudo-Qwen3-VL-MoE checkpoint the trainer uses.",
)
@click.option(
    "--base",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Qwen3-Omni checkpoint to write into (default: the run's model.omni_checkpoint).",
)
@click.option(
    "--dtype",
    type=click.Choice(["keep", "bf16", "fp32"]),
    default="keep",
    show_default=True,
    help="keep: every tensor in the base's dtype.",
)
@click.option(
    "--shard-size",
    default=None,
    help="Maximum shard size (e.g. 5GB, 500MB); default: the base's own shards (omni) or 5GB (vl).",
)
@click.option("--overwrite", is_flag=True, help="Replace a DST written by an earlier export.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export_command(
    run_dir: Path,
    dst: Path,
    step: int | None,
    fmt: str,
    base: Path | None,
    dtype: str,
    shard_size: str | None,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Write checkpoint STEP of RUN_DIR as a checkpoint transformers and sglang-omni load.

    Prints one JSON line: destination, step, format, tensors written and replaced.
    """
    from omni_extract.convert import parse_size

    from omni_grpo.export import export_run

    try:
        size = parse_size(shard_size) if shard_size is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard-size") from None
    # bad input raises ExportError / omni_extract errors: the CLI's one error layer prints them
    result, ckpt = export_run(
        run_dir,
        dst,
        step=step,
        fmt=fmt,  # type: ignore[arg-type]
        base=base,
        dtype=dtype,  # type: ignore[arg-type]
        shard_size=size,
        overwrite=overwrite,
        progress=not quiet,
    )
    if ckpt.path is None:
        click.echo(f"note: {run_dir} has no checkpoint; exported the untrained model", err=True)
    click.echo(
        json.dumps(
            {
                "dst": str(result.dst),
                "step": ckpt.step,
                "format": result.fmt,
                "tensors": result.num_tensors,
                "replaced": result.num_replaced,
                "bytes": result.num_bytes,
                "shards": len(result.shards),
            }
        )
    )
