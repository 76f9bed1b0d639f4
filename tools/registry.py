"""The one registry loader every program uses: the library's kernel modules, the roofline's CUDA source, the peers
(``tools.peers``: registered only where PyTorch, Triton and a GPU are present) and the prototypes, imported so that
each registers its variants (``kernels.variants.REGISTRY``) and CUDA sources
(``kernels.compile.SOURCES``). A module that fails to import is reported, not raised: one broken experiment must
not stop the bench, the sweep or the compile report."""

from __future__ import annotations

import importlib
from typing import Any

PEERS_MODULE = "tools.peers"  # loaded by name: nothing imports the optional peers directly


def peers() -> tuple[tuple[str, ...], str | None]:
    """The peers' variant names and, where they cannot run here, why (None where they are registered)."""
    module = importlib.import_module(PEERS_MODULE)
    return tuple(module.PEERS), module.WHY_NOT


def load() -> tuple[dict[str, Any], list[str]]:
    """Import everything that registers; returns ``(the variant registry, one line per module that failed)``."""
    from kernels import variants

    warnings = []
    for module in (*variants.BUILTIN_MODULES, "tools.roofline", PEERS_MODULE):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported with the results, the rest still loads
            warnings.append(f"{module}: {type(exc).__name__}: {exc}"[:300])
    try:
        import prototypes

        prototypes.load()
    except Exception as exc:  # noqa: BLE001
        warnings.append(f"prototypes: {type(exc).__name__}: {exc}"[:300])
    return variants.REGISTRY, warnings


def describe(registry: dict[str, Any], marked: Any = None, room: int | None = None) -> list[str]:
    """One line per variant of ``registry``: its name, the weight format it reads and its description (whitespace
    folded; cut to ``room`` characters with "..." where given). With ``marked`` (names), each line starts with ``*``
    for a marked variant and a space for the others. What ``--list`` prints in the bench and the sweep."""
    width = max((len(name) for name in registry), default=0)
    lines = []
    for name, variant in registry.items():
        description = " ".join((variant.description or "").split())
        if room is not None and len(description) > room:
            description = description[:max(0, room - 3)].rstrip() + "..."
        mark = "" if marked is None else ("* " if name in marked else "  ")
        weight_format = getattr(variant, "weight_format", "bf16")
        lines.append(f"{mark}{name:<{width}}  {weight_format:<16s}  {description}".rstrip())
    return lines

