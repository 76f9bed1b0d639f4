"""Hashes of the sm_90 machine code of every kernel the lab times: the check behind "same machine code".

A refactor of a kernel family (moving CUDA C between files, turning ``#if`` branches into a weight format's loader,
removing a knob that was always off) should leave the machine code of the kernels that run unchanged. This tool
compiles, for each CUDA variant and each model at each batch, the knob set that variant resolves to, with NVRTC for
sm_90 (no GPU), and hashes each kernel's ``.text`` section of the cubin: the same hash is the same SASS,
instruction for instruction. Run it before a change (``--out before.json``) and after (``--compare before.json``):
every key both runs share must hash the same; the keys only one run has are listed.

    python -m tools.sass_hashes --out /tmp/before.json
    python -m tools.sass_hashes --compare /tmp/before.json

By default it covers the variants the dispatch table picks (every policy) at its models and batches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from tools.cli import int_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TABLE = os.path.join(ROOT, "kernels", "dispatch_tables", "nvidia-h200.json")
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def text_sections(cubin: bytes) -> dict[str, str]:
    """``{kernel: sha256 of its .text.<kernel> section}`` of a 64-bit little-endian ELF cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        end = cubin.index(b"\0", names_at + offset)
        return cubin[names_at + offset:end].decode()

    out = {}
    for sh_name, _, _, _, offset, size in headers:
        section = name(sh_name)
        if section.startswith(".text."):
            out[section[len(".text."):]] = hashlib.sha256(cubin[offset:offset + size]).hexdigest()[:16]
    return out


def kernel_texts(variant: Any, dims: Any) -> list[tuple[str, str]]:
    """``[(kernel, rendered CUDA C)]`` that ``variant`` launches at ``dims`` (empty where it has no CUDA C or
    cannot run there)."""
    params = variant.compiled_params(dims)
    if params is None:
        return []
    family = variant.kernel_family
    names = family.kernel_names(params) if family.kernel_names else family.source.compiled_kernels(**params)
    text = family.source.render(**params)
    return [(name, text) for name in names]


def _compile(text: str) -> dict[str, str]:
    from kernels.compile import offline_compile

    cubin, _ = offline_compile(text)
    return text_sections(cubin)


def picked_points(table_path: str) -> list[tuple[str, str, str, int]]:
    """``(variant, model, weight format, T)`` for every choice of every policy in a dispatch table."""
    with open(table_path) as f:
        table = json.load(f)
    points = set()
    for entry in table["entries"].values():
        for t, point in entry["points"].items():
            for choice in point["choices"].values():
                points.add((choice, entry["model"], entry["weight_format"], int(t)))
    return sorted(points)


def collect(points: list[tuple[str, str, str, int]], jobs: int) -> dict[str, str]:
    """``{"variant|model|T|kernel": hash}`` for ``points``; each distinct text compiled once."""
    from kernels.contract import Dims
    from kernels.shapes import PRESETS
    from kernels.variants import get_variant, load_builtin

    load_builtin()
    wanted: dict[str, list[tuple[str, str]]] = {}  # text -> [(key, kernel)]
    for name, model, _, t in points:
        shape = PRESETS[model]
        dims = Dims(t, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        for kernel, text in kernel_texts(get_variant(name), dims):
            wanted.setdefault(text, []).append((f"{name}|{model}|T{t}|{kernel}", kernel))
    texts = list(wanted)
    print(f"{len(points)} points, {len(texts)} distinct texts to compile", file=sys.stderr, flush=True)
    hashes: dict[str, str] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for i, sections in enumerate(pool.map(_compile, texts)):
            for key, kernel in wanted[texts[i]]:
                hashes[key] = sections.get(kernel, "missing")
            print(f"  compiled {i + 1}/{len(texts)}", file=sys.stderr, flush=True)
    return dict(sorted(hashes.items()))


def compare(before: dict[str, str], after: dict[str, str]) -> int:
    """Print the differences; the number of shared keys whose hashes differ."""
    shared = sorted(set(before) & set(after))
    changed = [key for key in shared if before[key] != after[key]]
    for key in changed:
        print(f"DIFFERENT  {key}")
    for key in sorted(set(before) - set(after)):
        print(f"only before  {key}")
    for key in sorted(set(after) - set(before)):
        print(f"only after   {key}")
    print(f"{len(shared) - len(changed)} of {len(shared)} shared kernels identical")
    return len(changed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.sass_hashes", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m tools.sass_hashes --out /tmp/before.json\n"
               "  python -m tools.sass_hashes --compare /tmp/before.json --tokens 1,64")
    parser.add_argument("--table", default=DEFAULT_TABLE, help="dispatch table whose picks to hash (default: H200's)")
    parser.add_argument("--tokens", type=int_list, default=None,
                        help="only these batches (default: every batch in the table)")
    parser.add_argument("--out", help="write the hashes here (JSON; default: not written)")
    parser.add_argument("--compare",
                        help="compare against hashes written earlier; exit 1 if any differ (default: no comparison)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: CPUs)")
    args = parser.parse_args(argv)
    if not args.out and not args.compare:
        parser.error("give --out and/or --compare")
    points = picked_points(args.table)
    if args.tokens:
        points = [p for p in points if p[3] in args.tokens]
    hashes = collect(points, max(1, args.jobs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1)
        print(f"{len(hashes)} kernel hashes -> {args.out}")
    if args.compare:
        with open(args.compare) as f:
            return 1 if compare(json.load(f), hashes) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
