"""Offline compile report: registers, shared memory, stack, spills and sm_90 occupancy of every kernel.

    python -m tools.compile_report            # rich table, one line per kernel and parameter set
    python -m tools.compile_report --json     # one JSON object per row
    python -m tools.compile_report --defaults-only --source warp_decode_cupy

Compiles every registered :class:`kernels.compile.CudaSource` (library modules via
``kernels.variants.load_builtin()``, plus ``tools.roofline`` and ``prototypes.load()`` when present) for
sm_90 with NVRTC -- no GPU needed -- at its defaults and at each parameter set in its ``variants`` list.
Kernel families without CUDA C (Numba) join through their ``offline_reports``. The bench and the sweep
reuse :func:`collect`, :func:`variant_rows`, :func:`render` and :func:`occupancy`.

Each row shows its kernel's own knobs where its source says which those are (:func:`kernel_params`). A ``?``
under threads / warps/SM / occupancy: the kernel's block size is set at launch, not by a knob the report can map to
it, so its occupancy is not computed. A spill the source accepts (``CudaSource.accepted_spills``: bytes and why,
declared with the kernel) is marked ``†`` and its reason printed under the table; every other spill or stack frame
is red.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from kernels.compile import SOURCES, CudaSource, KernelResources, OfflineCompileError, offline_report
from tools.cli import examples

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
    variant: str = ""  # the registered variant these knobs belong to, when the row was made for one
    accepted_spill: str = ""  # why its spill / stack is kept, when the source accepts it (CudaSource.accepted_spills)

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)


LOAD_ERRORS: list[str] = []


def load_sources() -> dict[str, CudaSource]:
    """Everything that registers CUDA sources (:func:`tools.registry.load`); failures go to ``LOAD_ERRORS``."""
    from tools.registry import load

    LOAD_ERRORS[:] = load()[1]
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


def kernel_params(source: CudaSource, kernel: str, params: dict[str, Any]) -> dict[str, Any]:
    """The knobs of ``params`` that belong to ``kernel``: where the source declares its kernels' knob prefixes
    (``CudaSource.knob_prefixes``: gate_up ``GU_``, down ``DN_``), a kernel's row leaves out the knobs of the other
    kernels' prefixes, so the gate_up is not labelled with the down's knobs; knobs of no declared prefix (``PDL``)
    belong to every kernel, and a kernel or source without a declared prefix keeps them all."""
    own = source.knob_prefixes.get(kernel)
    if own is None:
        return dict(params)
    others = set(source.knob_prefixes.values()) - {own}
    return {key: value for key, value in params.items()
            if key.startswith(own) or not any(key.startswith(prefix) for prefix in others)}


def accepted_spill(source: CudaSource | None, report: KernelResources) -> str:
    """Why ``report``'s spill / stack is kept (``CudaSource.accepted_spills``), or "" when it has none or more than
    the source accepts."""
    if source is None or not (report.spill_stores or report.spill_loads or report.stack_bytes):
        return ""
    limit, why = source.accepted_spills.get(report.kernel, (0, ""))
    within = max(report.spill_stores or 0, report.spill_loads or 0, report.stack_bytes or 0) <= limit
    return why if within else ""


def _row(source: str, report: KernelResources, params: dict[str, Any], threads: int | None, default: bool,
         cuda: CudaSource | None = None) -> Row:
    """One kernel's row; with its ``cuda`` source, the row keeps only that kernel's knobs (:func:`kernel_params`)
    and says why an accepted spill is kept."""
    if cuda is not None:
        params = kernel_params(cuda, report.kernel, params)
    row = Row(
        source, report.kernel, dict(params), report.registers, report.shared_bytes, report.stack_bytes,
        report.spill_stores, report.spill_loads, threads, is_default=default,
        accepted_spill=accepted_spill(cuda, report),
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
    steps: Any = None,
) -> list[Row]:
    """Compile every registered source (or those named) at its defaults and each ``variants`` entry.

    A source that fails to compile yields one row carrying the error instead of raising; an unknown name is a
    ValueError. ``steps``: a :class:`tools.display.Steps` told about each compile. A kernel whose own knobs
    (:func:`kernel_params`) are those of an earlier parameter set is listed once.
    """
    load_sources()
    rows: list[Row] = [Row(error.split(":", 1)[0], "-", error=error) for error in LOAD_ERRORS]
    names = sorted(SOURCES) if sources is None else list(sources)
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown CUDA source(s) {', '.join(map(repr, unknown))}; registered: "
                         f"{', '.join(sorted(SOURCES))}")
    listed: set[tuple[str, str, str]] = set()
    for number, name in enumerate(names, 1):
        source = SOURCES[name]
        param_sets = [({}, True)] + ([] if defaults_only else [(dict(v), False) for v in source.variants])
        if steps is not None:
            steps.start(f"compiling {name} for {arch} ({len(param_sets)} parameter set(s); source {number} of "
                        f"{len(names)})")
        for overrides, default in param_sets:
            params = source.params(**overrides)
            try:
                reports = offline_report(source, arch, **overrides)
            except (OfflineCompileError, ValueError) as exc:
                rows.append(Row(name, "-", params, is_default=default, error=str(exc).splitlines()[0][:200]))
                continue
            for report in sorted(reports, key=lambda r: r.kernel):
                row = _row(name, report, params, threads_per_block(source, report.kernel, params), default, source)
                key = (name, row.kernel, json.dumps(row.params, sort_keys=True))
                if key not in listed:  # e.g. the gate_up of parameter sets that differ in the down's knobs
                    listed.add(key)
                    rows.append(row)
    if include_numba and sources is None:
        if steps is not None:
            steps.start("compiling the Numba kernels for sm_90 (Numba, then nvJitLink)")
        rows.extend(numba_rows())
    return rows


def variant_rows(variant: Any, dims: Any = None, params: dict[str, Any] | None = None,
                 arch: str = "sm_90") -> list[Row]:
    """One row per kernel of ``variant`` compiled offline with the knobs it runs at ``dims``.

    The variant's kernel family answers: its knobs are resolved for ``dims`` first (``Variant.resolve``), so the
    report is of what actually runs; without ``dims`` a knob at 0 ("auto") compiles at the source's default. A
    family without CUDA C (Numba) reports through its ``offline_reports``; a variant that composes others
    (auto-dispatch) has no family and yields no row. A failure is one row with ``error``.
    """
    params = {**variant.params, **(params or {})}
    family = getattr(variant, "kernel_family", None)
    if family is None:
        return []
    source = family.source
    if source is None:
        if family.offline_reports is None:
            return []
        try:
            reports = [r for r in family.offline_reports([params], defaults=False)
                       if all(r.params.get(k) == v for k, v in params.items()) and not r.params.get("out_f32")]
        except Exception as exc:  # noqa: BLE001 - the report must not die with one backend
            return [Row(variant.backend, "-", params, error=f"{type(exc).__name__}: {exc}"[:200], variant=variant.name)]
        seen: dict[str, Row] = {}
        for report in reports:
            threads = getattr(report, "threads_per_block", None)
            seen[report.kernel] = _row(variant.backend, report, dict(report.params), threads, True)
            seen[report.kernel].variant = variant.name
        return list(seen.values())
    resolved = dims is not None
    if resolved:
        try:
            params = variant.resolve(dims, **(params or {}))
        except (TypeError, ValueError) as exc:
            return [Row(source.name, "-", params, error=f"{type(exc).__name__}: {exc}"[:200], variant=variant.name)]
    # once resolved a 0 is a value (e.g. DB_MAX_REGS 0: launch bounds only), not "auto"
    defines = {k: int(v) for k, v in params.items()
               if k in source.defaults and (resolved or not (int(v) == 0 and source.defaults[k] != 0))}
    try:
        reports = offline_report(source, arch, **defines)
    except Exception as exc:  # noqa: BLE001 - reported as a row
        return [Row(source.name, "-", defines, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200],
                    variant=variant.name)]
    merged = source.params(**defines)
    rows = []
    for report in sorted(reports, key=lambda r: r.kernel):
        row = _row(source.name, report, merged, threads_per_block(source, report.kernel, merged), False, source)
        row.variant = variant.name
        rows.append(row)
    return rows


def numba_rows() -> list[Row]:
    """Rows of every registered kernel family without CUDA C (the Numba ones), from its ``offline_reports``."""
    from kernels.variants import REGISTRY, load_builtin

    load_builtin()
    families = {id(v.kernel_family): (v.backend, v.kernel_family) for v in REGISTRY.values()
                if v.kernel_family is not None and v.kernel_family.source is None
                and v.kernel_family.offline_reports is not None}
    rows = []
    for backend, family in families.values():
        try:
            reports = family.offline_reports()
        except Exception as exc:  # noqa: BLE001 - the report must not die with one backend
            rows.append(Row(backend, "-", error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        for report in reports:
            rows.append(_row(backend, report, dict(report.params), report.threads_per_block,
                             bool(report.is_default)))
    return rows


def _fmt_params(params: dict[str, Any], source: CudaSource | None) -> str:
    if source is not None:
        params = {k: v for k, v in params.items() if source.defaults.get(k) != v} or {"": "defaults"}
    return " ".join(f"{k}={v}" if k else str(v) for k, v in params.items())


UNKNOWN_THREADS = ("? the report cannot tell this kernel's threads per block: its launch sets them (a constant, the "
                   "problem's dims, or a knob its source does not name in warps_knobs), so warps/SM and occupancy "
                   "are not computed offline")


def render(rows: list[Row], title: str = "offline compile report (sm_90, NVRTC / nvJitLink)") -> Any:
    """A :class:`tools.display.FitTable` of the rows, one line per kernel (parameters shown as differences from the
    source's defaults; rows made for a variant name it). Its caption explains a ``?`` and gives the reason of each
    accepted spill (marked ``†``, yellow; any other spill is red)."""
    from rich.text import Text

    from tools.display import Column, FitTable

    by_variant = any(row.variant for row in rows)
    # a narrow terminal keeps the kernel, its registers and spills longest; occupancy and what limits it go first
    columns = [Column("variant" if by_variant else "source", "left"), Column("kernel", "left"),
               Column("params", "left", drop=5), Column("regs"), Column("spill st/ld B", short="spill B"),
               Column("stack B", drop=3), Column("smem B", drop=4), Column("threads", drop=6),
               Column("warps/SM", drop=2), Column("occupancy", drop=1, short="occ."), Column("limiter", "left", drop=7)]
    table = FitTable(columns, title=title)
    notes: dict[str, str] = {}  # footnote lines, each once
    for row in rows:
        source = SOURCES.get(row.source)
        first = row.variant or row.source
        if row.error:
            table.add_row(first, row.kernel, _fmt_params(row.params, source), Text(row.error, style="red"),
                          *[""] * 7)
            continue
        mark, style = ("†", "yellow") if row.accepted_spill else ("", "red")
        if row.accepted_spill:
            notes.setdefault(f"† {row.kernel} ({row.source})", f"† accepted spill, {row.kernel} ({row.source}): "
                                                               f"{row.accepted_spill}")
        if not row.threads_per_block:
            notes.setdefault("?", UNKNOWN_THREADS)
        spill = Text(f"{row.spill_stores}/{row.spill_loads}" + (mark if row.spills else ""),
                     style=style if row.spills else "")
        stack = Text(str(row.stack_bytes) + (mark if row.stack_bytes and not row.spills else ""),
                     style=style if row.stack_bytes else "")
        table.add_row(
            first, row.kernel, _fmt_params(row.params, source), str(row.registers), spill, stack,
            str(row.shared_bytes), str(row.threads_per_block or "?"),
            str(row.warps_per_sm) if row.warps_per_sm is not None else "?",
            f"{row.occupancy:.0%}" if row.occupancy is not None else "?", row.limiter,
        )
    table.caption = "\n".join(notes[key] for key in sorted(notes, key=lambda key: key != "?")) or None
    return table


def main(argv: list[str] | None = None) -> int:
    from tools.display import Steps, console

    parser = argparse.ArgumentParser(
        prog="python -m tools.compile_report", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples(
            "python -m tools.compile_report --defaults-only          # every source at its defaults, one line a kernel",
            "python -m tools.compile_report --source warp_decode_fp8 --no-numba   # one source, its parameter sets",
            "python -m tools.compile_report --json --defaults-only --no-numba     # one JSON object per row",
        ))
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per row instead of a table (default: the table)")
    parser.add_argument("--source", action="append", metavar="NAME",
                        help="only this registered CUDA source (repeatable; default: every source, and the Numba "
                             "kernels)")
    parser.add_argument("--defaults-only", action="store_true",
                        help="compile each source at its defaults only (default: also each parameter set in its "
                             "variants list)")
    parser.add_argument("--no-numba", action="store_true",
                        help="skip the Numba kernels (default: include them when no --source is given)")
    args = parser.parse_args(argv)
    with Steps(description="loading the registered CUDA sources") as steps:
        try:
            rows = collect(args.source, defaults_only=args.defaults_only, include_numba=not args.no_numba,
                           steps=steps)
        except ValueError as exc:
            parser.error(f"--source: {exc}")
    if args.json:
        for row in rows:
            print(json.dumps({**dataclasses.asdict(row), "spills": row.spills}))
    else:
        console().print(render(rows))
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
