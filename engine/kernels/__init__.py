"""Triton FlashAttention-2 kernels, each with its pure-torch reference."""
