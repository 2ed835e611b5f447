"""The one exception type omni-rope raises for bad inputs or configs.

A ``ValueError`` subclass so callers that already guard data errors with ``ValueError`` keep working,
while tests and the trainer can catch exactly ours.
"""

from __future__ import annotations


class OmniRopeError(ValueError):
    """Inputs or config that cannot yield correct Omni positions; the message names the culprit."""
