"""``omni-grpo prepare-data``: convert public datasets into our rows (jsonl, or parquet).

Each preparer is a plain function (source file -> validated rows, written atomically) plus a click
subcommand. Sources are read as the datasets ship them: jsonl, a json list, or parquet (the hub's
format). Records that cannot be converted are dropped and COUNTED by reason (``dropped_<reason>``:
a missing or null field, a bad answer index, unparseable choices, a media path outside the root,
a duplicate id — the first record with an id wins); the summary is printed and returned with the
first example of each reason, so nothing disappears silently. Only a source with no usable record
is an error, and then nothing is written. The output is parquet when its name ends in
``.parquet`` (our row fields as columns; ``media`` paths stay relative to the root), else jsonl.
More preparers can be added by other packages through the ``omni_grpo.preparers`` entry-point
group (a click command each).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import click

from omni_grpo.cli import EntryPointGroup
from omni_grpo.data.schema import DataError, DatasetRow, parse_row, write_rows
from omni_grpo.output_guard import refuse_output_over_input

log = logging.getLogger(__name__)

PREPARERS_GROUP = "omni_grpo.preparers"
LETTERS = string.ascii_uppercase
ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
OPTION_PREFIX = re.compile(r"^\s*\(?([A-Z])[\.\):]\s*")
# A reader's marker for records it could not read at all: ``{"__problem__": (reason, message),
# ROWS_MARKER: how many}`` (an unreadable parquet row group), counted as that many drops.
ROWS_MARKER = "__rows__"


def _options_block(options: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))


def _relative_media(path: str, root: Path, where: str) -> str:
    """``path`` as stored in a row (relative to root); DataError(``outside_root``) when it resolves
    outside the root (``..``, an absolute path elsewhere, a symlink out), whether or not the
    file exists: such a row could never load."""
    base = root.resolve()
    try:
        target = (base / path).resolve()
    except (ValueError, OSError) as err:  # a NUL byte, a symlink loop: no file could be read
        raise DataError(
            f"{where}: media path {path!r} is not a usable path ({err})", "bad_path"
        ) from None
    if not target.is_relative_to(base):
        raise DataError(f"{where}: media path {path!r} is outside the root {base}", "outside_root")
    return target.relative_to(base).as_posix()


def _media_ok(rel: str, root: Path) -> bool:
    return (root / rel).is_file()


def _required(rec: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """A missing key, or a null / empty-string value, is a missing field."""
    missing = [k for k in keys if rec.get(k) is None or rec.get(k) == ""]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing}", "missing_field")


def _texts(rec: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Fields that must be non-blank strings: a list, a number or spaces would be written into
    the prompt as their ``str()`` (``['a']``) or used as a dict key (a crash)."""
    bad = [k for k in keys if not isinstance(rec.get(k), str) or not rec[k].strip()]
    if bad:
        shown = {k: rec.get(k) for k in bad}
        raise DataError(f"{where}: expected non-blank text for {shown}", "bad_field")


def _scalar_id(value: Any, where: str) -> str:
    """A source id as text: a string or a number (``1`` -> ``"1"``); a list, mapping or boolean
    would make an id like ``avqa-{'a': 1}`` that no one can look up."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{where}: id {value!r} is not a string or a number", "bad_id")
    return str(value)


def _choice_list(value: Any, where: str) -> list[str]:
    """A list of option strings; a string is parsed as a JSON or Python list literal (some dumps
    store ``"['a', 'b']"``), never split into characters."""
    original = value
    if isinstance(value, str):
        parsed: Any = None
        for parse in (json.loads, ast.literal_eval):
            try:
                parsed = parse(value)
                break
            except (ValueError, SyntaxError):
                continue
        value = parsed
    if not isinstance(value, list | tuple) or not value:
        raise DataError(f"{where}: choices are not a non-empty list: {original!r}", "bad_choices")
    blank = [c for c in value if not isinstance(c, str | int | float) or not str(c).strip()]
    if blank:  # a None or "" option would be shown as "A. None" / "A. "
        raise DataError(f"{where}: choices hold blank options {blank!r}", "bad_choices")
    return [str(c) for c in value]


def convert(
    records: Iterable[dict[str, Any]],
    to_row: Callable[[int, dict[str, Any]], DatasetRow | None],
    stats: Counter[str],
    problems: dict[str, str],
) -> Iterator[DatasetRow]:
    """Rows of ``to_row`` (None: filtered, counted by it); a DataError drops the record, counted
    by its reason with the first message kept; later records with a seen id are dropped."""
    seen: set[str] = set()
    n = 0
    for rec in records:
        n += 1
        if isinstance(rec, dict) and ROWS_MARKER in rec:  # a reader's skip of many records
            rows = int(rec[ROWS_MARKER])
            reason, message = rec["__problem__"]
            stats[f"dropped_{reason}"] += rows
            problems.setdefault(reason, message)
            log.warning("dropping %d records: %s", rows, message)
            n += rows - 1
            continue
        try:
            if not isinstance(rec, dict):
                raise DataError(f"record {n}: not an object: {type(rec).__name__}", "not_object")
            row = to_row(n, rec)
        except DataError as err:
            stats[f"dropped_{err.reason}"] += 1
            if err.reason not in problems:
                problems[err.reason] = str(err)
                log.warning("dropping %s", err)
            continue
        if row is None:
            continue
        if row.id in seen:
            stats["dropped_duplicate_id"] += 1
            problems.setdefault("duplicate_id", f"record {n}: duplicate id {row.id!r}")
            continue
        seen.add(row.id)
        stats["kept"] += 1
        yield row


def write_prepared(
    out: str | os.PathLike[str],
    rows: Iterable[DatasetRow],
    src: Path,
    stats: Counter[str],
    problems: dict[str, str],
) -> dict[str, int]:
    """Write the rows (jsonl, or parquet by suffix) unless there is none: then a one-line error
    naming the source, with the first problem, and nothing written."""
    kept = list(rows)
    if not kept:
        dropped = {k: v for k, v in sorted(stats.items()) if k.startswith("dropped")}
        first = next(iter(problems.values()), "no records")
        raise DataError(f"{src}: no usable record ({dropped}; first: {first})")
    stats["written"] = write_rows(out, kept)
    return dict(stats)


# ------------------------------------------------------------------------------------------- AVQA
AVQA_INSTRUCTION = "Answer with the option's letter, inside <answer> </answer>."


def avqa_rows(
    records: Iterable[dict[str, Any]],
    root: Path,
    check_media: bool,
    stats: Counter[str],
    problems: dict[str, str] | None = None,
) -> Iterator[DatasetRow]:
    """R1-AQA jsonl (AVQA: id, question_text, multi_choice, answer = 0-based index, audio_path) -> rows.

    The question is reworded from "video" to "audio" as R1-AQA does (the model only hears the clip).
    """

    def to_row(n: int, rec: dict[str, Any]) -> DatasetRow | None:
        where = f"AVQA record {n} (id {rec.get('id')!r})"
        _required(rec, ("id", "question_text", "multi_choice", "answer", "audio_path"), where)
        _texts(rec, ("question_text", "audio_path"), where)
        choices = _choice_list(rec["multi_choice"], where)
        answer = rec["answer"]
        if (
            not isinstance(answer, int)
            or isinstance(answer, bool)
            or not 0 <= answer < len(choices)
            or len(choices) > len(LETTERS)
        ):
            raise DataError(
                f"{where}: answer {answer!r} is not an index into {len(choices)} choices",
                "bad_answer",
            )
        rel = _relative_media(str(rec["audio_path"]), root, where)
        if check_media and not _media_ok(rel, root):
            stats["dropped_missing_media"] += 1
            return None
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
        return parse_row(
            {
                "id": f"avqa-{_scalar_id(rec['id'], where)}",
                "prompt": prompt,
                "label": LETTERS[answer],
                "media": [{"type": "audio", "path": rel}],
                "choices": choices,
                "reward": "mcq",
                "modality": "audio",
                "metadata": meta,
            },
            where,
        )

    return convert(records, _problem_marker(to_row), stats, {} if problems is None else problems)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a jsonl file; a line that is not JSON (or not UTF-8) is yielded as a marker the
    converter drops and counts, naming the line."""
    from omni_grpo.data.sources import jsonl_records

    for rec in jsonl_records(path):
        if rec.problem is not None:
            yield {"__problem__": rec.problem}
        else:
            yield rec.obj  # type: ignore[misc]


def read_parquet(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a parquet file, one row group at a time (the hub ships datasets as parquet).

    A row group that cannot be read (a corrupt page or page header) is a marker for its rows:
    the converter counts them as dropped and names the file and row group once."""
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(str(path))
    except Exception as err:
        raise DataError(f"{path}: not a readable parquet file: {err}") from None
    first = 0
    for rg in range(f.metadata.num_row_groups):
        rows = f.metadata.row_group(rg).num_rows
        try:
            records = f.read_row_group(rg).to_pylist()
        except Exception as err:  # the group's rows are lost, not the conversion
            why = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
            message = (
                f"{path}: row group {rg} (records {first + 1}-{first + rows}) is unreadable "
                f"({why or type(err).__name__})"
            )
            yield {"__problem__": ("unreadable_row_group", message), ROWS_MARKER: rows}
        else:
            yield from records
        first += rows


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """A source as shipped: parquet (by suffix or magic), a json list / object, or jsonl."""
    with path.open("rb") as fh:
        head = fh.read(4)
    if path.suffix.lower() == ".parquet" or head == b"PAR1":
        yield from read_parquet(path)
        return
    text = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    if text.lstrip()[:1] == b"[":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if isinstance(data, list):
            yield from data
            return
    yield from read_jsonl(path)


def _problem_marker(to_row: Callable[[int, dict[str, Any]], DatasetRow | None]):  # type: ignore[no-untyped-def]
    """Wrap a record converter so the reader's bad-line markers become counted drops."""

    def wrapped(n: int, rec: dict[str, Any]) -> DatasetRow | None:
        if "__problem__" in rec:
            reason, message = rec["__problem__"]
            raise DataError(message, reason)
        return to_row(n, rec)

    return wrapped


def prepare_avqa(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    check_media: bool = True,
    problems: dict[str, str] | None = None,
) -> dict[str, int]:
    """Convert an R1-AQA/AVQA jsonl (or parquet); ``root`` (default: the source's directory) is
    the media root. ``problems`` receives the first message of each drop reason."""
    src_p = Path(src)
    refuse_output_over_input(out, [src_p], output_name="OUT", input_name="SRC")
    root_p = Path(root) if root is not None else src_p.parent
    stats: Counter[str] = Counter()
    problems = {} if problems is None else problems
    rows = avqa_rows(read_records(src_p), root_p, check_media, stats, problems)
    return write_prepared(out, rows, src_p, stats, problems)


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
    problems: dict[str, str] | None = None,
) -> Iterator[DatasetRow]:
    """Video-R1 json (problem_id, problem, data_type, problem_type, options, solution, path,
    data_source) -> rows; filters by data_type, data_source prefix, problem_type, media presence."""

    def to_row(n: int, rec: dict[str, Any]) -> DatasetRow | None:
        where = f"Video-R1 record {n} (problem_id {rec.get('problem_id')!r})"
        _required(
            rec, ("problem_id", "problem", "data_type", "problem_type", "solution", "path"), where
        )
        _texts(rec, ("problem", "data_type", "problem_type", "solution", "path"), where)
        kind, ptype = rec["data_type"], rec["problem_type"]
        if kind not in data_types:
            stats[f"dropped_data_type_{kind}"] += 1
            return None
        if source_prefixes and not str(rec.get("data_source") or "").startswith(source_prefixes):
            stats["dropped_source"] += 1
            return None
        if problem_types is not None and ptype not in problem_types:
            stats["dropped_problem_type"] += 1
            return None
        if ptype not in VIDEO_R1_TYPE_INSTRUCTION:
            stats[f"dropped_unsupported_problem_type_{ptype}"] += 1
            return None
        m = ANSWER_TAG.search(str(rec["solution"]))
        if m is None or not m.group(1):
            stats["dropped_no_answer_tag"] += 1
            return None
        rel = _relative_media(str(rec["path"]), root, where)
        if check_media and not _media_ok(rel, root):
            stats["dropped_missing_media"] += 1
            return None
        question = str(rec["problem"]).strip()
        choices = None
        if ptype == "multiple choice":
            if not rec.get("options"):
                stats["dropped_mcq_without_options"] += 1
                return None
            options = _choice_list(rec["options"], where)
            choices = [OPTION_PREFIX.sub("", o, count=1) for o in options]
            question += "\nOptions:\n" + "\n".join(options)
        prompt = f"<{kind}>\n{question}\n{VIDEO_R1_TYPE_INSTRUCTION[ptype]}"
        return parse_row(
            {
                "id": f"video-r1-{_scalar_id(rec['problem_id'], where)}",
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
            where,
        )

    return convert(records, _problem_marker(to_row), stats, {} if problems is None else problems)


def prepare_video_r1(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    data_types: Iterable[str] = ("video", "image"),
    source_prefixes: Iterable[str] = (),
    problem_types: Iterable[str] | None = None,
    check_media: bool = True,
    problems: dict[str, str] | None = None,
) -> dict[str, int]:
    """Convert Video-R1-260k style json (a list of records; jsonl and parquet also accepted)."""
    src_p = Path(src)
    refuse_output_over_input(out, [src_p], output_name="OUT", input_name="SRC")
    root_p = Path(root) if root is not None else src_p.parent
    stats: Counter[str] = Counter()
    problems = {} if problems is None else problems
    rows = video_r1_rows(
        read_records(src_p),
        root_p,
        set(data_types),
        tuple(source_prefixes),
        set(problem_types) if problem_types else None,
        check_media,
        stats,
        problems,
    )
    return write_prepared(out, rows, src_p, stats, problems)


# ------------------------------------------------------------------------------------------- CLI
class PreparerGroup(EntryPointGroup):
    """Built-in preparers plus any registered under ``omni_grpo.preparers``."""

    entry_point_group = PREPARERS_GROUP
    kind = "preparer"


def _report(stats: dict[str, int], out: str, problems: dict[str, str]) -> None:
    click.echo(f"wrote {stats.get('written', 0)} rows to {out}")
    for k, v in sorted(stats.items()):
        if k.startswith("dropped"):
            first = problems.get(k.removeprefix("dropped_"))
            click.echo(f"  {k}: {v}" + (f" (first: {first})" if first else ""))


@click.group("prepare-data", cls=PreparerGroup)
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
    """R1-AQA/AVQA jsonl or parquet SRC -> rows OUT (<audio> prompts, letter labels); OUT is
    parquet when it ends in .parquet, else jsonl."""
    problems: dict[str, str] = {}
    try:
        stats = prepare_avqa(src, out, root, check_media=not no_check_media, problems=problems)
    except DataError as err:
        raise click.ClickException(str(err)) from None
    _report(stats, out, problems)


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
    """Video-R1 json, jsonl or parquet SRC -> rows OUT (<answer>X</answer> answers); OUT is
    parquet when it ends in .parquet, else jsonl."""
    problems: dict[str, str] = {}
    try:
        stats = prepare_video_r1(
            src,
            out,
            root,
            data_types,
            source_prefixes,
            problem_types or None,
            check_media=not no_check_media,
            problems=problems,
        )
    except DataError as err:
        raise click.ClickException(str(err)) from None
    _report(stats, out, problems)


@prepare_data.command("parquet")
@click.argument("src", nargs=-1, required=True)
@click.argument("out", type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    help="Media root of SRC's files (default: the first source's directory).",
)
def parquet_command(src: tuple[str, ...], out: str, root: str | None) -> None:
    """Our rows SRC (jsonl / parquet / glob / datasets dir) -> one parquet OUT with the media
    files EMBEDDED as {bytes, path} in images/audios/videos (loads in `datasets` too).

    Bad rows are skipped and counted as when training; a missing or escaping media file is an
    error (the table would silently lose it)."""
    from omni_grpo.config import default_media_root
    from omni_grpo.data.media import MediaError
    from omni_grpo.data.sources import load_rows
    from omni_grpo.data.tables import write_embedded_parquet

    spec = list(src)
    from omni_grpo.data.spec import expand_spec

    refuse_output_over_input(out, expand_spec(spec), output_name="OUT", input_name="SRC")
    try:
        loaded = load_rows(spec)
        n = write_embedded_parquet(loaded.samples, root or default_media_root(spec), out)
    except (DataError, MediaError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"wrote {n} rows to {out}")
    for k, v in sorted(loaded.counters().items()):
        click.echo(f"  {k}: {v}")
