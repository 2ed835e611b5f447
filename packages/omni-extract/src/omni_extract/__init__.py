"""omni-extract."""
