"""The weight formats' geometry: the numbers both the NumPy side (:mod:`kernels.formats`, which stores and reads the
formats) and the CUDA side (:mod:`kernels.device_helpers`, whose ``FP8_HELPERS`` text ``#define`` s them) must agree
on. Plain numbers, imported from nothing: the CUDA text is built without reaching the formats (whose on-device
quantizer, ``kernels.quantize_cuda``, is itself built on that text).

``BLOCK``: the rows and columns of one fp8-block128 scale block. A tile (``fp8-block128-t16``, ``bf16-t16``):
``TILE_ROWS`` rows of ``TILE_ROW_BYTES`` bytes, 1 KB contiguous, :func:`tile_k` values a row.
:class:`FormatDimsError`: dims a format cannot store, here so that :mod:`kernels.formats` and the 4-bit formats'
arithmetic (:mod:`kernels.formats_fp4`, which the formats build on) raise the one class.
"""

from __future__ import annotations

BLOCK = 128  # rows and columns of an fp8-block128 scale block
TILE_ROWS, TILE_ROW_BYTES = 16, 64  # a tile: 16 rows x 64 bytes (64 e4m3 or 32 bf16 values), 1 KB contiguous


def tile_k(itemsize: int) -> int:
    """Values per tile row for values of ``itemsize`` bytes: 64 e4m3, 32 bf16 (one tensor-core k block)."""
    return TILE_ROW_BYTES // itemsize


class FormatDimsError(ValueError):
    """Dims a weight format cannot store (a tiled format's H and I not whole tiles, a 4-bit format's odd k)."""
