"""Interrupt a training run at a chosen moment of a chosen step, for fault tests.

A run can be stopped anywhere: by a signal to the process running the loop, by an actor killed
(``kill -9``, an OOM kill) or by a sync that fails. Whether every step's metrics row ends up
written exactly once, and the run directory resumable, depends on the moment, so the tests pick
it: :func:`at_moment` runs an action once, right before the loop's call of that moment in GRPO
step ``step`` (with ``run_dir``, steps count on from the checkpoint a resumed run starts at):

* ``rollout``: the engine's ``generate`` of the step's groups (``n > 1``: not an evaluation;
  with ``rollout.max_staleness: 1`` it runs during the step before);
* ``update``: the backend's ``step``;
* ``sync``: the weight sync's ``push`` of version ``step-<step>``;
* ``checkpoint``: the backend's ``trainable_state`` after the step's update (the checkpoint's
  first read; on Ray a call into trainer rank 0).

The hooks wrap the classes of one process and of the Ray driver alike (the stand-ins the driver
hands the loop); the actions are :func:`signal_self` and :func:`kill_actor` (SIGKILL of an
actor's process, found by the pid its log names, waited for until it is gone).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

MOMENTS = ("rollout", "update", "sync", "checkpoint")
# Where each moment's call lives: (module, attribute path) of every class the loop may call.
TARGETS: dict[str, tuple[tuple[str, str], ...]] = {
    "rollout": (
        ("omni_grpo.rollout.embedded", "EmbeddedEngine.generate"),
        ("omni_grpo.rollout.overlap", "PolicySnapshot.generate"),
        ("omni_grpo.ray.rollout", "RayRolloutEngine.generate"),
        ("omni_grpo.rollout.sglang_omni", "SglangOmniEngine.generate"),
    ),
    "update": (
        ("omni_grpo.backends.torch_backend", "TorchBackend.step"),
        ("omni_grpo.ray.driver", "RayTrainerGroup.step"),
    ),
    "sync": (
        ("omni_grpo.rollout.overlap", "PolicySnapshot.push"),
        ("omni_grpo.ray.rollout", "ActorWeightSync.push"),
        ("omni_grpo.ray.driver", "TrainerSideSync.push"),
        ("omni_grpo.sync.disk", "DiskWeightSync.push"),
        ("omni_grpo.sync.distributed", "DistributedWeightSync.push"),
    ),
    "checkpoint": (
        ("omni_grpo.backends.torch_backend", "TorchBackend.trainable_state"),
        ("omni_grpo.ray.driver", "RayTrainerGroup.trainable_state"),
    ),
}


class _Trigger:
    """Counts the moment's calls and fires the action once, at the chosen step."""

    def __init__(
        self, moment: str, step: int, action: Callable[[], None], run_dir: Path | None
    ) -> None:
        self.moment, self.step, self.action = moment, step, action
        self.run_dir = run_dir
        self.calls: int | None = None  # counted calls, from the resumed step once known
        self.updates = 0  # backend steps seen (the checkpoint moment follows the step's update)
        self.fired = False
        self.inside = threading.local()

    def _start(self) -> int:
        """The step a resumed run starts after (its latest checkpoint), read at the first call."""
        if self.run_dir is None:
            return 0
        from omni_grpo.run.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir)
        return int(ckpt.name.removeprefix("step_")) if ckpt is not None else 0

    def due(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call (``args`` without ``self``) is the chosen one."""
        if self.fired:
            return False
        if self.moment == "sync":
            version = kwargs.get("version", args[1] if len(args) > 1 else None)
            return str(version) == f"step-{self.step}"
        if self.calls is None:
            self.calls = self.updates = self._start()
        if self.moment == "checkpoint":
            return self.updates == self.step
        if self.moment == "rollout":
            n = kwargs.get("n", args[1] if len(args) > 1 else 0)
            if not isinstance(n, int) or n <= 1:
                return False  # an evaluation (one greedy sample per prompt)
        self.calls += 1
        return self.calls == self.step

    def count_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a backend ``step`` to count updates (for the checkpoint moment)."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.calls is None:
                self.calls = self.updates = self._start()
            out = original(*args, **kwargs)
            self.updates += 1
            return out

        return counted

    def wrap(self, original: Callable[..., Any], bound: bool) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            # one wrapped class calling another (PolicySnapshot -> EmbeddedEngine) is one call
            if getattr(self.inside, "depth", 0):
                return original(*args, **kwargs)
            # a method's self is not one of the call's arguments
            if self.due(args[1:] if bound else args, kwargs):
                self.fired = True
                self.action()
            self.inside.depth = 1
            try:
                return original(*args, **kwargs)
            finally:
                self.inside.depth = 0

        return hooked


@contextlib.contextmanager
def at_moment(
    monkeypatch: pytest.MonkeyPatch,
    moment: str,
    step: int,
    action: Callable[[], None],
    run_dir: Path | None = None,
) -> Iterator[_Trigger]:
    """Run ``action`` once, right before ``moment`` of GRPO step ``step`` (see module doc);
    the yielded trigger's ``fired`` says whether the moment came."""
    if moment not in MOMENTS:
        raise ValueError(f"moment {moment!r} is not one of {MOMENTS}")
    import importlib

    trigger = _Trigger(moment, step, action, run_dir)
    with monkeypatch.context() as patch:
        for module_name, attr in TARGETS[moment]:
            module = importlib.import_module(module_name)
            owner_name, _, name = attr.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            original = getattr(owner, name)
            patch.setattr(owner, name, trigger.wrap(original, bound=bool(owner_name)))
        if moment == "checkpoint":
            for module_name, attr in TARGETS["update"]:
                owner_name, _, name = attr.rpartition(".")
                owner = getattr(importlib.import_module(module_name), owner_name)
                patch.setattr(owner, name, trigger.count_update(getattr(owner, name)))
        yield trigger


def signal_self(signum: int = signal.SIGTERM) -> Callable[[], None]:
    """An action: send ``signum`` to this process (its handler runs in the main thread)."""
    return lambda: os.kill(os.getpid(), signum)


def actor_pid(run_dir: Path, log_name: str, label: str) -> int:
    """The pid an actor's log names (``<run>/logs/<log_name>``, line ``[<label> pid N]``)."""
    text = (Path(run_dir) / "logs" / log_name).read_text()
    return int(re.findall(rf"\[{re.escape(label)} pid (\d+)\]", text)[-1])


def kill_actor(
    run_dir: Path, log_name: str, label: str, timeout_s: float = 30.0
) -> Callable[[], None]:
    """An action: SIGKILL the actor whose log is ``log_name`` (e.g. ``rollout-1.log``, label
    ``rollout actor 1``) and wait until the process is gone, so the next call sees it dead."""

    def kill() -> None:
        pid = actor_pid(run_dir, log_name, label)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    return kill
