"""``python -m tools.peers``: the Triton fused-MoE peer, every tile config, beside the lab's paths, one process.

    python -m tools.peers --model qwen3-30b-a3b,qwen3-235b-a22b --batch 1,8,16,32,64 --json peers.json --tune

Each tile config of :data:`tools.peers.triton_fused_moe.CONFIGS` is a variant ``triton:fused-moe[<config>]``
measured by the bench's harness (same graph structure, weight rotation and in-process roofline as the lab's paths,
checked against ``reference.moe_decode(mode="classical")`` before and after timing), beside the lab's auto-dispatch on
both bf16 layouts (``cupy:auto``, ``cupy:auto-t16``). Per (model, batch) the fastest
config's row is also recorded as ``triton:fused-moe`` (the tuned peer, ``tuned_from`` naming the config);
``--tune`` writes those choices to ``tools/peers/tuned/<gpu slug>.json``, which the variant's ``CONFIG=-1`` reads;
``--configs`` runs only the named configs (a quicker comparison where the fastest are known; not with ``--tune``).
``--weight-format fp8-block128`` does the same for the W8A8 peer ``triton:fused-moe-w8a8`` (its own tile configs)
beside the lab's FP8 auto-dispatch on both layouts (``cupy:auto-fp8``, ``cupy:auto-fp8-t16``);
``--weight-format mxfp4`` for the W4A16 peer ``triton:fused-moe-w4a16`` (its own tile configs) beside the lab's
mxfp4 auto-dispatch (``cupy:auto-mxfp4``). Without PyTorch,
Triton or a GPU it says so in one line and exits 0 (after checking its arguments: a bad one exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kernels.routing import GENERATORS
from kernels.shapes import PRESETS
from tools import peers, report
from tools.cli import examples, int_list, positive_int

# what each peer is measured beside: the lab's auto-dispatch for its weights (FP8: both layouts')
LAB_DEFAULT = {"bf16": "cupy:auto,cupy:auto-t16", "fp8-block128": "cupy:auto-fp8,cupy:auto-fp8-t16",
               "mxfp4": "cupy:auto-mxfp4"}
DEFAULT_BATCHES = (1, 8, 16, 32, 64)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.peers", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples(
            "python -m tools.peers --model tiny --batch 1   # without PyTorch / Triton / a GPU: says so, exits 0",
            "python -m tools.peers --model qwen3-30b-a3b,qwen3-235b-a22b --batch 1,8,16,32,64 --json peers.json "
            "--tune",
            "python -m tools.peers --weight-format fp8-block128 --batch 1,8 --configs 0,1",
            "python -m tools.peers --weight-format mxfp4 --model qwen3-30b-a3b --batch 1,8,16,32,64 --tune",
        ))
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        help=f"comma list of presets (default %(default)s); known: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=int_list, default=list(DEFAULT_BATCHES), metavar="T,...",
                        help=f"comma list of batch sizes T (default {','.join(map(str, DEFAULT_BATCHES))})")
    parser.add_argument("--routing", default="uniform", choices=GENERATORS,
                        help="how tokens pick experts (default %(default)s)")
    parser.add_argument("--weight-format", choices=tuple(LAB_DEFAULT), default="bf16",
                        help="bf16: the fused-MoE peer; fp8-block128: its W8A8 form; mxfp4: its W4A16 form "
                             "(default %(default)s)")
    parser.add_argument("--lab", default=None, metavar="VARIANT,...",
                        help="lab variants measured beside the peer (default: cupy:auto,cupy:auto-t16; FP8: "
                             "cupy:auto-fp8,cupy:auto-fp8-t16; mxfp4: cupy:auto-mxfp4)")
    parser.add_argument("--configs", default=None,
                        help="comma list of the peer's tile configs to run, by name (M16-N64-K128-G1-w4-s3) or "
                             "index (default: all; the tuned peer is the fastest of those run)")
    parser.add_argument("--repeats", type=positive_int, default=10, metavar="N",
                        help="timed samples per point (default %(default)s)")
    parser.add_argument("--json", metavar="PATH",
                        help="write the bench record (every config's rows, the tuned peer rows) here (default: not "
                             "written)")
    parser.add_argument("--tune", action="store_true",
                        help="write the fastest config per point to tools/peers/tuned/ (default: write nothing)")
    return parser


def select_configs(peer: str, spec: str | None) -> list[int]:
    """The indices of ``peer``'s tile configs that ``spec`` (comma list of names or indices; None: all) names."""
    names = [c.name for c in peers.configs(peer)]
    if spec is None:
        return list(range(len(names)))
    chosen: list[int] = []
    for item in (part.strip() for part in spec.split(",")):
        index = int(item) if item.isdigit() else names.index(item) if item in names else -1
        if not 0 <= index < len(names):
            raise ValueError(f"--configs: {peer} has no tile config {item!r}; known: {', '.join(names)} "
                             f"(or 0..{len(names) - 1})")
        if index not in chosen:
            chosen.append(index)
    return chosen


def write_tuned(rows: list[dict[str, Any]], gpu: str, peer: str = peers.PEER) -> Any:
    """Merge the tuned rows' configs into ``gpu``'s table (shape key -> batch -> config index); returns its path."""
    from kernels.contract import Dims
    from kernels.shapes import get_shape

    path = peers.tuned_path(gpu)
    table = json.loads(path.read_text()) if path.exists() else {}
    names = [f"{peer}[{c.name}]" for c in peers.configs(peer)]
    for row in rows:
        shape = get_shape(row["model"])
        key = peers.shape_key(Dims(row["batch"], shape.hidden, shape.intermediate, shape.experts, shape.top_k), peer)
        table.setdefault(key, {})[str(row["batch"])] = names.index(row["tuned_from"])
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        parser.error(f"--model: unknown preset(s) {', '.join(map(repr, unknown)) or 'none given'}; "
                     f"known: {', '.join(PRESETS)}")
    name = next(p for p, fmt in peers.PEERS.items() if fmt == args.weight_format)
    try:
        chosen = select_configs(name, args.configs)
    except ValueError as error:
        parser.error(str(error))
    if args.tune and args.configs is not None:
        parser.error("--tune picks the fastest of every tile config: leave --configs out")
    if peers.WHY_NOT is not None:
        print(f"skipped: {peers.WHY_NOT}")
        return 0
    from kernels.dispatch import current_gpu
    from kernels.variants import REGISTRY
    from tools import bench

    peer = REGISTRY[name]
    configs = [dataclasses.replace(peer, name=f"{name}[{c.name}]", params={"CONFIG": i}, grid={})
               for i, c in enumerate(peers.configs(name)) if i in chosen]
    lab = [v for v in (args.lab or LAB_DEFAULT[args.weight_format]).split(",") if v]
    try:
        result = bench.run(models, args.batch, variants=[*lab, *configs], routing=args.routing,
                           repeats=args.repeats, stages=False, json_path=args.json)
    except bench.SelectionError as error:  # a --lab name no variant has
        parser.error(f"--lab: {error}")
    data = result.data
    rows = report.tuned_rows(data, name)
    data["results"].extend(rows)
    if args.json:
        result.to_json(args.json)
    for row in sorted(rows, key=lambda r: (r["model"], r["batch"])):
        lab_rows = {r["variant"]: r for r in data["results"] if r["model"] == row["model"]
                    and r["batch"] == row["batch"] and r["variant"] in lab and r.get("status") == "ok"}
        versus = " ".join(f"{name} {r['median_us']:.1f} us ({r['median_us'] / row['median_us']:.2f}x)"
                          for name, r in lab_rows.items())
        print(f"{row['model']} T={row['batch']}: peer {row['median_us']:.1f} us ({row['tuned_from']}); {versus}")
    if args.tune:
        path = write_tuned(rows, current_gpu(), name)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
