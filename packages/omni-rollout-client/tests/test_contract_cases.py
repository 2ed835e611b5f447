"""The server-contract cases of ``testing.contract_cases`` against this package's fake server.

``scripts/check_real_0_1_9.py`` runs the very same cases against the real sglang-omni 0.1.9 HTTP
layer (its last run: every case passed). A case failing here, and not there, means the fake no
longer reproduces the real server; a case failing in both means the client broke the contract.
"""

import asyncio

import pytest
from omni_rollout_client.testing.contract_cases import CASES, fake_server, run_case


@pytest.mark.parametrize("one", CASES, ids=[c.name for c in CASES])
def test_contract_case_on_the_fake_server(one):
    ok, detail = asyncio.run(run_case(one, fake_server))
    assert ok, detail


def test_there_are_enough_cases_to_cover_the_contract():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) >= 49
    for area in (
        "generate",
        "sampling",
        "multimodal",
        "timeouts",
        "cancel",
        "abort",
        "pause",
        "model_info",
        "ready",
        "auth",
        "disk",
        "distributed",
        "tensor",
    ):
        assert any(n.startswith(area) for n in names), area
