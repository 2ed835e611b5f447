"""omni-rope."""
