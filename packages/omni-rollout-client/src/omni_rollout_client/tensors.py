"""Tensor -> wire bytes for ``multimodal_train_inputs``, without importing torch.

sglang-omni rebuilds each tensor with ``torch.frombuffer(b64decode(data), dtype).reshape(shape)``,
so what travels is the raw little-endian buffer. Torch tensors and numpy arrays are both accepted by
duck typing; when a torch tensor arrives, torch is necessarily imported already and is reached
through ``sys.modules`` (this package never imports it itself).

bf16 casting halves the bytes. The rounding is round-to-nearest-even, bit-identical to
``tensor.to(torch.bfloat16)``, and the exact rounded values are kept on the ``EncodedTensor`` so the
trainer can feed the model the same numbers the server saw.
"""

from __future__ import annotations

import binascii
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ClientValidationError

try:  # optional accelerator: same output as binascii, SIMD-fast
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - depends on the environment
    _pybase64 = None

# Wire dtype name -> numpy dtype used to hold the raw bytes (bfloat16 travels as its uint16 bits).
WIRE_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

FLOAT_WIRE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


def b64encode(buffer: np.ndarray) -> bytes:
    """Standard base64 of a contiguous array's bytes, reading the buffer in place (no copy)."""
    view = memoryview(np.ascontiguousarray(buffer)).cast("B")
    if _pybase64 is not None:
        return _pybase64.b64encode(view)
    return binascii.b2a_base64(view, newline=False)


def is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def to_wire_array(name: str, value: Any) -> tuple[np.ndarray, str]:
    """Return ``(contiguous little-endian array holding the raw bytes, wire dtype name)``."""
    if is_torch_tensor(value):
        torch = sys.modules["torch"]
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in WIRE_DTYPES:
            raise ClientValidationError(
                f"tensor {name!r}: dtype {dtype_name} is not one sglang-omni decodes; expected one of {sorted(WIRE_DTYPES)}"
            )
        tensor = tensor.contiguous()
        if dtype_name == "bfloat16":
            tensor = tensor.view(torch.int16)
        array = tensor.numpy().view(WIRE_DTYPES[dtype_name])
        return array, dtype_name
    array = np.asarray(value)
    dtype_name = "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.name
    if dtype_name not in WIRE_DTYPES:
        raise ClientValidationError(
            f"tensor {name!r}: dtype {array.dtype} is not one sglang-omni decodes; expected one of {sorted(WIRE_DTYPES)}"
        )
    wire = WIRE_DTYPES[dtype_name]
    if dtype_name == "bfloat16":
        array = np.ascontiguousarray(array).view(wire)
    elif array.dtype != wire:  # big-endian input
        array = array.astype(wire)
    return np.ascontiguousarray(array), dtype_name


def round_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round-to-nearest-even, NaN kept as quiet NaN.

    Works in place on one temporary so a 150 MB video costs a few streaming passes.
    """
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    bits = f32.view(np.uint32)
    acc = bits >> 16
    acc &= 1
    acc += 0x7FFF
    acc += bits
    acc >>= 16
    out = acc.astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = 0x7FC0  # torch's canonical bf16 NaN
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns -> the exact same values as float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def cast_to_bf16(name: str, value: Any) -> tuple[np.ndarray, str]:
    """Cast a floating tensor to bf16 (torch's own cast for torch input), as wire bits."""
    if is_torch_tensor(value) and value.dtype.is_floating_point:
        torch = sys.modules["torch"]
        return to_wire_array(name, value.detach().to(torch.bfloat16))
    array, dtype_name = to_wire_array(name, value)
    if dtype_name == "bfloat16":
        return array, dtype_name
    if dtype_name not in FLOAT_WIRE_DTYPES:
        raise ClientValidationError(f"tensor {name!r}: cannot cast dtype {dtype_name} to bfloat16")
    return round_to_bf16_bits(array.astype(np.float32, copy=False)), "bfloat16"


@dataclass(frozen=True, eq=False)
class EncodedTensor:
    """One tensor encoded once, reused by every request of a GRPO group.

    ``raw`` holds exactly the bytes the server decodes; ``values()`` and ``to_torch()`` give those
    values back (bf16 rounding included) for the trainer. Without a cast, ``raw`` is a read-only
    view of the caller's buffer (no copy): do not modify the source tensor after encoding.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    raw: np.ndarray
    b64: bytes

    @classmethod
    def encode(cls, name: str, value: Any, *, bf16: bool = False) -> EncodedTensor:
        array, dtype_name = cast_to_bf16(name, value) if bf16 else to_wire_array(name, value)
        shape = tuple(int(d) for d in np.shape(value))
        if math.prod(shape) != array.size:
            raise ClientValidationError(
                f"tensor {name!r}: shape {shape} does not match {array.size} elements"
            )
        array = array.view()  # read-only view; never flips the caller's own array to read-only
        array.setflags(write=False)
        return cls(name=name, dtype=dtype_name, shape=shape, raw=array, b64=b64encode(array))

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def json_chunks(self) -> tuple[bytes, bytes, bytes]:
        """``{"dtype":..,"shape":..,"data":"<b64>"}`` as three byte strings (the b64 unjoined)."""
        head = b'{"dtype":"%s","shape":[%s],"data":"' % (
            self.dtype.encode(),
            ",".join(str(d) for d in self.shape).encode(),
        )
        return head, self.b64, b'"}'

    def values(self) -> np.ndarray:
        """The decoded values as numpy (bf16 widened exactly to float32)."""
        array = self.raw.reshape(self.shape)
        return bf16_bits_to_float32(array) if self.dtype == "bfloat16" else array

    def to_torch(self) -> Any:
        """The tensor the server rebuilds, as torch (dtype kept, bf16 included). Imports torch."""
        import torch  # the trainer side has torch; the client itself never needs it

        if self.dtype == "bfloat16":
            tensor = torch.from_numpy(np.array(self.raw).view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(np.array(self.raw))  # own, writable copy
        return tensor.reshape(self.shape)
