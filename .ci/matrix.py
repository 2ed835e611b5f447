"""Per-package CI matrix: each package installed ALONE into a fresh venv, its own tests run there.

Proves that every package pip-installs and tests on its own (with only its declared dependencies
plus the sibling workspace packages it declares), then runs the cross-package suite in the
workspace environment. Versions are pinned to uv.lock through a constraints file, so the matrix
tests what the lock tests. Stdlib only: it must run before anything is installed.

Two lanes run at once: the packages one after the other in one, the cross-package suite in the
other. Neither fills the CI machine's two cores on its own (single-threaded interpreter tests,
subprocess and Ray start-ups, servers waited on), and they share nothing but the read-only
checkout and uv's cache. Each stage's output goes to its own log, printed whole when it ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".ci-venvs"
PACKAGES = ["omni-extract", "omni-rope", "omni-audio-inject", "omni-rollout-client", "omni-grpo"]
# What a package's core install (no extras) must not pull in: test servers and plotting stacks
# belong to extras (`test`, `viz`), so `pip install omni-grpo` stays lean. Checked on the real
# install: the core goes in first, is listed, and only then the test extra is added on top.
CORE_MUST_NOT_PULL = {
    "omni-grpo": ["starlette", "uvicorn", "matplotlib", "tensorboard"],
}


_PRINT = threading.Lock()


def run(cmd: list[str], log=None, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the root; with ``log`` (an open file), its output goes there."""
    if log is None:
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=ROOT, **kw)
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, **kw)


def show(log: Path) -> None:
    """Print a finished stage's log in one piece (the lanes' outputs never interleave)."""
    with _PRINT:
        sys.stdout.write(log.read_text())
        sys.stdout.flush()


def bytecode_cache() -> None:
    """Let every Python process of the run (tests' subprocesses, Ray workers, the docs' commands)
    reuse the bytecode of what an earlier one imported, kept under .ci-venvs/pycache: nothing is
    written into the checkout, as with PYTHONDONTWRITEBYTECODE, but torch and transformers are
    compiled once per environment instead of at every interpreter start (~3 s of CPU each)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(VENVS / "pycache")


def local_deps(name: str, seen: set[str] | None = None) -> list[str]:
    """Workspace packages ``name`` needs (runtime + test extra), transitively, itself first."""
    seen = seen if seen is not None else set()
    if name in seen:
        return []
    seen.add(name)
    meta = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
    reqs = list(meta.get("dependencies", []))
    for extra in ("test", "testing"):
        reqs += meta.get("optional-dependencies", {}).get(extra, [])
    out = [name]
    for req in reqs:
        dep = req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        if dep in PACKAGES:
            out += local_deps(dep, seen)
    return out


def constraints() -> Path:
    exported = subprocess.run(
        [
            "uv",
            "export",
            "--frozen",
            "--no-hashes",
            "--all-packages",
            "--all-extras",
            "--no-extra",
            "server",
            "--no-emit-workspace",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = [
        ln for ln in exported.splitlines() if ln and not ln.lstrip().startswith(("-e", "#", "."))
    ]
    path = VENVS / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def installed(py: Path) -> set[str]:
    """Normalised names of the distributions installed in the venv of ``py``."""
    out = subprocess.run(
        ["uv", "pip", "freeze", "--python", str(py)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names = (ln.split("==")[0].split(" @ ")[0].strip() for ln in out.splitlines() if ln.strip())
    return {n.lower().replace("_", "-") for n in names}


def core_pulls(name: str, py: Path, cons: Path, log) -> list[str] | None:
    """Install ``name`` without extras; return what of CORE_MUST_NOT_PULL it pulled (None: failed)."""
    deps = local_deps(name)
    core = [f"./packages/{d}" for d in deps]
    if run(
        ["uv", "pip", "install", "-q", "--python", str(py), "-c", str(cons), *core], log
    ).returncode:
        return None
    have = installed(py)
    pulled = [dist for dist in CORE_MUST_NOT_PULL[name] if dist in have]
    log.write(
        f"core install of {name}: {'pulls ' + ', '.join(pulled) if pulled else 'lean'} "
        f"({len(have)} distributions; checked {', '.join(CORE_MUST_NOT_PULL[name])})\n"
    )
    log.flush()
    return pulled


def junit_counts(xml: Path) -> tuple[int, int, int]:
    if not xml.exists():
        return 0, 0, 0
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return tests - failed - skipped, failed, skipped


Row = tuple[str, int, int, int, float, str]


def package_stage(name: str, cons: Path) -> Row:
    """``name`` alone in a fresh venv (core install checked lean first where required), its tests."""
    t0 = time.time()
    venv = VENVS / name
    py = venv / "bin" / "python"
    logfile = VENVS / f"{name}.log"
    try:
        with logfile.open("w") as log:
            run(["uv", "venv", "-q", "--python", "3.11", str(venv)], log, check=True)
            lean = ""
            if name in CORE_MUST_NOT_PULL:
                pulled = core_pulls(name, py, cons, log)
                if pulled is None or pulled:
                    why = (
                        "core install failed"
                        if pulled is None
                        else f"core pulls {', '.join(pulled)}"
                    )
                    return (name, 0, 1, 0, time.time() - t0, why)
                lean = "; core lean"
            deps = local_deps(name)
            specs = [f"./packages/{deps[0]}[test]"] + [f"./packages/{d}" for d in deps[1:]]
            inst = run(
                ["uv", "pip", "install", "-q", "--python", str(py), "-c", str(cons), *specs], log
            )
            if inst.returncode != 0:
                return (name, 0, 1, 0, time.time() - t0, "install failed")
            xml = venv / "junit.xml"
            env = dict(os.environ)
            env.pop("VIRTUAL_ENV", None)
            pytest = [str(py), "-m", "pytest", f"packages/{name}/tests", "-q"]
            opts = ["-p", "no:cacheprovider", "--import-mode=importlib", f"--junitxml={xml}"]
            res = run([*pytest, *opts, "-o", "addopts=-ra"], log, env=env)
        passed, failed, skipped = junit_counts(xml)
        note = {0: "ok", 1: "tests failed", 5: "NO TESTS COLLECTED"}.get(
            res.returncode, f"exit {res.returncode}"
        )
        note += lean
        if res.returncode not in (0,):
            failed = max(failed, 1)
        return (name, passed, failed, skipped, time.time() - t0, note)
    finally:
        show(logfile)


def toplevel_stage() -> Row:
    """The cross-package suite in the workspace environment (`uv run pytest tests`)."""
    t0 = time.time()
    xml = VENVS / "toplevel.xml"
    logfile = VENVS / "toplevel.log"
    try:
        with logfile.open("w") as log:
            res = run(["uv", "run", "--frozen", "pytest", "tests", "-q", f"--junitxml={xml}"], log)
    finally:
        show(logfile)
    passed, failed, skipped = junit_counts(xml)
    if res.returncode != 0:
        failed = max(failed, 1)
    return (
        "tests/ (cross-package)",
        passed,
        failed,
        skipped,
        time.time() - t0,
        "ok" if res.returncode == 0 else f"exit {res.returncode}",
    )


def main() -> int:
    shutil.rmtree(VENVS, ignore_errors=True)
    VENVS.mkdir()
    bytecode_cache()
    cons = constraints()
    wall = time.time()
    toplevel: list[Row] = []

    def toplevel_lane() -> None:
        try:
            toplevel.append(toplevel_stage())
        except Exception as exc:  # a crash of the lane is a failed row, never a silent pass
            toplevel.append(("tests/ (cross-package)", 0, 1, 0, time.time() - wall, repr(exc)))

    lane = threading.Thread(target=toplevel_lane, name="tests/")
    lane.start()
    rows: list[Row] = [package_stage(name, cons) for name in PACKAGES]
    lane.join()
    rows += toplevel

    print("\n| package | passed | failed | skipped | seconds | status |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]:.0f} | {row[5]} |")
    total_p = sum(r[1] for r in rows)
    total_f = sum(r[2] for r in rows)
    total_s = sum(r[3] for r in rows)
    print(
        f"\n{total_p} passed, {total_f} failed, {total_s} skipped "
        f"(matrix wall {time.time() - wall:.0f}s, the two lanes concurrent)"
    )
    return 1 if total_f else 0


if __name__ == "__main__":
    sys.exit(main())
