"""Triton kernels for paged attention, with a torch reference beside each."""
