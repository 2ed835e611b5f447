import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_rollout_client import (
    RESERVED_METADATA_KEYS,
    ClientValidationError,
    PreparedPrompt,
    build_generate_body,
    filter_sampling_params,
)

RNG = np.random.default_rng(0)


def image_mm(n_rows=16):
    return {
        "pixel_values": RNG.standard_normal((n_rows, 1536)).astype(np.float32),
        "image_grid_thw": np.array([[1, 4, n_rows // 4]]),
    }


def audio_mm():
    mask = np.zeros((2, 30), dtype=np.int32)
    mask[0, :30] = 1
    mask[1, :17] = 1
    return {
        "input_features": RNG.standard_normal((2, 128, 30)).astype(np.float32),
        "feature_attention_mask": mask,
    }


def body_json(prompt, sampling=None, **kw):
    return json.loads(
        b"".join(build_generate_body(prompt, filter_sampling_params(sampling or {}), **kw))
    )


def test_body_is_the_contract_document():
    p = PreparedPrompt.build([5, 6, 7], image_mm(), bf16=True)
    doc = body_json(p, {"max_new_tokens": 3}, metadata={"uid": "a"})
    assert doc["input_ids"] == [5, 6, 7]
    assert doc["sampling_params"] == {
        "temperature": 1.0,
        "repetition_penalty": 1.0,
        "max_new_tokens": 3,
    }
    assert (
        doc["output_modalities"] == ["text"]
        and doc["return_logprob"] is True
        and doc["stream"] is False
    )
    assert doc["metadata"] == {"uid": "a"}
    bundle = doc["multimodal_train_inputs"]
    assert bundle["version"] == 1
    spec = bundle["tensors"]["pixel_values"]
    assert spec["dtype"] == "bfloat16" and spec["shape"] == [16, 1536]
    raw = base64.b64decode(spec["data"], validate=True)
    assert raw == p.tensors["pixel_values"].raw.tobytes()
    assert bundle["tensors"]["image_grid_thw"]["dtype"] == "int64"


def test_text_only_has_no_bundle():
    doc = body_json(PreparedPrompt.build(np.array([[1, 2]])))
    assert "multimodal_train_inputs" not in doc and doc["input_ids"] == [1, 2]


def test_encoded_once_shared_across_requests():
    p = PreparedPrompt.build([1], image_mm())
    a = build_generate_body(p, {"temperature": 1.0, "seed": 1})
    b = build_generate_body(p, {"temperature": 1.0, "seed": 2})
    shared_a = [c for c in a if len(c) > 10_000]
    shared_b = [c for c in b if len(c) > 10_000]
    assert shared_a and all(x is y for x, y in zip(shared_a, shared_b, strict=True))


def test_audio_feature_lengths_derived_and_bf16_only_for_payload():
    p = PreparedPrompt.build([1, 2], audio_mm())
    assert p.tensors["audio_feature_lengths"].dtype == "int64"
    np.testing.assert_array_equal(p.tensors["audio_feature_lengths"].values(), [30, 17])
    assert p.tensors["input_features"].dtype == "bfloat16"
    assert p.tensors["feature_attention_mask"].dtype == "int32"
    arrays = p.trainer_arrays()
    assert arrays["input_features"].dtype == np.float32


def test_bf16_opt_out_and_selection():
    p = PreparedPrompt.build([1], image_mm(), bf16=False)
    assert p.tensors["pixel_values"].dtype == "float32"
    with pytest.raises(ClientValidationError, match="image_grid_thw"):
        PreparedPrompt.build([1], image_mm(), bf16=["image_grid_thw"])


def test_video_second_per_grid_kept_float32():
    mm = {
        "pixel_values_videos": RNG.standard_normal((8, 1536)).astype(np.float32),
        "video_grid_thw": np.array([[2, 2, 2]]),
        "video_second_per_grid": np.array([1.0], dtype=np.float32),
    }
    p = PreparedPrompt.build([1], mm)
    assert (
        p.tensors["video_second_per_grid"].dtype == "float32"
        and p.tensors["pixel_values_videos"].dtype == "bfloat16"
    )


@pytest.mark.parametrize(
    "mm, match",
    [
        ({"foo": np.zeros(1)}, "unknown names"),
        ({"attention_mask": np.ones((1, 3))}, "from_processor_output"),
        ({"image_grid_thw": np.array([[1, 2, 2]])}, "without 'pixel_values'"),
        ({"pixel_values": np.zeros((4, 1536), np.float32)}, "without 'image_grid_thw'"),
        (
            {
                "pixel_values": np.zeros((5, 1536), np.float32),
                "image_grid_thw": np.array([[1, 2, 2]]),
            },
            "implies 4",
        ),
        (
            {
                "pixel_values": np.zeros((0, 1536), np.float32),
                "image_grid_thw": np.zeros((0, 3), np.int64),
            },
            "zero-element",
        ),
        ({"feature_attention_mask": np.ones((1, 3))}, "without 'input_features'"),
        (
            {
                "input_features": np.zeros((1, 128, 3), np.float32),
                "feature_attention_mask": np.ones(3),
            },
            "2-D",
        ),
        (
            {
                "input_features": np.zeros((1, 128, 4), np.float32),
                "feature_attention_mask": np.ones((1, 3)),
            },
            "does not match",
        ),
    ],
)
def test_bad_bundles_refused_before_sending(mm, match):
    with pytest.raises(ClientValidationError, match=match):
        PreparedPrompt.build([1, 2], mm)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([], "non-empty"),
        ([1, -1], r"input_ids\[1\]"),
        ([[1, 2], [3, 4]], "1-D"),
        ([1.5], "integer"),
    ],
)
def test_bad_input_ids(ids, match):
    with pytest.raises(ClientValidationError, match=match):
        PreparedPrompt.build(ids)


def test_vocab_bound_and_audio_in_video():
    with pytest.raises(ClientValidationError, match=r"input_ids\[1\] is 10"):
        PreparedPrompt.build([1, 10], vocab_size=10)
    with pytest.raises(ClientValidationError, match="use_audio_in_video"):
        PreparedPrompt.build([1], use_audio_in_video=True)


@pytest.mark.parametrize(
    "key", ["images", "audios", "videos", "video_fps", "use_audio_in_video", "omni_session"]
)
def test_reserved_metadata_refused(key):
    with pytest.raises(ClientValidationError, match=key):
        build_generate_body(PreparedPrompt.build([1]), {"temperature": 1.0}, metadata={key: 1})


def test_from_processor_output_takes_ids_and_refuses_padding():
    batch = {"input_ids": np.array([[3, 4, 5]]), "attention_mask": np.ones((1, 3)), **image_mm()}
    p = PreparedPrompt.from_processor_output(batch)
    assert p.input_ids == (3, 4, 5) and set(p.tensors) == {"pixel_values", "image_grid_thw"}
    batch["attention_mask"] = np.array([[1, 1, 0]])
    with pytest.raises(ClientValidationError, match="padding"):
        PreparedPrompt.from_processor_output(batch)


def test_continued_shares_tensors():
    p = PreparedPrompt.build([1, 2], image_mm())
    q = p.continued([9, 8])
    assert q.input_ids == (1, 2, 9, 8) and q.tensors is p.tensors


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(max_size=8))
metadata_st = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k not in RESERVED_METADATA_KEYS),
    st.one_of(json_leaf, st.lists(json_leaf, max_size=3)),
    max_size=4,
)


@settings(deadline=None, max_examples=60)
@given(
    ids=st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
    metadata=st.one_of(st.none(), metadata_st),
    temperature=st.floats(0, 2),
    top_k=st.one_of(st.just(-1), st.integers(1, 100)),
    stop=st.lists(st.text(max_size=4), max_size=3),
    with_image=st.booleans(),
)
def test_every_body_we_build_passes_the_server_schema(
    ids, metadata, temperature, top_k, stop, with_image
):
    """The fake server's restatement of sglang-omni's pydantic models accepts all our bodies."""
    from omni_rollout_client.testing.contract import GenerateRequestModel

    prompt = PreparedPrompt.build(ids, image_mm(4) if with_image else None)
    sampling = filter_sampling_params(
        {
            "temperature": temperature,
            "top_k": top_k,
            "stop": stop,
            "max_new_tokens": 8,
            "skip_special_tokens": True,
        }
    )
    req = GenerateRequestModel.model_validate_json(
        b"".join(build_generate_body(prompt, sampling, metadata=metadata))
    )
    assert req.input_ids == ids and req.metadata == metadata
    assert (
        req.sampling_params.temperature == temperature
        and req.sampling_params.repetition_penalty == 1.0
    )
    assert (req.multimodal_train_inputs is not None) == with_image
