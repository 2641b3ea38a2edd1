"""Checkpoints: sharded save with atomic commit, resolution, safe and verified load."""
