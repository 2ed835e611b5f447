"""``rollout.engine: sglang-omni`` — rollouts on external sglang-omni servers over HTTP.

Built on ``omni_rollout_client`` (the contract lives there); this module is the trainer-facing
adapter that turns ``PromptInputs`` into requests and responses into ``Completion``s:

* Each prompt's ids and media tensors are validated and encoded ONCE (``PreparedPrompt``) and
  the same encoded bundle is sent for its ``n`` samples; a group goes to one server so its
  content-keyed encoder cache can hit.
* ``bf16_payload``: pixels and mel features travel as bfloat16 (half the bytes). The server then
  sees bf16-rounded inputs, so the prompt's ``mm`` tensors are REPLACED IN PLACE by the same
  rounded values (original dtype kept; bf16 values are exact in float32). The trainer's recompute
  then sees exactly what the server saw, keeping rollout and trainer logprobs comparable.
* Sampling params are always explicit (sglang-omni treats an omitted ``temperature`` as greedy)
  and validated for every group before the first request is sent. With ``sampling.seed`` set,
  each sample gets its own seed derived from (seed, prompt uid, sample index).
* Samples the server finished with ``abort`` are resumed (prompt + generated ids, remaining
  budget) up to ``max_resumes`` times; the completion's ``weight_version`` is that of its last
  segment.
* Media marker tokens (``banned_token_ids``, from the trainer) cannot be masked server-side:
  generation stops at a sampled marker and the sample is continued from just before it with a
  fresh seed (rejection = sampling with the markers masked, as the embedded engine does).
* If anything fails mid-rollout, every server gets abort-all (``pause(abort)`` + ``continue``:
  sglang-omni has no ``/abort_request``) so no orphaned requests keep the servers busy, and the
  error is raised — a group is never returned short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from omni_rollout_client.client import ModelInfo, OmniRolloutClient
from omni_rollout_client.payload import (
    BF16_CASTABLE,
    QWEN3_OMNI_MEDIA_IDS,
    MediaTokenIds,
    PreparedPrompt,
)
from omni_rollout_client.result import GenerateResult, concat_results
from omni_rollout_client.sampling import filter_sampling_params

from omni_grpo.aio import BackgroundLoop, gather
from omni_grpo.sglang import make_clients
from omni_grpo.types import Completion, PromptInputs, SamplingParams

log = logging.getLogger(__name__)

SEED_MODULUS = 1 << 31


class SglangOmniEngineError(RuntimeError):
    """The servers could not produce a complete rollout; nothing partial is returned."""


def sample_seeds(seed: int | None, uid: str, n: int) -> list[int] | None:
    """Distinct, reproducible per-sample seeds (None when the config sets no seed)."""
    if seed is None:
        return None
    base = (seed * 1_000_003 + zlib.crc32(uid.encode())) * max(n, 1)
    return [(base + i) % SEED_MODULUS for i in range(n)]


def sampling_params(sampling: SamplingParams) -> dict[str, Any]:
    """The ``sampling_params`` sent to the server, validated (raises before anything is sent).

    ``seed`` is left out here: it is set per sample. ``temperature`` is always explicit, and so is
    ``max_new_tokens`` (the server default is 2048, and resume needs the total budget).
    """
    raw: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
    }
    if sampling.stop_token_ids:
        raw["stop_token_ids"] = list(sampling.stop_token_ids)
    return filter_sampling_params(raw)


class SglangOmniEngine:
    """``RolloutEngine`` over sglang-omni servers (``rollout.sglang`` = ``SglangOmniConfig``)."""

    def __init__(
        self,
        cfg: Any,
        *,
        vocab_size: int | None = None,
        max_resumes: int = 2,
        loop: BackgroundLoop | None = None,
        clients: Sequence[OmniRolloutClient] | None = None,
        decode_fn: Callable[[list[int]], str] | None = None,
        banned_token_ids: Sequence[int] | None = None,
        max_rerolls: int = 8,
        media_ids: MediaTokenIds | None = None,
    ) -> None:
        """``media_ids``: the checkpoint's placeholder ids (``omni_grpo.sglang.checkpoint_media_ids``)
        for the audio-in-video refusal; default the released Qwen3-Omni ids."""
        if not (cfg.urls or cfg.router_url) and clients is None:
            raise ValueError("rollout.sglang: set urls (worker URLs) or router_url")
        self.cfg = cfg
        self.bf16_payload = bool(cfg.bf16_payload)
        self.max_resumes = max_resumes
        self._own_loop = loop is None
        self.loop = loop or BackgroundLoop("omni-grpo-rollout")
        self.media_ids = media_ids or QWEN3_OMNI_MEDIA_IDS
        self.clients = (
            list(clients)
            if clients is not None
            else make_clients(cfg, vocab_size=vocab_size, media_ids=self.media_ids)
        )
        self.vocab_size = vocab_size
        # Local decoding of the full id list (the trainer's tokenizer) is preferred over the
        # server's ``text``: a resumed sample's text would otherwise be two separately decoded
        # segments, which can split a multi-byte character at the seam.
        self.decode_fn = decode_fn
        # Media marker ids a completion must not contain (see ``_reroll_banned``).
        self.banned = frozenset(int(t) for t in banned_token_ids or ())
        self.max_rerolls = max_rerolls
        self.banned_rerolls = 0
        self._next_client = 0
        self._ready = False
        self.last_weight_versions: set[str] = set()

    @classmethod
    def from_rollout_config(
        cls,
        cfg: Any,
        *,
        vocab_size: int | None = None,
        decode_fn: Callable[[list[int]], str] | None = None,
        banned_token_ids: Sequence[int] | None = None,
        media_ids: MediaTokenIds | None = None,
        **_context: Any,
    ) -> SglangOmniEngine:
        """Registry hook (``omni_grpo.rollout.create_engine``): server settings from
        ``cfg.sglang``; the trainer's tokenizer (``decode_fn``), ``vocab_size`` and the
        checkpoint's placeholder ids (``media_ids``). The in-process context (policy module,
        device) does not apply to a remote engine."""
        return cls(
            cfg.sglang,
            vocab_size=vocab_size,
            decode_fn=decode_fn,
            banned_token_ids=banned_token_ids,
            media_ids=media_ids,
        )

    # ------------------------------------------------------------------ lifecycle

    def preflight(self) -> list[ModelInfo]:
        """Check every server answers ``/model_info`` (not /health_generate or /get_server_info,
        which sglang-omni lacks); return what they report."""

        async def probe(client: OmniRolloutClient) -> ModelInfo:
            try:
                return await client.model_info()
            except Exception as exc:
                raise SglangOmniEngineError(
                    f"sglang-omni server {client.base_url} failed preflight (/model_info): {exc}"
                ) from exc

        infos = self.loop.run(gather(probe(c) for c in self.clients), self.cfg.timeout_s + 30)
        for client, info in zip(self.clients, infos, strict=True):
            log.info(
                "sglang-omni %s: weight_version=%s model_path=%s thinker_tp=%s",
                client.base_url,
                info.weight_version,
                info.model_path,
                info.thinker_tp_sizes,
            )
        self._ready = True
        return infos

    def abort_all(self) -> None:
        """Drop every in-flight request on every server (pause(abort) + continue)."""
        self.loop.run(gather(c.abort_all() for c in self.clients), self.cfg.timeout_s + 30)

    def close(self) -> None:
        try:
            self.loop.run(gather(c.aclose() for c in self.clients), 30)
        finally:
            if self._own_loop:
                self.loop.close()

    # ------------------------------------------------------------------ rollout

    def prepare(self, prompt: PromptInputs) -> PreparedPrompt:
        """Encode one prompt; with bf16 payloads, round ``prompt.mm`` in place to what is sent."""
        prepared = PreparedPrompt.build(
            prompt.input_ids,
            prompt.mm,
            bf16=self.bf16_payload,
            vocab_size=self.vocab_size,
            use_audio_in_video=prompt.use_audio_in_video,
            media_ids=self.media_ids,
        )
        if self.bf16_payload:
            for name in BF16_CASTABLE & prompt.mm.keys():
                original = prompt.mm[name]
                prompt.mm[name] = (
                    prepared.tensors[name].to_torch().to(original.dtype).to(original.device)
                )
        return prepared

    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        """``n`` completions per prompt, in prompt order; raises rather than return a short group."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        params = sampling_params(sampling)  # fails before anything is sent
        if self.banned:
            # Stop as soon as a media marker is sampled (it is rerolled below, not kept).
            params["stop_token_ids"] = sorted(set(params.get("stop_token_ids", [])) | self.banned)
        seed = sampling.seed
        prepared = [self.prepare(p) for p in prompts]  # encoding errors also fail before sending
        if not self._ready:
            self.preflight()
        try:
            results = self.loop.run(self._generate_all(prompts, prepared, n, params, seed))
        except BaseException as exc:
            try:
                self.abort_all()
            except Exception as abort_exc:  # noqa: BLE001 - the rollout error is the one to raise
                log.error("abort_all after a failed rollout also failed: %s", abort_exc)
            cause = _first_leaf(exc)
            if isinstance(cause, Exception):
                raise SglangOmniEngineError(
                    f"sglang-omni rollout failed: {type(cause).__name__}: {cause}"
                ) from cause
            raise
        out: list[list[Completion]] = []
        versions: set[str] = set()
        for prompt, group in zip(prompts, results, strict=True):
            completions = []
            for r in group:
                completions.append(self._completion(prompt, r))
                versions.update(str(v) for v in r.weight_versions)
            out.append(completions)
        self.last_weight_versions = versions
        return out

    async def _generate_all(
        self,
        prompts: list[PromptInputs],
        prepared: list[PreparedPrompt],
        n: int,
        params: dict[str, Any],
        seed: int | None,
    ) -> list[list[GenerateResult]]:
        # Groups go round-robin over the servers, continuing across calls (a step with fewer
        # prompts than servers must not always land on the first ones).
        start, self._next_client = self._next_client, self._next_client + len(prompts)
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(
                    self._group(
                        self.clients[(start + i) % len(self.clients)], prompt, prep, n, params, seed
                    )
                )
                for i, (prompt, prep) in enumerate(zip(prompts, prepared, strict=True))
            ]
        return [t.result() for t in tasks]

    async def _group(
        self,
        client: OmniRolloutClient,
        prompt: PromptInputs,
        prep: PreparedPrompt,
        n: int,
        params: dict[str, Any],
        seed: int | None,
    ) -> list[GenerateResult]:
        seeds = sample_seeds(seed, prompt.sample.uid, n)
        metadata = {"omni_grpo_uid": prompt.sample.uid}
        group = await client.generate_group(
            prep, n, params, seeds=seeds, metadata=metadata, max_resumes=self.max_resumes
        )
        if not self.banned:
            return group
        return list(
            await asyncio.gather(
                *(
                    self._reroll_banned(
                        client, prep, r, params, None if seeds is None else seeds[i], metadata
                    )
                    for i, r in enumerate(group)
                )
            )
        )

    async def _reroll_banned(
        self,
        client: OmniRolloutClient,
        prep: PreparedPrompt,
        result: GenerateResult,
        params: dict[str, Any],
        seed: int | None,
        metadata: dict[str, Any],
    ) -> GenerateResult:
        """Resample past any media marker the server sampled (it cannot mask logits for us).

        A marker in a completion would make the trainer's recompute look for media that does not
        exist. The sample is cut just before the marker and continued from there (same prompt
        bundle, remaining budget, a fresh seed): sampling again at that position until a
        non-marker token comes is exactly sampling from the distribution with markers masked,
        which is what the embedded engine does, and every kept logprob is still the server's
        full-vocabulary logprob of that token. After ``max_rerolls`` the sample ends at the cut
        with ``finish_reason="abort"`` (never an empty or marker-bearing completion is hidden).
        """
        for attempt in range(1, self.max_rerolls + 1):
            cut = next((i for i, t in enumerate(result.token_ids) if t in self.banned), None)
            if cut is None:
                return result
            self.banned_rerolls += 1
            partial = dataclasses.replace(
                result,
                token_ids=result.token_ids[:cut],
                logprobs=result.logprobs[:cut],
                completion_tokens=cut,
                text="",
            )
            budget = dict(params, max_new_tokens=params["max_new_tokens"] - cut)
            if seed is not None:
                budget["seed"] = (seed + 7919 * attempt) % SEED_MODULUS
            continuation = await client.generate(
                prep.continued(partial.token_ids), budget, metadata=metadata
            )
            result = concat_results(partial, continuation)
        cut = next((i for i, t in enumerate(result.token_ids) if t in self.banned), None)
        if cut is None:
            return result
        log.warning(
            "a sample kept sampling media markers after %d rerolls; cut at %d tokens",
            self.max_rerolls,
            cut,
        )
        return dataclasses.replace(
            result,
            token_ids=result.token_ids[:cut],
            logprobs=result.logprobs[:cut],
            completion_tokens=cut,
            finish_reason="abort",
        )

    def _completion(self, prompt: PromptInputs, r: GenerateResult) -> Completion:
        if len(r.token_ids) != len(r.logprobs):
            raise SglangOmniEngineError(
                f"sample of {prompt.sample.uid}: {len(r.token_ids)} ids but {len(r.logprobs)} logprobs"
            )
        if len(set(r.weight_versions)) > 1:
            log.warning(
                "sample of %s spans weight versions %s (resumed across an update)",
                prompt.sample.uid,
                r.weight_versions,
            )
        return Completion(
            prompt=prompt,
            token_ids=list(r.token_ids),
            logprobs=list(r.logprobs),
            finish_reason=r.finish_reason,
            weight_version=str(r.weight_version) if r.weight_version is not None else "default",
            text=self.decode_fn(list(r.token_ids)) if self.decode_fn is not None else r.text,
        )


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups raised by ``asyncio.TaskGroup``."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
