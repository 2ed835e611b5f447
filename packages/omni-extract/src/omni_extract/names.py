"""Every Qwen3-Omni thinker weight name, in every layout omni-grpo meets, as ONE data table.

One row per family of tensors; each column is a name template in one layout:

* ``hub``     the released Qwen3-Omni checkpoint (``thinker.*``, per-expert 2-D experts);
* ``hf_omni`` transformers' in-memory ``Qwen3OmniMoeThinkerForConditionalGeneration`` names;
* ``vl``      the pseudo-Qwen3-VL-MoE checkpoint we write (and the VL model's in-memory names);
* ``text``    the plain ``qwen3_moe`` checkpoint we write (``Qwen3MoeForCausalLM``);
* ``audio``   the audio-tower checkpoint we write;
* ``server``  the name we send to the sglang-omni thinker stage (contract §4.5). We send hub
  names, which that stage accepts verbatim; fused experts go as
  ``thinker.model.layers.N.mlp.experts.{gate_up_proj,down_proj}`` in the VL hub layout.

Extraction reads the table hub -> vl/text/audio; weight sync reads it vl/text/hf_omni -> server;
validation reads it hf_omni -> hub. ``None`` means "no counterpart in that layout". Rows are
tried in order and the first match wins, so the specific expert rows precede the generic ``lm`` row.

Fused-expert layouts (``[E, H, 2I]`` gate-then-up and ``[E, I, H]``) are the Qwen3-VL *hub*
layout; transformers holds them in memory as ``[E, 2I, H]`` / ``[E, H, I]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from omni_extract.errors import FrozenTensorError, UnmappedTensorError

Layout = Literal["hub", "hf_omni", "vl", "text", "audio", "server"]
LAYOUTS: tuple[Layout, ...] = ("hub", "hf_omni", "vl", "text", "audio", "server")

# What each ``{group}`` in a template may stand for.
GROUP_PATTERNS: dict[str, str] = {
    "layer": r"\d+",
    "expert": r"\d+",
    "i": r"\d+",
    "p": r"weight|bias",
    # the language-model body below the ``model`` prefix: exactly the Qwen3-MoE decoder parameters,
    # so a stray name (``...experts.gate_up``) is an error, never a silent pass-through
    "lm": (
        r"embed_tokens\.weight|norm\.weight"
        r"|layers\.\d+\.(?:input_layernorm|post_attention_layernorm)\.weight"
        r"|layers\.\d+\.self_attn\.(?:[qkvo]_proj\.(?:weight|bias)|[qk]_norm\.weight)"
        r"|layers\.\d+\.mlp\.gate\.weight"
        r"|layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight"  # dense layers (mlp_only_layers)
    ),
    # the vision-tower parts whose names Omni and Qwen3-VL share
    "vis": r"(?:patch_embed|pos_embed|blocks)\..+",
    "rest": r".+",
    "other": r"(?:talker|code2wav)\..+",
}

FusedKind = Literal["gate_up", "down"]
ExpertPart = Literal["gate", "up", "down"]


@dataclass(frozen=True)
class NameRow:
    """One family of tensors and its name in each layout (``None``: absent there).

    ``fuse``: per-expert rows say which fused tensor they become in the VL layout.
    ``fused``: fused rows say which fused layout they hold (drives transposes).
    ``frozen``: tower rows; they exist on the server side only in non-AR stages that cannot be
    refit, so weight sync refuses (or skips) them.
    """

    key: str
    hub: str | None
    hf_omni: str | None = None
    vl: str | None = None
    text: str | None = None
    audio: str | None = None
    server: str | None = None
    fuse: ExpertPart | None = None
    fused: FusedKind | None = None
    frozen: bool = False


_LM = "thinker.model."
_EXP = "layers.{layer}.mlp.experts"

NAME_TABLE: tuple[NameRow, ...] = (
    # --- MoE experts: per-expert 2-D on the hub and in the text checkpoint; fused in VL/memory.
    NameRow(
        "expert_gate",
        hub=f"{_LM}{_EXP}.{{expert}}.gate_proj.weight",
        text=f"model.{_EXP}.{{expert}}.gate_proj.weight",
        server=f"{_LM}{_EXP}.{{expert}}.gate_proj.weight",
        fuse="gate",
    ),
    NameRow(
        "expert_up",
        hub=f"{_LM}{_EXP}.{{expert}}.up_proj.weight",
        text=f"model.{_EXP}.{{expert}}.up_proj.weight",
        server=f"{_LM}{_EXP}.{{expert}}.up_proj.weight",
        fuse="up",
    ),
    NameRow(
        "expert_down",
        hub=f"{_LM}{_EXP}.{{expert}}.down_proj.weight",
        text=f"model.{_EXP}.{{expert}}.down_proj.weight",
        server=f"{_LM}{_EXP}.{{expert}}.down_proj.weight",
        fuse="down",
    ),
    NameRow(
        "fused_gate_up",
        hub=None,
        hf_omni=f"model.language_model.{_EXP}.gate_up_proj",
        vl=f"model.language_model.{_EXP}.gate_up_proj",
        text=f"model.{_EXP}.gate_up_proj",
        server=f"{_LM}{_EXP}.gate_up_proj",
        fused="gate_up",
    ),
    NameRow(
        "fused_down",
        hub=None,
        hf_omni=f"model.language_model.{_EXP}.down_proj",
        vl=f"model.language_model.{_EXP}.down_proj",
        text=f"model.{_EXP}.down_proj",
        server=f"{_LM}{_EXP}.down_proj",
        fused="down",
    ),
    # --- language model body and head
    NameRow(
        "lm",
        hub="thinker.model.{lm}",
        hf_omni="model.language_model.{lm}",
        vl="model.language_model.{lm}",
        text="model.{lm}",
        server="thinker.model.{lm}",
    ),
    NameRow(
        "lm_head",
        hub="thinker.lm_head.{p}",
        hf_omni="lm_head.{p}",
        vl="lm_head.{p}",
        text="lm_head.{p}",
        server="thinker.lm_head.{p}",
    ),
    # --- vision tower: the mergers are renamed, the rest keeps its names
    NameRow(
        "merger_norm",
        hub="thinker.visual.merger.ln_q.{p}",
        hf_omni="model.visual.merger.ln_q.{p}",
        vl="model.visual.merger.norm.{p}",
        frozen=True,
    ),
    NameRow(
        "merger_fc1",
        hub="thinker.visual.merger.mlp.0.{p}",
        hf_omni="model.visual.merger.mlp.0.{p}",
        vl="model.visual.merger.linear_fc1.{p}",
        frozen=True,
    ),
    NameRow(
        "merger_fc2",
        hub="thinker.visual.merger.mlp.2.{p}",
        hf_omni="model.visual.merger.mlp.2.{p}",
        vl="model.visual.merger.linear_fc2.{p}",
        frozen=True,
    ),
    NameRow(
        "deepstack_norm",
        hub="thinker.visual.merger_list.{i}.ln_q.{p}",
        hf_omni="model.visual.merger_list.{i}.ln_q.{p}",
        vl="model.visual.deepstack_merger_list.{i}.norm.{p}",
        frozen=True,
    ),
    NameRow(
        "deepstack_fc1",
        hub="thinker.visual.merger_list.{i}.mlp.0.{p}",
        hf_omni="model.visual.merger_list.{i}.mlp.0.{p}",
        vl="model.visual.deepstack_merger_list.{i}.linear_fc1.{p}",
        frozen=True,
    ),
    NameRow(
        "deepstack_fc2",
        hub="thinker.visual.merger_list.{i}.mlp.2.{p}",
        hf_omni="model.visual.merger_list.{i}.mlp.2.{p}",
        vl="model.visual.deepstack_merger_list.{i}.linear_fc2.{p}",
        frozen=True,
    ),
    NameRow(
        "visual",
        hub="thinker.visual.{vis}",
        hf_omni="model.visual.{vis}",
        vl="model.visual.{vis}",
        frozen=True,
    ),
    # --- audio tower: only in the audio checkpoint, under the ``audio_tower.`` prefix
    NameRow(
        "audio",
        hub="thinker.audio_tower.{rest}",
        hf_omni="model.audio_tower.{rest}",
        audio="audio_tower.{rest}",
        frozen=True,
    ),
    # --- speech output, never used by omni-grpo
    NameRow("talker", hub="{other}"),
)

# Source columns weight sync accepts, most specific first (a VL name is never a valid text name:
# ``model.{lm}`` cannot match ``model.language_model.*`` or ``model.visual.*``).
SYNC_SOURCES: tuple[Layout, ...] = ("vl", "hf_omni", "text", "audio", "server")


@dataclass(frozen=True)
class NameMatch:
    """A name resolved against the table: which row, and the values of its ``{groups}``."""

    row: NameRow
    groups: dict[str, str]

    def name_in(self, layout: Layout) -> str | None:
        template = getattr(self.row, layout)
        return None if template is None else template.format(**self.groups)


@cache
def _regex(template: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>{GROUP_PATTERNS[m.group(1)]})")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def match(name: str, layout: Layout) -> NameMatch | None:
    """The first table row whose ``layout`` column matches ``name`` exactly (or ``None``)."""
    for row in NAME_TABLE:
        template = getattr(row, layout)
        if template is None:
            continue
        m = _regex(template).fullmatch(name)
        if m:
            return NameMatch(row, m.groupdict())
    return None


# transformers releases before the thinker's ``model.{language_model,visual,audio_tower}`` nesting
# (e.g. 5.17, the GPU machine's version) keep the towers and the text model at the top level of the
# thinker. Their in-memory names are rewritten to the nested form before the table lookup, so one
# table serves both; a name that matches as it is never gets rewritten.
LEGACY_THINKER_PREFIXES: tuple[tuple[str, str], ...] = (
    ("audio_tower.", "model.audio_tower."),
    ("visual.", "model.visual."),
    ("model.", "model.language_model."),
)


def match_in_memory(name: str) -> NameMatch | None:
    """Resolve a thinker in-memory name, nested (current transformers) or flat (older releases)."""
    found = match(name, "hf_omni")
    if found is not None:
        return found
    for old, new in LEGACY_THINKER_PREFIXES:
        if name.startswith(old):
            return match(new + name[len(old) :], "hf_omni")
    return None


def _match_sync_source(name: str) -> NameMatch | None:
    for layout in SYNC_SOURCES:
        found = match(name, layout)
        if found is not None:
            return found
    return match_in_memory(name)


def match_hub(name: str) -> NameMatch:
    """Resolve a hub tensor name; any ``thinker.*`` name the table does not know is an error."""
    found = match(name, "hub")
    if found is None:
        raise UnmappedTensorError(
            f"tensor {name!r} matches no row of omni_extract.names.NAME_TABLE; refusing to drop it "
            "silently (is this really a Qwen3-Omni checkpoint, or a newer layout?)"
        )
    return found


# ----------------------------------------------------------------------------- weight sync


def is_server_syncable(name: str) -> bool:
    """Whether weight sync can send this (VL, text, in-memory or server) tensor to sglang-omni."""
    found = _match_sync_source(name)
    return found is not None and not found.row.frozen and found.row.server is not None


def to_server_name(name: str) -> str:
    """The name the sglang-omni thinker stage loads for a pseudo-VL, text or in-memory name.

    Fused experts keep their fused form (``...mlp.experts.gate_up_proj``); per-expert names stay
    per-expert. Tower tensors raise ``FrozenTensorError``; unknown names ``UnmappedTensorError``.
    """
    found = _match_sync_source(name)
    if found is not None:
        if found.row.frozen:
            raise FrozenTensorError(
                f"{name!r} belongs to a frozen tower ({found.row.key}); the sglang-omni encoders "
                "live in non-AR stages that cannot be refit (contract §4.7). Keep the towers "
                "frozen, or pass towers='skip' to to_server_tensors"
            )
        server = found.name_in("server")
        if server is None:
            raise UnmappedTensorError(f"{name!r} ({found.row.key}) has no server-side counterpart")
        return server
    raise UnmappedTensorError(
        f"{name!r} is not a pseudo-VL, text, thinker in-memory or server tensor name "
        "(omni_extract.names.NAME_TABLE); refusing to send a name the server would drop silently"
    )


def to_server_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    layout: Literal["hf_memory", "vl_hub"],
    towers: Literal["error", "skip"] = "error",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(server_name, tensor)`` ready for sglang-omni's ``update_weights_*``.

    ``layout`` says how FUSED experts are laid out in ``named_tensors`` and must be explicit,
    because the square-shape trap makes it undetectable in general:

    * ``"hf_memory"``: a transformers model's ``named_parameters()``/``state_dict()`` —
      ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; transposed here (contiguous copy).
    * ``"vl_hub"``: tensors read from our pseudo-VL files — already ``[E, H, 2I]`` / ``[E, I, H]``;
      passed through untouched.

    The server transposes fused experts unconditionally on load, so it must get the VL hub layout.
    Tower tensors raise ``FrozenTensorError`` unless ``towers="skip"``.
    """
    if layout not in ("hf_memory", "vl_hub"):
        raise ValueError(f"layout must be 'hf_memory' or 'vl_hub', got {layout!r}")
    if towers not in ("error", "skip"):
        raise ValueError(f"towers must be 'error' or 'skip', got {towers!r}")
    for name, tensor in named_tensors:
        if towers == "skip" and not is_server_syncable(name) and _is_tower(name):
            continue
        server = to_server_name(name)
        found = match(server, "server")
        assert found is not None  # every server template is in the table
        if found.row.fused is not None:
            if tensor.dim() != 3:
                raise ValueError(
                    f"fused expert {name!r} must be 3-D, got shape {tuple(tensor.shape)}"
                )
            if layout == "hf_memory":
                tensor = tensor.transpose(1, 2).contiguous()
        yield server, tensor


def _is_tower(name: str) -> bool:
    found = _match_sync_source(name)
    return found is not None and found.row.frozen
