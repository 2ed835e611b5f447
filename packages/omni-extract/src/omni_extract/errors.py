"""Errors raised by omni-extract. Each message names the file, key or field that is wrong."""

from __future__ import annotations


class ExtractError(Exception):
    """Base class: the input cannot be converted faithfully; nothing was written."""


class NotQwen3OmniError(ExtractError):
    """``config.json`` does not describe a Qwen3-Omni (``qwen3_omni_moe``) checkpoint."""


class MissingShardError(ExtractError):
    """A shard listed in ``model.safetensors.index.json`` is absent (or lacks a listed tensor)."""


class CorruptShardError(ExtractError):
    """A shard file is not a readable safetensors file (truncated, bad header)."""


class UnmappedTensorError(ExtractError):
    """A tensor name matches no row of the name table: it would otherwise be dropped silently."""


class TensorMismatchError(ExtractError):
    """A tensor has a shape or dtype the config does not allow, or an expected tensor is missing."""


class MissingExpertError(TensorMismatchError):
    """A MoE layer lacks one of its experts' projections."""


class EmptySelectionError(ExtractError):
    """The chosen variant selected zero tensors from the checkpoint."""


class FrozenTensorError(ExtractError):
    """A frozen-tower tensor was offered to weight sync (the server cannot refit encoders)."""


class DestinationExistsError(ExtractError):
    """The destination exists and ``overwrite`` was not given."""


class NotAnExportError(DestinationExistsError):
    """``overwrite`` was asked for a directory that ``export`` did not write (no marker file)."""
