"""omni-rollout-client."""
