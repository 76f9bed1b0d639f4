"""The Triton peer's tile configs, apart from its kernels so that the tools can name and check them without PyTorch
or Triton (``python -m tools.peers --configs``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    """One GEMM tiling (both GEMMs use it, as vLLM's per-shape config files do)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return (f"M{self.block_m}-N{self.block_n}-K{self.block_k}-G{self.group_m}-w{self.num_warps}"
                f"-s{self.num_stages}")


# Tilings of the kind vLLM's H100/H200 fused-MoE config files hold for these expert shapes (small BLOCK_M for
# decode batches, larger M and N tiles and more warps as the pairs per expert grow).
CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(16, 64, 128, 1, 4, 3),
    TileConfig(16, 128, 128, 1, 4, 3),
    TileConfig(16, 64, 256, 1, 4, 3),
    TileConfig(32, 64, 128, 1, 4, 4),
    TileConfig(64, 64, 64, 1, 4, 4),
    TileConfig(64, 128, 128, 16, 8, 3),
)
DEFAULT_CONFIG = CONFIGS[0]
# The W8A8 tilings: BLOCK_K = 128, one scale block per k step (vLLM's block-FP8 configs are all of this kind)
W8A8_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(16, 64, 128, 1, 4, 3),
    TileConfig(16, 128, 128, 1, 4, 3),
    TileConfig(16, 32, 128, 1, 4, 4),
    TileConfig(32, 64, 128, 1, 4, 4),
    TileConfig(64, 128, 128, 16, 8, 3),
)
# The W4A16 tilings (mxfp4 weights): BLOCK_K a multiple of the 32-value scale groups; a tile of packed weights is
# half the bytes of a bf16 one, so decode-sized M16 tiles with wide N or K, and the larger ones for big batches
W4A16_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(16, 64, 128, 1, 4, 3),
    TileConfig(16, 128, 128, 1, 4, 3),
    TileConfig(16, 64, 256, 1, 4, 3),
    TileConfig(16, 32, 256, 1, 4, 4),
    TileConfig(32, 64, 128, 1, 4, 4),
    TileConfig(64, 64, 64, 1, 4, 4),
    TileConfig(64, 128, 128, 16, 8, 3),
)
