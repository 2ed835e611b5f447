"""The Qwen3-Omni thinker, composed: HF Qwen3-VL-MoE + Omni TM-RoPE + the frozen audio tower.

``OmniThinker`` takes exactly the inputs of transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration``
and returns the same logits, but trains as a plain Qwen3-VL-MoE: its parameters and ``state_dict``
names are the VL model's (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``), which
is what Megatron-Bridge, sglang-omni's loaders and omni-extract's inverse name map speak.

How the pieces attach (the same two hook points a Megatron model uses):

* positions in: Omni 3-D positions are computed here (omni-rope) and passed as ``position_ids``,
  so the VL model's own rope index (which has no time scaling and no audio) is never used;
* embeddings in -> embeddings out: omni-audio-inject's hook on ``embed_tokens`` fills the
  ``<|audio_pad|>`` rows from the frozen tower before VL scatters image/video rows (the reference
  order: audio first). The tower is no submodule: it is invisible to the optimizer, DDP/FSDP,
  ``state_dict()`` and weight sync.

KV-cached decoding follows the HF convention: a forward on an empty cache (the prompt) stores
``rope_deltas``; later forwards with a non-empty cache continue positions from them. Pass the cache
as ``cache=`` (or ``past_key_values=``) and read it back from the output.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from omni_audio_inject import AudioInjector, PlaceholderCountError, audio_output_lengths
from omni_rope import OmniRopeConfig, positions_from_mm
from torch import nn

from omni_grpo.models.item_cache import reuse_tower_outputs
from omni_grpo.models.kernel_switch import recompute_context
from omni_grpo.models.positions import decode_positions
from omni_grpo.models.rotary_kernel import install_fused_rotary
from omni_grpo.models.sideband import OmniSideband
from omni_grpo.models.vision_dedup import deduplicate_vision_items


def cache_arg_name(forward: Any) -> str:
    """The keyword under which this transformers version passes the KV cache (renamed in 5.2x)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _seq_length(cache: Any) -> int:
    if cache is None:
        return 0
    return int(cache.get_seq_length())


class OmniThinker(nn.Module):
    """Qwen3-Omni thinker over a Qwen3-VL-MoE module tree (see module docstring).

    Build it with :func:`omni_grpo.models.load_thinker`. Children are the VL model's own
    (``model``, ``lm_head``), so names match a VL checkpoint; the VL wrapper object itself and the
    audio injector are held as plain attributes.
    """

    def __init__(
        self,
        vl: nn.Module,
        sideband: OmniSideband,
        injector: AudioInjector,
        rope_config: OmniRopeConfig,
        source_dir: Path,
        audio_dir: Path | None,
    ) -> None:
        super().__init__()
        self.model = vl.model
        self.lm_head = vl.lm_head
        self.config = vl.config
        object.__setattr__(self, "_vl", vl)  # not a child: its children are already ours
        self.sideband = sideband
        self.audio = injector
        self.rope_config = rope_config
        self.source_dir = Path(source_dir)
        self.audio_dir = Path(audio_dir) if audio_dir is not None else None
        self.rope_deltas: torch.Tensor | None = None
        self._vl_cache_name = cache_arg_name(vl.forward)
        self._hook = injector.attach(vl.get_input_embeddings())
        visual = getattr(vl.model, "visual", None)
        if visual is not None:  # a training row repeats its prompt's pixels: encode them once
            deduplicate_vision_items(visual)
        reuse_tower_outputs(self)  # the trainer's forwards find what the rollout's encoded
        install_fused_rotary(vl.model.language_model.layers)  # one kernel, torch's bits

    @property
    def vl(self) -> nn.Module:
        """The HF ``Qwen3VLMoeForConditionalGeneration`` sharing this module's parameters."""
        return self._vl

    def train(self, mode: bool = True) -> OmniThinker:
        """Also flips the VL wrapper's own flag (it is not a child, so ``nn.Module.train`` misses it)."""
        super().train(mode)
        self._vl.training = mode
        return self

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # ------------------------------------------------------------------ positions

    def compute_position_ids(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        use_audio_in_video: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Omni 3-D positions ``[3, B, L]`` and rope deltas ``[B, 1]`` for a full (prefill) sequence.

        ``use_audio_in_video``: ``True``/``False`` state it for every video of the batch (as
        transformers does; a mismatch with the tokens raises); ``None`` reads it per video from the
        tokens (``<vision_start><audio_start>``), which also positions mixed batches correctly.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        media = {
            "image_grid_thw": image_grid_thw,
            "video_grid_thw": video_grid_thw,
            "video_second_per_grid": video_second_per_grid,
            "feature_attention_mask": feature_attention_mask,
        }
        return positions_from_mm(
            input_ids,
            attention_mask,
            {k: v for k, v in media.items() if v is not None},
            self.rope_config,
            use_audio_in_video=use_audio_in_video,
        )

    def audio_token_counts(self, feature_attention_mask: torch.Tensor) -> torch.Tensor:
        """Placeholders each audio needs (for expanding ``<|audio_pad|>`` by hand)."""
        return audio_output_lengths(feature_attention_mask.sum(-1), self.sideband.audio_n_window)

    def _check_audio_counts(
        self,
        input_ids: torch.Tensor,
        input_features: torch.Tensor | None,
        feature_attention_mask: torch.Tensor | None,
    ) -> None:
        """Placeholders vs. the tokens the audio lengths imply, before positions or the tower run.

        The same count is checked again against the tower's actual output at scatter time; this
        early check gives the clear message before omni-rope reports a malformed layout.
        """
        placeholders = int((input_ids == self.sideband.audio_token_id).sum())
        if input_features is None:
            expected = 0
        else:
            if feature_attention_mask is None:
                frames = torch.full((input_features.shape[0],), input_features.shape[-1])
            else:
                frames = feature_attention_mask.sum(-1)
            expected = int(audio_output_lengths(frames, self.sideband.audio_n_window).sum())
        if placeholders != expected:
            raise PlaceholderCountError(
                placeholders,
                expected,
                "expected from feature_attention_mask"
                if input_features is not None
                else "no input_features were given",
            )

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        use_audio_in_video: bool | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        past_key_values: Any = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        """Same inputs as ``Qwen3OmniMoeThinkerForConditionalGeneration.forward``; returns ``.logits``.

        ``input_ids`` is required (placeholders are found by id, never by comparing embeddings).
        ``labels`` gives the usual shifted cross-entropy ``.loss``. ``use_audio_in_video=None`` (the
        default) detects audio-in-video per video from the tokens; see :meth:`compute_position_ids`. ``inputs_embeds`` and
        ``audio_feature_lengths`` are not supported: pass ids and ``feature_attention_mask``.
        """
        if input_ids is None:
            raise ValueError("OmniThinker.forward needs input_ids (placeholders are found by id)")
        for unsupported in ("inputs_embeds", "audio_feature_lengths", "mm_token_type_ids"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"OmniThinker.forward does not take {unsupported}")
            kwargs.pop(unsupported, None)
        cache = cache if cache is not None else past_key_values
        past = _seq_length(cache)
        # A decode step (cache filled, no features) embeds any sampled id as a plain token, like
        # transformers; every other forward is checked strictly.
        decode_step = past > 0 and input_features is None
        # the early check serves omni-rope's positions; with the caller's (the trainer computes
        # them on the host) it would only read two counts back from the GPU, stalling the host
        # at each forward's start: the injection checks the counts again at scatter time
        if not decode_step and position_ids is None:
            self._check_audio_counts(input_ids, input_features, feature_attention_mask)
        if position_ids is None:
            if past == 0:
                position_ids, self.rope_deltas = self.compute_position_ids(
                    input_ids,
                    attention_mask,
                    image_grid_thw,
                    video_grid_thw,
                    video_second_per_grid,
                    feature_attention_mask,
                    use_audio_in_video,
                )
            else:
                if self.rope_deltas is None or self.rope_deltas.shape[0] != input_ids.shape[0]:
                    raise RuntimeError(
                        "decoding with a non-empty cache needs the rope deltas of a prefill forward "
                        "of the same batch (run the prompt through forward first)"
                    )
                position_ids = decode_positions(
                    self.rope_deltas, past, input_ids.shape[1], attention_mask, input_ids.device
                )
        if cache is not None:
            kwargs[self._vl_cache_name] = cache
        feeding = (
            nullcontext()
            if decode_step
            else self.audio.feeding(input_features, feature_attention_mask)
        )
        with feeding:
            return self._vl(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )

    # ------------------------------------------------------------------ trainer helpers

    def trainable_parameter_names(self) -> list[str]:
        """Names (VL naming) of parameters with ``requires_grad``; the audio tower never appears."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What to hand the optimizer."""
        return [p for p in self.parameters() if p.requires_grad]

    def sync_state_dict(self, trainable_only: bool = True) -> dict[str, torch.Tensor]:
        """Weights to push to a rollout engine (VL names, HF in-memory layout).

        Only what training changes by default: frozen parts (the vision tower unless unfrozen) are
        already on the server, and the audio tower is never among them (not a parameter at all).
        Feed to ``omni_extract``'s ``to_server_tensors(..., layout="hf_memory")`` for server names.
        """
        state = self.state_dict()
        if trainable_only:
            keep = set(self.trainable_parameter_names())
            state = {k: v for k, v in state.items() if k in keep}
        return dict(state)

    def set_frozen(self, *, visual: bool = True, lm_head: bool = False) -> None:
        """Freeze the vision tower (default) and optionally the LM head; everything else trains."""
        for name, param in self.named_parameters():
            frozen = (visual and name.startswith("model.visual.")) or (
                lm_head and name.startswith("lm_head.")
            )
            param.requires_grad_(not frozen)

    def gradient_checkpointing_enable(
        self, use_reentrant: bool = False, context_fn: Any = None
    ) -> None:
        """Activation checkpointing of the decoder layers (delegates to the VL model).

        Non-reentrant by default: with frozen embeddings (LoRA) the reentrant variant would see
        inputs that need no grad and drop the adapters' gradients. transformers renamed the
        method (``activation_checkpointing_enable``) and its keyword; both spellings are served.
        ``context_fn``: torch's checkpoint contexts (the selective policy's), passed through.

        Otherwise the non-reentrant recompute runs under ``kernel_switch.recompute_context``: in
        exact mode (``rollout.exact_logprobs``) it rebuilds the activations with torch's kernels
        (it only serves the gradients; the logprobs came from the first forward). With the option
        off the context sets a flag nothing reads: the same kernels, the same numbers. (The
        selective policy and exact mode are refused together: ``config.exact_logprobs_refusals``.)
        """
        kwargs: dict[str, Any] = {"use_reentrant": use_reentrant}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        elif not use_reentrant:
            kwargs["context_fn"] = recompute_context
        enable = getattr(self._vl, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            self._vl.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
