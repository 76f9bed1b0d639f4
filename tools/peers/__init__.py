"""Peers: the designs serving engines run, re-implemented here and measured by the lab's own harness.

An optional extra (``pip install ".[peers]"``: PyTorch and Triton); the lab itself stays PyTorch-free. Importing
this package registers ``triton:fused-moe`` (:mod:`tools.peers.triton_fused_moe`, the fused-MoE design of vLLM and
SGLang, written here) when torch, triton and a CUDA device are present; otherwise it registers nothing and
:data:`WHY_NOT` says why in one line. Its knob ``CONFIG`` indexes :data:`~tools.peers.triton_fused_moe.CONFIGS`;
-1 (the default) takes the tile config ``python -m tools.peers --tune`` measured fastest for the shape and the
nearest batch (``tools/peers/tuned/<gpu slug>.json``), or the first config where none was measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernels.contract import Dims

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
PEER = "triton:fused-moe"


def _why_not() -> str | None:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        return f"needs PyTorch and Triton (pip install '.[peers]'): {exc}"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU for PyTorch"
    return None


WHY_NOT = _why_not()


def tuned_path(gpu: str) -> Path:
    """Where the tuned configs of ``gpu`` (a device name) live: ``tools/peers/tuned/<slug>.json``."""
    from kernels.dispatch import gpu_slug

    return TUNED_DIR / f"{gpu_slug(gpu)}.json"


def shape_key(dims: Dims) -> str:
    return f"{dims.hidden}x{dims.intermediate}x{dims.experts}x{dims.top_k}"


def tuned_config(dims: Dims, gpu: str) -> int:
    """The index of the config measured fastest for these dims' shape at the nearest measured batch (0 if none)."""
    path = tuned_path(gpu)
    if not path.exists():
        return 0
    table = json.loads(path.read_text())
    points = table.get(shape_key(dims), {})
    if not points:
        return 0
    nearest = min(points, key=lambda t: (abs(int(t) - dims.tokens), int(t)))
    return int(points[nearest])


def _register() -> None:
    import cupy
    import torch

    from kernels.dispatch import current_gpu
    from kernels.family import Launch
    from kernels.variants import Variant, register
    from tools.peers.triton_fused_moe import CONFIGS, FusedMoE, as_torch

    streams: dict[int, Any] = {}

    def build(dims: Dims, CONFIG: int = -1) -> Launch:  # noqa: N803 - a knob, named like the lab's
        if isinstance(CONFIG, bool) or not isinstance(CONFIG, int) or not -1 <= CONFIG < len(CONFIGS):
            raise ValueError(f"CONFIG must be -1 (tuned) or 0..{len(CONFIGS) - 1}, got {CONFIG!r}")
        index = tuned_config(dims, current_gpu()) if CONFIG == -1 else CONFIG
        layer = FusedMoE(dims, CONFIGS[index])

        def on_cupy_stream(stage: Any) -> Any:
            def run() -> None:  # launch on CuPy's current stream, so a CuPy graph capture holds it
                ptr = cupy.cuda.get_current_stream().ptr
                if ptr not in streams:
                    streams[ptr] = torch.cuda.ExternalStream(ptr)
                with torch.cuda.stream(streams[ptr]):
                    stage()
            return run

        def stages(x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> list[tuple[str, Any]]:
            views = [as_torch(a) for a in (x, w13, w2, ids, weights, out)]
            return [(name, on_cupy_stream(stage)) for name, stage in layer.stages(*views)]

        def run(*args: Any) -> None:
            for _, stage in stages(*args):
                stage()

        return Launch(run=run, stages=stages, params={"CONFIG": index}, workspace=layer,
                      facts={"config": CONFIGS[index].name})

    register(Variant(
        name=PEER, backend="triton", family="fused-moe-peer", build=build, reference_mode="classical",
        params={"CONFIG": -1}, grid={"CONFIG": list(range(len(CONFIGS)))},
        description="the serving engines' fused-MoE design (align, grouped GEMMs, SiLU*up, sum) in Triton, "
                    "re-implemented here",
    ), prototype=False)


if WHY_NOT is None:
    _register()
