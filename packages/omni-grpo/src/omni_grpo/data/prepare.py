"""``omni-grpo prepare-data``: convert public datasets into our jsonl rows.

Each preparer is a plain function (source file -> validated rows, written atomically) plus a click
subcommand. Rows that cannot be converted are dropped and COUNTED by reason; the summary is printed
and returned, so nothing disappears silently. More preparers can be added by other packages through
the ``omni_grpo.preparers`` entry-point group (a click command each).
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from collections.abc import Iterable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click

from omni_grpo.data.schema import DataError, DatasetRow, parse_row, write_rows

PREPARERS_GROUP = "omni_grpo.preparers"
LETTERS = string.ascii_uppercase
ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
OPTION_PREFIX = re.compile(r"^\s*\(?([A-Z])[\.\):]\s*")


def _options_block(options: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))


def _relative_media(path: str, root: Path) -> str | None:
    """``path`` as stored in a row (relative to root), or None if it lies outside the root."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix().removeprefix("./")
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def _media_ok(rel: str, root: Path) -> bool:
    target = (root / rel).resolve()
    return target.is_relative_to(root.resolve()) and target.is_file()


# ------------------------------------------------------------------------------------------- AVQA
AVQA_INSTRUCTION = "Answer with the option's letter, inside <answer> </answer>."


def avqa_rows(
    records: Iterable[dict[str, Any]], root: Path, check_media: bool, stats: Counter[str]
) -> Iterator[DatasetRow]:
    """R1-AQA jsonl (AVQA: id, question_text, multi_choice, answer = 0-based index, audio_path) -> rows.

    The question is reworded from "video" to "audio" as R1-AQA does (the model only hears the clip).
    """
    for n, rec in enumerate(records, start=1):
        where = f"record {n} (id {rec.get('id')!r})"
        missing = [
            k
            for k in ("id", "question_text", "multi_choice", "answer", "audio_path")
            if k not in rec
        ]
        if missing:
            raise DataError(f"AVQA {where}: missing field(s) {missing}")
        choices = [str(c) for c in rec["multi_choice"]]
        answer = rec["answer"]
        if (
            not isinstance(answer, int)
            or not 0 <= answer < len(choices)
            or len(choices) > len(LETTERS)
        ):
            raise DataError(
                f"AVQA {where}: answer {answer!r} is not an index into {len(choices)} choices"
            )
        rel = _relative_media(str(rec["audio_path"]), root)
        if rel is None:
            stats["dropped_outside_root"] += 1
            continue
        if check_media and not _media_ok(rel, root):
            stats["dropped_missing_media"] += 1
            continue
        question = str(rec["question_text"]).replace("video", "audio")
        prompt = f"<audio>\n{question}\n{_options_block(choices)}\n{AVQA_INSTRUCTION}"
        meta = {
            k: rec[k]
            for k in (
                "video_name",
                "video_id",
                "question_relation",
                "question_type",
                "dataset_name",
            )
            if k in rec
        }
        meta.update(choices=choices, answer_text=choices[answer], source="avqa")
        stats["kept"] += 1
        yield parse_row(
            {
                "id": f"avqa-{rec['id']}",
                "prompt": prompt,
                "label": LETTERS[answer],
                "media": [{"type": "audio", "path": rel}],
                "choices": choices,
                "reward": "mcq",
                "modality": "audio",
                "metadata": meta,
            },
            f"AVQA {where}",
        )


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: not valid JSON: {err.msg}") from None


def prepare_avqa(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    check_media: bool = True,
) -> dict[str, int]:
    """Convert an R1-AQA/AVQA jsonl; ``root`` (default: the source's directory) is the media root."""
    src_p = Path(src)
    root_p = Path(root) if root is not None else src_p.parent
    stats: Counter[str] = Counter()
    stats["written"] = write_rows(out, avqa_rows(read_jsonl(src_p), root_p, check_media, stats))
    return dict(stats)


# -------------------------------------------------------------------------------------- Video-R1
# Instruction appended per problem_type (our wording; the answer always goes in <answer> tags).
VIDEO_R1_TYPE_INSTRUCTION: dict[str, str] = {
    "multiple choice": "Answer with the option's letter only, inside <answer> </answer>.",
    "numerical": "Give the numerical value (e.g. 42 or 3.14) inside <answer> </answer>.",
    "regression": "Give the numerical value (e.g. 42 or 3.14) inside <answer> </answer>.",
    "OCR": "Transcribe the text and put it inside <answer> </answer>.",
    "free-form": "Put your answer inside <answer> </answer>.",
}
# problem_type -> reward entry-point name
VIDEO_R1_REWARD: dict[str, str] = {"multiple choice": "mcq"}


def video_r1_rows(
    records: Iterable[dict[str, Any]],
    root: Path,
    data_types: set[str],
    source_prefixes: tuple[str, ...],
    problem_types: set[str] | None,
    check_media: bool,
    stats: Counter[str],
) -> Iterator[DatasetRow]:
    """Video-R1 json (problem_id, problem, data_type, problem_type, options, solution, path,
    data_source) -> rows; filters by data_type, data_source prefix, problem_type, media presence."""
    for n, rec in enumerate(records, start=1):
        where = f"record {n} (problem_id {rec.get('problem_id')!r})"
        missing = [
            k
            for k in ("problem_id", "problem", "data_type", "problem_type", "solution", "path")
            if k not in rec
        ]
        if missing:
            raise DataError(f"Video-R1 {where}: missing field(s) {missing}")
        kind, ptype = rec["data_type"], rec["problem_type"]
        if kind not in data_types:
            stats[f"dropped_data_type_{kind}"] += 1
            continue
        if source_prefixes and not str(rec.get("data_source") or "").startswith(source_prefixes):
            stats["dropped_source"] += 1
            continue
        if problem_types is not None and ptype not in problem_types:
            stats["dropped_problem_type"] += 1
            continue
        if ptype not in VIDEO_R1_TYPE_INSTRUCTION:
            stats[f"dropped_unsupported_problem_type_{ptype}"] += 1
            continue
        m = ANSWER_TAG.search(str(rec["solution"]))
        if m is None or not m.group(1):
            stats["dropped_no_answer_tag"] += 1
            continue
        rel = _relative_media(str(rec["path"]), root)
        if rel is None:
            stats["dropped_outside_root"] += 1
            continue
        if check_media and not _media_ok(rel, root):
            stats["dropped_missing_media"] += 1
            continue
        options = [str(o) for o in rec.get("options") or []]
        question = str(rec["problem"]).strip()
        choices = None
        if ptype == "multiple choice":
            if not options:
                stats["dropped_mcq_without_options"] += 1
                continue
            choices = [OPTION_PREFIX.sub("", o, count=1) for o in options]
            question += "\nOptions:\n" + "\n".join(options)
        prompt = f"<{kind}>\n{question}\n{VIDEO_R1_TYPE_INSTRUCTION[ptype]}"
        stats["kept"] += 1
        yield parse_row(
            {
                "id": f"video-r1-{rec['problem_id']}",
                "prompt": prompt,
                "label": m.group(1),
                "media": [{"type": kind, "path": rel}],
                "choices": choices,
                "reward": VIDEO_R1_REWARD.get(ptype, "answer_tag"),
                "modality": kind,
                "metadata": {
                    "problem_type": ptype,
                    "data_source": rec.get("data_source", ""),
                    "source": "video-r1",
                },
            },
            f"Video-R1 {where}",
        )


def prepare_video_r1(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    data_types: Iterable[str] = ("video", "image"),
    source_prefixes: Iterable[str] = (),
    problem_types: Iterable[str] | None = None,
    check_media: bool = True,
) -> dict[str, int]:
    """Convert Video-R1-260k style json (a list of records; jsonl also accepted)."""
    src_p = Path(src)
    root_p = Path(root) if root is not None else src_p.parent
    text = src_p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        records = list(read_jsonl(src_p))
    stats: Counter[str] = Counter()
    rows = video_r1_rows(
        records,
        root_p,
        set(data_types),
        tuple(source_prefixes),
        set(problem_types) if problem_types else None,
        check_media,
        stats,
    )
    stats["written"] = write_rows(out, rows)
    return dict(stats)


# ------------------------------------------------------------------------------------------- CLI
class _PreparerGroup(click.Group):
    """Built-in preparers plus any registered under ``omni_grpo.preparers``."""

    def _plugins(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group=PREPARERS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and (ep := self._plugins().get(name)) is not None:
            try:
                cmd = ep.load()
            except Exception as err:
                raise click.ClickException(
                    f"preparer {name!r} ({ep.value}) failed to load: {err}"
                ) from err
        return cmd


def _report(stats: dict[str, int], out: str) -> None:
    click.echo(f"wrote {stats.get('written', 0)} rows to {out}")
    for k, v in sorted(stats.items()):
        if k.startswith("dropped"):
            click.echo(f"  {k}: {v}")


@click.group("prepare-data", cls=_PreparerGroup)
def prepare_data() -> None:
    """Convert public datasets into omni-grpo jsonl rows."""


_root_opt = click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    help="Media root (default: the source file's directory).",
)
_nocheck_opt = click.option(
    "--no-check-media", is_flag=True, help="Keep rows whose media file is absent."
)


@prepare_data.command("avqa")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=str))
@click.argument("out", type=click.Path(dir_okay=False, path_type=str))
@_root_opt
@_nocheck_opt
def avqa_command(src: str, out: str, root: str | None, no_check_media: bool) -> None:
    """R1-AQA/AVQA jsonl SRC -> rows OUT (<audio> prompts, letter labels)."""
    try:
        stats = prepare_avqa(src, out, root, check_media=not no_check_media)
    except DataError as err:
        raise click.ClickException(str(err)) from None
    _report(stats, out)


@prepare_data.command("video-r1")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=str))
@click.argument("out", type=click.Path(dir_okay=False, path_type=str))
@_root_opt
@_nocheck_opt
@click.option(
    "--data-type",
    "data_types",
    multiple=True,
    type=click.Choice(["video", "image"]),
    default=("video", "image"),
    show_default=True,
)
@click.option(
    "--source-prefix",
    "source_prefixes",
    multiple=True,
    help="Keep rows whose data_source starts with one of these.",
)
@click.option(
    "--problem-type",
    "problem_types",
    multiple=True,
    type=click.Choice(sorted(VIDEO_R1_TYPE_INSTRUCTION)),
)
def video_r1_command(
    src: str,
    out: str,
    root: str | None,
    no_check_media: bool,
    data_types: tuple[str, ...],
    source_prefixes: tuple[str, ...],
    problem_types: tuple[str, ...],
) -> None:
    """Video-R1 json SRC -> rows OUT (<answer>X</answer> answers)."""
    try:
        stats = prepare_video_r1(
            src,
            out,
            root,
            data_types,
            source_prefixes,
            problem_types or None,
            check_media=not no_check_media,
        )
    except DataError as err:
        raise click.ClickException(str(err)) from None
    _report(stats, out)
