"""Fixtures: fake sglang-omni servers on loopback (real HTTP, no mocks)."""

from __future__ import annotations

import pytest
from omni_rollout_client.testing import FakeOmniServer
from omni_rollout_client.testing.fixtures import fake_omni_server, make_fake_omni_server  # noqa: F401


@pytest.fixture
def make_server(make_fake_omni_server):  # noqa: F811
    return make_fake_omni_server


@pytest.fixture
def server(fake_omni_server) -> FakeOmniServer:  # noqa: F811
    return fake_omni_server
