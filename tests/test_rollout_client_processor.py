"""Real HF processor outputs of a tiny Qwen3-Omni checkpoint through omni-rollout-client to the
fake sglang-omni server: the server decodes exactly the values the trainer gets back (bf16 included)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import numpy as np
import pytest
import torch
from omni_extract.tiny import load_ids
from omni_rollout_client import OmniRolloutClient, PreparedPrompt
from omni_rollout_client.testing import FakeOmniServer
from PIL import Image

transformers = pytest.importorskip("transformers")


def processed_inputs(checkpoint):
    """Image + audio processed by the checkpoint's own image processor and feature extractor."""
    image_proc = transformers.AutoImageProcessor.from_pretrained(checkpoint)
    audio_proc = transformers.AutoFeatureExtractor.from_pretrained(checkpoint)
    rng = np.random.default_rng(0)
    image = Image.fromarray((rng.random((64, 96, 3)) * 255).astype(np.uint8))
    vision = image_proc(images=[image], return_tensors="pt")
    audio = audio_proc(
        [rng.random(16000, dtype=np.float32)],
        sampling_rate=16000,
        return_attention_mask=True,
        padding="max_length",
        return_tensors="pt",
    )
    mm = {
        "pixel_values": vision["pixel_values"],
        "image_grid_thw": vision["image_grid_thw"],
        "input_features": audio["input_features"],
        "feature_attention_mask": audio["attention_mask"],  # the Omni processor's name for it
    }
    ids = load_ids(checkpoint)
    merge = image_proc.merge_size**2
    n_image = int(vision["image_grid_thw"].prod()) // merge
    input_ids = [
        ids["vision_start_token_id"],
        *[ids["image_token_id"]] * n_image,
        ids["vision_end_token_id"],
        ids["audio_start_token_id"],
        ids["audio_token_id"],
        ids["audio_end_token_id"],
    ]
    return input_ids, mm


def test_processor_outputs_round_trip_exactly(tiny_omni_dir):
    input_ids, mm = processed_inputs(tiny_omni_dir)
    prompt = PreparedPrompt.build(input_ids, mm, bf16=True)
    trainer = prompt.trainer_tensors()
    for name in ("pixel_values", "input_features"):
        assert trainer[name].dtype == torch.bfloat16
        assert torch.equal(trainer[name], mm[name].to(torch.bfloat16))
    assert torch.equal(trainer["image_grid_thw"], mm["image_grid_thw"])
    assert torch.equal(trainer["audio_feature_lengths"], mm["feature_attention_mask"].sum(1).long())

    generation_config = json.loads((tiny_omni_dir / "generation_config.json").read_text())
    eos = generation_config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    with FakeOmniServer.from_checkpoint(tiny_omni_dir) as server:

        async def run():
            async with OmniRolloutClient(server.url, vocab_size=server.engine.vocab_size) as client:
                return await client.generate_group(prompt, 4, {"max_new_tokens": 32})

        results = asyncio.run(run())
        records = server.records
    vocab = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"][
        "text_config"
    ]["vocab_size"]
    assert server.engine.vocab_size == vocab and server.engine.eos_token_id == eos
    for res in results:
        assert all(0 <= t < vocab for t in res.token_ids)
        assert res.token_ids[-1] == eos or res.finish_reason == "length"
    for rec in records:
        assert rec.input_ids == input_ids
        for name, enc in prompt.tensors.items():
            assert rec.tensor_digests[name] == (
                enc.dtype,
                list(enc.shape),
                hashlib.sha256(enc.raw.tobytes()).hexdigest(),
            )
