"""``omni-grpo train``, ``eval`` and ``show-config`` (registered in the ``omni_grpo.commands`` group)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click

from omni_grpo.cli import config_options
from omni_grpo.data.ablation import ABLATIONS


@click.command("train")
@config_options
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in run.dir.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace the run already in run.dir (its checkpoints, metrics, TensorBoard events; the "
    "prepared model/ and data/ are kept).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
@click.option(
    "--plan",
    "plan_only",
    is_flag=True,
    help="Print where every rank and server goes; start nothing.",
)
@click.option(
    "--gpus", type=int, default=None, help="With --plan: refuse a plan needing more GPUs than this."
)
def train_command(
    cfg: Any, resume: bool, overwrite: bool, no_progress: bool, plan_only: bool, gpus: int | None
) -> None:
    """Run GRPO as configured: prepare the model and data, then train, evaluate and checkpoint."""
    if plan_only:
        click.echo(plan_text(cfg, gpus))
        return
    preflight(cfg)
    from omni_grpo.quiet import configure_run_logging
    from omni_grpo.trainer import train

    configure_run_logging()
    # one INFO line per HTTP request would bury the run's own log (hundreds per step)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from omni_grpo.ray.driver import ActorFailure
    from omni_grpo.ray.placement import PlacementError
    from omni_grpo.run.signals import RunInterrupted

    try:
        result = train(cfg, resume=resume, overwrite=overwrite, progress=not no_progress)
    except ActorFailure as err:  # an actor of a multi-process run died or raised
        raise click.ClickException(str(err)) from None
    except PlacementError as err:
        raise click.UsageError(str(err)) from None
    except RunInterrupted as stop:  # SIGTERM / SIGINT: everything is closed, the dir resumable
        click.echo(f"Error: {stop}", err=True)
        raise click.exceptions.Exit(128 + stop.signum) from None
    summary = {
        "run_dir": str(result.run_dir),
        "steps": result.steps,
        "wall_s": round(result.wall_s, 1),
        **{k: round(v, 4) for k, v in result.final_eval.items()},
    }
    (Path(result.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    click.echo(json.dumps(summary))


def preflight(cfg: Any) -> None:
    """Refuse, before any model or data preparation, a run that cannot start: a layout that does
    not fit the GPUs or cannot shard the model (what ``--plan`` checks), or a missing extra.

    Without this a run without Ray would spend minutes making the model and the data and only
    then fail at ``import ray``; a TP size the model's heads do not divide would fail inside a
    server's or a rank's model constructor, after the GPUs were allocated.
    """
    from omni_grpo.extras import require

    plan = checked_plan(cfg)[0]
    if plan.distributed:
        require("the scale path (Ray actors)")
    elif cfg.trainer.backend == "megatron":
        from omni_grpo.backends.megatron import mcore

        mcore()


def checked_plan(cfg: Any, gpus: int | None = None) -> tuple[Any, list[str]]:
    """The placement plan and the layout notes, or a one-line usage error naming the field."""
    from omni_grpo.layout import check_layout
    from omni_grpo.ray.placement import PlacementError, plan_run

    try:
        plan = plan_run(cfg, available_gpus=gpus)
        return plan, check_layout(cfg, plan)
    except PlacementError as err:
        raise click.UsageError(str(err)) from None


def plan_text(cfg: Any, gpus: int | None = None) -> str:
    """``--plan``: the placement and the layout check as text; nothing is started. A request the
    machine's CPUs, GPUs or memory cannot place per actor is a one-line usage error."""
    from omni_grpo.ray.placement import PlacementError, format_plan
    from omni_grpo.ray.resources import check_local_resources

    plan, notes = checked_plan(cfg, gpus)
    try:
        check_local_resources(cfg, plan, for_plan=True, gpus=gpus)  # per actor vs the Ray
    except PlacementError as err:
        raise click.UsageError(str(err)) from None
    return "\n".join([format_plan(plan, cfg), *notes])


@click.command("show-config")
@config_options
@click.option(
    "--plan", "plan", is_flag=True, help="Also print the placement plan (see train --plan)."
)
@click.option("--gpus", type=int, default=None, help="With --plan: the GPUs available.")
def show_config_command(cfg: Any, plan: bool, gpus: int | None) -> None:
    """Print the fully resolved config (defaults, file, overrides) as YAML."""
    from omni_grpo.config import dump_config

    click.echo(dump_config(cfg), nl=False)
    if plan:
        click.echo(plan_text(cfg, gpus))


@click.command("eval")
@config_options
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory (default: the newest in run.dir; none = the untrained model).",
)
@click.option(
    "--base", is_flag=True, help="Evaluate the untrained model even if checkpoints exist."
)
@click.option(
    "--exported",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Evaluate a directory written by `omni-grpo export` (omni or vl format) instead.",
)
@click.option(
    "--ablate",
    "ablate",
    multiple=True,
    type=click.Choice(list(ABLATIONS)),
    help="Also evaluate with this modality's media replaced by a neutral input of the same "
    "shape (silence, mid-grey frames); repeatable. Default: eval.ablations.",
)
def eval_command(
    cfg: Any, checkpoint: Path | None, base: bool, exported: Path | None, ablate: tuple[str, ...]
) -> None:
    """Held-out accuracy per modality of a checkpoint (greedy, rollout.eval_sampling), and with
    each ``--ablate`` modality blanked: a task that uses its medium falls to chance without it."""
    from rich.console import Console

    from omni_grpo.backends import create_backend
    from omni_grpo.config import check_paths
    from omni_grpo.data.dataset import OmniDataset
    from omni_grpo.data.prompt import PromptBuilder
    from omni_grpo.models.sideband import media_token_ids
    from omni_grpo.rollout import create_engine
    from omni_grpo.run.checkpoint import latest_checkpoint, load_checkpoint
    from omni_grpo.sglang import checkpoint_media_ids
    from omni_grpo.trainer import (
        end_of_turn_ids,
        evaluate,
        evaluate_ablated,
        prepare_data,
        prepare_model,
    )

    if exported is not None:  # the exported model replaces the run's model and checkpoints
        from omni_grpo.export.evaluate import exported_model_config

        cfg = exported_model_config(cfg, exported, click.get_current_context().call_on_close)
        base = True
    check_paths(cfg)
    if checkpoint is not None and not checkpoint.is_dir():
        raise click.UsageError(f"--checkpoint {checkpoint} is not a directory")
    run_dir = Path(cfg.run.dir)
    vl_dir, _ = prepare_model(cfg.model, run_dir)
    data_cfg = prepare_data(cfg.data, run_dir)
    if data_cfg.eval is None:
        raise click.UsageError("data.eval is not set (and data.synthetic is not configured)")
    builder = PromptBuilder(vl_dir, data_cfg)
    tok = builder.tokenizer
    eos_ids = end_of_turn_ids(vl_dir, tok)
    eos_id = eos_ids[0]
    backend = create_backend(
        cfg.trainer.backend, cfg.model, cfg.trainer, cfg.algo, pad_token_id=eos_id
    )
    ckpt = None if base else (checkpoint or latest_checkpoint(run_dir))
    if ckpt is not None:
        _, weights, _, _ = load_checkpoint(ckpt)
        backend.load_trainable_state(weights)
    engine = create_engine(
        cfg.rollout.model_copy(update={"engine": "embedded"})
        if cfg.rollout.engine == "embedded"
        else cfg.rollout,
        policy=backend.policy,
        eos_token_ids=eos_ids,
        banned_token_ids=media_token_ids(backend.policy),
        media_ids=checkpoint_media_ids(vl_dir),
        decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=True),
        device=str(backend.device),
        vocab_size=len(tok),
    )
    eval_set = OmniDataset(data_cfg.eval, data_cfg.root, builder)
    args = (cfg.rollout.eval_sampling, cfg.rewards, cfg.eval.max_samples)
    ablations = list(dict.fromkeys(ablate or cfg.eval.ablations))
    result = {
        **evaluate(engine, eval_set, *args),
        **evaluate_ablated(engine, eval_set, ablations, *args),
    }
    title = f"held-out accuracy ({ckpt or exported or 'untrained model'})"
    Console(stderr=True).print(accuracy_table(result, ablations, title))
    source = {"exported": str(exported)} if exported is not None else {}
    click.echo(json.dumps({"checkpoint": str(ckpt) if ckpt else None, **source, **result}))


def accuracy_table(result: dict[str, float], ablations: list[str], title: str) -> Any:
    """Rows = modalities, columns = the plain evaluation and each ablation."""
    from rich.table import Table

    prefix = "eval/accuracy/"
    modalities = [k[len(prefix) :] for k in result if k.startswith(prefix)]
    table = Table(title=title)
    table.add_column("modality")
    table.add_column("accuracy", justify="right")
    for name in ablations:
        table.add_column(f"{name} ablated", justify="right")
    for m in modalities:
        cells = [result.get(f"eval/accuracy/{m}")]
        cells += [result.get(f"eval/ablated/{name}/accuracy/{m}") for name in ablations]
        table.add_row(m, *("-" if v is None else f"{v:.3f}" for v in cells))
    return table
