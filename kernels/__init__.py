"""Triton attention kernels and their PyTorch references.

Only torch and triton are imported here; nothing in this package knows about the model.
"""
