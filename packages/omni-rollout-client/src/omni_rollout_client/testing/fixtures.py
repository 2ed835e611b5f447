"""pytest fixtures for the fake server. Opt in from a conftest.py:

    pytest_plugins = ["omni_rollout_client.testing.fixtures"]

Then ask for ``fake_omni_server`` (a default fake worker) or ``make_fake_omni_server(**kwargs)``
(any number, all stopped at the end of the test).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .serving import FakeOmniServer


@pytest.fixture
def make_fake_omni_server() -> Iterator[Callable[..., FakeOmniServer]]:
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
def fake_omni_server(make_fake_omni_server: Callable[..., FakeOmniServer]) -> FakeOmniServer:
    return make_fake_omni_server()
