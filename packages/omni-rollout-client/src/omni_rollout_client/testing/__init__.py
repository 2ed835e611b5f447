"""A fake sglang-omni 0.1.9 server (and router) enforcing the real contract, for CPU tests.

    from omni_rollout_client.testing import FakeOmniServer
    with FakeOmniServer(token_delay_s=0.01) as server:
        ... OmniRolloutClient(server.url) ...
        server.faults.fail_next(3, status=503)

Needs the ``testing`` extra (starlette, uvicorn, pydantic).
"""

from .faults import Fault, Faults
from .generator import FakeGeneration, FakeRequest, Generator, make_hash_generator
from .router_app import FakeOmniRouter
from .serving import BackgroundServer, FakeOmniServer
from .worker_app import GenerationRecord

__all__ = [
    "BackgroundServer",
    "FakeGeneration",
    "FakeOmniRouter",
    "FakeOmniServer",
    "FakeRequest",
    "Fault",
    "Faults",
    "GenerationRecord",
    "Generator",
    "make_hash_generator",
]
