"""The request schemas of sglang-omni 0.1.9's /generate and admin routes, re-stated for the fake.

Written from reading the server (not copied): sampling params forbid extra keys (422), the top
level ignores them, and the ``multimodal_train_inputs`` bundle is validated by strict base64
decoding with an exact byte-length check.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

WIRE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

TOKEN_ID_BOUND = 1 << 63


class SamplingParamsModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    max_new_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)


class MessageModel(BaseModel):
    role: str = Field(min_length=1)
    content: str | list[object]


class TensorSpecModel(BaseModel):
    dtype: str = Field(min_length=1)
    shape: list[int]
    data: str

    @model_validator(mode="after")
    def _check(self) -> TensorSpecModel:
        itemsize = WIRE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"invalid tensor shape {self.shape}")
        try:
            raw_len = len(base64.b64decode(self.data, validate=True))
        except binascii.Error as exc:
            raise ValueError("tensor data is not valid base64") from exc
        expected = math.prod(self.shape) * itemsize
        if raw_len != expected:
            raise ValueError(
                f"tensor data has {raw_len} bytes, expected {expected} for shape={self.shape} dtype={self.dtype}"
            )
        return self


class BundleModel(BaseModel):
    version: Literal[1] = 1
    tensors: dict[str, TensorSpecModel] = Field(min_length=1)


class GenerateRequestModel(BaseModel):
    """Top level keeps pydantic's default ``extra="ignore"`` like the server."""

    model: str | None = None
    input_ids: list[int] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    messages: list[MessageModel] | None = Field(default=None, min_length=1)
    sampling_params: SamplingParamsModel = Field(default_factory=SamplingParamsModel)
    stream: bool = False
    stage_sampling: dict[str, SamplingParamsModel] | None = None
    stage_params: dict[str, dict[str, object]] | None = None
    output_modalities: list[str] | None = None
    multimodal_train_inputs: BundleModel | None = None
    metadata: dict[str, object] | None = None
    return_logprob: bool = True
    return_omni_rollout: bool = False
    return_routed_experts: bool = False
    return_indexer_topk: bool = False

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, ids: list[int] | None) -> list[int] | None:
        for i, t in enumerate(ids or ()):
            if not 0 <= t < TOKEN_ID_BOUND:
                raise ValueError(f"input_ids[{i}] is {t}. Token ids must be in [0, 2**63).")
        return ids


class AdminBase(BaseModel):
    stages: list[str] | None = None
    timeout_s: float | None = None


class PauseModel(AdminBase):
    mode: str = "abort"


class ContinueModel(AdminBase):
    torch_empty_cache: bool = True


class DiskUpdateModel(AdminBase):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, object] | None = None


class DistributedUpdateModel(AdminBase):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class InitGroupModel(AdminBase):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 0
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupModel(AdminBase):
    group_name: str = "weight_update_group"


class CheckerModel(AdminBase):
    action: str = "checksum"
