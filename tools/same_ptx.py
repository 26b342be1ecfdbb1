"""Whether two emitted modules run the same triton GEMM kernels: for each case's leader in
db/moe_tune.sqlite3, its GEMM1 and GEMM2 from each module compiled for sm_90 (here, GPU or not) and
their PTX compared without source locations and debug sections (which name the module's file).

    python tools/same_ptx.py OLD.py NEW.py

For a re-emission that changes a module's text but should not change its kernels (e.g. helpers no
row of a form calls): the bench of the old module then stands for the new one. Gluon GEMMs are
skipped (report them separately). Exit status 1 if any kernel differs.
"""

import re
import sys

from sqlalchemy.orm import Session

from autotune import db, emit, render, sm90, target
from autotune.space import Variant
from autotune.workloads import seed16


def code_lines(ptx: str) -> list[str]:
    """PTX without what names the source: debug sections, .loc/.file lines and comments."""
    body = re.split(r"\.section\s+\.debug", ptx)[0]
    return [line for line in body.splitlines() if not re.match(r"\s*(\.loc|\.file|//)", line)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    modules = [render.load_source(open(path).read()) for path in argv]
    differ = 0
    with Session(db.connect(db.GPU_URL)) as session:
        for case in seed16():
            lead = emit.leader(session, db.COMMITTED_FINGERPRINT, case)
            if lead is None:
                continue
            v = Variant.from_dict(lead.params)
            for which in (1, 2):
                if getattr(v, f"g{which}_gluon"):
                    continue
                ptx = []
                for m in modules:
                    fn = (m._GEMM1 if which == 1 else m._GEMM2)[v.triton_form(which)]
                    ptx.append(code_lines(sm90.compile_triton(fn, case, v, which).asm["ptx"]))
                same = ptx[0] == ptx[1]
                differ += not same
                print(f"T={case.T:<6} GEMM{which} {fn.__name__}: {'same' if same else 'DIFFERENT'}", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    target.quiet_interpreter()
    sys.exit(main(sys.argv[1:]))
