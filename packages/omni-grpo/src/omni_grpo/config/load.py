"""From YAML files and ``--set``-style overrides to a validated tree, and back to YAML.

Relative paths in a YAML file are resolved against the directory of that file (not the current
working directory), so a config can be run from anywhere. An override naming no field, a key
given twice in one mapping and a field that was removed are refused with a sentence that says
so, never ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from omni_grpo.config.errors import ConfigError, format_validation_error
from omni_grpo.config.root import OmniGRPOConfig
from omni_grpo.config.secrets import mask_url_passwords

# Fields that existed once and were removed: a config that still sets one gets this sentence
# instead of the generic "extra fields not permitted", so the user learns where the setting went.
REMOVED_FIELDS: dict[tuple[str, ...], str] = {
    ("run", "eval_every"): "run.eval_every was removed: eval.every is the one evaluation interval",
    ("trainer", "grad_accum"): "trainer.grad_accum was removed: a step always accumulates all of "
    "its micro-batches (trainer.micro_batch_size rows each) into one optimizer step",
    ("eval", "per_modality"): "eval.per_modality was removed: held-out accuracy is always "
    "reported per modality and overall (eval/accuracy/<modality>, eval/accuracy/all)",
}


def _refuse_removed(cfg_dict: dict[str, Any], source: str | None) -> None:
    for path, message in REMOVED_FIELDS.items():
        node: Any = cfg_dict
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise ConfigError(f"{source}: {message}" if source else message)


def _parse_value(text: str) -> Any:
    """YAML-typed scalar/list/dict from an override (``8`` -> int, ``[1,2]`` -> list, ``null`` -> None)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _model_for_path(path: list[str]) -> None:
    """Raise ConfigError unless the dotted path names a field of the tree (dict fields may go deeper)."""
    if tuple(path) in REMOVED_FIELDS:
        raise ConfigError(REMOVED_FIELDS[tuple(path)])
    model: Any = OmniGRPOConfig
    for i, key in enumerate(path):
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return  # inside a free-form dict field: any key is allowed
        if key not in fields:
            known = ", ".join(sorted(fields))
            where = ".".join(path[: i + 1])
            raise ConfigError(f"unknown config key '{where}' (known at this level: {known})")
        model = _submodel(fields[key].annotation)


def _submodel(annotation: Any) -> Any:
    """The BaseModel class inside ``X | None`` style annotations, else None (leaf or dict)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


_SECRET_TEXT = re.compile(r"(?i)key|secret|passw|token|auth|credential|bearer")


def apply_overrides(
    cfg_dict: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (YAML-typed values) to a raw config dict, returning a new dict.

    Unknown paths raise ConfigError naming the path, so a typo on the command line never silently
    does nothing. Validation of the values themselves happens when the tree is built.
    """
    import copy

    out = copy.deepcopy(cfg_dict)
    for item in overrides:
        if "=" not in item:
            shown = "<hidden: it may hold a secret>" if _SECRET_TEXT.search(item) else repr(item)
            raise ConfigError(f"override {shown} is not KEY=VALUE (e.g. rollout.n_samples=8)")
        key, raw = item.split("=", 1)
        path = [p for p in key.strip().split(".")]
        if not all(path):
            raise ConfigError(f"override {item!r} has an empty key segment")
        _model_for_path(path)
        node = out
        for p in path[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
            node = nxt
        node[path[-1]] = _parse_value(raw)
    return out


def _annotation_parts(annotation: Any) -> Iterator[Any]:
    """``annotation`` and everything nested in it (``Path | list[Path] | None`` -> Path, list, ...)."""
    yield annotation
    for arg in get_args(annotation):
        yield from _annotation_parts(arg)


def path_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Dotted paths of every field annotated with ``Path`` (alone, optional or in a list), found by
    walking the config models, so a new path field is resolved without being listed anywhere."""
    for name, info in model.model_fields.items():
        sub = _submodel(info.annotation)
        if sub is not None:
            yield from path_fields(sub, (*prefix, name))
        elif any(t is Path for t in _annotation_parts(info.annotation)):
            yield (*prefix, name)


# Fields holding paths, resolved relative to the config file's directory.
PATH_FIELDS: tuple[tuple[str, ...], ...] = tuple(path_fields(OmniGRPOConfig))


def _resolve_one(value: Any, base: Path) -> Any:
    if isinstance(value, list):
        return [_resolve_one(v, base) for v in value]
    if isinstance(value, str | os.PathLike) and str(value).strip() != "":
        p = Path(os.path.expanduser(str(value)))
        # normpath: `run.dir: ../runs/tiny` in examples/ is printed and stored as <repo>/runs/tiny,
        # not <repo>/examples/../runs/tiny (lexical, like the shell's `cd`; symlinks are kept)
        return os.path.normpath(p if p.is_absolute() else (base / p))
    return value


def _resolve_paths(cfg_dict: dict[str, Any], base: Path) -> None:
    """Resolve every path field (``PATH_FIELDS``) of a raw config dict against ``base``."""
    for path in PATH_FIELDS:
        node: Any = cfg_dict
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            node[path[-1]] = _resolve_one(node[path[-1]], base)


def build_config(cfg_dict: dict[str, Any], source: str | None = None) -> OmniGRPOConfig:
    """Validate a raw dict into the tree, converting pydantic errors into a readable ConfigError."""
    _refuse_removed(cfg_dict, source)
    try:
        return OmniGRPOConfig.model_validate(cfg_dict)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, cfg_dict)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping: YAML keeps the last value
    silently, so the first one (e.g. an edited ``lr``) would be ignored without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(file: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping in ``file`` with its relative paths resolved against its own directory.

    ``extends: other.yaml`` (relative to ``file``) starts from that file's tree and deep-merges
    this one over it, so a variant (``examples/tiny-ray.yaml``) says only what differs from its
    base and follows the base's recipe when that changes.
    """
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}")
    try:
        loaded = yaml.load(file.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}: not a UTF-8 text file (byte {err.start})") from None
    except yaml.YAMLError as err:
        # Only the problem and its position: YAML's own message quotes the offending line,
        # which may be the one holding the admin key.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{file}: not valid YAML: {problem}{where}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: top level must be a mapping, got {type(loaded).__name__}")
    parent = loaded.pop("extends", None)
    _resolve_paths(loaded, file.resolve().parent)
    if parent is None:
        return loaded
    if not isinstance(parent, str):
        raise ConfigError(f"{file}: extends must be a file name, got {parent!r}")
    base_file = (file.resolve().parent / parent).resolve()
    if base_file in chain:
        raise ConfigError(f"{file}: extends {parent} makes a cycle")
    return _deep_merge(_read_yaml(base_file, (*chain, file.resolve())), loaded)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None, overrides: list[str] | tuple[str, ...] = ()
) -> OmniGRPOConfig:
    """Load a YAML config, apply dotted overrides, resolve relative paths against the file's dir.

    ``path=None`` starts from the defaults (overrides still apply; paths resolve against the cwd).
    A file may start from another with ``extends: base.yaml`` (see ``_read_yaml``).
    """
    raw: dict[str, Any] = {}
    base = Path.cwd()
    source = None
    if path is not None:
        file = Path(path)
        source = str(file)
        raw = _read_yaml(file)
        base = file.resolve().parent
    raw = apply_overrides(raw, overrides)
    _resolve_paths(raw, base)
    return build_config(raw, source)


def dump_config(cfg: OmniGRPOConfig) -> str:
    """YAML of the full resolved tree (secrets masked), for saving next to a run."""
    return mask_url_passwords(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
