"""Test rigs shipped with omni-grpo, kept out of the product rooms.

* :mod:`omni_grpo.testing.models` — hand-built Omni thinker batches (placeholders expanded as the
  processor does) for parity tests and benchmarks.
* :mod:`omni_grpo.testing.sync` — the server side of the distributed weight-sync protocol in real
  processes, and the independently computed tensors a server must end up holding.
* :mod:`omni_grpo.testing.fake_server` — the fake sglang-omni server as a process (what
  ``omni-grpo serve --kind fake`` and ``rollout.sglang.launch.kind: fake`` start), optionally with
  distributed weight-sync receivers.
* :mod:`omni_grpo.testing.megatron` — the GPU verification of the Megatron thinker and its
  stand-in weight-sync receiver.
* :mod:`omni_grpo.testing.export` — a run directory with a "trained" checkpoint (torch backend)
  and the same weights under the Megatron backend's names, for export tests.
* :mod:`omni_grpo.testing.rollouts` — a tiny policy and real embedded rollout groups, the inputs a
  backend test feeds to ``step``.
* :mod:`omni_grpo.testing.data_parallel` — a local gloo world of spawned processes
  (``run_world``) and the torch backend's steps on one rank, for the data-parallel equivalence test.

Nothing in the product imports this package; tests, benchmarks and device runs do.
"""
