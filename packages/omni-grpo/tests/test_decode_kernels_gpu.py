"""The default path's decode-step forwards (``models.decode_kernels``) on CUDA in bf16: the
rollout they sample scores in the trainer as transformers' and peft's forwards' rollout does."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from omni_grpo.testing.rollouts import rollout_world

    return rollout_world(tmp_path_factory.mktemp("decode_gpu"), n_prompts=3, max_new_tokens=3)


def _lengths(prompts: list[Any], n: int) -> list[int]:
    return [[2, 5, 24, 9][j % 4] + i for i in range(len(prompts)) for j in range(n)]


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_decode_kernels_sample_what_the_trainer_scores(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, batching: str
) -> None:
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.models import decode_kernels as dk
    from omni_grpo.rollout.embedded import EmbeddedEngine
    from omni_grpo.trainer import media_token_ids
    from omni_grpo.types import GRPOBatch, SamplingParams

    swaps: list[int] = []
    inner = dk.decode_kernels

    @contextlib.contextmanager
    def counted(thinker: Any, on: Any = None) -> Iterator[int]:
        with inner(thinker, on) as n:
            swaps.append(n)
            yield n

    monkeypatch.setattr("omni_grpo.models.generation.decode_kernels", counted)
    diffs = {}
    for on in (False, True):
        monkeypatch.setenv("OMNI_GRPO_DECODE_KERNELS", "1" if on else "0")
        model = copy.deepcopy(world["base"]).to("cuda", torch.bfloat16)
        lora = LoraConfig(rank=4, targets=["attention", "experts"])
        cfg = TrainerConfig(device="cuda", lr=1e-3, micro_batch_size=8, lora=lora)
        backend = TorchBackend(model, cfg, AlgoConfig(kl_coef=0.01), pad_token_id=world["eos"])
        for name, p in model.named_parameters():  # peft starts B at zero: make the adapters count
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
        assert dk.enabled(model) is on
        swaps.clear()
        engine = EmbeddedEngine(
            model,
            [world["eos"]],
            device="cuda",
            autocast_dtype=torch.bfloat16,
            banned_token_ids=media_token_ids(model),
            batching=batching,
            max_batch_rows=5,
            length_plan=_lengths if batching == "continuous" else None,
        )
        torch.manual_seed(0)
        groups = engine.generate(world["prompts"], 4, SamplingParams(max_new_tokens=24))
        adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * len(groups))
        metrics = backend.step(GRPOBatch(groups, adv))
        diffs[on] = metrics["train_rollout_logprob_abs_diff"]
        assert metrics["train_rollout_logprob_pearson"] > 0.99
        assert swaps and all((n > 0) is on for n in swaps), swaps  # entered, swapped when on
    # bf16 kernels against the trainer's: a missing adapter term or a wrong norm would be 0.1+
    assert diffs[True] <= 1.5 * diffs[False] + 5e-3, diffs
