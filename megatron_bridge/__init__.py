"""HF <-> Megatron weight layouts, checkpoint conversion and in-place rollout resharding."""
