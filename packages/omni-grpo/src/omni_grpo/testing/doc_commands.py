"""The shell commands of the docs, as a test runs them: README.md and docs/*.md, in reading order.

Every fenced ``bash`` / ``sh`` / ``shell`` block of a page is a list of commands (a line ending
in ``\\`` continues on the next; full-line comments are prose). A command may end with one
comment that the docs test reads:

* ``# ci: ARGS`` — CI appends ``ARGS`` to the command (small ``--set`` overrides: a 2-step run
  instead of 160; a later option wins over an earlier one in click and argparse alike). The
  docs say so next to the first such block, so a reader can paste them for a quick check;
* ``# needs: REASON`` — the command needs hardware or data CI lacks (a GPU, several nodes, the
  released 63 GB checkpoint); it is listed, never run.

Any other trailing comment is ordinary prose. Fenced ``python`` blocks are run too (as a script
through ``uv run python -``), unless their first line is a ``# needs:`` comment.

A page is run top to bottom in one clone, after the pages before it (``PAGES``), so a page may
use what an earlier one made (the demo run of the front page), exactly as a reader following
them would.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Reading order: the front page, then the pages in the order of its table.
PAGES = (
    "README.md",
    "docs/demo.md",
    "docs/scale.md",
    "docs/one-gpu-lora.md",
    "docs/export.md",
    "docs/datasets.md",
    "docs/server-contract.md",
    "docs/benchmarks.md",
    "docs/run-faults.md",
    "docs/exact-logprobs.md",
)

SHELL_LANGS = frozenset({"bash", "sh", "shell"})
_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
_MARK = re.compile(r"^#\s*(ci|needs):\s*(.*?)\s*$")


def split_comment(line: str) -> tuple[str, str]:
    """``(code, comment)``: a ``#`` that starts a word outside quotes starts the comment."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i:].strip()
    return line.rstrip(), ""


@dataclass(frozen=True)
class DocCommand:
    """One command of a page: where it is, what it says, and how CI treats it."""

    page: str
    line: int  # 1-based line of its first line in the page
    lang: str  # "bash" or "python"
    text: str  # as written, continuation lines joined, trailing comment removed
    ci_args: str = ""  # appended by CI (``# ci: ...``)
    needs: str = ""  # why CI cannot run it (``# needs: ...``); empty: CI runs it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def ci_text(self) -> str:
        """The command CI runs: as written, plus the ``# ci:`` arguments."""
        return f"{self.text} {self.ci_args}".strip()


def _blocks(lines: list[str]) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the block's first line, its lines dedented) of every block."""
    out: list[tuple[str, int, list[str]]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        out.append((lang, i + 2, body))
        i = j + 1
    return out


def _shell_commands(page: str, first: int, body: list[str]) -> list[DocCommand]:
    out: list[DocCommand] = []
    pending: list[str] = []
    start = first
    for offset, raw in enumerate(body):
        line = raw.rstrip()
        if not pending:
            start = first + offset
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.endswith("\\"):
            pending.append(line[:-1].rstrip())
            continue
        text, comment = split_comment(" ".join([*pending, line.strip()]).strip())
        pending = []
        ci_args = needs = ""
        mark = _MARK.match(comment)
        if mark and mark.group(1) == "ci":
            ci_args = mark.group(2)
        elif mark:
            needs = mark.group(2)
        out.append(DocCommand(page, start, "bash", text, ci_args, needs))
    if pending:
        raise ValueError(f"{page}:{start}: a command ends with '\\' and nothing follows")
    return out


def extract(root: Path, page: str) -> list[DocCommand]:
    """The commands of ``page`` (relative to ``root``), in order."""
    lines = (root / page).read_text().splitlines()
    out: list[DocCommand] = []
    for lang, first, body in _blocks(lines):
        if lang in SHELL_LANGS:
            out += _shell_commands(page, first, body)
        elif lang == "python":
            head = next((ln for ln in body if ln.strip()), "")
            mark = _MARK.match(head.strip())
            needs = mark.group(2) if mark and mark.group(1) == "needs" else ""
            out.append(DocCommand(page, first, "python", "\n".join(body), needs=needs))
    return out


def all_commands(root: Path) -> list[DocCommand]:
    """Every command of every page in :data:`PAGES`, in reading order."""
    return [cmd for page in PAGES for cmd in extract(root, page)]


#: what a checkout never holds (build outputs, runs); used when ``src`` is not a git work tree
_NOT_CHECKED_OUT = (".git", ".venv", ".ci-venvs", "runs", "exported", "__pycache__",
                    ".pytest_cache", ".ruff_cache", ".hypothesis", "*.egg-info")  # fmt: skip


def fresh_checkout(src: Path, dst: Path) -> Path:
    """Copy what a clone of ``src`` would hold (tracked files, plus untracked ones git does not
    ignore: the working tree under test) into ``dst``; no ``.venv``, no ``runs/``. Outside a git
    work tree (an unpacked archive), everything but :data:`_NOT_CHECKED_OUT`."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=src,
            check=True,
            capture_output=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*_NOT_CHECKED_OUT))
        return dst
    for rel in filter(None, listed.split("\0")):
        path = src / rel
        if not path.is_file():  # deleted in the working tree
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return dst


def clean_env(path_first: Path | None = None) -> dict[str, str]:
    """The environment of a new shell: none of the test's own virtualenv or pytest settings."""
    drop = ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH", "PYTEST_ADDOPTS", "UV_FROZEN")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}
    venv = os.environ.get("VIRTUAL_ENV")
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if not venv or not p.startswith(venv)]
    if path_first is not None:
        parts.insert(0, str(path_first))
    env["PATH"] = os.pathsep.join(parts)
    return env


#: Lines that a quiet ``omni-grpo`` command may print: our packages' log lines.
_OWN_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \w+ omni_\w+")


def third_party_noise(output: str) -> list[str]:
    """Lines of an ``omni-grpo`` command's output that are third-party warnings or progress bars."""
    noisy = []
    for line in output.splitlines():
        # ours; and uv's own (lower-case "warning: "), about the machine's tooling, e.g. a cache
        # on another filesystem than the checkout ("Failed to hardlink files")
        if _OWN_LOG.match(line) or line.startswith("warning: "):
            continue
        low = line.lower()
        if "warn" in low or "[transformers]" in low or re.search(r"\d+(\.\d+)?(it/s|s/it)\]", line):
            noisy.append(line)
    return noisy
