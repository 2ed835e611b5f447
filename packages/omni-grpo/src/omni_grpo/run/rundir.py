"""Who owns a run directory, what a resume may change, and what interrupted writes leave behind.

* ``claim_run_dir``: a directory that already holds a run (checkpoints, metrics, TensorBoard
  events) is refused unless the caller says ``resume`` (continue it) or ``overwrite`` (start over:
  the old run's outputs are removed; the prepared ``model/`` and ``data/`` are kept, they are
  caches keyed by the config). Without this, a second ``train`` silently replaced the first run's
  metrics while a later ``--resume`` could load the FIRST run's checkpoint.
* ``config_fingerprint`` / ``check_resume_config``: every checkpoint stores the settings that
  decide what training does; a resume under different ones is refused with the differences.
  Settings that may change on a resume by design (``RESUMABLE``: the step budget, logging,
  evaluation, server addresses) are left out.
* ``clean_stale_temps``: atomic writers build in hidden siblings (``.<name>.tmp-*``,
  ``.tmp-<name>-*``); a kill leaves them behind (856 MB in one case). The next run removes those
  whose writer is gone, and says so in one log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omni_extract.convert import process_alive

log = logging.getLogger(__name__)


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message names it and the way out."""


# What a run writes into its directory (everything else there is the caller's or a cache).
RUN_OUTPUTS: tuple[str, ...] = (
    "checkpoints",
    "metrics.jsonl",
    "tensorboard",
    "plots",
    "summary.json",
    "weight_sync",
)


def _run_evidence(run_dir: Path) -> list[str]:
    found = []
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        steps = sorted(p.name for p in ckpts.glob("step_*"))
        if steps:
            found.append(
                f"checkpoints/{steps[-1]}" + (f" (+{len(steps) - 1})" if steps[1:] else "")
            )
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        lines = sum(1 for line in metrics.read_bytes().splitlines() if line.strip())
        found.append(f"metrics.jsonl ({lines} lines)")
    tb = run_dir / "tensorboard"
    if tb.is_dir() and any(tb.iterdir()):
        found.append("tensorboard/")
    return found


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a directory holding another run unless ``resume`` or ``overwrite``; with
    ``overwrite``, remove that run's outputs (one log line says what)."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError(
            "--resume and --overwrite exclude each other: continue the run or replace it"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run.dir {run_dir} is a file, not a directory")
    evidence = _run_evidence(run_dir) if run_dir.is_dir() else []
    if not evidence or resume:
        return
    if not overwrite:
        raise RunDirError(
            f"run.dir {run_dir} already holds a run ({', '.join(evidence)}): pass --resume to "
            "continue it, --overwrite to replace it, or choose another run.dir"
        )
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(name + "/")
        elif path.exists():
            path.unlink()
            removed.append(name)
    log.warning(
        "--overwrite: removed the previous run's %s from %s (model/ and data/ are kept)",
        ", ".join(removed),
        run_dir,
    )


# ------------------------------------------------------------------------------ config identity
# Dotted prefixes that may differ between a checkpoint and its resume.
RESUMABLE: tuple[str, ...] = (
    "run.dir",
    "run.steps",
    "run.save_every",
    "run.log_every",
    "run.tensorboard",
    "run.wandb",
    "run.plots",
    "run.collapse_warn_steps",
    "model.extracted_dir",
    "model.audio_dir",
    "eval.",
    "rollout.sglang.urls",
    "rollout.sglang.router_url",
    "rollout.sglang.admin_api_key",
    "rollout.sglang.timeout_s",
    "rollout.sglang.max_concurrency",
    "rollout.sglang.launch",
    "ray.",
    "trainer.device",
)
_SECRET = re.compile(r"(?i)(?:^|_)(?:api_?key|key|secret|password|token|auth|credentials?)$")


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def _resumable(key: str) -> bool:
    return any(
        key == p or (p.endswith(".") and key.startswith(p)) or key.startswith(p + ".")
        for p in RESUMABLE
    )


def config_fingerprint(cfg: Any) -> dict[str, Any]:
    """The flattened settings a checkpoint is only valid under (``RESUMABLE`` and secrets left
    out), with ``hash`` = sha256 of them: ``{"hash": ..., "settings": {dotted: value}}``."""
    flat = _flatten(cfg.model_dump(mode="json"))
    settings = {
        k: v
        for k, v in sorted(flat.items())
        if not _resumable(k) and not _SECRET.search(k.rsplit(".", 1)[-1])
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return {"hash": digest, "settings": settings}


def check_resume_config(
    stored: Mapping[str, Any] | None, current: Mapping[str, Any], ckpt: Path
) -> None:
    """Refuse to resume ``ckpt`` under settings that differ from those it was saved under.

    Keys present on one side only (a config field added or removed by an upgrade) are not
    differences of the run and are only logged. A checkpoint from before fingerprints is accepted
    with a warning.
    """
    if not stored or "settings" not in stored:
        log.warning("%s stores no config fingerprint (an older checkpoint): not checked", ckpt)
        return
    if stored.get("hash") == current["hash"]:
        return
    old, new = stored["settings"], current["settings"]
    changed = [k for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]
    one_sided = sorted(old.keys() ^ new.keys())
    if one_sided:
        log.info(
            "config keys present on one side only (schema change), not compared: %s", one_sided
        )
    if changed:
        diff = "; ".join(f"{k}: {json.dumps(old[k])} -> {json.dumps(new[k])}" for k in changed)
        raise RunDirError(
            f"cannot resume {ckpt}: the config differs from the one it was trained with: {diff} "
            "(restore those settings, or start over with --overwrite or another run.dir)"
        )


def check_resume(run_dir: Path, current: Mapping[str, Any]) -> None:
    """Before anything is prepared: the newest checkpoint's stored fingerprint must match."""
    from omni_grpo.run.checkpoint import latest_checkpoint, read_state, verify_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return
    verify_checkpoint(ckpt)  # a damaged newest checkpoint: named, with the way out, right now
    extra = read_state(ckpt).get("extra")
    stored = extra.get("config") if isinstance(extra, dict) else None
    check_resume_config(stored, current, ckpt)


# ------------------------------------------------------------------------------ stale temp dirs
# Hidden siblings of atomic writers: ``.<name>.tmp-*`` / ``.<name>.old-*`` (staged_dir,
# omni-extract) and ``.tmp-<name>-*`` (the weight-sync writer). ``-p<pid>-`` names the writer.
TEMP_NAME = re.compile(r"^\.(?:.+\.(?:tmp|old)-.+|tmp-.+)$")
OWNER_PID = re.compile(r"-p(\d+)-")
# A temp dir without an owner pid counts as abandoned once nothing in it changed for this long.
UNOWNED_STALE_S = 15 * 60.0


def _newest_mtime(path: Path) -> float:
    try:
        times = [path.lstat().st_mtime]
        if path.is_dir():
            times += [p.lstat().st_mtime for p in path.iterdir()]
        return max(times)
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def is_stale_temp(path: Path, now: float | None = None) -> bool:
    """A hidden temp sibling whose writer is gone (its pid is dead, or, without a pid in the
    name, nothing in it changed for ``UNOWNED_STALE_S``)."""
    if not TEMP_NAME.match(path.name):
        return False
    owner = OWNER_PID.search(path.name)
    if owner is not None:
        return not process_alive(int(owner.group(1)))
    return (now or time.time()) - _newest_mtime(path) >= UNOWNED_STALE_S


def clean_stale_temps(dirs: Iterable[Path]) -> list[Path]:
    """Remove stale temp siblings directly inside ``dirs``; one log line lists them."""
    removed: list[Path] = []
    total = 0
    now = time.time()
    for parent in dict.fromkeys(Path(d) for d in dirs):
        if not parent.is_dir():
            continue
        for path in sorted(parent.iterdir()):
            if is_stale_temp(path, now):
                total += _size(path)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(path)
    if removed:
        log.warning(
            "removed %d stale temporary file(s)/dir(s) left by interrupted writes (%.1f MB): %s",
            len(removed),
            total / 1e6,
            ", ".join(str(p) for p in removed),
        )
    return removed


def run_temp_parents(cfg: Any, run_dir: Path) -> list[Path]:
    """Where this run's atomic writers put their temp siblings."""
    model = cfg.model
    parents = [
        run_dir,
        run_dir / "checkpoints",
        run_dir / "model",
        run_dir / "data",
        run_dir / "weight_sync",
    ]
    for path in (model.extracted_dir, model.audio_dir, model.omni_checkpoint):
        if path is not None:
            parents.append(Path(path).parent)
    sync_dir = getattr(cfg.rollout.sglang, "sync_dir", None)
    if sync_dir is not None:
        parents.append(Path(sync_dir))
    return parents
