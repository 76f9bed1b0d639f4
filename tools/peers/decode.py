"""``python -m tools.peers.decode``: ``tools.decode`` with the peers extra's rows in the same tables -- the MoE path
"triton-peer" (the serving engines' fused-MoE design, ``tools/peers/triton_fused_moe.py``, tuned as ``tools.peers``
tunes it) inside the lab's step, and ``--torch``: the PyTorch-composed step (``tools/peers/torch_step.py``: cuBLAS
GEMMs, ``scaled_dot_product_attention`` with GQA, torch top-k, the peer's MoE; one CUDA graph), timed the same way.

    python -m tools.peers.decode --tokens 1,4 --context 2048,8192 --moe warp-decode,triton-peer --torch

Without PyTorch and Triton the peer's rows say why they were skipped; every other row runs as ``tools.decode`` runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tools import decode


def triton_peer() -> tuple[Any, str | None]:
    """The step's MoE hook building the peer's registered variant for (dims, weight format), or None and why."""
    from tools import peers

    if peers.WHY_NOT is not None:
        return None, peers.WHY_NOT

    def hook(dims: Any, weight_format: str) -> Any:
        from kernels.variants import REGISTRY

        return REGISTRY[peers.PEER if weight_format == "bf16" else peers.PEER_W8A8].make(dims)

    hook.name = "triton-peer"  # type: ignore[attr-defined]
    return hook, None


def torch_composed(device_model: Any, model: Any, tokens: int, context: int, repeats: int, inner: int,
                   seed: int) -> dict[str, Any]:
    """The PyTorch-composed step at one point, timed as ``tools.decode`` times the lab's."""
    from tools.peers import torch_step

    row: dict[str, Any] = {"tokens": tokens, "context": context, "moe": "torch", "status": "ok"}
    if torch_step.WHY_NOT is not None:
        return {**row, "status": "skipped", "error": torch_step.WHY_NOT}
    composed = torch_step.TorchStep.build(device_model, tokens, context,
                                          capacity=context + inner + decode.HEADROOM, seed=seed)
    samples = composed.time(repeats, inner)
    row.update(samples_us=samples, **decode.summary(samples))
    row["tokens_per_s"] = tokens / (row["median_us"] * 1e-6)
    return row


EXTRAS = decode.Extras(prog="python -m tools.peers.decode", moes={"triton-peer": triton_peer},
                       composed=torch_composed)


def main(argv: Sequence[str] | None = None) -> int:
    return decode.main(argv, EXTRAS)


if __name__ == "__main__":
    sys.exit(main())
