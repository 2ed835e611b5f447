"""Before anything runs: the inputs a config names exist.

Validation checks the tree alone; this looks at the disk (datasets, the media root, the
checkpoint, the run dir), so that a missing input fails in one line naming its key instead of
after the model is made. A renamed column is checked against the tables' headers
(``omni_grpo.dataset_spec``, a floor below the config: it imports nothing of omni_grpo).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from omni_grpo.config.errors import ConfigError
from omni_grpo.dataset_spec import check_columns

if TYPE_CHECKING:
    from omni_grpo.config.root import OmniGRPOConfig


def _missing_dataset(key: str, spec: Path | list[Path] | None) -> list[str]:
    """A dataset spec's entries that name nothing: a glob without a match, a missing path (a
    file is a jsonl/parquet file, a directory a ``save_to_disk`` dataset)."""
    import glob as globlib

    if spec is None:
        return []
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        return [f"{key}: an empty list"]
    out = []
    for item in items:
        text = os.fspath(item)
        if globlib.has_magic(text):
            if not globlib.glob(text):
                out.append(f"{key}: no file matches {text}")
        elif not Path(text).exists():
            out.append(f"{key}: {text} does not exist")
    return out


def check_paths(cfg: OmniGRPOConfig) -> None:
    """Refuse, before anything runs, inputs that do not exist: ``data.train``/``eval``/``root``
    (unless ``data.synthetic`` makes them) and the Omni checkpoint (unless ``model.make_tiny``
    creates it or its parts are already extracted). All problems in one ``ConfigError`` line, each naming its dotted key."""
    problems: list[str] = []
    data, model = cfg.data, cfg.model
    if data.synthetic is None:
        if data.train is None:
            problems.append("data.train is not set (and data.synthetic is not configured)")
        problems += _missing_dataset("data.train", data.train)
        problems += _missing_dataset("data.eval", data.eval)
        if data.columns and not problems:  # a renamed column a table lacks: before the model
            found = [check_columns(s, data.columns) for s in (data.train, data.eval) if s]
            problems += list(dict.fromkeys(m for ms in found for m in ms))  # train = eval: once
        if data.root is not None and not data.root.is_dir():
            problems.append(f"data.root: {data.root} is not a directory")
    omni = model.omni_checkpoint or cfg.run.dir / "model" / "omni"
    if model.make_tiny is None and not (omni / "config.json").is_file() and not model.extracted():
        key = "model.omni_checkpoint" if model.omni_checkpoint else "model.omni_checkpoint (unset)"
        where = "does not exist" if not omni.exists() else "has no config.json"
        problems.append(
            f"{key}: {omni} {where} (point it at a Qwen3-Omni checkpoint, or set model.make_tiny)"
        )
    if cfg.run.dir.exists() and not cfg.run.dir.is_dir():
        problems.append(f"run.dir: {cfg.run.dir} is a file, not a directory")
    if problems:
        raise ConfigError("; ".join(problems))
