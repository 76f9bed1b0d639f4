"""The house stays one a newcomer can walk through: small files, small kernel families, no format branches.

Bars: no file in kernels/ over 900 lines; no batched family file over 600 (each holds one family's CUDA C, or the
shared core, or the loaders); no kernel family over 16 knobs; no batched kernel text naming a weight format's
switch in any kernel text (the format's loader is compiled in front of the batched kernels instead:
kernels/batched/loaders.py; the expert-centric W8A8 design names what it is).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_KERNEL_FILE_LINES = 900
MAX_FAMILY_FILE_LINES = 600
MAX_KNOBS = 16


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_file_in_kernels_is_over_900_lines() -> None:
    long = {str(p.relative_to(ROOT)): _lines(p) for p in sorted((ROOT / "kernels").rglob("*.py"))
            if _lines(p) > MAX_KERNEL_FILE_LINES}
    assert not long, f"files over {MAX_KERNEL_FILE_LINES} lines: {long}"


def test_every_batched_family_file_reads_in_one_sitting() -> None:
    long = {p.name: _lines(p) for p in sorted((ROOT / "kernels" / "batched").glob("*.py"))
            if _lines(p) > MAX_FAMILY_FILE_LINES}
    assert not long, f"kernels/batched files over {MAX_FAMILY_FILE_LINES} lines: {long}"


def test_no_kernel_family_has_more_than_16_knobs() -> None:
    from kernels.variants import load_builtin

    families = {v.kernel_family.name: v.kernel_family for v in load_builtin().values() if v.kernel_family}
    assert families
    big = {name: sorted(f.defaults) for name, f in families.items() if len(f.defaults) > MAX_KNOBS}
    assert not big, f"kernel families over {MAX_KNOBS} knobs: {big}"


@pytest.mark.parametrize("switch", ["W_FP8", "W_TILED", "FP8_BLOCK_SUM"])
def test_no_kernel_text_branches_on_the_weight_format(switch: str) -> None:
    """No registered CUDA source (the batched families on every format, the strict, expert-centric and prototype
    kernels) names a weight format's switch: a format is data and a loader."""
    from kernels import batched
    from kernels.compile import SOURCES
    from kernels.variants import load_builtin

    load_builtin()
    texts = {name: source.code for name, source in SOURCES.items()}
    for families in batched.FAMILIES.values():
        texts.update({family.name: family.source.code for family in families.families.values()})
    assert len(texts) > 10
    for name, code in texts.items():
        assert not re.search(rf"\b{switch}\b", code), (name, switch)
