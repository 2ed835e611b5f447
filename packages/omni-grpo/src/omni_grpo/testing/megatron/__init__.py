"""GPU verification rigs for the Megatron backend (run on the device machine).

* :mod:`.verify` — logits parity against transformers, TP/EP/SP steps and weight-sync round trips.
* :mod:`.sender` / :mod:`.receiver` — the trainer's and a stand-in server rank's ends of a
  distributed weight sync, joined through the rendezvous store instead of HTTP.
"""
