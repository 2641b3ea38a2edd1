"""The training loop and what it needs: optimizer, schedule, clipping, metrics, state."""
