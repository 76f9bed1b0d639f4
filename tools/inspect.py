"""Offline compile report: registers, shared memory, stack, spills and sm_90 occupancy of every kernel.

    python -m tools.inspect            # rich table
    python -m tools.inspect --json     # one JSON object per row
    python -m tools.inspect --defaults-only --source warp_decode_cupy

Compiles every registered :class:`kernels.compile.CudaSource` (library modules via
``kernels.variants.load_builtin()``, plus ``tools.roofline`` and ``prototypes.load()`` when present) for
sm_90 with NVRTC -- no GPU needed -- at its defaults and at each parameter set in its ``variants`` list.
Numba kernels join when ``kernels.warp_decode_numba.offline_reports()`` exists. The bench and the sweep
reuse :func:`collect`, :func:`render` and :func:`occupancy`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from kernels.compile import SOURCES, CudaSource, KernelResources, OfflineCompileError, offline_report

# sm_90 (H100 / H200) per-SM limits
SM90_MAX_WARPS = 64
SM90_REGISTERS = 65536
SM90_REG_ALLOC_UNIT = 256  # registers, allocated per warp
SM90_MAX_BLOCKS = 32
SM90_SHARED_BYTES = 228 * 1024
SM90_SHARED_RESERVED_PER_BLOCK = 1024
SM90_MAX_REGS_PER_THREAD = 255


@dataclass(frozen=True)
class Occupancy:
    """Theoretical residency of one kernel on one sm_90 SM."""

    blocks_per_sm: int
    warps_per_sm: int
    limiter: str  # "warps", "registers", "shared", "blocks" or "none"

    @property
    def fraction(self) -> float:
        return self.warps_per_sm / SM90_MAX_WARPS

    def __float__(self) -> float:  # float(occupancy(...)) is the fraction of 64 warps
        return self.fraction


def occupancy(registers: int, threads_per_block: int, shared_bytes: int = 0) -> Occupancy:
    """Blocks and warps one sm_90 SM holds for a kernel using ``registers`` per thread.

    Registers are allocated per warp in units of 256 (``ceil(regs * 32 / 256) * 256``); shared memory per
    block is its static + dynamic bytes plus 1 KB reserved by the system; at most 32 blocks and 64 warps.
    """
    if threads_per_block < 1 or threads_per_block > 1024:
        raise ValueError(f"threads_per_block must be in 1..1024, got {threads_per_block}")
    if registers < 0 or registers > SM90_MAX_REGS_PER_THREAD:
        raise ValueError(f"registers must be in 0..255, got {registers}")
    warps_per_block = math.ceil(threads_per_block / 32)
    limits = {"warps": SM90_MAX_WARPS // warps_per_block, "blocks": SM90_MAX_BLOCKS}
    regs_per_warp = math.ceil(max(registers, 1) * 32 / SM90_REG_ALLOC_UNIT) * SM90_REG_ALLOC_UNIT
    limits["registers"] = (SM90_REGISTERS // regs_per_warp) // warps_per_block
    limits["shared"] = SM90_SHARED_BYTES // (shared_bytes + SM90_SHARED_RESERVED_PER_BLOCK)
    limiter = min(limits, key=lambda key: (limits[key], key != "warps"))
    blocks = max(0, min(limits.values()))
    return Occupancy(blocks, blocks * warps_per_block, limiter if blocks else "registers")


@dataclass
class Row:
    """One kernel compiled with one parameter set."""

    source: str
    kernel: str
    params: dict[str, Any] = field(default_factory=dict)
    registers: int | None = None
    shared_bytes: int | None = None
    stack_bytes: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    threads_per_block: int | None = None
    warps_per_sm: int | None = None
    occupancy: float | None = None
    limiter: str = ""
    is_default: bool = False
    error: str = ""

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)


LOAD_ERRORS: list[str] = []


def load_sources() -> dict[str, CudaSource]:
    """Import everything that registers CUDA sources; tolerate absent optional modules."""
    from kernels.variants import load_builtin

    LOAD_ERRORS.clear()
    load_builtin()
    try:
        importlib.import_module("tools.roofline")
    except ImportError:
        pass
    try:
        prototypes = importlib.import_module("prototypes")
    except ImportError:
        return SOURCES
    try:
        prototypes.load()
    except Exception as exc:  # noqa: BLE001 - one broken prototype must not hide the others' report
        LOAD_ERRORS.append(f"prototypes.load(): {type(exc).__name__}: {exc}"[:200])
    return SOURCES


def threads_per_block(source: CudaSource, kernel: str, params: dict[str, Any]) -> int | None:
    """Threads per block of ``kernel`` from its warps knob: the source's ``warps_knobs`` mapping if it has
    one, else a knob named ``WARPS``, else the only knob ending in ``WARPS``; a ``THREADS`` knob also works."""
    knobs = getattr(source, "warps_knobs", None) or {}
    if kernel in knobs and knobs[kernel] in params:
        return int(params[knobs[kernel]]) * 32
    if "WARPS" in params:
        return int(params["WARPS"]) * 32
    if "THREADS" in params:
        return int(params["THREADS"])
    warps = [key for key in params if key.endswith("WARPS")]
    if len(warps) == 1:
        return int(params[warps[0]]) * 32
    return None


def _row(source: str, report: KernelResources, params: dict[str, Any], threads: int | None, default: bool) -> Row:
    row = Row(
        source, report.kernel, dict(params), report.registers, report.shared_bytes, report.stack_bytes,
        report.spill_stores, report.spill_loads, threads, is_default=default,
    )
    if threads:
        occ = occupancy(report.registers, threads, report.shared_bytes)
        row.warps_per_sm, row.occupancy, row.limiter = occ.warps_per_sm, occ.fraction, occ.limiter
    return row


def collect(
    sources: list[str] | None = None,
    defaults_only: bool = False,
    include_numba: bool = True,
    arch: str = "sm_90",
) -> list[Row]:
    """Compile every registered source (or those named) at its defaults and each ``variants`` entry.

    A source that fails to compile yields one row carrying the error instead of raising.
    """
    load_sources()
    rows: list[Row] = [Row("prototypes", "-", error=error) for error in LOAD_ERRORS]
    names = sorted(SOURCES) if sources is None else list(sources)
    for name in names:
        if name not in SOURCES:
            raise ValueError(f"unknown CUDA source {name!r}; registered: {', '.join(sorted(SOURCES))}")
        source = SOURCES[name]
        param_sets = [({}, True)] + ([] if defaults_only else [(dict(v), False) for v in source.variants])
        for overrides, default in param_sets:
            params = source.params(**overrides)
            try:
                reports = offline_report(source, arch, **overrides)
            except (OfflineCompileError, ValueError) as exc:
                rows.append(Row(name, "-", params, is_default=default, error=str(exc).splitlines()[0][:200]))
                continue
            for report in sorted(reports, key=lambda r: r.kernel):
                rows.append(_row(name, report, params, threads_per_block(source, report.kernel, params), default))
    if include_numba and sources is None:
        rows.extend(numba_rows())
    return rows


def numba_rows() -> list[Row]:
    """Rows from ``kernels.warp_decode_numba.offline_reports()`` when that module exists."""
    try:
        module = importlib.import_module("kernels.warp_decode_numba")
    except ModuleNotFoundError as exc:
        if exc.name == "kernels.warp_decode_numba":
            return []
        raise
    reports_fn = getattr(module, "offline_reports", None)
    if reports_fn is None:
        return []
    try:
        reports = reports_fn()
    except Exception as exc:  # noqa: BLE001 - the report must not die with one backend
        return [Row("numba", "-", error=f"{type(exc).__name__}: {exc}"[:200])]
    rows = []
    for report in reports:
        params = dict(getattr(report, "params", {}) or {})
        if not params:  # offline_reports() names kernels "name[warps=8,rows=1,...]"
            tag = re.search(r"\[(.*)\]$", report.kernel)
            for item in (tag.group(1).split(",") if tag else []):
                key, _, value = item.partition("=")
                if value.lstrip("-").isdigit():
                    params[key] = int(value)
        threads = getattr(report, "threads_per_block", None)
        if threads is None:
            threads = threads_per_block(CudaSource("numba", "", ()), "", {k.upper(): v for k, v in params.items()})
        rows.append(_row("numba", report, params, threads, bool(getattr(report, "is_default", True))))
    return rows


def _fmt_params(params: dict[str, Any], source: CudaSource | None) -> str:
    if source is not None:
        params = {k: v for k, v in params.items() if source.defaults.get(k) != v} or {"": "defaults"}
    return " ".join(f"{k}={v}" if k else str(v) for k, v in params.items())


def render(rows: list[Row]) -> Any:
    """A ``rich.table.Table`` of the rows (parameters shown as differences from the source's defaults)."""
    from rich.table import Table

    table = Table(title="offline compile report (sm_90, NVRTC / nvJitLink)", show_lines=False)
    for name, justify in (
        ("source", "left"), ("kernel", "left"), ("params", "left"), ("regs", "right"), ("smem B", "right"),
        ("stack B", "right"), ("spill st/ld B", "right"), ("threads", "right"), ("warps/SM", "right"),
        ("occupancy", "right"), ("limiter", "left"),
    ):
        table.add_column(name, justify=justify)
    for row in rows:
        source = SOURCES.get(row.source)
        if row.error:
            table.add_row(row.source, row.kernel, _fmt_params(row.params, source), f"[red]{row.error}[/red]",
                          *[""] * 7)
            continue
        spill = f"{row.spill_stores}/{row.spill_loads}"
        if row.spills or row.stack_bytes:
            spill = f"[red]{spill}[/red]"
        table.add_row(
            row.source, row.kernel, _fmt_params(row.params, source), str(row.registers), str(row.shared_bytes),
            str(row.stack_bytes), spill, str(row.threads_per_block or "?"),
            str(row.warps_per_sm) if row.warps_per_sm is not None else "?",
            f"{row.occupancy:.0%}" if row.occupancy is not None else "?", row.limiter,
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    parser.add_argument("--source", action="append", help="only this registered source (repeatable)")
    parser.add_argument("--defaults-only", action="store_true", help="skip each source's variants list")
    parser.add_argument("--no-numba", action="store_true", help="skip Numba kernels")
    args = parser.parse_args(argv)
    rows = collect(args.source, defaults_only=args.defaults_only, include_numba=not args.no_numba)
    if args.json:
        for row in rows:
            print(json.dumps({**dataclasses.asdict(row), "spills": row.spills}))
    else:
        from rich.console import Console

        Console(width=200).print(render(rows))
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
