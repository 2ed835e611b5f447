"""What sglang-omni 0.1.9's thinker loader does with each tensor name of a disk weight update.

Restated from ``Qwen3OmniThinkerForCausalLM.load_weights`` (contract §4.5), independently of
omni-extract's name table, so the fake server can check a ``/update_weights_from_disk`` directory
the way the real loader would consume it: per name, ``model.language_model.`` becomes ``model.``
and a leading ``thinker.`` is stripped; ``talker.*``, ``code2wav.*``, ``audio_tower.*`` and
``visual.*`` are skipped (other stages or non-AR encoders); q/k/v fold into ``qkv_proj``, dense
gate/up into ``gate_up_proj``, experts (per-expert 2-D or fused, the fused ones transposed
unconditionally, i.e. expected in the Qwen3-VL hub layout) into the FusedMoE weights. Whatever
matches no parameter is DROPPED by the real loader without an error — the hazard this check
exists for. With the thinker's text config, shapes are checked too, and the parameters a
complete checkpoint leaves unloaded are listed (``missing``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SKIPPED_PREFIXES = ("talker.", "code2wav.", "audio_tower.", "visual.")
_LAYER = r"model\.layers\.(?P<layer>\d+)\."
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("embed", r"model\.embed_tokens\.weight"),
        ("norm", r"model\.norm\.weight"),
        ("lm_head", r"lm_head\.weight"),
        ("layer_norm", _LAYER + r"(?P<which>input_layernorm|post_attention_layernorm)\.weight"),
        ("qkv", _LAYER + r"self_attn\.(?P<which>[qkv])_proj\.weight"),
        ("o", _LAYER + r"self_attn\.o_proj\.weight"),
        ("qk_norm", _LAYER + r"self_attn\.(?P<which>[qk])_norm\.weight"),
        ("router", _LAYER + r"mlp\.gate\.weight"),
        ("expert", _LAYER + r"mlp\.experts\.(?P<expert>\d+)\.(?P<which>gate|up|down)_proj\.weight"),
        ("fused", _LAYER + r"mlp\.experts\.(?P<which>gate_up|down)_proj"),
        ("dense", _LAYER + r"mlp\.(?P<which>gate|up|down)_proj\.weight"),
    )
)


@dataclass
class LoaderReport:
    """``loaded``: names the loader consumes; ``skipped``: other stages / encoders; ``dropped``:
    names it would silently ignore; ``bad_shapes``: ``name: got vs want`` lines; ``missing``: thinker
    parameters nothing in the directory loads (only meaningful for a full checkpoint)."""

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    bad_shapes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.dropped and not self.bad_shapes


def loader_name(name: str) -> str | None:
    """The name after the loader's prefix rewriting, or ``None`` when the loader skips it."""
    name = name.replace("model.language_model.", "model.")
    name = name.removeprefix("thinker.")
    if name.startswith(SKIPPED_PREFIXES):
        return None
    return name


def _headers(directory: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return out


def _text_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return config.get("thinker_config", {}).get("text_config") or config.get("text_config")


def _want(kind: str, m: re.Match[str], text: dict[str, Any]) -> list[int] | None:
    h, v = int(text["hidden_size"]), int(text["vocab_size"])
    heads, kv = int(text["num_attention_heads"]), int(text["num_key_value_heads"])
    d = int(text.get("head_dim") or h // heads)
    e, i = int(text["num_experts"]), int(text["moe_intermediate_size"])
    which = m.groupdict().get("which")
    if kind in ("embed", "lm_head"):
        return [v, h]
    if kind in ("norm", "layer_norm"):
        return [h]
    if kind == "qkv":
        return [(heads if which == "q" else kv) * d, h]
    if kind == "o":
        return [h, heads * d]
    if kind == "qk_norm":
        return [d]
    if kind == "router":
        return [e, h]
    if kind == "expert":
        return [h, i] if which == "down" else [i, h]
    if kind == "fused":
        return [e, h, 2 * i] if which == "gate_up" else [e, i, h]
    return None  # dense MLP layers: sizes depend on mlp_only_layers, not checked


def _params(text: dict[str, Any]) -> set[str]:
    """The loader-side parameter groups a complete thinker checkpoint must fill."""
    out = {"embed", "norm", "lm_head"}
    for layer in range(int(text["num_hidden_layers"])):
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "q",
            "k",
            "v",
            "o",
            "q_norm",
            "k_norm",
            "router",
            "gate_up",
            "down",
        ):
            out.add(f"{layer}.{part}")
    return out


def _group(kind: str, m: re.Match[str]) -> set[str]:
    g = m.groupdict()
    layer, which = g.get("layer"), g.get("which")
    if kind in ("embed", "norm", "lm_head"):
        return {kind}
    if kind == "layer_norm":
        return {f"{layer}.{which}"}
    if kind == "qkv":
        return {f"{layer}.{which}"}
    if kind == "qk_norm":
        return {f"{layer}.{which}_norm"}
    if kind == "o":
        return {f"{layer}.o"}
    if kind == "router":
        return {f"{layer}.router"}
    if kind in ("expert", "fused"):
        return {f"{layer}.{'down' if which == 'down' else 'gate_up'}"}
    return set()


def check_names(shapes: dict[str, list[int]], config: dict[str, Any] | None = None) -> LoaderReport:
    """Classify every name as the real loader would (see the module docstring)."""
    text = _text_config(config)
    report = LoaderReport()
    filled: set[str] = set()
    for name, shape in shapes.items():
        mapped = loader_name(name)
        if mapped is None:
            report.skipped.append(name)
            continue
        hit = next(((k, m) for k, rx in _RULES if (m := rx.fullmatch(mapped))), None)
        if hit is None:
            report.dropped.append(name)
            continue
        kind, m = hit
        if text is not None:
            layer = m.groupdict().get("layer")
            expert = m.groupdict().get("expert")
            if (
                layer is not None
                and int(layer) >= int(text["num_hidden_layers"])
                or (expert is not None and int(expert) >= int(text["num_experts"]))
            ):
                report.dropped.append(name)
                continue
            want = _want(kind, m, text)
            if want is not None and list(shape) != want:
                report.bad_shapes.append(f"{name}: {list(shape)} vs {want}")
                continue
        report.loaded.append(name)
        filled |= _group(kind, m)
    if text is not None:
        tied = bool((config or {}).get("tie_word_embeddings") or text.get("tie_word_embeddings"))
        report.missing = sorted(_params(text) - filled - ({"lm_head"} if tied else set()))
    return report


def check_disk_checkpoint(
    directory: str | Path, config: dict[str, Any] | None = None
) -> LoaderReport:
    """Check a weight directory; ``config`` defaults to its own ``config.json`` when it has one."""
    directory = Path(directory)
    if config is None and (directory / "config.json").is_file():
        config = json.loads((directory / "config.json").read_text())
    return check_names(_headers(directory), config)
