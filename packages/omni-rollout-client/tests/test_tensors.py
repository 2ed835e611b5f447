import base64

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from omni_rollout_client import ClientValidationError, EncodedTensor
from omni_rollout_client.tensors import bf16_bits_to_float32, round_to_bf16_bits


def server_decode(enc: EncodedTensor) -> np.ndarray:
    """sglang-omni's rule: strict base64 -> frombuffer(dtype) -> reshape(shape)."""
    raw = base64.b64decode(enc.b64, validate=True)
    wire = {
        "float32": "<f4",
        "bfloat16": "<u2",
        "int64": "<i8",
        "float16": "<f2",
        "bool": "?",
        "uint8": "u1",
    }[enc.dtype]
    return np.frombuffer(raw, dtype=wire).reshape(enc.shape)


@settings(deadline=None)
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(max_dims=3, max_side=6),
        elements=st.floats(width=32, allow_nan=False),
    )
)
def test_bf16_rounding_matches_torch(values):
    torch = pytest.importorskip("torch")
    ours = round_to_bf16_bits(values)
    ref = (
        torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    )
    np.testing.assert_array_equal(ours, ref)


def test_bf16_nan_and_extremes_match_torch():
    torch = pytest.importorskip("torch")
    values = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, 0.0, -0.0], dtype=np.float32
    )
    ours = round_to_bf16_bits(values)
    ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours[2:], ref[2:])
    assert np.isnan(bf16_bits_to_float32(ours[:2])).all()


def test_numpy_and_torch_inputs_encode_identically():
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    for bf16 in (False, True):
        e_np = EncodedTensor.encode("pixel_values", a, bf16=bf16)
        e_t = EncodedTensor.encode("pixel_values", torch.from_numpy(a), bf16=bf16)
        assert e_np.b64 == e_t.b64 and e_np.dtype == e_t.dtype and e_np.shape == e_t.shape


def test_server_decodes_exact_values_and_trainer_sees_them():
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    enc = EncodedTensor.encode("pixel_values", a, bf16=True)
    assert enc.dtype == "bfloat16"
    decoded = bf16_bits_to_float32(server_decode(enc))
    np.testing.assert_array_equal(decoded, enc.values())
    trainer = enc.to_torch()
    assert trainer.dtype == torch.bfloat16
    np.testing.assert_array_equal(trainer.float().numpy(), decoded)
    np.testing.assert_array_equal(
        trainer.float().numpy(), torch.from_numpy(a).to(torch.bfloat16).float().numpy()
    )


def test_torch_bf16_and_int_inputs_pass_through():
    torch = pytest.importorskip("torch")
    t = torch.randn(2, 3).to(torch.bfloat16)
    enc = EncodedTensor.encode("x", t)
    assert enc.dtype == "bfloat16"
    assert torch.equal(enc.to_torch(), t)
    g = EncodedTensor.encode("g", torch.tensor([[1, 2, 2]]))
    np.testing.assert_array_equal(server_decode(g), [[1, 2, 2]])


def test_big_endian_and_bool_numpy():
    a = np.arange(6, dtype=">i8").reshape(2, 3)
    enc = EncodedTensor.encode("g", a)
    assert enc.dtype == "int64"
    np.testing.assert_array_equal(server_decode(enc), a)
    m = np.array([[True, False]])
    np.testing.assert_array_equal(server_decode(EncodedTensor.encode("m", m)), m)


def test_unsupported_dtype_named():
    with pytest.raises(ClientValidationError, match="complex"):
        EncodedTensor.encode("pixel_values", np.zeros(3, dtype=np.complex64))
    with pytest.raises(ClientValidationError, match="bfloat16"):
        EncodedTensor.encode("image_grid_thw", np.zeros(3, dtype=np.int64), bf16=True)


def test_b64_reads_buffer_without_copy_semantics():
    a = np.arange(12, dtype=np.float32)[::2]  # non-contiguous input still encodes its values
    enc = EncodedTensor.encode("x", a)
    np.testing.assert_array_equal(server_decode(enc), a)


@pytest.mark.parametrize(
    "value, bits",
    [
        (1.0, 0x3F80),
        (1.0078125, 0x3F81),  # exactly representable
        (1.00390625, 0x3F80),  # tie between 0x3F80 and 0x3F81 -> even
        (1.01171875, 0x3F82),  # tie between 0x3F81 and 0x3F82 -> even
        (np.nextafter(np.float32(1.00390625), np.float32(2)), 0x3F81),  # just above the tie
        (-2.0, 0xC000),
        (np.inf, 0x7F80),
    ],
)
def test_bf16_round_to_nearest_even_by_definition(value, bits):
    """IEEE bfloat16 = the top 16 bits of float32, rounded to nearest, ties to even (no torch)."""
    assert int(round_to_bf16_bits(np.array([value], dtype=np.float32))[0]) == bits


def test_fast_base64_matches_stdlib():
    import binascii

    from omni_rollout_client.tensors import b64encode

    a = np.random.default_rng(2).integers(0, 255, size=(1001,), dtype=np.uint8)
    assert b64encode(a) == binascii.b2a_base64(a.tobytes(), newline=False)
    assert b64encode(a[:1000].reshape(10, 100)) == base64.b64encode(a[:1000].tobytes())
