"""Workload cases: the seed16 suite, user shapes, input generation, and each case's bytes and FLOPs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROUTINGS = ("uniform", "zipf")
# The skewed routing: expert r (by popularity) gets logit bias -ZIPF_SCALE * ZIPF_EXPONENT * log(r + 1).
# The scale sharpens the bias against the unit-variance logits; the product is kept as two factors,
# applied in this order, so the committed studies' zipf routings stay bit for bit what they were.
ZIPF_EXPONENT = 1.2
ZIPF_SCALE = 4.0
SEED16_TOKENS = tuple(2**i for i in range(16))


@dataclass(frozen=True)
class Shape:
    """The model's side of a case: experts, hidden size, intermediate size, experts per token."""

    E: int
    H: int
    I: int  # noqa: E741 - the model's name for the intermediate size
    k: int
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("E", "H", "I", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.k > self.E:
            raise ValueError(f"k={self.k} exceeds E={self.E}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def key(self) -> str:
        return f"E{self.E}-H{self.H}-I{self.I}-k{self.k}-{self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def expert_bytes(self) -> int:
        """One expert's weights: w13 (2I x H) and w2 (H x I)."""
        return 3 * self.H * self.I * self.elem_bytes


@dataclass(frozen=True)
class Case:
    """One tuning target: a shape, a token count and a routing distribution with its seed."""

    shape: Shape
    T: int
    routing: str = "uniform"
    seed: int = 0

    def __post_init__(self):
        if self.T < 0:
            raise ValueError(f"T must be >= 0, got {self.T}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")

    @property
    def key(self) -> str:
        return f"{self.shape.key}-{self.routing}-T{self.T}"

    @property
    def flops(self) -> int:
        """6·T·k·H·I: two GEMMs over the k routed copies of each token (2I·H and H·I, 2 FLOPs a MAC)."""
        s = self.shape
        return 6 * self.T * s.k * s.H * s.I

    def bytes_moved(self, experts_touched: int) -> int:
        """The floor's bytes: weights of the experts routed to, x read once and out written once."""
        s = self.shape
        return experts_touched * s.expert_bytes + 2 * self.T * s.H * s.elem_bytes

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        return cls(shape=Shape(**d["shape"]), T=d["T"], routing=d["routing"], seed=d["seed"])


def experts_touched(ids_TK: torch.Tensor, E: int) -> int:
    """Distinct ids in [0, E): the experts whose weights a case must read."""
    ids = ids_TK[(ids_TK >= 0) & (ids_TK < E)]
    return int(torch.unique(ids).numel())


SEED16_SHAPE = Shape(E=256, H=4096, I=2048, k=8, dtype="bfloat16")
# Small enough for the Triton interpreter on two CPU cores; fp16 because its bf16 tl.dot is broken.
DEMO_SHAPE = Shape(E=8, H=64, I=32, k=2, dtype="float16")
DEMO_TOKENS = (1, 5, 33)


def suite(shape: Shape, tokens, routing: str = "uniform", seed: int = 0) -> list[Case]:
    """One case per token count; each case's routing seed is `seed + T` so cases differ."""
    return [Case(shape, T, routing, seed + T) for T in tokens]


def seed16(routing: str = "uniform") -> list[Case]:
    return suite(SEED16_SHAPE, SEED16_TOKENS, routing)


def parse_shape(text: str, dtype: str = "bfloat16") -> Shape:
    """'E,H,I,k' -> Shape."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--shape takes four positive integers E,H,I,k; got {text!r}")
    E, H, I, k = map(int, parts)  # noqa: E741
    return Shape(E, H, I, k, dtype)


def parse_tokens(text: str) -> tuple[int, ...]:
    """'1,16,512' -> (1, 16, 512): ascending, each count once."""
    try:
        tokens = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise ValueError(f"--tokens takes comma-separated integers; got {text!r}") from exc
    if not tokens or min(tokens) < 1:
        raise ValueError(f"--tokens needs token counts >= 1; got {text!r}")
    return tuple(sorted(set(tokens)))


def make_weights(shape: Shape, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Model-like weights, N(0, 1/fan_in): w13 [E, 2I, H] and w2 [E, H, I] in the shape's dtype.

    Drawn expert by expert so no fp32 copy of all weights ever exists (seed16's are 12.9 GB in bf16).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = shape.torch_dtype
    w13 = torch.empty(shape.E, 2 * shape.I, shape.H, dtype=dt, device=device)
    w2 = torch.empty(shape.E, shape.H, shape.I, dtype=dt, device=device)
    for e in range(shape.E):
        w13[e] = torch.randn(2 * shape.I, shape.H, generator=gen, device=device) / math.sqrt(shape.H)
        w2[e] = torch.randn(shape.H, shape.I, generator=gen, device=device) / math.sqrt(shape.I)
    return w13, w2


def route(logits_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax, renormalised to sum 1: (weights fp32 [T, k], ids int64 [T, k])."""
    probs = torch.softmax(logits_TE.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids


def make_tokens(case: Case, device, seed_offset: int = 0):
    """x [T, H] ~ N(0, 1) and the router's (weights, ids) for `case`, from its seed (+ offset).

    `zipf` routing biases expert logits so a few experts get most tokens (a hot-expert load).
    """
    s = case.shape
    gen = torch.Generator(device=device).manual_seed(case.seed + seed_offset)
    x = torch.randn(case.T, s.H, generator=gen, device=device).to(s.torch_dtype)
    logits = torch.randn(case.T, s.E, generator=gen, device=device)
    if case.routing == "zipf":
        rank = torch.randperm(s.E, generator=gen, device=device).float()
        logits = logits - ZIPF_EXPONENT * torch.log1p(rank)[None, :] * ZIPF_SCALE
    w, ids = route(logits, s.k)
    return x, w, ids
