"""Triton kernels (CUDA; CPU through TRITON_INTERPRET=1) and their torch references."""
