"""The pieces the GRPO loop (``omni_grpo.trainer``) is assembled from, kept out of its way.

* ``components``: the backend (owns the weights), the rollout engine and the weight sync — in
  this process, or Ray actors behind stand-ins — built together and closed together;
* ``data_order``: which training rows each step (and the warm-up) draws, resumable by a cursor;
* ``rollout_batches``: the step's rollouts, generated in the step or one step ahead
  (``rollout.max_staleness: 1``), and the data cursor a checkpoint may store.

The resume and the metrics row of a step whose weight sync failed are run management:
``omni_grpo.run.resume``.
"""
