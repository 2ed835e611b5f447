import pytest
from hypothesis import given
from hypothesis import strategies as st
from omni_rollout_client import ClientValidationError, filter_sampling_params
from omni_rollout_client.sampling import ACCEPTED_KEYS, DROPPED_KEYS


def test_temperature_always_explicit_and_repetition_penalty_pinned():
    out = filter_sampling_params({"max_new_tokens": 5})
    assert out == {"temperature": 1.0, "repetition_penalty": 1.0, "max_new_tokens": 5}
    assert filter_sampling_params({"temperature": 0})["temperature"] == 0.0


def test_detok_keys_dropped_and_max_tokens_folded():
    out = filter_sampling_params(
        {
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "max_tokens": 7,
            "top_k": -1,
            "stop": "x",
        }
    )
    assert not set(out) & DROPPED_KEYS
    assert out["max_new_tokens"] == 7 and "max_tokens" not in out
    assert out["stop"] == ["x"]


@pytest.mark.parametrize(
    "key",
    [
        "sampling_seed",
        "n",
        "ignore_eos",
        "min_new_tokens",
        "frequency_penalty",
        "regex",
        "custom_params",
    ],
)
def test_unknown_keys_raise_naming_the_key(key):
    with pytest.raises(ClientValidationError, match=key):
        filter_sampling_params({key: 1})


@given(st.text(min_size=1, max_size=20).filter(lambda k: k not in ACCEPTED_KEYS | DROPPED_KEYS))
def test_any_unknown_key_raises(key):
    with pytest.raises(ClientValidationError):
        filter_sampling_params({key: 1, "temperature": 1.0})


@pytest.mark.parametrize(
    "params, field",
    [
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ["a"] * 33}, "stop"),
        ({"stop": 12}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_values_the_server_rejects_are_refused_locally(params, field):
    with pytest.raises(ClientValidationError, match=field):
        filter_sampling_params(params)
