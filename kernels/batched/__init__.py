"""Batched warp decode: the kernel families that read each routed expert once per batch."""
