"""PNG plots of a finished run from its ``metrics.jsonl`` (matplotlib, Agg: no display needed).

matplotlib is in the ``viz`` extra; without it ``plot_run`` warns once and writes nothing (the
data stays in ``metrics.jsonl``), so a lean install still finishes its runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omni_grpo.extras import optional
from omni_grpo.run.metrics import read_metrics

ACCURACY_PREFIX = "eval/accuracy/"
# collapse watch (issue 16): panel title -> metrics.jsonl key prefix, one line per modality
HEALTH_PANELS: dict[str, str] = {
    "policy entropy (sampled tokens, nats)": "entropy/",
    "zero-variance group fraction (no GRPO signal)": "zero_variance_frac/",
}


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def _label_fraction_axes(ax: Any, ylabel: str, title: str) -> None:
    """Steps against a value in [0, 1] (reward, accuracy), on one scale so plots compare."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right")
    ax.set_title(title)


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` and close it (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_health(records: list[dict[str, Any]], path: Path) -> bool:
    """Per-modality entropy and zero-variance fraction, the two signs of a collapsing modality."""
    import matplotlib.pyplot as plt

    panels = [
        (title, sorted({k for r in records for k in r if k.startswith(prefix)}))
        for title, prefix in HEALTH_PANELS.items()
    ]
    if not any(keys for _, keys in panels):
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 2.6 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels, strict=True):
        for key in keys:
            s, v = _series(records, key)
            ax.plot(s, _moving_mean(v, max(1, len(v) // 20)), lw=1.5, label=key.split("/", 1)[1])
        ax.set_title(title)
        if keys:
            ax.legend(loc="upper right")
    axes[-1].set_xlabel("step")
    _save(fig, path)
    return True


def plot_run(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``reward.png``, ``accuracy.png`` and ``health.png`` (per-modality entropy and
    zero-variance fraction) into ``<run>/plots``; return the files written."""
    matplotlib = optional("run.plots")
    if matplotlib is None:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    steps, reward = _series(records, "reward_mean")
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, reward, lw=1, alpha=0.4, label="reward_mean")
        window = max(1, len(reward) // 20)
        smooth = _moving_mean(reward, window)
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({window})")
        _label_fraction_axes(ax, "reward", "training reward")
        written.append(_save(fig, out_dir / "reward.png"))

    keys = sorted({k for r in records for k in r if k.startswith(ACCURACY_PREFIX)})
    if keys:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            s, v = _series(records, key)
            ax.plot(s, v, marker="o", label=key[len(ACCURACY_PREFIX) :])
        ax.axhline(0.9, color="grey", ls="--", lw=1)
        _label_fraction_axes(ax, "held-out accuracy", "held-out accuracy per modality")
        written.append(_save(fig, out_dir / "accuracy.png"))
    if _plot_health(records, out_dir / "health.png"):
        written.append(out_dir / "health.png")
    return written
