"""The claim the emitted modules' planned launches rest on (templates/fast_launch.py.j2): within one
call, every launch's specialisation (what triton compiles a kernel for: dtypes, 16-byte alignment,
integer classes, constexprs, launch options) is a function of the call's key. Checked on the CPU by
running each committed module's host code with every kernel replaced by a recorder that binds the
arguments with triton's own binder: two calls with one key but other buffers and other routing
specialise every launch alike, and a call of another key does not (so the recorder sees what the key
is for). The GPU side (outputs against triton's own launches) is in tests/test_gpu.py."""

import inspect
import os
import subprocess
import sys

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import create_function_from_signature

from autotune import db, emit, render
from autotune.workloads import SEED16_SHAPE, Case, Shape, make_tokens

MODULES = [
    (SEED16_SHAPE, (1, 2, 5, 11, 16, 64, 128, 300, 2048, 8192, 32768)),
    (Shape(E=128, H=2048, I=768, k=8), (1, 4, 16, 64, 1024, 16384)),
]


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` appends what triton would specialise."""

    def __init__(self, fn, log):
        self.name, self.log = fn.__name__, log
        self.bind = create_function_from_signature(inspect.signature(fn.fn), fn.params, BaseBackend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.bind(*args, **kwargs)
            self.log.append((self.name, tuple(specialization), tuple(sorted(options.items()))))
        return launch


def _recording(module) -> list:
    """Every launch of `module` recorded (a launch that bypasses the wrappers would run a real kernel
    on CPU tensors and fail the test)."""
    log = []
    launched = [fn for fn in vars(module).values() if isinstance(fn, module._FastLaunch)]
    launched += [fn for table in (module._GEMM1, module._GEMM2) for fn in table.values()]
    for fast in launched:
        fast.fn = _Recorder(fast.fn, log)
    module._INTERPRETED = True  # CPU tensors past the argument checks
    module._check_interpretable = lambda *args: None  # bf16 and Gluon rows: their kernels are recorders here
    module._FAST_LAUNCH = False  # every launch goes to its recorder
    torch.cuda.current_device = lambda: 0
    return log


def _call(module, case: Case, weights, log, *, x_offset: int = 0, ids_dtype=torch.int32,
          weights_dtype=torch.float32, out_pad: int = 0):
    """The call's key and its launches. hidden_states starts `x_offset` elements into its buffer;
    `out` rows are `out_pad` elements apart beyond H."""
    x, w, ids = make_tokens(case, "cpu")
    if x_offset:
        x = torch.cat([x.new_zeros(x_offset), x.flatten()])[x_offset:].view(x.shape)
    ids, w = ids.to(ids_dtype), w.to(weights_dtype)
    out = torch.empty((case.T, case.shape.H + out_pad), dtype=x.dtype)[:, :case.shape.H]
    del log[:]
    module.fused_experts(x, *weights, w, ids, out=out)
    return module._call_key(x, *weights, w, ids, out, case.T), tuple(log)


@pytest.mark.parametrize("shape, tokens", MODULES, ids=lambda x: getattr(x, "key", ""))
def test_a_calls_key_fixes_every_launchs_specialisation(shape, tokens):
    if not emit.module_path(db.COMMITTED_FINGERPRINT, shape.key).exists():
        pytest.skip("no committed module")
    # In a process of its own: the module's kernels must be triton's JIT functions, as on a GPU (the
    # interpreter, which this suite's process runs under, has no binder and no planned launches).
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, __file__, shape.key], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def _check(shape: Shape, tokens) -> None:
    module = render.load_path(emit.module_path(db.COMMITTED_FINGERPRINT, shape.key))
    assert module._FAST_LAUNCH, "the committed module plans no launches on this triton"
    log = _recording(module)
    # Weights are never read here: empty tensors of the shape (seed16's are 13 GB), in the layout the
    # module reads (its prepare_weights run on meta tensors gives that layout's shapes, allocating nothing).
    weights = (torch.empty((shape.E, 2 * shape.I, shape.H), dtype=torch.bfloat16, device="meta"),
               torch.empty((shape.E, shape.H, shape.I), dtype=torch.bfloat16, device="meta"))
    weights = render.weights_for(module, *weights)
    weights = tuple(torch.empty(w.shape, dtype=w.dtype) for w in weights)
    # Calls that share a key (other buffers, other routing) and calls that differ in what it holds.
    calls = [dict(routing="uniform"), dict(routing="zipf"), dict(routing="uniform", ids_dtype=torch.int64),
             dict(routing="uniform", weights_dtype=torch.bfloat16), dict(routing="uniform", out_pad=8),
             dict(routing="zipf", x_offset=1)]
    for T in tokens:
        seen = {}
        for n, how in enumerate(calls):
            how = dict(how)
            case = Case(shape, T, how.pop("routing"), seed=n)
            try:
                key, launches = _call(module, case, weights, log, **how)
            except ValueError:  # a variant reading hidden_states by TMA or cp.async refuses it unaligned
                assert how.get("x_offset"), how
                continue
            assert launches, (T, how)
            assert seen.setdefault(key, launches) == launches, f"T={T} {how}: one key, launches specialised differently"
        assert len(set(seen.values())) > 1, f"T={T}: the recorder sees no difference between the calls' arguments"

if __name__ == "__main__":
    _check(*next((s, t) for s, t in MODULES if s.key == sys.argv[1]))
