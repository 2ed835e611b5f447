"""The resolved config stored with a run (``<run>/config.yaml``), for the tools that come after.

``export`` needs the run's base checkpoint (``model.omni_checkpoint``) long after training, from
the run directory alone; a user needs to see how a run was configured. Paths are stored absolute
(relative ones would depend on the directory ``train`` was started from) and secrets masked
(``dump_config``). Written atomically at every start, so a resumed run's file is its latest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from omni_grpo.config import OmniGRPOConfig

CONFIG_FILE = "config.yaml"
_ABSOLUTE = (
    ("run", "dir"),
    ("model", "omni_checkpoint"),
    ("model", "extracted_dir"),
    ("model", "audio_dir"),
)


def store_run_config(cfg: OmniGRPOConfig, run_dir: Path) -> Path:
    """Write ``cfg`` (paths absolute, secrets masked) to ``run_dir/config.yaml``; return the path."""
    raw = yaml.safe_load(_dump(cfg))
    for section, key in _ABSOLUTE:
        value = (raw.get(section) or {}).get(key)
        if value:
            raw[section][key] = str(Path(value).absolute())
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    os.replace(tmp, path)
    return path


def _dump(cfg: OmniGRPOConfig) -> str:
    from omni_grpo.config import dump_config

    return dump_config(cfg)
