"""Command line: ``omni-extract`` (also ``omni-grpo extract``) and ``omni-grpo make-tiny``.

Heavy imports (torch, transformers) happen inside the commands, so listing or ``--help`` is quick.
Bad input surfaces as a one-line ``click`` error naming the file/key, with exit status 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

VARIANT_CHOICES = ("text", "vl", "audio")
DTYPE_CHOICES = ("keep", "bf16", "fp32")


@click.command(name="extract", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--src",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Qwen3-Omni hub checkpoint directory.",
)
@click.option("--dst", required=True, type=click.Path(path_type=Path), help="Output directory.")
@click.option(
    "--variant",
    required=True,
    type=click.Choice(VARIANT_CHOICES),
    help="text: qwen3_moe; vl: pseudo-Qwen3-VL-MoE; audio: the audio tower.",
)
@click.option(
    "--shard-size",
    default="5GB",
    show_default=True,
    help="Maximum output shard size (e.g. 5GB, 500MB, 2GiB, bytes).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default="keep",
    show_default=True,
    help="Output dtype.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing DST (atomically, at the end).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def extract_command(
    src: Path, dst: Path, variant: str, shard_size: str, dtype: str, overwrite: bool, quiet: bool
) -> None:
    """Stream the Qwen3-Omni thinker out of SRC into a text, VL or audio checkpoint at DST."""
    from omni_extract.convert import extract, parse_size
    from omni_extract.errors import ExtractError

    try:
        size = parse_size(shard_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard-size") from exc
    try:
        result = extract(
            src,
            dst,
            variant=variant,
            shard_size=size,
            dtype=dtype,  # type: ignore[arg-type]
            overwrite=overwrite,
            progress=not quiet,
        )
    except ExtractError as exc:  # one line, whatever the reason's own line breaks
        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise click.ClickException(f"{type(exc).__name__}: {text}") from exc
    click.echo(
        f"wrote {result.num_tensors} tensors ({result.num_bytes / 1e9:.3f} GB) in "
        f"{len(result.shards)} shard(s) to {result.dst}"
    )


@click.command(name="make-tiny", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--vocab",
    type=click.Choice(("small", "real")),
    default="small",
    show_default=True,
    help="small: a 400-token BPE; real: the Qwen3 vocabulary and the released ids.",
)
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--dtype", type=click.Choice(("float32", "bfloat16")), default="float32", show_default=True
)
@click.option("--no-talker", is_flag=True, help="Leave out talker.* and code2wav.* weights.")
def make_tiny_command(
    directory: Path, vocab: str, shards: int, seed: int, dtype: str, no_talker: bool
) -> None:
    """Write a tiny random Qwen3-Omni checkpoint (hub layout) into DIRECTORY."""
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    spec = TinyOmniSpec(
        vocab=vocab,
        num_shards=shards,
        seed=seed,
        dtype=dtype,  # type: ignore[arg-type]
        with_talker=not no_talker,
    )
    try:
        out = make_tiny_omni(directory, spec)
    except (FileExistsError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    cfg = json.loads((out / "config.json").read_text())
    vocab_size = cfg["thinker_config"]["text_config"]["vocab_size"]
    click.echo(f"wrote tiny Qwen3-Omni checkpoint to {out} (vocab {vocab_size}, seed {seed})")


def main() -> None:
    """Entry point of the ``omni-extract`` script: one ``Error:`` line for anything the command
    raises (``--debug`` or ``OMNI_EXTRACT_DEBUG=1`` shows the traceback instead)."""
    import os
    import sys

    debug = "--debug" in sys.argv[1:] or os.environ.get("OMNI_EXTRACT_DEBUG", "") not in ("", "0")
    args = [a for a in sys.argv[1:] if a != "--debug"]
    try:
        extract_command.main(args, prog_name="omni-extract")
    except Exception as exc:
        if debug:
            raise
        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        click.echo(f"Error: {type(exc).__name__}: {text}", err=True)
        sys.exit(1)
