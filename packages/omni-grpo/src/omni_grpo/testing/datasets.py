"""The same rows three ways, as users keep datasets: jsonl + media files, a parquet file with the
media embedded, and a ``datasets.save_to_disk`` directory whose ``images`` / ``audios`` /
``videos`` columns are ``datasets`` ``Image`` / ``Audio`` / ``Video`` features.

The ``save_to_disk`` copy is built with the ``datasets`` library itself (a test extra), so the
directory is exactly what a researcher's ``ds.save_to_disk(...)`` leaves: Arrow IPC stream
files, ``state.json`` and ``dataset_info.json`` with the feature types.
"""

from __future__ import annotations

import os
from pathlib import Path

from omni_grpo.data.schema import MEDIA_COLUMNS
from omni_grpo.data.sources import read_samples
from omni_grpo.data.tables import write_embedded_parquet

# list column -> the datasets feature class name of its items
HF_FEATURES: dict[str, str] = {"images": "Image", "audios": "Audio", "videos": "Video"}


def parquet_copy(jsonl: str | os.PathLike[str], root: str | os.PathLike[str], out: Path) -> Path:
    """``jsonl``'s rows (media under ``root``) as a parquet file with the media embedded."""
    write_embedded_parquet(read_samples(jsonl), root, out)
    return out


def save_to_disk_copy(parquet: Path, out_dir: Path) -> Path:
    """The rows of an embedded parquet file as a ``save_to_disk`` dir with HF media features.

    Cast (not encoded) onto the features: ``datasets`` 5 needs torchcodec to *encode* audio, but
    casting ``{bytes, path}`` structs onto ``Audio`` is a storage cast and keeps the bytes as is.
    """
    import datasets
    import pyarrow.parquet as pq

    table = pq.read_table(parquet)
    ds = datasets.Dataset(table)
    features = ds.features.copy()
    for col, feature in HF_FEATURES.items():
        if col in features:
            features[col] = datasets.List(getattr(datasets, feature)())
    ds = ds.cast(features)
    ds.save_to_disk(str(out_dir))
    return out_dir


__all__ = ["HF_FEATURES", "MEDIA_COLUMNS", "parquet_copy", "save_to_disk_copy"]
