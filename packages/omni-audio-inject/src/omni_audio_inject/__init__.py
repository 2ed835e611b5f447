"""omni-audio-inject."""
