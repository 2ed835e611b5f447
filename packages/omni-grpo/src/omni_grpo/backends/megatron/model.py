"""The thinker on megatron-core: GPTModel language model + frozen HF towers outside Megatron.

What the model sees equals the HF Omni thinker (design.md "one definition of what the thinker sees"):

1. word embeddings (``[S, B, H]``, this rank's sequence window under SP);
2. audio rows from omni-audio-inject's frozen tower, scattered into the window;
3. image / video rows from the frozen visual tower + merger, scattered the same way;
4. M-RoPE from EXPLICIT ``[3, B, S]`` position ids (omni-rope) — never derived by the model;
5. deepstack: the visual tower's deepstack features are ADDED to the hidden states at visual
   positions after decoder layers ``0 .. len(deepstack)-1`` (forward hooks on those layers);
6. the decoder and the untied LM head (vocab-parallel logits).

The visual tower is transformers' ``Qwen3VLMoeVisionModel`` built from the extracted ``vl``
config and loaded from its ``model.visual.*`` tensors; it stays frozen, replicated, and out of the
optimizer, DDP and weight sync (towers cannot be refit on the server).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_grpo.backends.megatron._mcore import mcore
from omni_grpo.backends.megatron.config_map import (
    ExpertsImpl,
    MegatronModelArgs,
    megatron_model_args,
)
from omni_grpo.backends.megatron.layers import InterleavedMRope, thinker_block_spec
from omni_grpo.backends.megatron.names import ShardSpec, hf_shapes_check, megatron_tensor_from_hf

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {"silu": F.silu}


# ----------------------------------------------------------------------------- config / build
def build_transformer_config(args: MegatronModelArgs, **overrides: Any) -> Any:
    kw = dict(args.transformer)
    kw["activation_func"] = _ACTIVATIONS[kw["activation_func"]]
    kw["params_dtype"] = _DTYPES[kw["params_dtype"]]
    kw["pipeline_dtype"] = _DTYPES[kw["pipeline_dtype"]]
    kw.update(overrides)
    return mcore().TransformerConfig(**kw)


def build_language_model(args: MegatronModelArgs, config: Any | None = None) -> Any:
    """A ``GPTModel`` (local spec, our norms/experts/rotary) for this rank; weights not yet loaded."""
    m = mcore()
    config = config if config is not None else build_transformer_config(args)
    spec = thinker_block_spec(config.num_layers, args.num_experts, args.experts_impl)
    model = m.GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=args.share_embeddings_and_output_weights,
        position_embedding_type="mrope",
        rotary_base=int(args.rotary_base),
    )
    # Qwen3's interleaved M-RoPE replaces megatron's chunked MultimodalRotaryEmbedding.
    model.rotary_pos_emb = InterleavedMRope(
        args.head_dim, args.rotary_base, args.mrope_section, args.mrope_interleaved
    )
    dev = next(model.parameters()).device
    model.rotary_pos_emb.to(dev)
    return model


def current_shard() -> ShardSpec:
    ps = mcore().parallel_state
    return ShardSpec(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
    )


# ----------------------------------------------------------------------------- weights
class SafetensorsDir:
    """Lazy name -> tensor access over a (sharded) safetensors checkpoint directory."""

    def __init__(self, root: str | Path) -> None:
        from safetensors import safe_open

        self.root = Path(root)
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.root}: no *.safetensors files")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._where: dict[str, Path] = {}
        for f, h in self._handles.items():
            for k in h.keys():  # noqa: SIM118 (safe_open is not iterable)
                self._where[k] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.root}: tensor {name!r} not found in the checkpoint")
        return self._handles[self._where[name]].get_tensor(name)


def load_language_model(
    model: nn.Module, vl_dir: str | Path, args: MegatronModelArgs, shard: ShardSpec
) -> list[str]:
    """Fill every parameter of ``model`` from the extracted vl checkpoint through the name table.

    Returns the HF names consumed. Raises if a parameter has no table row, a source tensor is
    missing, or a shape differs; LM tensors of the checkpoint that no parameter consumed raise too
    (nothing is dropped silently).
    """
    src = SafetensorsDir(vl_dir)
    cfg = args.transformer
    used: set[str] = set()
    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in cache:
            t = src.get(name)
            hf_shapes_check(name, t, cfg["hidden_size"], cfg["moe_ffn_hidden_size"])
            cache.clear() if len(cache) > 4 else None
            cache[name] = t
        used.add(name)
        return cache[name]

    with torch.no_grad():
        for name, param in model.named_parameters():
            t = megatron_tensor_from_hf(
                name,
                get,
                num_heads=cfg["num_attention_heads"],
                num_query_groups=cfg["num_query_groups"],
                num_experts=cfg["num_moe_experts"],
                shard=shard,
            )
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: checkpoint gives shape {tuple(t.shape)}, parameter is {tuple(param.shape)}"
                )
            param.copy_(t.to(param.dtype))
    lm = {k for k in src if k.startswith("model.language_model.") or k.startswith("lm_head.")}
    unused = sorted(lm - used)
    if unused:
        raise ValueError(
            f"{vl_dir}: {len(unused)} language-model tensors were not loaded, e.g. {unused[:5]}"
        )
    return sorted(used)


def load_visual(vl_dir: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """transformers' Qwen3-VL vision tower (patch embed, blocks, merger, deepstack mergers), frozen."""
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    cfg = Qwen3VLMoeConfig.from_pretrained(str(vl_dir))
    visual = Qwen3VLMoeVisionModel._from_config(cfg.vision_config, torch_dtype=dtype)
    src = SafetensorsDir(vl_dir)
    prefix = "model.visual."
    state = {k[len(prefix) :]: src.get(k) for k in src if k.startswith(prefix)}
    missing, unexpected = visual.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{vl_dir}: visual tower missing {missing[:5]} unexpected {unexpected[:5]}"
        )
    visual.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return visual


def run_visual(
    visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merged embeddings ``[N, H]`` and deepstack features (list of ``[N, H]``) across transformers versions."""
    dtype = next(visual.parameters()).dtype
    out = visual(pixel_values.to(dtype), grid_thw=grid_thw)
    if isinstance(out, tuple):
        return out[0], list(out[1])
    return out.pooler_output, list(out.deepstack_features)


# ----------------------------------------------------------------------------- the thinker
def _window_scatter(
    window: torch.Tensor,
    full_mask: torch.Tensor,
    rows: torch.Tensor,
    start: int,
    end: int,
    add: bool,
) -> torch.Tensor:
    """Place (or add) ``rows`` at ``full_mask`` positions inside a ``[s, B, H]`` sequence window."""
    from omni_audio_inject import scatter_audio_window

    wb = window.transpose(0, 1)  # [B, s, H]
    if add:
        delta = scatter_audio_window(torch.zeros_like(wb), full_mask, rows, start, end)
        return (wb + delta).transpose(0, 1).contiguous()
    return scatter_audio_window(wb, full_mask, rows, start, end).transpose(0, 1).contiguous()


class MegatronThinker(nn.Module):
    """Forward of the whole thinker with the LM on megatron-core; returns vocab-parallel logits.

    ``forward(input_ids [B,S], position_ids [3,B,S], mm)`` -> logits ``[B, S, V/tp]``.
    ``mm`` holds the processed media tensors (``omni_grpo.types.MM_TENSOR_KEYS``).
    """

    def __init__(
        self,
        args: MegatronModelArgs,
        lm: nn.Module,
        *,
        visual: nn.Module | None = None,
        audio: Any | None = None,  # omni_audio_inject.AudioInjector
    ) -> None:
        super().__init__()
        self.args = args
        self.lm = lm
        self._visual = [visual]  # a list: keeps the frozen tower out of parameters()/state_dict()
        self.audio = audio
        self._deepstack: list[torch.Tensor] | None = None
        self._visual_mask: torch.Tensor | None = None
        self._window = (0, 0)
        for i in range(args.deepstack_layers):
            if i < len(lm.decoder.layers):
                lm.decoder.layers[i].register_forward_hook(self._make_deepstack_hook(i))

    @property
    def visual(self) -> nn.Module | None:
        return self._visual[0]

    def _make_deepstack_hook(self, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
            if self._deepstack is None or index >= len(self._deepstack):
                return output
            hidden = output[0] if isinstance(output, tuple) else output
            start, end = self._window
            hidden = _window_scatter(
                hidden, self._visual_mask, self._deepstack[index], start, end, add=True
            )
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def _sequence_window(self, seq_len: int) -> tuple[int, int]:
        cfg = self.lm.config
        if not cfg.sequence_parallel:
            return 0, seq_len
        ps = mcore().parallel_state
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if seq_len % tp:
            raise ValueError(
                f"sequence length {seq_len} must be a multiple of tp={tp} under sequence parallelism"
            )
        chunk = seq_len // tp
        return rank * chunk, (rank + 1) * chunk

    def _visual_rows(
        self, input_ids: torch.Tensor, mm: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
        ids = self.args.token_ids
        out = []
        for pix_key, grid_key, tok_key in (
            ("pixel_values", "image_grid_thw", "image_token_id"),
            ("pixel_values_videos", "video_grid_thw", "video_token_id"),
        ):
            pix = mm.get(pix_key)
            mask = input_ids == ids[tok_key] if tok_key in ids else None
            if pix is None:
                if mask is not None and bool(mask.any()):
                    raise ValueError(
                        f"input_ids hold {tok_key} placeholders but no {pix_key} were given"
                    )
                continue
            if self.visual is None:
                raise ValueError(f"{pix_key} given but the model has no visual tower")
            with torch.no_grad():
                embeds, deepstack = run_visual(
                    self.visual, pix.to(input_ids.device), mm[grid_key].to(input_ids.device)
                )
            if int(mask.sum()) != embeds.shape[0]:
                raise ValueError(
                    f"{tok_key}: {int(mask.sum())} placeholders but the tower produced {embeds.shape[0]} rows"
                )
            out.append((mask, embeds, deepstack))
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mm: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        mm = mm or {}
        b, s = input_ids.shape
        if tuple(position_ids.shape) != (3, b, s):
            raise ValueError(
                f"position_ids must be [3, {b}, {s}] (explicit M-RoPE ids), got {tuple(position_ids.shape)}"
            )
        start, end = self._window = self._sequence_window(s)
        emb = self.lm.embedding(input_ids=input_ids, position_ids=None)  # [s_local, B, H]
        if self.audio is not None:
            window = None if (start, end) == (0, s) else (start, end)
            emb = (
                self.audio.inject(
                    input_ids,
                    emb.transpose(0, 1),
                    mm.get("input_features"),
                    mm.get("feature_attention_mask"),
                    window=window,
                    full_input_ids=input_ids,
                )
                .transpose(0, 1)
                .contiguous()
            )
        elif mm.get("input_features") is not None:
            raise ValueError("input_features given but the model has no audio tower (audio_dir)")
        visual = self._visual_rows(input_ids, mm)
        self._deepstack, self._visual_mask = None, None
        if visual:
            vmask = torch.zeros_like(input_ids, dtype=torch.bool)
            for mask, embeds, _ in visual:
                emb = _window_scatter(emb, mask, embeds.to(emb.dtype), start, end, add=False)
                vmask |= mask
            if self.args.deepstack_layers:
                levels = len(visual[0][2])
                joint = []
                for level in range(levels):
                    rows = torch.zeros(
                        int(vmask.sum()), emb.shape[-1], device=emb.device, dtype=emb.dtype
                    )
                    for mask, _, ds in visual:
                        rows[mask[vmask]] = ds[level].to(emb.dtype)
                    joint.append(rows)
                self._deepstack, self._visual_mask = joint, vmask
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
        try:
            return self.lm(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=causal,
                decoder_input=emb,
            )
        finally:
            self._deepstack, self._visual_mask = None, None

    def trainable_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.lm.named_parameters() if p.requires_grad)


def read_vl_config(vl_dir: str | Path) -> dict[str, Any]:
    path = Path(vl_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{path}: extracted vl config not found (run omni-extract variant 'vl')"
        ) from exc


# ----------------------------------------------------------------------------- process groups, the whole thinker
def init_parallel(megatron: Any, seed: int = 0, backend: str | None = None) -> None:
    """Initialise torch.distributed (torchrun env, or a 1-process world) and megatron's groups.

    As megatron-core does it: ``torch.distributed`` from the ``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_*`` environment (a process group someone else initialised is kept), then
    ``parallel_state.initialize_model_parallel(tp, pp, ep, etp=1)``.
    """
    ps = mcore().parallel_state
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            from omni_grpo.serve import free_port

            # A one-process world on a port the OS says is free, passed to this call alone: a
            # fixed port, or one written to os.environ (inherited by every child process, which
            # then tried to bind it while this process held it), failed with EADDRINUSE.
            port = free_port("127.0.0.1")
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=megatron.tp,
            pipeline_model_parallel_size=megatron.pp,
            expert_model_parallel_size=megatron.ep,
            expert_tensor_parallel_size=1,
        )
    if torch.cuda.is_available():
        mcore().model_parallel_cuda_manual_seed(seed)


def build_thinker(
    vl_dir: str | Path,
    megatron: Any,
    *,
    audio_dir: str | Path | None = None,
    experts_impl: ExpertsImpl = "grouped",
    freeze_lm_head: bool = False,
) -> MegatronThinker:
    """The Megatron thinker for this rank, weights loaded from omni-extract's ``vl`` (+ ``audio``) output."""
    cfg = read_vl_config(vl_dir)
    args = megatron_model_args(
        cfg,
        megatron,
        world_size=dist.get_world_size(),
        experts_impl=experts_impl,
        source=str(Path(vl_dir) / "config.json"),
    )
    lm = build_language_model(args, build_transformer_config(args))
    load_language_model(lm, vl_dir, args, current_shard())
    if freeze_lm_head:
        lm.output_layer.weight.requires_grad_(False)
    dev = next(lm.parameters()).device
    dtype = next(lm.parameters()).dtype
    visual = load_visual(vl_dir, dev, dtype) if "vision_config" in cfg else None
    audio = None
    if audio_dir is not None:
        from omni_audio_inject import AudioInjector, FrozenAudioTower

        audio = AudioInjector(FrozenAudioTower(audio_dir), int(args.token_ids["audio_token_id"]))
    return MegatronThinker(args, lm, visual=visual, audio=audio)


@contextmanager
def no_op() -> Iterator[None]:
    yield
