"""Peers: the designs serving engines run, re-implemented here and measured by the lab's own harness.

An optional extra (``pip install ".[peers]"``: PyTorch and Triton); the lab itself stays PyTorch-free. Importing
this package registers ``triton:fused-moe`` (:mod:`tools.peers.triton_fused_moe`, the fused-MoE design of vLLM and
SGLang, written here), ``triton:fused-moe-w8a8`` (the same design on fp8-block128 weights with both activation
quantizations: what serving engines run on FP8 checkpoints) and ``triton:fused-moe-w4a16`` (the same design on mxfp4
weights widened to bf16 in registers, bf16 activations: what they run on MXFP4 checkpoints on Hopper) when torch,
triton and a CUDA device are present;
otherwise it registers nothing and :data:`WHY_NOT` says why in one sentence ("the peers need ..."). Their knob
``CONFIG`` indexes the peer's tile configs (:data:`PEERS`); -1 (the default) takes the tile config
``python -m tools.peers --tune`` measured fastest for the shape and the nearest batch
(``tools/peers/tuned/<gpu slug>.json``), or the first config where none was measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernels.contract import Dims

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
PEER = "triton:fused-moe"
PEER_W8A8 = "triton:fused-moe-w8a8"
PEER_W4A16 = "triton:fused-moe-w4a16"
# peer -> the weight format it reads (its tile configs: tools.peers.tile_configs.CONFIGS / W8A8_CONFIGS /
# W4A16_CONFIGS)
PEERS = {PEER: "bf16", PEER_W8A8: "fp8-block128", PEER_W4A16: "mxfp4"}
# the tuned table's key suffix of each quantized peer's entries (the bf16 peer's have none)
KEY_SUFFIX = {PEER_W8A8: "-w8a8", PEER_W4A16: "-w4a16"}


def _why_not() -> str | None:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        return f"the peers need PyTorch and Triton (pip install '.[peers]'): {exc}"
    if not torch.cuda.is_available():
        return "the peers need a CUDA GPU that PyTorch can use; it sees none"
    return None


WHY_NOT = _why_not()


def tuned_path(gpu: str) -> Path:
    """Where the tuned configs of ``gpu`` (a device name) live: ``tools/peers/tuned/<slug>.json``."""
    from kernels.dispatch import gpu_slug

    return TUNED_DIR / f"{gpu_slug(gpu)}.json"


def shape_key(dims: Dims, peer: str = PEER) -> str:
    """How the tuned table names a shape (``HxIxExK``; the W8A8 / W4A16 peers' entries end in ``-w8a8`` /
    ``-w4a16``)."""
    return f"{dims.hidden}x{dims.intermediate}x{dims.experts}x{dims.top_k}" + KEY_SUFFIX.get(peer, "")


def configs(peer: str = PEER) -> tuple[Any, ...]:
    """The tile configs ``peer`` is tuned over."""
    from tools.peers.tile_configs import CONFIGS, W4A16_CONFIGS, W8A8_CONFIGS

    return {PEER_W8A8: W8A8_CONFIGS, PEER_W4A16: W4A16_CONFIGS}.get(peer, CONFIGS)


def tuned_config(dims: Dims, gpu: str, peer: str = PEER) -> int:
    """The index of the config measured fastest for these dims' shape at the nearest measured batch (0 if none)."""
    path = tuned_path(gpu)
    if not path.exists():
        return 0
    table = json.loads(path.read_text())
    points = table.get(shape_key(dims, peer), {})
    if not points:
        return 0
    nearest = min(points, key=lambda t: (abs(int(t) - dims.tokens), int(t)))
    return int(points[nearest])


def _register() -> None:
    import cupy
    import torch

    from kernels.dispatch import current_gpu
    from kernels.family import Launch
    from kernels.formats import Quantized
    from kernels.variants import Variant, register
    from tools.peers.triton_fused_moe import FusedMoE, as_torch

    streams: dict[int, Any] = {}

    def weight_view(w: Any) -> Any:
        return (as_torch(w.values), as_torch(w.scales)) if isinstance(w, Quantized) else as_torch(w)

    def make_build(peer: str) -> Any:
        tiles = configs(peer)

        def build(dims: Dims, CONFIG: int = -1) -> Launch:  # noqa: N803 - a knob, named like the lab's
            if isinstance(CONFIG, bool) or not isinstance(CONFIG, int) or not -1 <= CONFIG < len(tiles):
                raise ValueError(f"CONFIG must be -1 (tuned) or 0..{len(tiles) - 1}, got {CONFIG!r}")
            index = tuned_config(dims, current_gpu(), peer) if CONFIG == -1 else CONFIG
            layer = FusedMoE(dims, tiles[index], w8a8=peer == PEER_W8A8, w4a16=peer == PEER_W4A16)
            return launch_of(layer, index, tiles[index].name)

        return build

    def launch_of(layer: Any, index: int, name: str) -> Launch:

        def on_cupy_stream(stage: Any) -> Any:
            def run() -> None:  # launch on CuPy's current stream, so a CuPy graph capture holds it
                ptr = cupy.cuda.get_current_stream().ptr
                if ptr not in streams:
                    streams[ptr] = torch.cuda.ExternalStream(ptr)
                with torch.cuda.stream(streams[ptr]):
                    stage()
            return run

        def stages(x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> list[tuple[str, Any]]:
            views = [as_torch(x), weight_view(w13), weight_view(w2), *(as_torch(a) for a in (ids, weights, out))]
            return [(stage_name, on_cupy_stream(stage)) for stage_name, stage in layer.stages(*views)]

        def run(*args: Any) -> None:
            for _, stage in stages(*args):
                stage()

        return Launch(run=run, stages=stages, params={"CONFIG": index}, workspace=layer, facts={"config": name})

    register(Variant(
        name=PEER, backend="triton", family="fused-moe-peer", build=make_build(PEER), reference_mode="classical",
        params={"CONFIG": -1}, grid={"CONFIG": list(range(len(configs(PEER))))},
        description="the serving engines' fused-MoE design (align, grouped GEMMs, SiLU*up, sum) in Triton, "
                    "re-implemented here",
    ), prototype=False)
    register(Variant(
        name=PEER_W8A8, backend="triton", family="fused-moe-peer", build=make_build(PEER_W8A8),
        reference_mode="classical", quant="fp8", weight_format=PEERS[PEER_W8A8], params={"CONFIG": -1},
        grid={"CONFIG": list(range(len(configs(PEER_W8A8))))},
        description="the serving engines' W8A8 block-FP8 fused-MoE design in Triton, re-implemented here: x and the "
                    "activation quantized per token and 128 channels, e4m3 x e4m3 tensor-core GEMMs",
    ), prototype=False)
    register(Variant(
        name=PEER_W4A16, backend="triton", family="fused-moe-peer", build=make_build(PEER_W4A16),
        reference_mode="classical", weight_format=PEERS[PEER_W4A16], params={"CONFIG": -1},
        grid={"CONFIG": list(range(len(configs(PEER_W4A16))))},
        description="the serving engines' W4A16 fused-MoE design on mxfp4 weights in Triton, re-implemented here: "
                    "e2m1 x e8m0 widened to bf16 in registers, bf16 activations, bf16 tensor-core GEMMs",
    ), prototype=False)


if WHY_NOT is None:
    _register()
