"""How many bytes each kernel of one call takes from DRAM, read by Nsight Compute's counters, beside
the bytes the call must read at least (every weight once, the tokens once).

    bash tools/dram.sh 8192,16384 [MODULE.py]     # runs this file under ncu and prints the table

Under ncu this file runs the module at each T twice untimed (compiles, allocator warm) and once
inside an NVTX range named `call-T`, which is what ncu profiles (`--nvtx-include`). Run plainly
(no ncu), it only checks that the calls work and prints the least bytes per T. MODULE defaults to
this machine's emitted seed16 module, else the committed H200 one (the GEMMs' traffic is a
property of the variant, so an H200 module profiled on an H100 still answers whether a weight slab
comes from DRAM once).
"""

import csv
import sys
from collections import defaultdict
from pathlib import Path

import torch

from autotune import db, emit, render, target
from autotune.workloads import SEED16_SHAPE, make_tokens, make_weights, suite

H200 = db.COMMITTED_FINGERPRINT


def least_bytes(T: int, shape=SEED16_SHAPE) -> dict[str, int]:
    """The bytes a call cannot avoid, by part: every expert's weights once (each expert is routed to
    at seed16's T >= 64 on uniform routing), x read once and out written once: Case.bytes_moved's
    floor with every expert touched."""
    e = shape.elem_bytes
    return {"w13": shape.E * 2 * shape.I * shape.H * e, "w2": shape.E * shape.H * shape.I * e,
            "x": T * shape.H * e, "out": T * shape.H * e}


def default_module() -> Path:
    """This machine's emitted seed16 module, else the H200's (the target's, committed)."""
    for path in (emit.this_machine_module_path(SEED16_SHAPE.key), emit.module_path(H200, SEED16_SHAPE.key)):
        if path.exists():
            return path
    raise SystemExit(f"no emitted seed16 module for this machine or {H200}")


def summarize(csv_path: Path) -> None:
    """ncu's `--csv --print-units base` page: one line per profiled kernel (its time, DRAM bytes and read
    rate), then their sum."""
    rows = list(csv.DictReader(line for line in csv_path.open() if line.startswith('"')))
    kernels: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in rows:
        metric, value = r["Metric Name"], float(r["Metric Value"].replace(",", ""))
        kernels[(r["ID"], r["Kernel Name"])][metric] = value
    total = defaultdict(float)
    for (kid, name), m in sorted(kernels.items(), key=lambda kv: int(kv[0][0])):
        read, write, ns = (m.get(f"{k}.sum", 0.0) for k in ("dram__bytes_read", "dram__bytes_write",
                                                              "gpu__time_duration"))
        total["read"] += read
        total["write"] += write
        total["us"] += ns / 1e3
        print(f"{kid:>4} {name[:48]:48s} {ns / 1e3:9.1f} us  read {read / 1e9:7.3f} GB  write {write / 1e9:7.3f} GB"
              f"  {read / max(ns, 1) / 1e3:6.2f} TB/s read")
    print(f"sum  {'':48s} {total['us']:9.1f} us  read {total['read'] / 1e9:7.3f} GB"
          f"  write {total['write'] / 1e9:7.3f} GB")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--csv":
        summarize(Path(argv[1]))
        return 0
    if not target.has_gpu():
        print("tools/dram.py runs on the GPU; there is none here")
        return 1
    shape = SEED16_SHAPE
    path = Path(argv[1]) if len(argv) > 1 else default_module()
    module = render.load_path(path)
    print(f"module {path.name}")
    w13, w2 = render.weights_for(module, *make_weights(shape, target.device()))
    for T in (int(t) for t in argv[0].split(",")):
        x, w, ids = make_tokens(suite(shape, [T])[0], target.device())
        out = torch.empty_like(x)
        for _ in range(2):
            module.fused_experts(x, w13, w2, w, ids, out=out)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"call-{T}")
        module.fused_experts(x, w13, w2, w, ids, out=out)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        least = least_bytes(T, shape)
        row = module.select_variant(T)
        print(f"T={T} variant max_tokens={row.max_tokens}: least bytes " +
              ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in least.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
