"""A dataset spec's files and its tables' columns, read from headers alone: the row loader's view.

Defined in ``omni_grpo.dataset_spec``, a floor below the config, whose pre-flight check needs the
same (the config imports nothing of ``omni_grpo.data``); served here under the data's names.
"""

from omni_grpo.dataset_spec import (
    PARQUET_MAGIC,
    Spec,
    arrow_files,
    check_columns,
    expand_spec,
    missing_column_error,
    table_schemas,
)

__all__ = [
    "PARQUET_MAGIC",
    "Spec",
    "arrow_files",
    "check_columns",
    "expand_spec",
    "missing_column_error",
    "table_schemas",
]
