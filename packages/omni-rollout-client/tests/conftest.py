"""Fixtures: fake sglang-omni servers on loopback (real HTTP, no mocks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from omni_rollout_client.testing import FakeOmniServer


@pytest.fixture
def make_server() -> Iterator[Callable[..., FakeOmniServer]]:
    started: list[FakeOmniServer] = []

    def make(**kwargs: Any) -> FakeOmniServer:
        server = FakeOmniServer(**kwargs)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def server(make_server: Callable[..., FakeOmniServer]) -> FakeOmniServer:
    return make_server()
