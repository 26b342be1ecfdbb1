"""Render templates/ into standalone Python modules (Triton kernels plus their launcher) and load them.

A module holds a table of variants; the tuner renders one-variant modules, the emitter the best
variant of every case. Both go through `render_module`, so what is timed is what is shipped.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import jinja2

from .space import K_BLOCK, Variant

_HERE = Path(__file__).resolve().parent
# An installed wheel carries the templates inside the package; a checkout keeps them beside it.
TEMPLATE_DIR = next((p for p in (_HERE / "templates", _HERE.parent / "templates") if p.is_dir()),
                    _HERE.parent / "templates")
GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "weight_tma", "persistent")

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


@dataclass(frozen=True)
class Row:
    """One row of a module's variant table: `v` serves T <= max_tokens. A routing-adaptive row also
    has `hot`, the variant that runs the experts routed at least `hot_rows` rows (see
    `space.hot_split_violations` for the pairs that can share a call)."""

    max_tokens: float
    v: Variant
    hot: Variant | None = None
    hot_rows: int = 0


def _weights_doc(tma: bool, a_tma: bool, persistent: bool) -> str:
    loads = ("rows and weight tiles by TMA descriptor" if a_tma else "weight tiles by TMA descriptor" if tma
             else "weight tiles by pointer loads")
    return loads + (";\n    persistent over the used tiles" if persistent else ";\n    one program per tile")


def _gemm1_form(dispatch: str, activation: str, tma: bool, persistent: bool) -> dict:
    direct = dispatch == "direct"
    gather, swiglu = dispatch in ("fused", "direct"), activation == "fused"
    # Expert-contiguous rows can come by TMA; gathered rows cannot (sm_90 has no TMA gather).
    a_tma = tma and not gather
    # With TMA weights, the fused SwiGLU loads gate and up as one box and runs one dot.
    joint = tma and swiglu
    rows = ("row block b is slot b alone (no sort), its token row gathered" if direct
            else "gathers token rows through sorted_slots" if gather else "reads rows already in expert order")
    epilogue = ("applies SwiGLU in the epilogue and writes h [M, I]" if swiglu
                else "writes gate and up [M, 2I] for the activation kernel")
    if joint:
        epilogue = "one dot over gate and up (a [1, 2, BLOCK_N, BLOCK_K] box);\n    " + epilogue
    source = "direct" if direct else "gather" if gather else "grouped"
    return {
        "name": f"_gemm1_{source}_{'swiglu' if swiglu else 'gate_up'}{'_tma' * tma}{'_persistent' * persistent}",
        "gather": gather, "direct": direct, "swiglu": swiglu, "tma": tma, "a_tma": a_tma, "joint": joint,
        "persistent": persistent,
        "dispatch": dispatch, "activation": activation,
        "rows": rows, "epilogue": epilogue, "weights": _weights_doc(tma, a_tma, persistent),
    }


def _gemm2_form(direct: bool, tma: bool, persistent: bool) -> dict:
    # h is written in block order, so with TMA weights its rows come by TMA too.
    return {"name": f"_gemm2_weighted{'_direct' * direct}{'_tma' * tma}{'_persistent' * persistent}",
            "direct": direct, "tma": tma, "a_tma": tma, "joint": False, "persistent": persistent,
            "weights": _weights_doc(tma, tma, persistent)}


@dataclass(frozen=True)
class TunedGpu:
    """The GPU an emitted module was tuned on: the module refuses a GPU of another compute capability
    before any launch, and names the commands that make one for it (`shape_options`: the CLI's options
    that name the module's shape)."""

    name: str
    capability: tuple[int, int]
    shape_options: str


def render_module(rows: list[Row], title: str, header: list[str], tuned_gpu: TunedGpu | None = None,
                  op_name: str | None = None, fast_launch: bool = False, graph_max_tokens: int = 0,
                  graph_reason: str = "no row replays a graph") -> str:
    """Source of a module that serves each row's token range with its variant. With `tuned_gpu`, the
    module checks the GPU it runs on; with `op_name`, it defines the torch custom operator
    moe_tune::op_name, which torch.compile calls in its place; with `fast_launch`, an eager call whose
    key was seen before launches its kernels without triton's per-launch binding (fast_launch.py.j2),
    and one of at most `graph_max_tokens` tokens replays a CUDA graph of its call (graph_replay.py.j2;
    `graph_reason` says in the module why that many).
    Trial modules, timed on the GPU they are rendered for (as CUDA graphs, which hold no host code)
    and never compiled, go without all three (so their sources, and hashes, stay as they were)."""
    if op_name is not None and not op_name.isidentifier():
        raise ValueError(f"op_name must be a Python identifier, got {op_name!r}")
    if not rows:
        raise ValueError("a module needs at least one variant")
    table = sorted(rows, key=lambda r: r.max_tokens)
    # Every variant the module runs, a hot side as its own row: what the kernels and flags cover.
    rows = table + [Row(r.max_tokens, r.hot) for r in table if r.hot is not None]
    # The op takes its weights in one layout: every row's kernels read that one.
    layouts = {r.v.weight_layout for r in rows}
    if len(layouts) > 1:
        raise ValueError(f"a module reads its weights in one layout; these rows mix {sorted(layouts)}")
    k_blocked = layouts == {"k64"}
    # A GEMM run by its Gluon kernel needs no triton form.
    rows1 = [r for r in rows if not r.v.g1_gluon]
    rows2 = [r for r in rows if not r.v.g2_gluon]
    forms1, forms2 = sorted({r.v.triton_form(1) for r in rows1}), sorted({r.v.triton_form(2) for r in rows2})
    # Rendered only when a row uses them, so modules without them keep their source (and trial hashes).
    half_tail = any(r.v.half_tail for r in rows)
    tail_walk = any(r.v.tail_walk for r in rows)
    g1_pair = any(r.v.g1_pair_tail for r in rows1)  # the triton forms' pairs; the Gluon GEMM1's below
    g2_pair = any(r.v.g2_pair_tail for r in rows2)
    g1_swap = any(r.v.g1_swap_tail for r in rows)
    g2_swap = any(r.v.g2_swap_tail for r in rows)
    gluon_gemm1 = any(r.v.g1_gluon for r in rows)
    gluon_gemm1_gather = any(r.v.g1_gluon and r.v.dispatch == "fused" for r in rows)
    gluon_gemm2 = any(r.v.g2_gluon for r in rows)
    return _ENV.get_template("module.py.j2").render(
        title=title,
        tuned_gpu=tuned_gpu,
        op_name=op_name,
        fast_launch=fast_launch,
        graph_max_tokens=int(graph_max_tokens),
        graph_reason=graph_reason,
        header=header,
        rows=[replace(r, max_tokens="float('inf')" if math.isinf(r.max_tokens) else int(r.max_tokens)) for r in table],
        hot_split=any(r.hot is not None for r in table),
        gemm_keys=GEMM_KEYS,
        # A form carries the pair tile (g1_pair_tail, g2_pair_tail) and its swapped tail only where one of its
        # rows uses them (a direct form has no blocks to pair); the kernel's PAIR_TAIL and SWAP_TAIL
        # arguments stay module-wide, as the launcher passes them to every form.
        k_blocked=k_blocked,
        k_block=K_BLOCK,
        gemm1_forms=[{**_gemm1_form(*f), "half_tail": half_tail, "walk": tail_walk, "kb": k_blocked,
                      "pair": any(r.v.g1_pair_tail for r in rows1 if r.v.triton_form(1) == f),
                      "swap": any(r.v.g1_swap_tail for r in rows1 if r.v.triton_form(1) == f)} for f in forms1],
        gemm2_forms=[{**_gemm2_form(*f), "half_tail": half_tail, "walk": tail_walk, "kb": k_blocked,
                      "pair": any(r.v.g2_pair_tail for r in rows2 if r.v.triton_form(2) == f),
                      "swap": any(r.v.g2_swap_tail for r in rows2 if r.v.triton_form(2) == f)} for f in forms2],
        g1_pair=g1_pair,
        g2_pair=g2_pair,
        g1_swap=g1_swap,
        g2_swap=g2_swap,
        half_tail=half_tail,
        tail_walk=tail_walk,
        gluon_gemm1=gluon_gemm1,
        gluon_gemm1_rows=any(r.v.g1_gluon and r.v.dispatch == "split" for r in rows),
        gluon_gemm1_gather=gluon_gemm1_gather,
        g1_tma_store=any(r.v.g1_tma_store for r in rows),
        sorted_out=any(r.v.g2_sorted_out for r in rows),
        token_permute=any(r.v.permute_by_token for r in rows),
        # Dispatch writes each slot's sorted position for a sorted-out GEMM2 and for a token-walking permutation.
        slot_pos=any(r.v.g2_sorted_out or r.v.permute_by_token for r in rows),
        gluon_gemm2=gluon_gemm2,
        # Gluon GEMMs with half tails: a tile helper of the row count, and GEMM1's loader reorders the columns.
        g1_gluon_half=any(r.v.g1_gluon and r.v.half_tail for r in rows),
        g2_gluon_half=any(r.v.g2_gluon and r.v.half_tail for r in rows),
        g1_gluon_pair=any(r.v.g1_gluon and r.v.g1_pair_tail for r in rows),
        gluon_dynamic=any(r.v.dynamic_walk and (r.v.g1_gluon or r.v.g2_gluon) for r in rows),
        # GEMM walks grouped within experts (negative GROUP_M): dispatch writes each block's expert span.
        expert_groups=any(r.v.group_by_expert for r in rows),
        any_gluon=gluon_gemm1 or gluon_gemm2,
        any_tma=any(r.v.g1_weight_tma or r.v.g2_weight_tma for r in rows),
        # The Gluon GEMMs are persistent by construction: their grids need the SM count too.
        any_persistent=any(r.v.g1_persistent or r.v.g2_persistent or r.v.g1_gluon or r.v.g2_gluon for r in rows),
        split_dispatch=any(r.v.route == "split" for r in rows),
        direct_dispatch=any(r.v.direct for r in rows),
        split_activation=any(r.v.activation == "split" for r in rows),
    )


def render_variant(v: Variant) -> str:
    """The one-variant module the tuner times."""
    return render_module([Row(math.inf, v)], "moe-tune trial module: one variant, rendered for timing.",
                         [f"Variant: {v.label}"])


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


@functools.cache
def variant_hash(v: Variant) -> str:
    """The hash a trial of `v` records when timed on today's templates (cached: the templates do not
    change under a running process)."""
    return source_hash(render_variant(v))


def module_cache_dir() -> Path:
    """Rendered trial modules live here (Triton reads kernel source from files)."""
    root = os.environ.get("MOE_TUNE_CACHE") or Path.home() / ".cache" / "moe-tune"
    path = Path(root) / "modules"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_source(source: str) -> ModuleType:
    """Write `source` under its hash (once) and import it as a fresh module."""
    name = f"moe_tune_variant_{source_hash(source)}"
    path = module_cache_dir() / f"{name}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    return load_path(path, name)


def weights_for(module: ModuleType, w13, w2) -> tuple:
    """The weights as `module` (a trial or an emitted module) takes them: w13 and w2 themselves, or,
    for a module that reads a layout of its own (it defines prepare_weights: weight_layout=k64), its
    one-time copy of them."""
    prepare = getattr(module, "prepare_weights", None)
    return (w13, w2) if prepare is None else prepare(w13, w2)


def load_path(path: Path | str, name: str | None = None) -> ModuleType:
    """Import a module file (an emitted or a trial module) by path."""
    path = Path(path)
    name = name or f"moe_tune_loaded_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
