"""Per-package CI matrix: each package installed ALONE into a fresh venv, its own tests run there.

Proves that every package pip-installs and tests on its own (with only its declared dependencies
plus the sibling workspace packages it declares), then runs the cross-package suite in the
workspace environment. Versions are pinned to uv.lock through a constraints file, so the matrix
tests what the lock tests. Stdlib only: it must run before anything is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kw)


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
        ["uv", "export", "--frozen", "--no-hashes", "--all-packages", "--all-extras", "--no-extra", "server", "--no-emit-workspace"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    lines = [ln for ln in exported.splitlines() if ln and not ln.lstrip().startswith(("-e", "#", "."))]
    path = VENVS / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def installed(py: Path) -> set[str]:
    """Normalised names of the distributions installed in the venv of ``py``."""
    out = subprocess.run(
        ["uv", "pip", "freeze", "--python", str(py)], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    names = (ln.split("==")[0].split(" @ ")[0].strip() for ln in out.splitlines() if ln.strip())
    return {n.lower().replace("_", "-") for n in names}


def core_pulls(name: str, py: Path, cons: Path) -> list[str] | None:
    """Install ``name`` without extras; return what of CORE_MUST_NOT_PULL it pulled (None: failed)."""
    deps = local_deps(name)
    core = [f"./packages/{d}" for d in deps]
    if run(["uv", "pip", "install", "-q", "--python", str(py), "-c", str(cons), *core]).returncode:
        return None
    have = installed(py)
    pulled = [dist for dist in CORE_MUST_NOT_PULL[name] if dist in have]
    print(f"core install of {name}: {'pulls ' + ', '.join(pulled) if pulled else 'lean'} "
          f"({len(have)} distributions; checked {', '.join(CORE_MUST_NOT_PULL[name])})", flush=True)
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


def main() -> int:
    shutil.rmtree(VENVS, ignore_errors=True)
    VENVS.mkdir()
    cons = constraints()
    rows: list[tuple[str, int, int, int, float, str]] = []
    for name in PACKAGES:
        t0 = time.time()
        venv = VENVS / name
        py = venv / "bin" / "python"
        run(["uv", "venv", "-q", "--python", "3.11", str(venv)], check=True)
        lean = ""
        if name in CORE_MUST_NOT_PULL:
            pulled = core_pulls(name, py, cons)
            if pulled is None or pulled:
                why = "core install failed" if pulled is None else f"core pulls {', '.join(pulled)}"
                rows.append((name, 0, 1, 0, time.time() - t0, why))
                continue
            lean = "; core lean"
        deps = local_deps(name)
        specs = [f"./packages/{deps[0]}[test]"] + [f"./packages/{d}" for d in deps[1:]]
        inst = run(["uv", "pip", "install", "-q", "--python", str(py), "-c", str(cons), *specs])
        if inst.returncode != 0:
            rows.append((name, 0, 1, 0, time.time() - t0, "install failed"))
            continue
        xml = venv / "junit.xml"
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("VIRTUAL_ENV", None)
        res = run(
            [str(py), "-m", "pytest", f"packages/{name}/tests", "-q", "-p", "no:cacheprovider",
             "--import-mode=importlib", f"--junitxml={xml}", "-o", "addopts=-ra"],
            env=env,
        )
        passed, failed, skipped = junit_counts(xml)
        note = {0: "ok", 1: "tests failed", 5: "NO TESTS COLLECTED"}.get(res.returncode, f"exit {res.returncode}")
        note += lean
        if res.returncode not in (0,):
            failed = max(failed, 1)
        rows.append((name, passed, failed, skipped, time.time() - t0, note))

    t0 = time.time()
    xml = VENVS / "toplevel.xml"
    res = run(["uv", "run", "--frozen", "pytest", "tests", "-q", f"--junitxml={xml}"])
    passed, failed, skipped = junit_counts(xml)
    if res.returncode != 0:
        failed = max(failed, 1)
    rows.append(("tests/ (cross-package)", passed, failed, skipped, time.time() - t0,
                 "ok" if res.returncode == 0 else f"exit {res.returncode}"))

    print("\n| package | passed | failed | skipped | seconds | status |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]:.0f} | {row[5]} |")
    total_p = sum(r[1] for r in rows)
    total_f = sum(r[2] for r in rows)
    total_s = sum(r[3] for r in rows)
    print(f"\n{total_p} passed, {total_f} failed, {total_s} skipped")
    return 1 if total_f else 0


if __name__ == "__main__":
    sys.exit(main())
