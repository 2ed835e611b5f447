"""Wire cost of /generate payloads: encode-once bf16 (omni_rollout_client) vs the original design.

For an image, 32- and 64-frame videos (448x448 at 2 fps) and 30 s of audio, with processed tensor
shapes as the Qwen3-Omni processor produces them (vision patches of 3*2*16*16 = 1536 floats,
448/16 = 28 -> 28x28 patches per temporal patch, frames/2 temporal patches; audio 128 mel x 3000
frames), measure for one GRPO group of n requests:

- baseline ("original design"): per request, fp32 tensors -> ``base64.b64encode(t.numpy().tobytes())``
  -> ``json.dumps(body).encode()``;
- ours: ``PreparedPrompt.build`` once (bf16 pixels/features), then ``build_generate_body`` per request
  (byte chunks sharing the encoded tensors); also ``ours_fp32`` (encode once, no cast);

reporting bytes per request, client CPU seconds per group (``time.process_time``, all threads), and
server-side decode seconds per request under sglang-omni 0.1.9's own rules: ``json.loads`` of the
body, the protocol's strict ``b64decode(validate=True)`` length check, the preprocessor's second
``b64decode`` and ``torch.frombuffer(bytearray(raw), dtype).reshape(shape)`` (its xxh3 cache-key
hash is not included). Prints one JSON object.

    uv run python benchmarks/payload.py [--group 8] [--cases image,video32,video64,audio30s]
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import math
import time
from typing import Any

import numpy as np
import torch
from omni_rollout_client import PreparedPrompt, build_generate_body, filter_sampling_params

PATCH = 3 * 2 * 16 * 16  # channels * temporal_patch * patch * patch
SIDE_PATCHES = 448 // 16  # 28
MERGE = 2 * 2  # spatial merge: patches per placeholder token
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 1024}


def make_case(name: str, rng: np.random.Generator) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Processed tensors (torch, as the HF processor returns them) and placeholder-sized ids."""
    if name == "image":
        grid = (1, SIDE_PATCHES, SIDE_PATCHES)
        mm = {"pixel_values": _pixels(math.prod(grid), rng), "image_grid_thw": torch.tensor([grid])}
        n_placeholders = math.prod(grid) // MERGE
    elif name.startswith("video"):
        frames = int(name.removeprefix("video"))
        grid = (frames // 2, SIDE_PATCHES, SIDE_PATCHES)
        mm = {
            "pixel_values_videos": _pixels(math.prod(grid), rng),
            "video_grid_thw": torch.tensor([grid]),
            "video_second_per_grid": torch.tensor([1.0]),  # 2 frames per temporal patch at 2 fps
        }
        n_placeholders = math.prod(grid) // MERGE
    elif name == "audio30s":
        frames = 3000
        mm = {
            "input_features": torch.from_numpy(
                rng.standard_normal((1, 128, frames), dtype=np.float32)
            ),
            "feature_attention_mask": torch.ones((1, frames), dtype=torch.int32),
        }
        n_placeholders = 390  # ~13 tokens per second after the audio tower's downsampling
    else:
        raise ValueError(f"unknown case {name!r}")
    ids = rng.integers(0, 150_000, size=n_placeholders + 64).tolist()
    return ids, mm


def _pixels(rows: int, rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((rows, PATCH), dtype=np.float32))


def baseline_body(ids: list[int], mm: dict[str, torch.Tensor], seed: int) -> bytes:
    tensors = {
        name: {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(t.numpy().tobytes()).decode("ascii"),
        }
        for name, t in mm.items()
    }
    body = {
        "input_ids": ids,
        "sampling_params": {**SAMPLING, "seed": seed},
        "return_logprob": True,
        "multimodal_train_inputs": {"version": 1, "tensors": tensors},
    }
    return json.dumps(body).encode()


def ours_group(
    ids: list[int], mm: dict[str, torch.Tensor], n: int, bf16: bool
) -> tuple[PreparedPrompt, list[list[bytes]]]:
    prompt = PreparedPrompt.build(ids, mm, bf16=bf16)
    bodies = [
        build_generate_body(prompt, filter_sampling_params({**SAMPLING, "seed": i}))
        for i in range(n)
    ]
    return prompt, bodies


_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "float16": torch.float16,
}


def server_decode(body: bytes) -> dict[str, torch.Tensor]:
    """sglang-omni 0.1.9: FastAPI json parse, pydantic strict-b64 length check, preprocessor decode."""
    doc = json.loads(body)
    out = {}
    for name, spec in doc["multimodal_train_inputs"]["tensors"].items():
        _ = len(
            base64.b64decode(spec["data"], validate=True)
        )  # SerializedMultimodalTensor validator
        raw = base64.b64decode(spec["data"])  # preprocess_train_inputs
        out[name] = torch.frombuffer(bytearray(raw), dtype=_TORCH_DTYPES[spec["dtype"]]).reshape(
            spec["shape"]
        )
    return out


def cpu(fn: Any) -> tuple[float, Any]:
    gc.collect()
    t0 = time.process_time()
    value = fn()
    return time.process_time() - t0, value


def run_case(name: str, n: int, rng: np.random.Generator) -> dict[str, Any]:
    ids, mm = make_case(name, rng)

    base_cpu, base_bodies = cpu(lambda: [baseline_body(ids, mm, i) for i in range(n)])
    base_bytes = len(base_bodies[0])
    base_tensor_bytes = sum(math.ceil(t.numel() * t.element_size() / 3) * 4 for t in mm.values())
    base_decode, decoded = cpu(lambda body=base_bodies[0]: server_decode(body))
    for key, t in mm.items():
        assert torch.equal(decoded[key], t), f"{name}: baseline round trip changed {key}"
    del base_bodies, decoded

    results: dict[str, Any] = {}
    for label, bf16 in (("ours", True), ("ours_fp32", False)):
        our_cpu, (prompt, bodies) = cpu(lambda bf16=bf16: ours_group(ids, mm, n, bf16))
        our_bytes = sum(len(c) for c in bodies[0])
        joined = b"".join(bodies[0])  # what arrives at the server
        our_decode, decoded = cpu(lambda joined=joined: server_decode(joined))
        expected = prompt.trainer_tensors()
        for key, t in expected.items():
            assert torch.equal(decoded[key], t), (
                f"{name}/{label}: server would see different {key} than the trainer"
            )
        results[label] = {
            "bytes_per_request": our_bytes,
            "tensor_base64_bytes": sum(len(e.b64) for e in prompt.tensors.values()),
            "client_cpu_s_per_group": round(our_cpu, 4),
            "server_decode_s_per_request": round(our_decode, 4),
        }
        del bodies, joined, decoded, prompt, expected

    ours = results["ours"]
    return {
        "tensor_shapes": {k: list(v.shape) for k, v in mm.items()},
        "prompt_tokens": len(ids),
        "baseline": {
            "bytes_per_request": base_bytes,
            "tensor_base64_bytes": base_tensor_bytes,
            "client_cpu_s_per_group": round(base_cpu, 4),
            "server_decode_s_per_request": round(base_decode, 4),
        },
        **results,
        "client_cpu_ratio_baseline_over_ours": round(
            base_cpu / max(ours["client_cpu_s_per_group"], 1e-9), 2
        ),
        "bytes_ratio_ours_over_baseline": round(ours["bytes_per_request"] / base_bytes, 5),
        "tensor_bytes_ratio_ours_over_baseline": round(
            ours["tensor_base64_bytes"] / base_tensor_bytes, 5
        ),
        "server_decode_ratio_baseline_over_ours": round(
            base_decode / max(ours["server_decode_s_per_request"], 1e-9), 2
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8, help="requests per GRPO group (n)")
    parser.add_argument("--cases", default="image,video32,video64,audio30s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    cases = {name: run_case(name, args.group, rng) for name in args.cases.split(",")}
    report: dict[str, Any] = {
        "benchmark": "payload",
        "group_size": args.group,
        "torch_threads": torch.get_num_threads(),
        "cases": cases,
    }
    if "video64" in cases:
        v = cases["video64"]
        report["targets_video64"] = {
            "client_cpu_ratio": v["client_cpu_ratio_baseline_over_ours"],
            "client_cpu_ratio_ge_20": v["client_cpu_ratio_baseline_over_ours"] >= 20,
            "bytes_ratio": v["bytes_ratio_ours_over_baseline"],
            "bytes_ratio_le_0_5": v["bytes_ratio_ours_over_baseline"] <= 0.5,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
