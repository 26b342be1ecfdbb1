"""Where the tuner looks in the variant space (`space`): the sampler's define-by-run ask (`suggest`),
the hand-picked first points of a new study (`starting_points`), and the one-step moves around a
leader (`neighbours`). Which points exist and which can run a case is `space`'s; this module only
picks among them.
"""

from __future__ import annotations

from .space import PARAM_BY_NAME, PARAMS, Variant, choices, in_space, violations
from .workloads import Case, experts_touched, make_tokens


def neighbours(v: Variant, case: Case) -> list[Variant]:
    """The variants one step from `v` that can run `case`: each parameter moved to the next choice
    either side (numeric choices are ordered), or to each other choice (flags and names), the rest
    of `v` kept. A move that fits only with fewer pipeline stages (a larger tile) takes the most
    stages that fit. A local search around a leader, which a sampler over the whole space seldom
    does (NOTES 44)."""
    out = []
    for p in PARAMS:
        options = choices(p, case)
        current = getattr(v, p.name)
        if current not in options:
            continue
        i = options.index(current)
        ordered = all(isinstance(c, int) and not isinstance(c, bool) for c in options)
        steps = [options[j] for j in (i - 1, i + 1) if 0 <= j < len(options)] if ordered else \
            [c for c in options if c != current]
        for value in steps:
            n = Variant.from_dict({**v.as_dict(), p.name: value})
            if violations(n, case):
                n = None if p.name.endswith("_num_stages") else _with_fewer_stages(
                    n, [1] if p.name.startswith("g1_") else [2] if p.name.startswith("g2_") else [1, 2], case)
            if n is not None and n != v and n not in out:
                out.append(n)
    return out


def _with_fewer_stages(v: Variant, gemms: list[int], case: Case) -> Variant | None:
    """`v` with the given GEMMs' pipelines one, two, ... stages shorter, the first that can run `case`
    (None if none can)."""
    lowest = min(PARAM_BY_NAME["g1_num_stages"].choices)
    for fewer in range(1, max(getattr(v, f"g{w}_num_stages") for w in gemms) - lowest + 1):
        stages = {f"g{w}_num_stages": max(lowest, getattr(v, f"g{w}_num_stages") - fewer) for w in gemms}
        n = Variant.from_dict({**v.as_dict(), **stages})
        if not violations(n, case):
            return n
    return None


def suggest(trial, case: Case) -> Variant:
    """Ask an Optuna trial for a variant, define-by-run: every unconditional parameter, then each
    conditional one whose `when` holds for the answers so far (the rest keep their defaults), so the
    sampler does not spend its trials on points the rules would reject."""
    values = {p.name: trial.suggest_categorical(p.name, choices(p, case)) for p in PARAMS if p.when is None}
    for p in PARAMS:
        if p.when is not None:
            values[p.name] = (trial.suggest_categorical(p.name, choices(p, case)) if p.when(values, case)
                              else p.default)
    return Variant(**values)


def starting_points(case: Case) -> list[Variant]:
    """Hand-picked variants tried first in a new study, so a short budget starts from sane ground.

    Small T streams weights: narrow row tiles, many column tiles, deep pipelines. Large T is
    compute-bound: 128-row tiles and wide columns. These are only seeds; the sampler moves on.
    """
    rows_per_expert = case.T * case.shape.k / case.shape.E
    if case.routing != "uniform":  # a hot-expert load: the rows of the experts it routes to
        ids = make_tokens(case, "cpu")[2]
        rows_per_expert = case.T * case.shape.k / max(1, experts_touched(ids, case.shape.E))
    if rows_per_expert <= 16:
        picks = [
            Variant("fused", "fused", 16, 64, 128, 1, 4, 4, 64, 128, 1, 4, 4),
            Variant("fused", "fused", 16, 32, 256, 1, 4, 3, 32, 256, 1, 4, 3),
        ]
    elif rows_per_expert <= 64:
        picks = [
            Variant("fused", "fused", 32, 64, 128, 1, 4, 4, 64, 128, 1, 4, 4),
            Variant("fused", "fused", 64, 64, 64, 8, 4, 4, 128, 64, 8, 4, 4),
        ]
    else:
        picks = [
            Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3),
            Variant("fused", "fused", 64, 128, 64, 8, 4, 4, 128, 64, 8, 4, 4),
        ]
    return [v for v in picks if in_space(v, case) and not violations(v, case)]
