"""What every benchmark does the same way: options, limits, clocks, children, versions, the record.

A benchmark is ``uv run python benchmarks/NAME.py`` from the repository root; it reads top to
bottom as its measurement and prints ONE JSON object on stdout (progress goes to stderr). Python
puts the script's folder on ``sys.path``, so ``import harness`` works from any working directory.

    ap = harness.parser(__doc__, steps=2, work=Path)  # --steps 2, --work PATH, --save MACHINE
    harness.add_options(ap, device="cuda", fast=False)  # more: --device cuda, --fast (a flag)
    limits = harness.device_limits(device)  # copy_bytes_per_s, matmul_flops_per_s: measured here
    with harness.timed(device) as gen:      # gen.s: wall seconds, CUDA synchronised at both ends
        ...
    harness.emit(NAME, record, args.save)   # print (+ "benchmark", "versions"); --save MACHINE
                                            # also writes benchmarks/results/NAME_MACHINE.json

Clocks: ``seconds(fn, repeats, device)`` (wall, after a warm-up call), ``gpu_seconds(fn, repeats)``
(CUDA events), ``now(device)``. Memory: ``peak_bytes(device, reset)`` (CUDA's peak, else this
process's peak RSS), ``status_kb("VmHWM")`` (a child's own peak RSS), ``nbytes(tensors)``,
``state_tensors(optimizer)``. Processes: ``child_json(argv)`` (a side in its own process: its
last JSON line), ``rerun("ours")`` (this script's own command + ``--side ours``: the child's
``args.side``, which ends with ``reply(record)``), ``progress(record)`` (a JSON line on stderr),
``torch_threads(default)``, ``cuda_device("NAME.py")`` (a GPU-only script's device, or its
one-line exit). Records: ``train_metrics(run_dir)``, ``means(rows, keys)``,
``profile_table(fn, dst)`` (the ops' table; on a GPU the idle timeline: ``gpu_timeline``),
``sync_sites(fn)`` (each line that made the host wait for the GPU, counted),
``versions("peft")`` (python, git, GPU, packages).

The baseline a figure is compared with is measured in the same run, never hard-coded: a ratio to
a number from another day measures the other day's load.
"""

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def parser(doc: str | None, **options: Any) -> argparse.ArgumentParser:
    """The script's docstring's first paragraph, ``--save MACHINE``, a child's hidden ``--side``
    (:func:`rerun`) and :func:`add_options`."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    save = "also write benchmarks/results/NAME_MACHINE.json"
    ap.add_argument("--save", metavar="MACHINE", type=machine_name, help=save)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    return add_options(ap, **options)


def add_options(ap: argparse.ArgumentParser, **options: Any) -> argparse.ArgumentParser:
    """``name=default`` as ``--name`` of the default's type (False: a flag; a list: one or more
    values; a tuple: one of its items, default the first; a type such as ``Path``: that type,
    default None). With help: add_argument."""
    for name, default in options.items():
        flag = "--" + name.replace("_", "-")
        if default is False:
            ap.add_argument(flag, action="store_true")
        elif isinstance(default, tuple):
            ap.add_argument(flag, choices=default, default=default[0])
        elif isinstance(default, type):
            ap.add_argument(flag, type=default)
        elif isinstance(default, list):
            ap.add_argument(flag, type=type(default[0]), nargs="+", default=default)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    return ap


def machine_name(text: str) -> str:
    """``--save``'s value (``h200``), a path refused at parse time, not after a long run."""
    if not text or "/" in text or text.endswith(".json"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a path; --save takes a machine name (h200): the result goes to "
            "benchmarks/results/NAME_MACHINE.json (redirect stdout for a file elsewhere)"
        )
    return text


def emit(name: str, record: dict[str, Any], save: str | None = None) -> None:
    """Print ``record`` as ONE JSON line, ``benchmark`` and ``versions`` added; ``save``: a file."""
    out = {"benchmark": name, **record, "versions": versions() | (record.get("versions") or {})}
    print(json.dumps(out), flush=True)  # first: a failed save does not lose the result
    if save:  # what ran, then where (h200)
        path = REPO / "benchmarks" / "results" / f"{name}_{save}.json"
        path.write_text(json.dumps(out, indent=2) + "\n")


# ------------------------------------------------------------------------------------ clocks
def now(device: Any = None) -> float:
    """``time.perf_counter()`` once the queued CUDA work is done (a GPU phase ends with it)."""
    if str(device).startswith("cuda"):  # then torch is imported
        sys.modules["torch"].cuda.synchronize()
    return time.perf_counter()


Timing = types.SimpleNamespace  # ``t.s``: a timed block's seconds, set when it ends


@contextlib.contextmanager
def timed(device: Any = None) -> Iterator[Timing]:
    """``with timed(device) as t:`` — afterwards ``t.s`` is the block's wall seconds."""
    t, start = Timing(s=float("nan")), now(device)
    yield t
    t.s = now(device) - start


def seconds(fn: Callable, repeats: int, device: Any = None, warmup: int = 1) -> list[float]:
    """Wall seconds of ``repeats`` calls after ``warmup`` untimed ones: report min and median."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        with timed(device) as t:
            fn()
        out.append(t.s)
    return out


def gpu_seconds(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> list[float]:
    """GPU seconds of each call between CUDA events, no host sync: the kernels' own time."""
    cuda = sys.modules["torch"].cuda  # imported by the caller that has a GPU
    for _ in range(warmup):
        fn()
    events = [[cuda.Event(enable_timing=True) for _ in "ab"] for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def cuda_device(script: str) -> Any:
    """``torch.device("cuda")``, or a one-line exit naming the GPU-only ``script``."""
    torch = sys.modules["torch"]  # the caller's
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA device")
    return torch.device("cuda")


def device_limits(device: Any, matmul: int = 8192, copy_gib: float = 4.0) -> dict[str, Any]:
    """What a roofline divides by, measured (a datasheet is not what this card and driver give):
    copy bandwidth (bytes read + written per second) and matmul FLOP/s of ``matmul``^3, medians.
    CUDA: bf16, GPU events. CPU: fp32 (bf16 is emulated there), 2048^3 and 256 MiB, wall time."""
    torch, cuda = sys.modules["torch"], str(device).startswith("cuda")  # torch: the caller's
    dtype = torch.bfloat16 if cuda else torch.float32
    n, nbytes = (matmul, int(copy_gib * GIB)) if cuda else (min(matmul, 2048), 256 << 20)
    src = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in "ab")

    def rate(fn: Callable[[], Any]) -> float:
        return 1 / statistics.median(gpu_seconds(fn) if cuda else seconds(fn, 5))

    out = {"copy_bytes_per_s": 2 * src.numel() * src.element_size() * rate(lambda: dst.copy_(src))}
    out["matmul_flops_per_s"] = 2 * n**3 * rate(lambda: a @ b)
    return out | {"matmul_dtype": str(dtype).removeprefix("torch."), "matmul_n": n}


def profile_table(fn: Callable[[], Any], dst: Path, labels: list[str] | None = None) -> Any:
    """``fn()`` under torch.profiler: its ops by CUDA, then self CPU time (no GPU: CPU), to dst.
    On a GPU the file ends with the timeline (:func:`gpu_timeline`): how long the GPU sat idle
    and which host ops ran through the longest idle gaps — the kernel table alone cannot show a
    step that waits on its host (a profile of the exact update found 12 % of it idle that way);
    with ``labels`` (filled by :func:`phase_marks` during ``fn``), then the kernels by phase
    (:func:`phase_split`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * cuda]) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    table, width = prof.key_averages(), {"max_name_column_width": 70}
    text = table.table(sort_by=f"{'cuda' if cuda else 'cpu'}_time_total", row_limit=45, **width)
    if cuda:
        text += "\n\n" + table.table(sort_by="self_cpu_time_total", row_limit=25, **width)
        events = [
            (e.device_type.name, e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
        ]
        named = [(n, a, b) for kind, n, a, b in events if kind == "CUDA"]
        host = [(n, a, b) for kind, n, a, b in events if kind == "CPU"]
        kernels = [(a, b) for _, a, b in named]
        text += "\n\n" + json.dumps(gpu_timeline(kernels, host), indent=1)
        if labels is not None:
            text += "\n\n" + json.dumps(phase_split(named, labels), indent=1)
    dst.write_text(text)
    return out


def gpu_timeline(
    kernels: list[tuple[float, float]], host: list[tuple[str, float, float]], top: int = 10
) -> dict[str, Any]:
    """From kernel intervals and host op intervals (microseconds): the span from the first kernel
    to the last, the time some kernel ran (their union), the idle rest, the gaps of 1 ms or more,
    and for the ``top`` longest gaps the host ops (under 5 s) that spanned them, longest first."""
    if not kernels:
        return {"kernels": 0}
    busy, gaps = 0.0, []
    start, end = sorted(kernels)[0]
    for a, b in sorted(kernels):
        if a > end:
            busy += end - start
            gaps.append((a - end, end, a))
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    span = max(b for _, b in kernels) - min(a for a, _ in kernels)
    gaps.sort(reverse=True)
    long = [g for g in gaps if g[0] >= 1000]
    spanning = []
    for length, lo, hi in gaps[:top]:
        ops = sorted(
            ((b - a, n) for n, a, b in host if a < hi and b > lo and b - a < 5e6), reverse=True
        )
        names = list(dict.fromkeys(n for _, n in ops))[:6]
        spanning.append({"gap_ms": round(length / 1e3, 2), "host_ops": names})
    return {
        "kernels": len(kernels),
        "span_s": round(span / 1e6, 4),
        "gpu_busy_s": round(busy / 1e6, 4),
        "idle_s": round((span - busy) / 1e6, 4),
        "gaps_over_1ms": len(long),
        "gaps_over_1ms_s": round(sum(g[0] for g in long) / 1e6, 4),
        "longest_gaps": spanning,
    }


MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel: a phase marker on the GPU timeline


@contextlib.contextmanager
def phase_marks(labels: list[str], *sites: tuple[Any, str, str, Any]) -> Iterator[None]:
    """While inside, each site ``(owner, attribute, label, when)``'s function first appends
    ``label`` to ``labels`` and launches a marker kernel (``torch.cuda._sleep(1)``, a few cycles),
    when ``when()`` is true (``None``: always). The GPU runs one stream in order, so the i-th
    marker on the timeline starts phase ``labels[i]``: :func:`phase_split` cuts the kernels there.
    Why: an op table sums the whole update; which phase (reference, forward, backward) owns a
    kernel family is what a change is aimed at."""
    torch = sys.modules["torch"]  # the caller's
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _, _ in sites]

    def marked(fn: Callable[..., Any], label: str, when: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if when is None or when():
                labels.append(label)
                torch.cuda._sleep(1)
            return fn(*args, **kwargs)

        return call

    try:
        for (owner, attr, label, when), (_, _, fn) in zip(sites, saved, strict=True):
            setattr(owner, attr, marked(fn, label, when))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def phase_split(
    kernels: list[tuple[str, float, float]], labels: list[str], top: int = 12
) -> dict[str, Any]:
    """Kernels ``(name, start, end)`` (microseconds) cut into phases at the marker kernels
    (:func:`phase_marks`; the i-th marker starts ``labels[i]``, kernels before the first are
    ``"before"``); per phase label, summed over its occurrences: GPU ms of its kernels, their
    count, and the ``top`` kernel names by time."""
    phase, seen, out = "before", 0, {}
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if MARKER_KERNEL in name:
            phase = labels[seen] if seen < len(labels) else f"marker {seen}"
            seen += 1
            continue
        rec = out.setdefault(phase, {"gpu_ms": 0.0, "kernels": 0, "by_name": {}})
        rec["gpu_ms"] += (end - start) / 1e3
        rec["kernels"] += 1
        rec["by_name"][name] = rec["by_name"].get(name, 0.0) + (end - start) / 1e3
    for rec in out.values():
        names = sorted(rec.pop("by_name").items(), key=lambda kv: -kv[1])[:top]
        rec["gpu_ms"] = round(rec["gpu_ms"], 2)
        rec["top_ms"] = [[n[:90], round(ms, 2)] for n, ms in names]
    return {"markers": seen, "phases": out}


SYNC_WARNING = "synchronizing CUDA operation"  # torch's sync debug mode's warning


def sync_sites(fn: Callable[[], Any], top: int = 25) -> tuple[Any, dict[str, int]]:
    """``fn()`` under CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``): how
    many times the host waited for the GPU, by the innermost line of this repository (else of any
    Python) that asked. Why: a sync drains the GPU's queue, and whatever the host does next, the
    GPU waits for — the idle gaps in a profile, named by the line that caused them. Without CUDA
    the mode is not set: only warnings ``fn`` emits itself are counted (the CPU test)."""
    import traceback
    import warnings

    torch = sys.modules["torch"]  # the caller's
    cuda = torch.cuda.is_available()
    sites: dict[str, int] = {}

    def record(message: Any, *_: Any) -> None:
        if SYNC_WARNING not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f for f in frames if str(REPO) in f.filename or "omni_" in f.filename]
        frame = (ours or frames)[-1]
        site = f"{_short(frame.filename)}:{frame.lineno} {frame.name}"
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return out, dict(ranked)


def _short(path: str) -> str:
    """A path from the package or repository it lives in (``omni_grpo/...``, ``benchmarks/...``)."""
    parts = Path(path).parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "src") or Path(*parts[: i + 1]) == REPO:
            return str(Path(*parts[i + 1 :]))
    return path


# ----------------------------------------------------------------------- memory and processes
def peak_bytes(device: Any = None, reset: bool = False) -> int:
    """CUDA: the peak allocation since the last reset (``reset`` starts a new one). CPU: this
    process's peak RSS, which a forked child inherits (an exec'd one, :func:`child_json`, not)."""
    if not str(device).startswith("cuda"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda = sys.modules["torch"].cuda  # a CUDA device: torch is imported
    peak = cuda.max_memory_allocated()
    if reset:
        cuda.reset_peak_memory_stats()
    return peak


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` figure in kB: ``VmHWM`` (peak RSS, afresh at exec unlike
    ``ru_maxrss``), ``VmRSS``, ``RssAnon``, ``RssFile``; 0 where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def nbytes(tensors: Any) -> int:
    """The bytes of ``tensors`` (any iterable of them: parameters, :func:`state_tensors`)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def state_tensors(optimizer: Any) -> list[Any]:
    """The tensors of an optimizer's state (AdamW's moments and steps)."""
    is_tensor = sys.modules["torch"].is_tensor  # an optimizer: torch is imported
    return [x for s in optimizer.state.values() for x in s.values() if is_tensor(x)]


def torch_threads(default: int) -> int:
    """Torch's threads: ``OMNI_GRPO_TORCH_THREADS`` as the trainer reads it, else ``default``."""
    import torch

    n = int(os.environ.get("OMNI_GRPO_TORCH_THREADS") or 0) or default
    torch.set_num_threads(max(1, n))
    return n


def child_json(argv: list[str], check: bool = True, **run: Any) -> dict[str, Any]:
    """Run ``argv`` (a side in its own process: its own peak memory, imports, CUDA context) and
    parse the last stdout line that is a JSON object. A failure raises with the child's last
    lines, or with ``check=False`` is returned as ``{"error", "stderr_tail"}``."""
    proc = subprocess.run(argv, capture_output=True, text=True, **run)
    found = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode == 0 and found:
        return json.loads(found[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    if check:
        raise RuntimeError(f"{argv[1:3]} exited {proc.returncode}:\n" + "\n".join(tail))
    return {"error": f"exit {proc.returncode}", "stderr_tail": tail}


def rerun(side: str, check: bool = True, **run: Any) -> dict[str, Any]:
    """:func:`child_json` of this script's own command line + ``--side side``: the child sees
    ``args.side`` and ends with :func:`reply`."""
    return child_json([sys.executable, sys.argv[0], *sys.argv[1:], "--side", side], check, **run)


def reply(record: dict[str, Any]) -> NoReturn:
    """A child's end: ``record`` as the JSON line :func:`child_json` reads."""
    print(json.dumps(record), flush=True)
    sys.exit()


def progress(record: dict[str, Any]) -> None:
    """``record`` as one JSON line on stderr: each part's result as it ends (kept if one hangs)."""
    print(json.dumps(record), file=sys.stderr, flush=True)


def train_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of a training run's ``metrics.jsonl`` (steps and evaluations)."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def means(rows: list[dict[str, Any]], keys: Any) -> dict[str, float]:
    """Each key's mean over the rows that have it, to 4 places; keys no row has are left out."""
    found = {k: [r[k] for r in rows if k in r] for k in keys}
    return {k: round(statistics.fmean(v), 4) for k, v in found.items() if v}


# ---------------------------------------------------------------------------------- versions
def versions(*dists: str) -> dict[str, str | None]:
    """What a result depends on: python, the git commit (``+dirty``: with local changes), the GPU
    (if this process imported torch and has one), torch, transformers, triton and ``dists``
    (None: not installed), read from package metadata: nothing is imported for it."""
    torch = sys.modules.get("torch")
    gpu = torch.cuda.get_device_name() if torch and torch.cuda.is_available() else None
    out = {"python": platform.python_version(), "git_commit": None, "gpu": gpu}
    with contextlib.suppress(OSError):
        dirty = _git("status", "--porcelain", "--untracked-files=no").strip()
        commit = _git("rev-parse", "--short", "HEAD").strip()
        out["git_commit"] = (commit + ("+dirty" if dirty else "")) or None
    for dist in ("torch", "transformers", "triton", *dists):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if torch is not None:  # with its build's local part (+cu130): which CUDA it was built for
        out["torch"] = torch.__version__
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout
