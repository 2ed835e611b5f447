"""Every command in README.md and docs/ works on a fresh clone (issue 29).

The pages are read in order (``omni_grpo.testing.doc_commands.PAGES``) and every command of
their fenced blocks runs, as written plus the arguments of its ``# ci:`` comment, in one fresh
checkout of this working tree with its own ``uv`` environment: what a new user gets from
``git clone`` and the front page's first line. Later pages use what earlier ones made (the front
page's demo run), as a reader following them would. A command marked ``# needs:`` (a GPU,
several nodes, a dataset CI lacks) is only checked to carry its reason.

A command that stops working fails here, with its page and line; run the whole module (a
command selected alone lacks the runs of the commands before it). Cost: ~8 minutes on 2 quiet
cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omni_grpo.testing.doc_commands import (
    PAGES,
    DocCommand,
    all_commands,
    clean_env,
    extract,
    fresh_checkout,
    split_comment,
    third_party_noise,
)

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = all_commands(ROOT)
RUNNABLE = [c for c in COMMANDS if not c.needs]
TIMEOUT_S = 900
#: run by CI itself: .ci/run is the test suite this test is part of
SUITE = "uv run pytest"


# ------------------------------------------------------------------------------- the pages
def test_every_page_exists_and_has_commands() -> None:
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert docs <= set(PAGES), f"pages not in PAGES (never tested): {sorted(docs - set(PAGES))}"
    for page in PAGES:
        assert (ROOT / page).is_file(), page
    assert {c.page for c in COMMANDS} >= {"README.md", "docs/demo.md", "docs/scale.md"}


def test_every_command_runs_in_ci_or_says_why_not() -> None:
    hardware = re.compile(r"GPU|H200|node|checkpoint|dataset|venv", re.I)
    for cmd in COMMANDS:
        if cmd.needs:
            assert hardware.search(cmd.needs), (
                f"{cmd.where}: '# needs: {cmd.needs}' names no hardware or data"
            )
            assert not cmd.ci_args, f"{cmd.where}: both '# ci:' and '# needs:'"
        if cmd.lang == "bash":
            first = cmd.text.split("&&")[-1].strip()
            words = [w for w in first.split() if "=" not in w or w.startswith("-")]
            # on a fresh clone only `uv run` finds our commands (no activated venv)
            assert words[0] in {"uv", "python3", "/tmp/sgl/bin/python"}, f"{cmd.where}: {cmd.text}"


def test_the_front_page_fits_two_screens() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 110, f"README.md has {len(lines)} lines"


def test_the_parser_reads_marks_and_continuations(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n```bash\n# a comment line\nuv run a --x 1  # ci: --x 2\n"
        "uv run b \\\n  --y 'a # b'  # needs: a GPU\nuv run c  # plain prose\n```\n"
        "```python\nprint(1)\n```\n```yaml\nk: v\n```\n"
    )
    got = extract(tmp_path, "p.md")
    assert [(c.lang, c.text, c.ci_args, c.needs, c.line) for c in got] == [
        ("bash", "uv run a --x 1", "--x 2", "", 4),
        ("bash", "uv run b --y 'a # b'", "", "a GPU", 5),
        ("bash", "uv run c", "", "", 7),
        ("python", "print(1)", "", "", 10),
    ]
    assert got[0].ci_text == "uv run a --x 1 --x 2"
    assert split_comment("echo '#x' # y") == ("echo '#x'", "# y")


# --------------------------------------------------------------------------- the fresh clone
@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A fresh checkout, and a PATH whose ``python3`` is a bare interpreter with pip (the front
    page's "fresh machine"): its first command installs uv there."""
    base = tmp_path_factory.mktemp("docs")
    repo = fresh_checkout(ROOT, base / "omni-grpo")
    bare = base / "python"
    uv = shutil.which("uv")
    if uv:
        subprocess.run([uv, "venv", "-q", "--seed", str(bare)], check=True)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True)
    env = clean_env(path_first=bare / "bin")
    env["UV_NO_PROGRESS"] = "1"
    return {"repo": repo, "env": env}


def _run(cmd: DocCommand, repo: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """Run ``cmd``; ``(part, output)`` of each part of an ``a && b`` chain, run one after the
    other as the shell would (so that pip's output is not read as the training run's)."""
    if cmd.lang == "python":
        steps = [("python", ["uv", "run", "python", "-"], cmd.text)]
    else:
        parts = [p.strip() for p in cmd.ci_text.split(" && ")]
        steps = [(p, ["bash", "-eo", "pipefail", "-c", p], None) for p in parts]
    outputs = []
    for part, argv, stdin in steps:
        t0 = time.monotonic()
        res = subprocess.run(
            argv, cwd=repo, env=env, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        out = res.stdout + res.stderr
        assert res.returncode == 0, (
            f"{cmd.where}: exit {res.returncode} after {time.monotonic() - t0:.0f}s\n"
            f"$ {part}\n{out[-4000:]}"
        )
        outputs.append((part, out))
    return outputs


def _ci_covers_the_suite() -> None:
    """``uv run pytest`` is this suite: .ci/run runs it (per package, then tests/), not this test."""
    ci = (ROOT / ".ci" / "run").read_text() + (ROOT / ".ci" / "matrix.py").read_text()
    assert "matrix.py" in ci and '"pytest", "tests"' in ci and '-m", "pytest"' in ci


@pytest.mark.slow
@pytest.mark.parametrize("cmd", RUNNABLE, ids=[f"{c.where}" for c in RUNNABLE])
def test_documented_command(cmd: DocCommand, clone: dict[str, object]) -> None:
    repo, env = Path(clone["repo"]), dict(clone["env"])  # type: ignore[arg-type]
    if cmd.text == SUITE:
        _ci_covers_the_suite()
        return
    t0 = time.monotonic()
    for part, out in _run(cmd, repo, env):
        if re.search(r"\bomni-grpo (train|eval|export)\b", part):
            noise = third_party_noise(out)
            assert not noise, f"{cmd.where}: third-party noise in the output:\n" + "\n".join(noise)
            assert "/../" not in out, f"{cmd.where}: a path printed unnormalised:\n{out[-2000:]}"
    print(f"{cmd.where}: {time.monotonic() - t0:.1f}s", file=sys.stderr)


def test_benchmark_imports_resolve() -> None:
    """Every ``from omni_grpo... import name`` in benchmarks/ names something that exists (a
    renamed function broke data_sources.py without any test noticing)."""
    import ast
    import importlib

    missing = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("omni_"):
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(mod, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{script.name}: {node.module}.{alias.name}")
    assert not missing, missing


if os.environ.get("OMNI_GRPO_DOCS_LIST"):  # pragma: no cover - a listing for humans
    for _c in COMMANDS:
        print(_c.where, "| needs:" if _c.needs else "|", _c.needs or _c.ci_text)
