"""The variant space: every tunable parameter declared once, with what it is for and its constraints.

The Optuna sampler, the pruning rules, the database rows and `moe-tune show` all read `PARAMS`.
A `Variant` is one point of the space: the structure of the pipeline (which kernels run) plus the
compile-time constants of each kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from . import target
from .workloads import Case


@dataclass(frozen=True)
class Param:
    name: str
    choices: tuple
    doc: str
    # The case dimension no useful value exceeds (rounded up to a power of two), if any.
    cap: str | None = None
    # The value that trials recorded before this parameter existed ran with.
    default: object = None
    # Asked only when this holds for the answers so far (dict by name) and the case; otherwise the
    # parameter keeps its default. Conditional parameters are asked after all others, in order.
    when: Callable[[dict, Case], bool] | None = None


# When the conditional parameters can take effect, given the answers so far (`v`, by name). The full
# rules, with reasons, are `violations`; these only keep the sampler off points they would reject.
def _direct_can_run(v: dict, case: Case) -> bool:
    return (case.T * case.shape.k <= DIRECT_MAX_SLOTS and v["dispatch"] == "fused" and v["block_m"] == 16
            and not (v["g1_persistent"] or v["g2_persistent"]))


def _half_tail_can_run(v: dict, case: Case) -> bool:
    return v["block_m"] >= 32 and not v["direct"]


def _tail_walk_can_run(v: dict, case: Case) -> bool:
    return v["half_tail"] and (v["g1_persistent"] or v["g2_persistent"])


def _pair_can_run(which: int) -> Callable[[dict, Case], bool]:
    # The Gluon GEMM1 pairs too: on expert-ordered rows (split dispatch), claiming past paired tails.
    def can_run(v: dict, case: Case) -> bool:
        gluon = v[f"g{which}_gluon"]
        return v["half_tail"] and not v["tail_walk"] and (
            not gluon or (which == 1 and v["dispatch"] == "split" and v["dynamic_walk"]))
    return can_run


def _swap_can_run(which: int) -> Callable[[dict, Case], bool]:
    # The swapped tail's dot is narrower than the half tail's BLOCK_M / 2 rows (violations: swap < block_m / 2).
    def can_run(v: dict, case: Case) -> bool:
        return (_pair_can_run(which)(v, case) and v[f"g{which}_pair_tail"] and v["block_m"] >= 64
                and not v[f"g{which}_gluon"])
    return can_run


def _gluon_can_run(which: int) -> Callable[[dict, Case], bool]:
    def can_run(v: dict, case: Case) -> bool:
        g = f"g{which}_"
        return (target.has_gpu() and case.shape.dtype in ("bfloat16", "float16") and v["block_m"] in (64, 128)
                and v[g + "weight_tma"] and v[g + "persistent"] and v[g + "num_warps"] * 16 == v["block_m"]
                and not (v["direct"] or v["tail_walk"] or (v["half_tail"] and v["block_m"] != 128))
                and (which == 2 or v["activation"] == "fused"))
    return can_run


# The k-blocked weight layout's block of K: w [E, N, K] stored as [E, K / K_BLOCK, N, K_BLOCK], so that a
# GEMM's [BLOCK_N, K_BLOCK] weight box is one contiguous run (NOTES 79: 128-byte runs per row stream at
# x0.91-0.93 of a contiguous read).
K_BLOCK = 64


def _k_blocked_can_run(v: dict, case: Case) -> bool:
    return (case.shape.H % K_BLOCK == 0 and case.shape.I % K_BLOCK == 0
            and all(v[f"g{w}_block_k"] == K_BLOCK if v[f"g{w}_weight_tma"] else v[f"g{w}_block_k"] % K_BLOCK == 0
                    for w in (1, 2)))


def _group_by_expert_can_run(v: dict, case: Case) -> bool:
    # Direct dispatch has no row blocks; tail walks and pair tiles index blocks in the plain groups' order.
    return not (v["direct"] or v["tail_walk"] or v["g1_pair_tail"] or v["g2_pair_tail"])


PARAMS: tuple[Param, ...] = (
    Param("dispatch", ("fused", "split"),
          "fused: GEMM1 gathers token rows through the sorted indices; split: a permutation kernel first "
          "writes the rows expert-contiguous so GEMM1 reads a plain grouped layout"),
    Param("direct", (False, True),
          "tiny T: no sort and no dispatch launch; row block b is slot b alone and GEMM1 gathers its token "
          "row (needs dispatch=fused), so an expert two slots share is read twice", default=False,
          when=_direct_can_run),
    Param("activation", ("fused", "split"),
          "fused: SiLU(gate)*up in GEMM1's epilogue, which writes [M, I]; split: GEMM1 writes [M, 2I] and "
          "an activation kernel reduces it"),
    Param("pdl", (False, True),
          "programmatic dependent launch: each kernel launches while the previous one finishes and waits "
          "for its results on the device, hiding the launch gaps that matter at small T", default=False),
    Param("block_m", (16, 32, 64, 128),
          "rows of a tile; each expert's rows are padded to it, so both GEMMs share it", "slots"),
    Param("g1_block_n", (32, 64, 128, 256), "GEMM1 output columns per tile (of I when fused, of 2I when split)",
          "2I"),
    Param("g1_block_k", (32, 64, 128, 256), "GEMM1 reduction step over H", "H"),
    Param("g1_group_m", (1, 4, 8, 16), "GEMM1 tile swizzle: row tiles visited together so weight tiles stay in L2"),
    Param("g1_num_warps", (4, 8), "GEMM1 warps per program"),
    Param("g1_num_stages", (2, 3, 4, 5), "GEMM1 software-pipeline depth (shared-memory buffers)"),
    Param("g1_weight_tma", (False, True),
          "GEMM1 loads w13 tiles through TMA tensor descriptors (bulk copy engine) instead of pointers: with "
          "the fused SwiGLU, gate and up as one box and one dot of twice the width; with split dispatch, the "
          "expert-ordered rows by TMA too", default=False),
    Param("g1_persistent", (False, True),
          "GEMM1 runs one program per SM over the used tiles, the next tile's loads overlapping this "
          "tile's epilogue, instead of one program per tile", default=False),
    Param("g2_block_n", (32, 64, 128, 256), "GEMM2 output columns per tile (of H)", "H"),
    Param("g2_block_k", (32, 64, 128, 256), "GEMM2 reduction step over I", "I"),
    Param("g2_group_m", (1, 4, 8, 16), "GEMM2 tile swizzle"),
    Param("g2_num_warps", (4, 8), "GEMM2 warps per program"),
    Param("g2_num_stages", (2, 3, 4, 5), "GEMM2 software-pipeline depth"),
    Param("g2_weight_tma", (False, True),
          "GEMM2 loads w2 tiles and the expert-ordered activation rows through TMA tensor descriptors",
          default=False),
    Param("g2_persistent", (False, True), "GEMM2 runs one program per SM over the used tiles", default=False),
    Param("half_tail", (False, True),
          "an expert's last row block, when it holds at most block_m/2 rows, runs as a tile of half the "
          "rows in both GEMMs: less padded tensor work where experts get a few blocks each (T*k/E near "
          "block_m); a Gluon GEMM runs it as one 64-row tile whose columns its two warpgroups split",
          default=False, when=_half_tail_can_run),
    Param("tail_walk", (False, True),
          "with half_tail, each persistent GEMM walks two block lists that dispatch writes, full blocks then "
          "half tails, in two launches, instead of branching on each tile's height (a branch inside the tile "
          "walk stops triton from overlapping one tile's epilogue with the next tile's loads)", default=False,
          when=_tail_walk_can_run),
    Param("g2_gluon", (False, True),
          "GEMM2 as a warp-specialised Gluon kernel: a TMA loader warp runs ahead of one consumer partition "
          "(a warpgroup per 64 rows of the tile) across tiles, so the next tile's loads fly during an "
          "epilogue (GPU only)", default=False, when=_gluon_can_run(2)),
    Param("g1_gluon", (False, True),
          "GEMM1 as a warp-specialised Gluon kernel like g2_gluon: gate and up boxes of the same columns "
          "stacked in one stage, one wgmma group per step, SwiGLU in the consumer; rows by TMA after split "
          "dispatch, or gathered from x by a cp.async loader warpgroup with fused dispatch", default=False,
          when=_gluon_can_run(1)),
    Param("g1_tma_store", (False, True),
          "the Gluon GEMM1 writes each h tile by TMA store from shared memory, left in flight while the next "
          "tile runs, instead of a layout change and masked row stores", default=False,
          when=lambda v, case: v["g1_gluon"]),
    Param("g2_sorted_out", (False, True),
          "the Gluon GEMM2 writes y in expert order (whole tiles by TMA store, left in flight while the next "
          "tile runs) instead of scattering rows to slot order; dispatch also writes each slot's position and "
          "the combine reads through it", default=False, when=lambda v, case: v["g2_gluon"]),
    Param("dynamic_walk", (False, True),
          "the Gluon GEMMs' persistent walk is dynamic: each program's loader claims its next tile from a "
          "global counter and posts it to the consumer with the tile's first stage, so programs whose tiles "
          "differ in length (half tails, uneven experts) stay on neighbouring tiles and share them in L2, "
          "where the static walk (tiles p, p + SMs, ...) drifts apart", default=False,
          when=lambda v, case: v["g1_gluon"] or v["g2_gluon"]),
    Param("g1_pair_tail", (False, True),
          "with half_tail, GEMM1 runs an expert's last full block and its half tail in one program (the "
          "Gluon GEMM1: one tile, on split dispatch's rows and the dynamic walk), each weight stage loaded "
          "once for both row sets, instead of two programs that each stream the expert's weights (where "
          "experts get one block and a tail, they are read ~1.5 times)",
          default=False, when=_pair_can_run(1)),
    Param("g2_pair_tail", (False, True), "the same pairing in the triton GEMM2", default=False,
          when=_pair_can_run(2)),
    Param("g1_swap_tail", (0, 16, 32),
          "with g1_pair_tail, a paired tail of at most this many rows is the narrow side of a swapped dot "
          "(the stage's weight rows x the tail's rows, a wgmma N of 16 or 32) instead of a block_m/2-row dot "
          "mostly over padding: where experts get one full block and a few rows more (T=4096: 128 +- 11), "
          "the tails' padded rows, ~15% of the GEMM's rows, fall away (0: off)",
          default=0, when=_swap_can_run(1)),
    Param("g2_swap_tail", (0, 16, 32), "the same swapped tail in the triton GEMM2 (with g2_pair_tail)", default=0,
          when=_swap_can_run(2)),
    Param("weight_layout", ("rows", "k64"),
          "the weights as the GEMMs read them: rows, w13 [E, 2I, H] and w2 [E, H, I] as the op's contract "
          "has them; k64, a copy made once by the module's prepare_weights, [E, K/64, N, 64] (K the GEMM's "
          "reduction), so that each [BLOCK_N, 64] weight box is one contiguous run instead of BLOCK_N runs of "
          "128 bytes. A module reads one layout: emit takes every row from one of them",
          default="rows", when=_k_blocked_can_run),
    Param("group_by_expert", (False, True),
          "both GEMMs' swizzle groups stop at expert boundaries: an expert's row blocks (up to g*_group_m of "
          "them a group) take each weight tile together, instead of groups of g*_group_m consecutive blocks "
          "that split an expert between two groups, whose second reads the expert's weights from DRAM again "
          "(NOTES 88: 1.33x the weights' bytes at T=8192). Dispatch writes each block's expert span for it",
          default=False, when=_group_by_expert_can_run),
    Param("permute_by_token", (False, True),
          "split dispatch's permutation walks tokens: each program reads a token row once and writes it to its "
          "k expert-order positions (dispatch also writes each slot's position), instead of each row block "
          "gathering its rows, which reads a token's row once per expert it goes to (k times where L2 misses)",
          default=False, when=lambda v, case: v["dispatch"] == "split"),
)

PARAM_BY_NAME = {p.name: p for p in PARAMS}

# Parameters measured on the GPU and withdrawn (NOTES), with the value every variant of today's
# templates has. Committed studies and trial rows still name them; a variant that set one otherwise
# is not one the templates render.
WITHDRAWN = {"fused_mlp": False}  # the fused direct MLP: NOTES 37

# A tile's fp32 accumulators above this many per thread spill registers (255 is the hardware cap,
# and the loads in flight need the rest).
MAX_ACC_PER_THREAD = 128
# Direct dispatch reads an expert once per slot routed to it: past this many slots, shared experts
# (and 16-row blocks holding one row each) cost more than the sort saves.
DIRECT_MAX_SLOTS = 32


@dataclass(frozen=True)
class Variant:
    dispatch: str
    activation: str
    block_m: int
    g1_block_n: int
    g1_block_k: int
    g1_group_m: int
    g1_num_warps: int
    g1_num_stages: int
    g2_block_n: int
    g2_block_k: int
    g2_group_m: int
    g2_num_warps: int
    g2_num_stages: int
    g1_weight_tma: bool = False
    g2_weight_tma: bool = False
    g1_persistent: bool = False
    g2_persistent: bool = False
    pdl: bool = False
    direct: bool = False
    half_tail: bool = False
    tail_walk: bool = False
    g2_gluon: bool = False
    g1_gluon: bool = False
    g1_tma_store: bool = False
    g2_sorted_out: bool = False
    dynamic_walk: bool = False
    g1_pair_tail: bool = False
    g2_pair_tail: bool = False
    g1_swap_tail: int = 0
    g2_swap_tail: int = 0
    permute_by_token: bool = False
    weight_layout: str = "rows"
    group_by_expert: bool = False

    @property
    def route(self) -> str:
        """How rows reach GEMM1: "fused" (gathered in sorted order), "split" (permuted first) or
        "direct" (one slot per block, no sort)."""
        return "direct" if self.direct else self.dispatch

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Variant:
        names = {f.name for f in fields(cls)}
        gone = sorted(name for name, value in WITHDRAWN.items() if d.get(name, value) != value)
        if gone:
            raise ValueError(f"variant sets withdrawn parameter(s) {gone}: today's templates cannot render it")
        d = {**{p.name: p.default for p in PARAMS if p.default is not None}, **d}
        missing = names - d.keys()
        if missing:
            raise ValueError(f"variant is missing {sorted(missing)}")
        return cls(**{n: d[n] for n in names})

    def gemm(self, which: int) -> dict:
        """The constants of GEMM `which` (1 or 2) under their kernel names."""
        p = f"g{which}_"
        return {
            "BLOCK_N": getattr(self, p + "block_n"), "BLOCK_K": getattr(self, p + "block_k"),
            # Negative: groups of up to -GROUP_M row blocks within one expert (group_by_expert).
            "GROUP_M": getattr(self, p + "group_m") * (-1 if self.group_by_expert else 1),
            "num_warps": getattr(self, p + "num_warps"),
            "num_stages": getattr(self, p + "num_stages"), "weight_tma": getattr(self, p + "weight_tma"),
            "persistent": getattr(self, p + "persistent"),
        }

    def gemm_dims(self, which: int, shape) -> tuple[int, int]:
        """GEMM `which`'s (N, K) on `shape`: GEMM1's N is I with the SwiGLU fused into it, 2I (gate and
        up both written) without; GEMM2 maps I to H."""
        if which == 1:
            return (shape.I if self.activation == "fused" else 2 * shape.I), shape.H
        return shape.H, shape.I

    def triton_form(self, which: int) -> tuple:
        """The key of GEMM `which`'s triton kernel in a module's _GEMM1 / _GEMM2 table (the forms
        render_module renders): the row route, activation, TMA and persistence for GEMM1; directness,
        TMA and persistence for GEMM2."""
        if which == 1:
            return (self.route, self.activation, self.g1_weight_tma, self.g1_persistent)
        return (self.direct, self.g2_weight_tma, self.g2_persistent)

    @property
    def label(self) -> str:
        g1, g2 = self.gemm(1), self.gemm(2)
        def group(g):  # G8, or E8 for groups of up to 8 blocks within one expert
            return f"E{-g['GROUP_M']}" if g["GROUP_M"] < 0 else f"G{g['GROUP_M']}"

        def gemm(g, pair: bool, swap: int):
            tma = " tma" if g["weight_tma"] else ""
            persistent = " persistent" if g["persistent"] else ""
            return (f"{g['BLOCK_N']}x{g['BLOCK_K']} {group(g)} w{g['num_warps']} s{g['num_stages']}"
                    f"{tma}{persistent}{' pair' if pair else ''}{f' swap{swap}' if swap else ''}")

        pdl = " pdl" if self.pdl else ""
        half = ("/half+walk" if self.tail_walk else "/half") if self.half_tail else ""
        # A Gluon GEMM is TMA-fed, persistent and a warpgroup per 64 rows by construction.
        def gluon(g, store=""):
            return f"gluon {g['BLOCK_N']}x{g['BLOCK_K']} {group(g)} s{g['num_stages']}{store}"

        g1_text = (gluon(g1, " tma-store" if self.g1_tma_store else "") if self.g1_gluon
                   else gemm(g1, self.g1_pair_tail, self.g1_swap_tail))
        g2_text = (gluon(g2, " sorted-out" if self.g2_sorted_out else "") if self.g2_gluon
                   else gemm(g2, self.g2_pair_tail, self.g2_swap_tail))
        dynamic = " dynamic-walk" if self.dynamic_walk else ""
        route = f"{self.route}-by-token" if self.permute_by_token else self.route
        layout = " k64" if self.weight_layout == "k64" else ""
        return f"{route}/{self.activation} M{self.block_m}{half}{pdl} g1 {g1_text} g2 {g2_text}{dynamic}{layout}"


def rows_computed(v, ids: torch.Tensor, num_experts: int) -> tuple[int, int]:
    """The rows GEMM1 and GEMM2 compute for routing `ids` under `v` (a Variant, or an emitted module's
    table row): each expert's slots padded to whole blocks of block_m; under half_tail a last block of
    at most block_m / 2 rows at half height, or, paired behind a full block with a swapped tail of at
    least its rows (g1_swap_tail, g2_swap_tail), at the swap's width; on the direct route a block per
    routed slot. Against T*k, the rows the op needs, this is the padding's share of the tensor work."""
    ids = ids.flatten()
    routed = ids[(ids >= 0) & (ids < num_experts)]
    if getattr(v, "hot", None) is not None:  # a routing-adaptive table row: each side on its own experts
        hot_expert = routed.bincount(minlength=num_experts) >= v.hot_rows
        on_hot = hot_expert[routed]
        cold = rows_computed(v._replace(hot=None), routed[~on_hot], num_experts)
        hot = rows_computed(v.hot, routed[on_hot], num_experts)
        return cold[0] + hot[0], cold[1] + hot[1]
    bm = v.block_m
    if getattr(v, "route", v.dispatch) == "direct":
        return (routed.numel() * bm,) * 2
    counts = routed.bincount(minlength=num_experts)
    tail = counts % bm
    out = []
    for which in (1, 2):
        last = torch.where(tail == 0, 0, bm)
        if getattr(v, "half_tail", False):
            last = torch.where((tail > 0) & (tail <= bm // 2), bm // 2, last)
            swap = getattr(v, f"g{which}_swap_tail", 0) if getattr(v, f"g{which}_pair_tail", False) else 0
            if swap:
                last = torch.where((tail > 0) & (tail <= swap) & (counts > bm), swap, last)
        out.append(int((counts - tail + last).sum()))
    return out[0], out[1]


# The smallest hot block worth a second pipeline: on the H200 a 32-row hot side ran a zipf load 10%
# slower than the cold variant alone (T=32), 64- and 128-row ones 16-50% faster (T=64-1024; NOTES 55).
HOT_MIN_BLOCK_M = 64


def hot_split_violations(cold: Variant, hot: Variant) -> list[str]:
    """Why two variants cannot share a routing-adaptive call (empty: they can). There the cold variant
    runs the experts routed fewer than hot_rows rows and the hot one the rest, each with its own
    dispatch, both writing one y in slot order that one combine reads; so neither may write y in
    expert order, need a dispatch-free route, walk tails in a second launch, or permute by token
    (dispatch leaves a slot's position unset on the other side), and the Gluon GEMMs are left out
    until tested there. The hot side takes the larger blocks: what it is for."""
    bad = []
    for side, v in (("cold", cold), ("hot", hot)):
        unfit = [name for name, on in (("direct dispatch", v.direct), ("g2_sorted_out", v.g2_sorted_out),
                                       ("tail_walk", v.tail_walk), ("permute_by_token", v.permute_by_token),
                                       ("a Gluon GEMM", v.g1_gluon or v.g2_gluon)) if on]
        if unfit:
            bad.append(f"the {side} side runs {', '.join(unfit)}, which a routing-adaptive call cannot share")
    if hot.block_m <= cold.block_m:
        bad.append(f"the hot side's blocks ({hot.block_m} rows) must be larger than the cold side's ({cold.block_m})")
    if hot.block_m < HOT_MIN_BLOCK_M:
        bad.append(f"a hot side of {hot.block_m}-row blocks saves less than its second pipeline costs "
                   f"(needs block_m >= {HOT_MIN_BLOCK_M})")
    return bad


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _gemm_smem(block_m: int, block_n: int, block_k: int, stages: int, b_tiles: int, elem: int) -> int:
    """Shared memory of a pipelined GEMM: `stages` copies of the A tile and the B tiles."""
    return stages * (block_m * block_k + b_tiles * block_n * block_k) * elem


def violations(v: Variant, case: Case) -> list[str]:
    """Why `v` cannot run `case` (empty when it can): checked before anything compiles."""
    s, d = case.shape, v.as_dict()  # d: the `when` predicates' view of v
    bad = []
    if v.direct:
        if v.dispatch != "fused":
            bad.append("direct dispatch gathers rows in GEMM1: it needs dispatch=fused")
        if case.T * s.k > DIRECT_MAX_SLOTS:
            bad.append(f"direct dispatch is for T*k <= {DIRECT_MAX_SLOTS} slots, not {case.T * s.k}")
        if v.block_m != 16:
            bad.append("direct dispatch holds one row per block: block_m must be 16, the smallest")
        if v.g1_persistent or v.g2_persistent:
            bad.append("direct dispatch has no used-block count for a persistent GEMM to walk")
    if v.half_tail and not _half_tail_can_run(d, case):
        bad.append("half_tail splits a row block of at least 32 rows (a dot needs 16), and never a direct one")
    for which in (1, 2):
        if getattr(v, f"g{which}_gluon"):
            bad += _gluon_violations(v, case, which)
    if v.g1_tma_store and not v.g1_gluon:
        bad.append("g1_tma_store is the Gluon GEMM1's epilogue: it needs g1_gluon")
    if v.g1_tma_store and (s.I * s.elem_bytes) % target.TMA_ALIGN_BYTES:
        bad.append(f"g1_tma_store writes h rows by TMA, which needs {target.TMA_ALIGN_BYTES}-byte rows; I={s.I} is not")
    if v.permute_by_token and v.dispatch != "split":
        bad.append("permute_by_token is split dispatch's permutation: it needs dispatch=split")
    if v.g2_sorted_out and not v.g2_gluon:
        bad.append("g2_sorted_out is the Gluon GEMM2's epilogue: it needs g2_gluon")
    if v.g2_sorted_out and (s.H * s.elem_bytes) % target.TMA_ALIGN_BYTES:
        bad.append(f"g2_sorted_out writes y rows by TMA, which needs {target.TMA_ALIGN_BYTES}-byte rows; "
                   f"H={s.H} is not")
    if v.dynamic_walk and not (v.g1_gluon or v.g2_gluon):
        bad.append("dynamic_walk is how the Gluon GEMMs walk their tiles: it needs g1_gluon or g2_gluon")
    for which in (1, 2):
        if getattr(v, f"g{which}_pair_tail") and not _pair_can_run(which)(d, case):
            bad.append(f"g{which}_pair_tail pairs half tails with the full block before them: it needs half_tail, "
                       f"no tail_walk, and g{which}_gluon off, or (GEMM1) on with dispatch=split and dynamic_walk")
        swap = getattr(v, f"g{which}_swap_tail")
        if swap and not (_swap_can_run(which)(d, case) and swap < v.block_m // 2):
            bad.append(f"g{which}_swap_tail runs a paired tail as a swapped dot narrower than block_m/2 rows: it "
                       f"needs g{which}_pair_tail and block_m >= 64, fewer rows than block_m/2, and the triton "
                       f"GEMM{which}")
    if v.weight_layout == "k64":
        if s.H % K_BLOCK or s.I % K_BLOCK:
            bad.append(f"weight_layout=k64 blocks K in {K_BLOCK}s: H={s.H} and I={s.I} must be multiples of {K_BLOCK}")
        for which in (1, 2):
            g = v.gemm(which)
            if g["weight_tma"] and g["BLOCK_K"] != K_BLOCK:
                bad.append(f"weight_layout=k64 with TMA weights reads one {K_BLOCK}-column block a box: "
                           f"g{which}_block_k must be {K_BLOCK}")
            elif g["BLOCK_K"] % K_BLOCK:
                bad.append(f"weight_layout=k64 steps through whole {K_BLOCK}-column blocks: g{which}_block_k must be "
                           f"a multiple of {K_BLOCK}")
    if v.group_by_expert and not _group_by_expert_can_run(d, case):
        bad.append("group_by_expert groups an expert's row blocks: not with direct dispatch (no blocks), tail "
                   "walks or pair tails (their walks keep the plain groups)")
    if v.tail_walk and not _tail_walk_can_run(d, case):
        bad.append("tail_walk is how a persistent GEMM runs half tails: it needs half_tail and a persistent GEMM")
    smem = target.smem_bytes()
    for which in (1, 2):
        n, k = v.gemm_dims(which, s)
        # B tiles per step: the fused GEMM1 loads a gate and an up tile of the same columns.
        b_tiles = 2 if which == 1 and v.activation == "fused" else 1
        g = v.gemm(which)
        if g["BLOCK_K"] > max(16, _next_pow2(k)):
            bad.append(f"g{which}_block_k={g['BLOCK_K']} exceeds K={k}")
        if g["BLOCK_N"] > max(16, _next_pow2(n)):
            bad.append(f"g{which}_block_n={g['BLOCK_N']} exceeds N={n}")
        # A pair tile stages its half tail's rows too. (Its accumulators are not counted below: the
        # compiler fits 128 + 64 per thread, at 255 registers, without spilling.)
        pair = getattr(v, f"g{which}_pair_tail")
        rows = v.block_m + v.block_m // 2 if pair else v.block_m
        need = _gemm_smem(rows, g["BLOCK_N"], g["BLOCK_K"], g["num_stages"], b_tiles, s.elem_bytes)
        if need > smem:
            bad.append(f"GEMM{which} needs {need // 1024} KB shared memory > {smem // 1024} KB")
        acc = b_tiles * v.block_m * g["BLOCK_N"] // (32 * g["num_warps"])
        if acc > MAX_ACC_PER_THREAD:
            bad.append(f"GEMM{which} holds {acc} accumulators per thread > {MAX_ACC_PER_THREAD}")
        if g["weight_tma"]:
            if g["BLOCK_K"] * s.elem_bytes > target.TMA_MAX_INNER_BYTES:
                bad.append(f"g{which}_block_k={g['BLOCK_K']} is wider than a TMA box row "
                           f"({target.TMA_MAX_INNER_BYTES} B)")
            if (k * s.elem_bytes) % target.TMA_ALIGN_BYTES:
                bad.append(f"TMA needs {target.TMA_ALIGN_BYTES}-byte aligned weight rows; K={k} is not")
    return bad


def _gluon_violations(v: Variant, case: Case, which: int) -> list[str]:
    """Why the warp-specialised Gluon GEMM `which` cannot run `v` on `case`. Its structure is fixed
    (TMA, persistent, a warpgroup per 64 rows; half tails at 64 rows by branch), so the flags that
    would choose otherwise must say so."""
    name, g = f"g{which}_gluon", v.gemm(which)
    bad = []
    if not target.has_gpu():
        bad.append(f"{name}: Gluon kernels need a GPU (there is no interpreter for them)")
    if case.shape.dtype not in ("bfloat16", "float16"):
        bad.append(f"{name}: wgmma here takes 16-bit inputs, not {case.shape.dtype}")
    if v.direct or v.block_m not in (64, 128):
        bad.append(f"{name}: the tile is 64 or 128 rows of a sorted block")
    if not (g["weight_tma"] and g["persistent"]):
        bad.append(f"{name} is TMA-fed and persistent: set g{which}_weight_tma and g{which}_persistent")
    if g["num_warps"] * 16 != v.block_m:
        bad.append(f"{name} runs a warpgroup per 64 rows: g{which}_num_warps must be {v.block_m // 16} "
                   f"for block_m={v.block_m}")
    if v.half_tail and v.block_m != 128:
        bad.append(f"{name} runs a half tail as one 64-row warpgroup tile, its columns split across two "
                   f"warpgroups: half_tail needs block_m=128")
    if v.tail_walk:
        bad.append(f"{name} branches on each block's height inside its walk: tail_walk must be off")
    if which == 1 and v.activation != "fused":
        bad.append("g1_gluon applies SwiGLU itself: activation=fused")
    if which == 1 and v.dispatch == "fused" and case.shape.H % 16:
        bad.append(f"g1_gluon gathering rows copies 16 bytes at a time, which triton proves only for H a "
                   f"multiple of 16, not H={case.shape.H}")
    # GEMM1's tile is [gate | up], 2 * BLOCK_N wide; one wgmma instruction is at most 256 wide.
    width = (2 if which == 1 else 1) * g["BLOCK_N"]
    if width > 256:
        bad.append(f"{name}: a {width}-column tile is wider than one wgmma (256)")
    # The ring (a pair's stages hold its half tail's rows too), and the epilogue's layout change of the
    # [BLOCK_M, BLOCK_N] output tile.
    rows = v.block_m * 3 // 2 if getattr(v, f"g{which}_pair_tail") else v.block_m
    need = _gemm_smem(rows, width, g["BLOCK_K"], g["num_stages"], 1, case.shape.elem_bytes) \
        + v.block_m * g["BLOCK_N"] * case.shape.elem_bytes
    if need > target.smem_bytes():
        bad.append(f"{name} needs {need // 1024} KB shared memory > {target.smem_bytes() // 1024} KB")
    return bad


def parse_assignments(text: str) -> dict:
    """`"g1_weight_tma=True,dispatch=split"` -> {"g1_weight_tma": True, "dispatch": "split"}, each value
    one of its parameter's choices (ValueError naming the bad part otherwise); names and values in any
    case (`true` is True)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        p = PARAM_BY_NAME.get(name.strip().lower())
        if p is None:
            raise ValueError(f"{part!r}: no parameter {name.strip()!r} (see `moe-tune space`)")
        if not eq:
            raise ValueError(f"{part!r}: no value (PARAM=VALUE; {p.name} takes one of "
                             f"{', '.join(map(str, p.choices))})")
        match = [c for c in p.choices if str(c).lower() == value.strip().lower()]
        if not match:
            raise ValueError(f"{part!r}: {p.name} takes one of {', '.join(map(str, p.choices))}")
        out[p.name] = match[0]
    return out


def _dims(case: Case) -> dict[str, int]:
    s = case.shape
    return {"slots": case.T * s.k, "H": s.H, "I": s.I, "2I": 2 * s.I}


def choices(p: Param, case: Case) -> tuple:
    """The values of `p` worth trying on `case`: none beyond its capping dimension (at least one).

    Fixed per case, so one study always sees the same distribution for a parameter.
    """
    if p.cap is None:
        return p.choices
    limit = _next_pow2(_dims(case)[p.cap])
    return tuple(c for c in p.choices if c <= limit) or p.choices[:1]


def unfit(shape) -> str | None:
    """Why no variant of the space can run `shape` (None where some can): each GEMM's reduction runs
    over H or I in steps of the smallest block_k, which may not exceed the dimension's next power of
    two (violations)."""
    step = min(c for p in PARAMS if p.name.endswith("_block_k") for c in p.choices)
    small = [f"{name}={dim}" for name, dim in (("H", shape.H), ("I", shape.I)) if step > max(16, _next_pow2(dim))]
    if small:
        return (f"{' and '.join(small)}: the smallest reduction step in the space is {step}, so no variant "
                f"can run this shape (H and I must be above {step // 2})")
    return None


def off_choices(assignment: dict, case: Case) -> list[str]:
    """Each value of `assignment` that `case`'s study does not ask for (one past the case's capping
    dimension): optuna refuses a queued point holding one."""
    off = []
    for name, value in assignment.items():
        allowed = choices(PARAM_BY_NAME[name], case)
        if value not in allowed:
            off.append(f"{name}={value} is not among this case's choices ({', '.join(map(str, allowed))})")
    return off


def in_space(v: Variant, case: Case) -> bool:
    """Whether every parameter of `v` is among the values `case`'s study asks for (choices): a point
    from another shape's study may hold a tile wider than this case's capping dimension."""
    return not off_choices({p.name: getattr(v, p.name) for p in PARAMS}, case)
