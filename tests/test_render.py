"""Rendered modules read like hand-written code (ruff-clean), stand alone, and hash stably."""

import dataclasses
import importlib.util
import itertools
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FORMS, small_variant

from autotune import render, search, space, target
from autotune.workloads import SEED16_SHAPE, Case, Shape, make_tokens


def every_form_module() -> str:
    rows = [render.Row(2**i, small_variant(*form)) for i, form in enumerate(FORMS)]
    # Groups within experts beside FORMS' tail walks (dispatch's signatures take both flags).
    rows.append(render.Row(2 ** len(rows), dataclasses.replace(small_variant("split", tma=True, persistent=True),
                                                               group_by_expert=True)))
    # The Gluon GEMMs only render here (they have no interpreter to run under).
    for gluon in (dataclasses.replace(small_variant(tma=True, persistent=True, block_m=64), g2_gluon=True,
                                      g2_sorted_out=True),
                  dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                                      g1_gluon=True),
                  dataclasses.replace(small_variant("fused", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                                      g1_gluon=True, g1_tma_store=True),
                  # Half tails in both Gluon GEMMs, on both row routes and both epilogues.
                  dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                                      g2_num_warps=8, g1_gluon=True, g1_tma_store=True, g2_gluon=True,
                                      g2_sorted_out=True, half_tail=True),
                  dataclasses.replace(small_variant("fused", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                                      g2_num_warps=8, g1_gluon=True, g2_gluon=True, half_tail=True),
                  # Dynamic walks beside the static ones above, with half tails (GEMM2's longest launch).
                  dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                                      g2_num_warps=8, g1_gluon=True, g2_gluon=True, dynamic_walk=True,
                                      half_tail=True),
                  # Gluon GEMM1 pair tiles, in a module whose fused-dispatch Gluon GEMM1 (above) shares
                  # their consumer partition but never pairs.
                  dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                                      g1_gluon=True, dynamic_walk=True, half_tail=True, g1_pair_tail=True)):
        rows.append(render.Row(2 ** len(rows), gluon))
    # Swapped tails beside pairs, on pointer rows and TMA rows (the TMA row box of 32 rows).
    for form, swap in ((("fused", "fused", False, False), 16), (("split", "fused", True, True), 32)):
        rows.append(render.Row(2 ** len(rows), dataclasses.replace(
            small_variant(*form, half_tail=True, pair_tail=True, block_m=64), g1_swap_tail=swap, g2_swap_tail=swap)))
    rows[-1] = render.Row(math.inf, rows[-1].v)
    return render.render_module(rows, "every form", ["a test module"], H200, "every_form")


H200 = render.TunedGpu("NVIDIA H200", (9, 0), "--shape 256,4096,2048,8 --dtype bfloat16")


def _ruff(path: Path) -> subprocess.CompletedProcess:
    # The project's rules (line length included), as for hand-written code.
    config = Path(__file__).resolve().parent.parent / "pyproject.toml"
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(config), str(path)],
                          capture_output=True, text=True)


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_rendered_module_passes_ruff(tmp_path):
    path = tmp_path / "every_form.py"
    path.write_text(every_form_module())
    result = _ruff(path)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_gluon_half_dynamic_module_passes_ruff(tmp_path):
    """GEMM2's Gluon launch with half tails and the dynamic walk and no sorted output (a branch the
    every-form module, which has a sorted-output row, does not render) once made a 134-column line."""
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                            g2_num_warps=8, g1_gluon=True, g2_gluon=True, dynamic_walk=True, half_tail=True)
    path = tmp_path / "half_dynamic.py"
    path.write_text(render.render_variant(v))
    result = _ruff(path)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("gluon", ["g1_gluon", "g2_gluon"])
def test_one_gluon_gemm_with_the_dynamic_walk_passes_ruff(tmp_path, gluon):
    """The dynamic walk's counter arguments are set up only for the Gluon GEMMs a module has (the
    other's once rendered as an unused local)."""
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128), g1_num_warps=8,
                            g2_num_warps=8, dynamic_walk=True, **{gluon: True})
    path = tmp_path / "one_gluon.py"
    path.write_text(render.render_variant(v))
    result = _ruff(path)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("shape", [SEED16_SHAPE, Shape(E=128, H=2880, I=2880, k=4, dtype="bfloat16")],
                         ids=["seed16", "gpt-oss-120b"])
def test_sampled_mixes_of_runnable_variants_pass_ruff(tmp_path, monkeypatch, shape):
    """emit renders modules that mix leaders no trial module held together (a gathering Gluon GEMM1
    beside a paired one once passed an undefined name, tail walks beside expert groups made over-long
    lines). Mixes of variants the space accepts on two shapes, sampled at random, Gluon forms included
    (rendering needs no GPU), must pass ruff as a one-variant module does (the second shape's sample
    found a Gluon GEMM2 launch with half tails alone 122 columns wide)."""
    import optuna

    target.smem_bytes()  # sized before the GPU check is faked (on a CPU: Hopper's)
    monkeypatch.setattr(target, "has_gpu", lambda: True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pool = {"rows": [], "k64": []}
    rng = random.Random(0)
    for T in (1, 4, 64, 512, 4096, 16384):
        case = Case(shape, T)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=T))
        sampled = (search.suggest(study.ask(), case) for _ in range(1000))
        for v in itertools.islice((v for v in sampled if not space.violations(v, case)), 20):
            # The sampler seldom meets a Gluon GEMM's many conditions: each point also tries one Gluon GEMM.
            # Not yet a gathering Gluon GEMM1 (fused dispatch): without a sorted-rows one beside it, its
            # module renders a dead launch of a kernel it does not define (F821). The fix changes those
            # variants' trial source, so it waits on branch map-owner for the next full re-time.
            which = 2 if v.dispatch == "fused" else rng.choice((1, 2))
            gluon = dataclasses.replace(v, **{f"g{which}_weight_tma": True, f"g{which}_persistent": True,
                                              f"g{which}_num_warps": v.block_m // 16, f"g{which}_gluon": True,
                                              "dynamic_walk": rng.random() < 0.5})
            pool[v.weight_layout] += [v] + ([gluon] if not space.violations(gluon, case) else [])
    assert any(v.g1_gluon for v in pool["rows"]) and any(v.g2_gluon for v in pool["rows"])
    for i in range(24):
        layout = "rows" if i % 3 else "k64"
        chosen = rng.sample(pool[layout], min(5, len(pool[layout])))
        rows = [render.Row(2**j, v) for j, v in enumerate(chosen[:-1])] + [render.Row(math.inf, chosen[-1])]
        path = tmp_path / f"mix_{i}.py"
        path.write_text(render.render_module(rows, "a sampled mix", ["a test module"]))
        result = _ruff(path)
        assert result.returncode == 0, ([v.label for v in chosen], result.stdout)


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_k_blocked_module_passes_ruff(tmp_path):
    """A weight_layout=k64 module renders prepare_weights and its own weight checks, which no row-major
    module has."""
    v = dataclasses.replace(small_variant(tma=True), g1_block_k=64, g2_block_k=64, weight_layout="k64")
    path = tmp_path / "k_blocked.py"
    path.write_text(render.render_variant(v))
    assert "def prepare_weights(w13, w2, in_place=False)" in path.read_text()
    result = _ruff(path)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_committed_modules_pass_ruff():
    for path in sorted((Path(__file__).resolve().parent.parent / "kernels_generated").glob("*.py")):
        result = _ruff(path)
        assert result.returncode == 0, result.stdout


def test_rendered_module_imports_only_torch_and_triton():
    imports = [line for line in every_form_module().splitlines() if line.startswith(("import ", "from "))]
    roots = {line.split()[1].split(".")[0] for line in imports}
    assert roots <= {"torch", "triton", "os", "typing", "functools"}, roots


def test_source_hash_is_stable_and_tracks_the_variant():
    a, b = render.render_variant(small_variant()), render.render_variant(small_variant())
    assert render.source_hash(a) == render.source_hash(b)
    assert render.source_hash(a) != render.source_hash(render.render_variant(small_variant(bn=64)))


def test_variant_table_selects_by_token_count():
    module = render.load_source(every_form_module())
    assert module.select_variant(1) is module.VARIANTS[0]
    assert module.select_variant(3) is module.VARIANTS[2]  # rows serve T <= 1, 2, 4, ...
    assert module.select_variant(10**9) is module.VARIANTS[-1]


def test_zipf_routing_is_skewed():
    shape = Shape(E=16, H=8, I=8, k=2, dtype="float32")
    _, _, ids = make_tokens(Case(shape, 512, routing="zipf"), "cpu")
    counts = ids.flatten().bincount(minlength=16).sort(descending=True).values
    assert counts[0] > 4 * counts[8]  # the hottest expert gets many times a median one


def test_every_form_module_loads_with_each_rows_flags():
    """The variant table carries every flag its launcher reads (a missing field only fails at launch)."""
    module = render.load_source(every_form_module())
    assert [row.dynamic_walk for row in module.VARIANTS][-5:-2] == [False, True, True]
    assert module.VARIANTS[-4].g1_gluon and module.VARIANTS[-4].g2_gluon
    assert module.VARIANTS[-3].g1_gluon and module.VARIANTS[-3].g1_pair_tail
    assert [row.g1_swap_tail for row in module.VARIANTS][-3:] == [0, 16, 32]


def test_an_emitted_module_refuses_a_gpu_of_another_architecture(monkeypatch):
    """A module checks each GPU once against the compute capability it was tuned on, and a GPU of
    another architecture gets a ValueError that names it and the commands that tune for it."""
    module = render.load_source(render.render_module([render.Row(math.inf, small_variant())], "t", [], H200))
    names = {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda index: {0: (9, 0), 1: (8, 0)}[index])
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index: names[index])
    module._check_gpu(0)
    with pytest.raises(ValueError, match=r"cuda:1, a NVIDIA A100-SXM4-80GB of compute capability 8\.0; this module "
                                         r"was tuned and verified on NVIDIA H200 \(9\.0\)") as refused:
        module._check_gpu(1)
    assert refused.value.args[0].endswith("moe-tune tune --shape 256,4096,2048,8 --dtype bfloat16 && "
                                          "moe-tune emit --shape 256,4096,2048,8 --dtype bfloat16")


def test_trial_modules_check_no_gpu():
    """Trials run on the GPU they are rendered for: they carry no check (so trial sources, and their
    recorded hashes, are unchanged); a module given the GPU it was tuned on carries it. (A module
    emitted under the interpreter names no GPU: test_tuner's test_emit_import_and_check.)"""
    assert "_check_gpu" not in render.render_variant(small_variant())
    assert "_check_gpu" in render.render_module([render.Row(math.inf, small_variant())], "t", [], H200)
