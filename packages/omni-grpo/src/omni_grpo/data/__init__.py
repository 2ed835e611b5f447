"""Datasets: the jsonl row format, preparers, lazy media decoding and prompt building."""

from omni_grpo.data.schema import DataError, DatasetRow, MediaRef, write_rows
from omni_grpo.data.sources import iter_rows, read_samples

__all__ = ["DataError", "DatasetRow", "MediaRef", "iter_rows", "read_samples", "write_rows"]
