"""omni-grpo."""
