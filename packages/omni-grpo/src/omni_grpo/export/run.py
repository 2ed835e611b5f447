"""What ``omni-grpo export`` needs from a run directory: the checkpoint, its format, the base.

A run directory holds ``config.yaml`` (the resolved config, written by ``train`` at start) and
``checkpoints/step_NNNNNN/`` directories, complete once ``state.json`` exists (see
:mod:`omni_grpo.run.checkpoint`). The trained weights are ``model.safetensors`` — or several
``model*.safetensors`` files (per-rank shards of the multi-process path), read as one list and
never merged in memory. Their names say which backend wrote them: pseudo-VL names with fused
experts in transformers' in-memory layout (torch backend) or ``GPTModel`` names (Megatron).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from omni_extract.names import match
from omni_extract.plan import FUSED_OF, FUSED_ROWS
from omni_extract.source import OmniSource
from omni_extract.trained import (
    SafetensorsFiles,
    SafetensorsTrained,
    TrainedWeights,
    is_fused,
)

from omni_grpo.export.megatron import MegatronTrained, is_megatron_name
from omni_grpo.run.checkpoint import STATE_FILE, checkpoint_dir
from omni_grpo.run.stored_config import CONFIG_FILE

WEIGHTS_INDEX = "model.safetensors.index.json"
# Rows of the name table the trainer always trains (both backends): a checkpoint lacking one of
# them is incomplete, not "partly frozen".
ALWAYS_TRAINED_ROWS = frozenset({"lm", "fused_gate_up", "fused_down"})


class ExportError(RuntimeError):
    """The run, its checkpoint or the base cannot be exported; the message names the thing."""


@dataclass(frozen=True)
class RunCheckpoint:
    """The checkpoint chosen for export (``path None``: the untrained model, step 0)."""

    run_dir: Path
    step: int
    path: Path | None
    files: tuple[Path, ...] = ()


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def run_of(path: Path) -> tuple[Path, int | None]:
    """A run directory, or one of its checkpoint directories (``<run>/checkpoints/step_N``)."""
    if path.name.startswith("step_") and path.parent.name == "checkpoints":
        try:
            return path.parent.parent, _step_of(path)
        except ValueError:
            pass
    return path, None


def _read_state(path: Path) -> None:
    state = path / STATE_FILE
    try:
        raw = json.loads(state.read_text())
        int(raw["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(
            f"checkpoint {path} is incomplete: {STATE_FILE} unreadable ({exc})"
        ) from None


def find_checkpoint(run_dir: Path, step: int | None) -> RunCheckpoint:
    """``--step N`` (0 = untrained), else the newest complete checkpoint; refuse incomplete ones."""
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    run_dir, given = run_of(run_dir)
    if given is not None:
        if step is not None and step != given:
            raise ExportError(
                f"--step {step} contradicts the checkpoint directory step_{given:06d}"
            )
        step = given
    root = run_dir / "checkpoints"
    dirs = sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    complete = [p for p in dirs if (p / STATE_FILE).is_file()]
    if step == 0:
        return RunCheckpoint(run_dir, 0, None)
    if step is not None:
        path = checkpoint_dir(run_dir, step)
        if not path.is_dir():
            have = [_step_of(p) for p in complete]
            raise ExportError(f"{run_dir} has no checkpoint for step {step} (complete: {have})")
        if not (path / STATE_FILE).is_file():
            raise ExportError(f"checkpoint {path} is incomplete (no {STATE_FILE})")
    elif complete:
        path = complete[-1]
    elif dirs:
        raise ExportError(
            f"checkpoint {dirs[-1]} is incomplete (no {STATE_FILE}); nothing to export"
        )
    else:
        return RunCheckpoint(run_dir, 0, None)  # nothing trained yet: the base is the policy
    _read_state(path)
    return RunCheckpoint(run_dir, _step_of(path), path, weight_files(path))


def weight_files(ckpt: Path) -> tuple[Path, ...]:
    """The checkpoint's trained-weight files: the index's shards, else every ``model*.safetensors``."""
    index = ckpt / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ExportError(f"{index}: not a safetensors index ({exc})") from None
        missing = [n for n in names if not (ckpt / n).is_file()]
        if missing:
            raise ExportError(
                f"checkpoint {ckpt} is incomplete: {index.name} lists missing {missing[0]}"
            )
        return tuple(ckpt / n for n in names)
    files = tuple(sorted(ckpt.glob("model*.safetensors")))
    if not files:
        raise ExportError(f"checkpoint {ckpt} is incomplete: no model.safetensors")
    return files


def stored_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ExportError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ExportError(f"{path}: top level must be a mapping")
    return raw


def default_base(run_dir: Path) -> Path:
    """The run's ``model.omni_checkpoint`` from its stored config (default ``<run>/model/omni``)."""
    cfg = stored_config(run_dir)
    if cfg is None:
        fallback = run_dir / "model" / "omni"
        if (fallback / "config.json").is_file():
            return fallback
        raise ExportError(
            f"{run_dir} has no {CONFIG_FILE} (runs store it since omni-grpo export exists) and no "
            "model/omni; pass --base with the Qwen3-Omni checkpoint the run started from"
        )
    omni = (cfg.get("model") or {}).get("omni_checkpoint")
    if omni:
        path = Path(omni)
        return path if path.is_absolute() else run_dir / path
    return run_dir / "model" / "omni"  # where train makes it (here, even if the run was moved)


def open_trained(files: tuple[Path, ...], base: OmniSource) -> TrainedWeights:
    """The checkpoint's weights as pseudo-VL tensors, whichever backend wrote them."""
    store = SafetensorsFiles(files)
    names = list(store.tensors)
    megatron = [n for n in names if is_megatron_name(n)]
    if megatron and len(megatron) != len(names):
        other = next(n for n in names if not is_megatron_name(n))
        raise ExportError(
            f"{files[0].parent}: mixes Megatron names ({megatron[0]!r}) with others ({other!r})"
        )
    if megatron:
        text = base.thinker_config["text_config"]
        return MegatronTrained(
            store,
            num_heads=int(text["num_attention_heads"]),
            num_query_groups=int(text["num_key_value_heads"]),
            head_dim=int(
                text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
            ),
            num_experts=int(text["num_experts"]),
        )
    return SafetensorsTrained(store, "hf_memory")  # the torch backend saves named_parameters()


def check_complete(trained: TrainedWeights, base: OmniSource, where: Path) -> None:
    """Every language-model tensor of the base must be in the checkpoint (both backends train it)."""
    have = set(trained.names())
    need: list[str] = []
    for hub in base.tensors:
        found = match(hub, "hub")
        if found is None:
            continue
        if found.row.fuse is not None:
            template = FUSED_ROWS[FUSED_OF[found.row.fuse]].vl
            vl = template.format(layer=found.groups["layer"]) if template else None
        elif found.row.key in ALWAYS_TRAINED_ROWS:
            vl = found.name_in("vl")
        else:
            continue
        if vl is not None and vl not in have:
            need.append(vl)
    if need:
        need = sorted(set(need))
        raise ExportError(
            f"checkpoint {where} is incomplete: it lacks {need[0]!r}"
            + (f" and {len(need) - 1} more language-model tensor(s)" if len(need) > 1 else "")
        )


def holds_lora(files: tuple[Path, ...]) -> bool:
    """A LoRA run's checkpoint: its trained weights are adapters (``trainer.lora``)."""
    from omni_grpo.models.lora import is_adapter_name

    return any(is_adapter_name(n) for n in SafetensorsFiles(files).tensors)


class MergedTrained:
    """:class:`TrainedWeights` over in-memory tensors in transformers' layout (``hf_memory``).

    What a LoRA checkpoint exports as: the merged ``W + scale * B A`` of the adapted tensors; the
    tensors LoRA did not touch are the base's, which the export copies as for a frozen part.
    """

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str) -> Any:
        return self.tensors[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.tensors[name].shape)
        return (shape[0], shape[2], shape[1]) if is_fused(name) else shape

    def tensor(self, name: str) -> Any:
        return self.tensors[name]

    def hub_expert(self, name: str, expert: int, part: str) -> Any:
        block = self.tensors[name][expert]  # gate_up [2I, H] (gate rows, then up rows); down [H, I]
        if part == "down":
            return block.contiguous()
        half = block.shape[0] // 2
        return (block[:half] if part == "gate" else block[half:]).contiguous()

    def vl_block(self, name: str, expert: int) -> Any:
        return self.tensors[name][expert].T.contiguous()


def lora_trained(run_dir: Path, files: tuple[Path, ...]) -> MergedTrained:
    """Merge a LoRA checkpoint's adapters into the run's base: the run's own model (its stored
    ``model.extracted_dir``, dtype and ``trainer.lora``) with the adapters loaded, merged by peft's
    ``get_delta_weight`` exactly as the weight sync merges them."""
    from safetensors.torch import load_file

    from omni_grpo.config import LoraConfig
    from omni_grpo.models import load_thinker
    from omni_grpo.models.lora import apply_lora, merged_weights

    cfg = stored_config(run_dir) or {}
    lora = (cfg.get("trainer") or {}).get("lora")
    model_cfg = cfg.get("model") or {}
    vl = model_cfg.get("extracted_dir")
    if lora is None or vl is None:
        raise ExportError(
            f"{files[0].parent} holds LoRA adapters but {run_dir / CONFIG_FILE} has no "
            "trainer.lora / model.extracted_dir to merge them with"
        )
    vl_dir = Path(vl) if Path(vl).is_absolute() else run_dir / vl
    model = load_thinker(vl_dir, dtype=model_cfg.get("dtype", "auto"))
    apply_lora(model, LoraConfig(**lora))
    adapters: dict[str, Any] = {}
    for f in files:
        adapters.update(load_file(str(f)))
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.requires_grad}
    if set(adapters) != expected:
        odd = sorted(set(adapters) ^ expected)[:3]
        raise ExportError(f"{files[0].parent}: adapters do not match trainer.lora ({odd})")
    with torch.no_grad():
        for name, value in adapters.items():
            params[name].copy_(value)
    return MergedTrained(merged_weights(model))
