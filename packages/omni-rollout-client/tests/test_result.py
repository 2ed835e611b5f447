import pytest
from omni_rollout_client import ResponseContractError, parse_generate_response
from omni_rollout_client.result import concat_results


def body(pairs, completion=None, finish="stop"):
    return {
        "text": "x",
        "audio": None,
        "meta_info": {
            "finish_reason": {"type": finish, "length": None},
            "prompt_tokens": 3,
            "completion_tokens": len(pairs) if completion is None else completion,
            "cached_tokens": 0,
            "weight_version": "v1",
            "request_metadata": {"k": 1},
            "output_token_logprobs": pairs,
        },
    }


def test_parses_pairs_into_ids_and_logprobs():
    r = parse_generate_response(body([[-0.5, 11], [-0.25, 22]]))
    assert r.token_ids == [11, 22] and r.logprobs == [-0.5, -0.25]
    assert r.finish_reason == "stop" and r.weight_version == "v1" and r.metadata == {"k": 1}


@pytest.mark.parametrize(
    "b, match",
    [
        (body([[-0.5, 11, None]]), "plain sglang"),
        (body([[-0.5, 11]], completion=2), "completion_tokens=2"),
        (body([[0.5, 11]]), "logprob <= 0"),
        (body([[-0.5, "a"]]), "token id"),
        (body([], finish="weird"), "finish_reason"),
        ({"text": ""}, "meta_info"),
        (
            {"meta_info": {**body([])["meta_info"], "output_token_logprobs": None}},
            "expected a list",
        ),
    ],
)
def test_contract_violations_raise(b, match):
    with pytest.raises(ResponseContractError, match=match):
        parse_generate_response(b)


def test_concat_keeps_segments_and_versions():
    a = parse_generate_response(body([[-0.1, 1]], finish="abort"))
    b = parse_generate_response(body([[-0.2, 2], [-0.3, 3]]))
    c = concat_results(a, b)
    assert c.token_ids == [1, 2, 3] and c.logprobs == [-0.1, -0.2, -0.3]
    assert (
        c.completion_tokens == 3 and c.finish_reason == "stop" and c.weight_versions == ("v1", "v1")
    )
