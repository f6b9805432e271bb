"""Helpers every benchmark shares: servers on loopback, result files and device names (common.py),
random checkpoints at published shapes (checkpoint.py)."""
