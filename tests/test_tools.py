"""tools/ab.py, methods.py, replay_sizing.py, same_ptx.py, padding.py, host.py, weight_stream.py, dram.py,
twin_gemm.py and lent_gpu.sh, as far as they run without a GPU."""

import gzip
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import small_variant

from autotune.workloads import SEED16_SHAPE, Case


def _tool(name: str):
    """tools/<name>.py, imported as a module."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ab = _tool("ab")


def test_ab_times_the_leader_then_each_new_accepted_variant(capsys):
    case = Case(SEED16_SHAPE, 64)
    lead = small_variant(block_m=16, bn=64, bk=128)
    cands = ab.candidates(lead, case, ["g1_num_stages=3", "g1_num_stages=3", "g1_tma_store=True",
                                       f"g1_num_stages={lead.g1_num_stages}"])
    assert [name for name, _ in cands] == ["leader", "g1_num_stages=3"]
    assert cands[0][1] == lead and cands[1][1].g1_num_stages == 3
    assert "g1_tma_store=True: rejected" in capsys.readouterr().out


def test_interleaved_rounds_rotate_the_turns():
    """Every party takes every turn equally often over len(names) rounds: no fixed second place."""
    from autotune.timing import turns

    names = ["leader", "a", "b"]
    orders = [turns(names, r) for r in range(6)]
    assert orders[:3] == [["leader", "a", "b"], ["a", "b", "leader"], ["b", "leader", "a"]] and orders[3] == names
    assert all(sorted(o) == sorted(names) for o in orders) and turns([], 2) == []


@pytest.mark.skipif(ab.target.has_gpu(), reason="it times on this GPU instead")
def test_ab_refuses_to_run_without_a_gpu(capsys):
    assert ab.main(["64"]) == 1
    assert "GPU" in capsys.readouterr().out


methods = _tool("methods")


def test_methods_times_each_module_four_ways_after_checking_it(capsys):
    """On the CPU (a small fp16 case, the interpreter): a k-blocked module's four methods each write the
    checked output, into out= or a new tensor; a module whose output fails the bar gets no method."""
    import dataclasses
    import types

    import torch

    from autotune import render
    from autotune.runner import CaseState
    from autotune.workloads import Shape

    case = Case(Shape(4, 64, 64, 2, "float16"), 5)
    module = render.load_source(render.render_variant(dataclasses.replace(small_variant(bk=64), weight_layout="k64")))
    state = CaseState()
    runs = methods.calls(state, module, case)
    assert list(runs) == [name for name, _, _ in methods.METHODS]
    assert [settle for _, settle in runs.values()] == [methods.SETTLE_MS, 0.0, 0.0, methods.SETTLE_MS]
    x, w, ids = state.tokens
    want = module.fused_experts(x, *module.prepare_weights(*state.weights), w, ids)
    assert all(torch.equal(call(), want) for call, _ in runs.values())
    doubled = types.SimpleNamespace(__name__="doubled", prepare_weights=module.prepare_weights,
                                    fused_experts=lambda *args, **kw: module.fused_experts(*args, **kw) * 2)
    assert methods.calls(state, doubled, case) == {}
    assert "fails the bar" in capsys.readouterr().out


replay_sizing = _tool("replay_sizing")


def test_replay_sizing_counts_from_the_first_lone_call_or_the_fastest(tmp_path, capsys):
    """The stand-in gives time_fn's least-of-three the first call's time; on the CPU (the interpreter,
    wall-clock timing) every round benches the module's rows, checked, and timing's own is restored."""
    from autotune import render, timing
    from autotune.workloads import Shape

    lone = iter([9.0, 1.0, 1.0, 2.0])
    first = replay_sizing.sized_by_first_call(lambda fn: next(lone))
    assert min(first(None) for _ in range(3)) == 9.0 and first(None) == 1.0
    own = timing._one_call_ms
    shape = Shape(4, 64, 32, 2, "float32")
    module = render.load_source(render.render_variant(small_variant()))
    out = replay_sizing.compare(module.__file__, [Case(shape, 3), Case(shape, 5)])
    assert list(out) == list(replay_sizing.ROUNDS) and timing._one_call_ms is own
    assert all([c["T"] for c in rows] == [3, 5] and all(c["ours"]["ok"] for c in rows) for rows in out.values())
    assert "calls a sample" in capsys.readouterr().out


same_ptx = _tool("same_ptx")


def test_same_ptx_compares_code_not_where_it_came_from():
    """Two compilations of one kernel from differently named files differ only in .loc/.file lines and
    the debug sections, which code_lines drops; an instruction is kept."""
    ptx = ('.file 1 "/tmp/{}.py"\n.visible .entry k()\n{{\n.loc 1 12 3\nadd.s32 %r1, %r2, %r3;\n}}\n'
           '\t.section\t.debug_info\n.b8 {}\n')
    assert same_ptx.code_lines(ptx.format("a", 97)) == same_ptx.code_lines(ptx.format("b", 98))
    assert "add.s32 %r1, %r2, %r3;" in same_ptx.code_lines(ptx.format("a", 97))
    assert same_ptx.main([]) == 2


padding = _tool("padding")


def test_balanced_routing_gives_every_expert_its_share_and_each_token_distinct_experts():
    import torch

    like = torch.zeros(1, dtype=torch.int64)
    ids = padding.balanced_ids(T=96, k=8, E=256, like=like)
    assert ids.shape == (96, 8) and ids.dtype == torch.int64
    assert (ids.flatten().bincount(minlength=256) == 3).all()
    assert all(len(set(row.tolist())) == 8 for row in ids)
    with pytest.raises(ValueError, match="E >= k"):
        padding.balanced_ids(T=2, k=8, E=4, like=like)


@pytest.mark.skipif(padding.target.has_gpu(), reason="it times on this GPU instead")
def test_padding_refuses_to_run_without_a_gpu(capsys):
    assert padding.main(["8192"]) == 1
    assert "GPU" in capsys.readouterr().out


def test_padding_without_token_counts_prints_its_usage(capsys):
    """Before any GPU work, wherever it runs: no T list is a usage error, not an IndexError."""
    assert padding.main([]) == 2
    assert "Balanced routing" in capsys.readouterr().out


host = _tool("host")


@pytest.mark.skipif(host.target.has_gpu(), reason="it times on this GPU instead")
def test_host_refuses_to_run_without_a_gpu(capsys):
    assert host.main(["1"]) == 1
    assert "GPU" in capsys.readouterr().out


dense_bound = _tool("dense_bound")


def test_dense_chain_runs_both_gemms_on_the_cases_flops():
    """GEMM1 writes rows @ w1^T; GEMM2 multiplies SwiGLU of torch's GEMM1 (made once, outside the call) by w2^T."""
    import torch

    gen = torch.Generator().manual_seed(0)
    R, H, inter = 24, 16, 8
    rows, w1, w2 = (torch.randn(*s, generator=gen) for s in ((R, H), (2 * inter, H), (H, inter)))
    calls = []

    def gemm(a, b, c):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return dense_bound._torch_gemm(a, b, c)

    ref, act = dense_bound.gemm1_and_activation(rows, w1, inter)
    call, g = dense_bound.dense_chain(rows, w1, act, w2, gemm)
    assert calls == [((R, H), (2 * inter, H)), ((R, inter), (H, inter))]  # 2·R·2I·H + 2·R·H·I = 6·R·H·I FLOPs
    g.zero_()
    call()
    torch.testing.assert_close(g, rows @ w1.T)
    assert torch.equal(ref, rows @ w1.T)
    torch.testing.assert_close(act, torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:])


@pytest.mark.skipif(dense_bound.target.has_gpu(), reason="it times on this GPU instead")
def test_dense_bound_refuses_to_run_without_a_gpu_and_needs_its_tokens(capsys):
    assert dense_bound.main(["8192"]) == 1
    assert "GPU" in capsys.readouterr().out
    assert dense_bound.main([]) == 2


def test_dense_bound_row_times_the_module_and_each_chain_that_runs(capsys):
    """The whole row on a small fp32 case on the CPU: the module (here the reference itself) and the
    torch chain are timed both ways; a GEMM that cannot run here is reported as out, not fatal."""
    import types

    import torch

    from autotune.ceilings import Ceilings
    from autotune.reference import moe_reference
    from autotune.workloads import Shape, make_weights, suite

    shape = Shape(E=4, H=32, I=16, k=2, dtype="float32")
    w13, w2 = make_weights(shape, "cpu")
    ceil = Ceilings(read_bytes_per_s=1e9, matmul_flops_per_s=1e9, torch_matmul_flops_per_s=1e9,
                    triton_gemm_flops_per_s=None)
    module = types.SimpleNamespace(fused_experts=moe_reference)
    row = dense_bound._case_row(suite(shape, [8])[0], module, w13, w2, ceil, rounds=2)
    timed = {n for n, p in row["parties"].items() if "ms" in p}
    assert {"module", "torch.matmul"} <= timed
    for name in timed:
        p = row["parties"][name]
        assert p["ms"] > 0 and len(p["settled_ms"]) == 2 and p["settled_median_ms"] > 0
    assert all("failed" in p for n, p in row["parties"].items() if n not in timed)
    assert set(row["parties"]) == {"module", *dense_bound.GEMMS}
    assert "T=8" in capsys.readouterr().out
    assert torch.isfinite(torch.tensor(row["floor_ms"]))


weight_stream = _tool("weight_stream")


@pytest.mark.parametrize("walk", ["row-major", "rotated", "k-blocked"])
def test_weight_stream_reads_every_box_of_each_slab_once(walk):
    """Each program's sum is its slab's, whichever column its walk starts at: the rotated walk wraps
    around K and misses or repeats no box, and the k-blocked walk sums the rows of its slab in the
    storage read as [K / BLOCK_K, R, BLOCK_K] (fp16 integers, so the fp32 sums are exact)."""
    import torch

    w = torch.randint(-8, 9, (64, 256), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    w = w.to(weight_stream.target.device())
    launch, partial = weight_stream.slab_sums(w, (16, 32), walk)
    launch()
    storage = w.float().view(256 // 32, 64, 32).transpose(0, 1) if walk == "k-blocked" else w.float()
    assert torch.equal(partial.cpu(), storage.reshape(4, -1).sum(dim=1).cpu())
    with pytest.raises(ValueError, match="does not tile"):
        weight_stream.slab_sums(w, (24, 32), walk)


def test_weight_stream_names_an_unknown_walk():
    with pytest.raises(ValueError, match="'diagonal'"):
        weight_stream.slab_sums(None, (16, 32), "diagonal")


def test_weight_stream_parses_boxes_and_names_a_bad_one():
    assert weight_stream.parse_boxes("256x64, 64x256") == [(256, 64), (64, 256)]
    with pytest.raises(ValueError, match="'256'"):
        weight_stream.parse_boxes("128x128,256")


@pytest.mark.skipif(weight_stream.target.has_gpu(), reason="it times on this GPU instead")
def test_weight_stream_refuses_to_run_without_a_gpu(capsys):
    assert weight_stream.main([]) == 1
    assert "GPU" in capsys.readouterr().out


_LENDER_FILE_LIMIT = 16 * 2**20  # the most a lent GPU machine brings back of one file under $OUT
_MODULE = "kernels_generated/h200_sm90_e256_h4096_i2048_k8_bfloat16"
_QWEN3_MODULE = "kernels_generated/h200_sm90_e128_h2048_i768_k8_bfloat16"


def _stub_machine(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the repository's files that tools/lent_gpu.sh touches, and an environment whose
    nvidia-smi and python3 are stand-ins: python3 logs each moe-tune command it is asked to run and
    writes what emit and bench would (the module; its bench JSON and PNG)."""
    root = Path(__file__).resolve().parent.parent
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / "db").mkdir()
    (repo / "kernels_generated").mkdir()
    shutil.copy(root / "tools" / "lent_gpu.sh", repo / "tools")
    shutil.copy(root / "db" / "moe_tune.sqlite3", repo / "db")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "nvidia-smi": "#!/bin/sh\necho \"${STUB_GPU:-NVIDIA H200 stand-in}, 700.00 W, 1980 MHz\"\n",
        "python3": f"""#!/bin/sh
shift; code=$1; shift
case "$code" in *autotune.cli*) ;; *) exit 0 ;; esac
echo "$*" >> {tmp_path}/calls
case "$*" in *"--shape 128,2048,768,8"*) module={_QWEN3_MODULE} ;; *) module={_MODULE} ;; esac
case "$1" in
  emit) echo module > $module.py ;;
  bench) echo '{{}}' > $module.bench.json; echo png > $module.bench.png ;;
esac
""",
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    return repo, env


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("gzip")), reason="needs bash and gzip")
def test_lent_gpu_all_tunes_then_finishes_and_brings_back_what_a_lender_can(tmp_path):
    repo, env = _stub_machine(tmp_path)
    done = subprocess.run(["bash", str(repo / "tools" / "lent_gpu.sh"), "all"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["tune", "tune", "show", "emit", "bench", "check"]
    assert "--probe weight_layout=k64" in calls[0] and "--routing zipf" in calls[1]
    assert calls[3] == "emit --hot-routing zipf" and calls[4] == f"bench --png {_MODULE}.bench.png"
    out = tmp_path / "out"
    packed = out / "db" / "moe_tune.sqlite3.gz"
    assert packed.stat().st_size < _LENDER_FILE_LIMIT
    assert gzip.decompress(packed.read_bytes()) == (repo / "db" / "moe_tune.sqlite3").read_bytes()
    name = Path(_MODULE).name
    assert {p.name for p in (out / "km").iterdir()} == {f"{name}.py", f"{name}.bench.json", f"{name}.bench.png"}
    assert all(p.stat().st_size < _LENDER_FILE_LIMIT for p in out.rglob("*") if p.is_file())


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("gzip")), reason="needs bash and gzip")
def test_lent_gpu_probes_each_leader_with_every_probe_named(tmp_path):
    repo, env = _stub_machine(tmp_path)
    env["PROBE"] = "weight_layout=k64;weight_layout=k64,group_by_expert=True"
    done = subprocess.run(["bash", str(repo / "tools" / "lent_gpu.sh"), "tune"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    for sweep in calls[:2]:
        assert "--probe weight_layout=k64 --probe weight_layout=k64,group_by_expert=True " in sweep


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("gzip")), reason="needs bash and gzip")
def test_lent_gpu_skips_a_sweep_of_no_seconds_and_benches_skew_on_request(tmp_path):
    """TL1=0: the zipf sweep alone, on ZIPF_T's tokens; SKEW=1: finish also benches zipf routing."""
    repo, env = _stub_machine(tmp_path)
    env.update(TL1="0", ZIPF_T="128,256", SKEW="1")
    done = subprocess.run(["bash", str(repo / "tools" / "lent_gpu.sh"), "all"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["tune", "show", "emit", "bench", "check", "bench"]
    assert calls[0].startswith("tune --routing zipf --tokens 128,256 ")
    assert calls[-1] == f"bench --routing zipf --json {tmp_path / 'out' / 'skew' / 'committed.zipf.bench.json'}"


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("gzip")), reason="needs bash and gzip")
def test_lent_gpu_qwen3_retimes_reemits_and_benches_the_second_committed_module(tmp_path):
    """A landing that changes every variant's source must bring the Qwen3 module too: its eight cases'
    leaders re-timed, then emit, bench and check on its shape, and all of it brought back."""
    repo, env = _stub_machine(tmp_path)
    done = subprocess.run(["bash", str(repo / "tools" / "lent_gpu.sh"), "qwen3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["tune", "emit", "bench", "check"]
    assert all("--shape 128,2048,768,8 --tokens 1,4,16,64,256,1024,4096,16384" in c for c in calls)
    assert "--more 0 --retime 1" in calls[0]
    assert "--hot-routing" not in calls[1]  # committed without routing-adaptive rows
    out = tmp_path / "out"
    assert (out / "db" / "moe_tune.sqlite3.gz").exists()
    name = Path(_QWEN3_MODULE).name
    assert {p.name for p in (out / "km").iterdir()} == {f"{name}.py", f"{name}.bench.json", f"{name}.bench.png"}


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
@pytest.mark.parametrize("any_gpu", ["0", "1"])
def test_lent_gpu_runs_nothing_on_a_card_that_is_not_an_h200_unless_told(tmp_path, any_gpu):
    repo, env = _stub_machine(tmp_path)
    env.update(STUB_GPU="NVIDIA H100 80GB HBM3", ANY_GPU=any_gpu, TL1="0", TL2="0")
    done = subprocess.run(["bash", str(repo / "tools" / "lent_gpu.sh"), "tune"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    if any_gpu == "1":
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "calls").read_text().split()[0] == "show"
    else:
        assert done.returncode == 3 and "not an H200: NVIDIA H100 80GB HBM3" in done.stderr
        assert not (tmp_path / "calls").exists()


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
def test_lent_gpu_names_an_unknown_stage_before_it_installs_anything(tmp_path):
    repo, env = _stub_machine(tmp_path)
    done = subprocess.run(["bash", str(repo / "tools" / "lent_gpu.sh"), "tunes"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unknown stage: tunes" in done.stderr
    assert not (tmp_path / "calls").exists() and not (tmp_path / "out").exists()


dram = _tool("dram")


def test_dram_least_bytes_are_the_weights_once_and_the_tokens():
    least = dram.least_bytes(8192)
    assert least["w13"] == 256 * 2 * 2048 * 4096 * 2 and least["w2"] == least["w13"] // 2
    assert least["x"] == least["out"] == 8192 * 4096 * 2
    assert sum(least.values()) == Case(SEED16_SHAPE, 8192).bytes_moved(SEED16_SHAPE.E)  # the bench's floor bytes


def test_dram_sums_each_kernel_of_ncus_csv(tmp_path, capsys):
    head = '"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows = [(0, "_gemm1_x", "dram__bytes_read.sum", "9,000,000,000"), (0, "_gemm1_x", "dram__bytes_write.sum", "1000"),
            (0, "_gemm1_x", "gpu__time_duration.sum", "3000000"), (1, "_gemm2_y", "dram__bytes_read.sum", "4500000000"),
            (1, "_gemm2_y", "gpu__time_duration.sum", "1500000")]
    text = "==PROF== Connected to process\n" + head + "\n" + "\n".join(
        f'"{i}","7","{name}","{metric}","byte","{value}"' for i, name, metric, value in rows) + "\n"
    (tmp_path / "ncu.csv").write_text(text)
    assert dram.main(["--csv", str(tmp_path / "ncu.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "_gemm1_x" in out[0] and "3000.0 us" in out[0] and "read   9.000 GB" in out[0] and "3.00 TB/s" in out[0]
    assert "_gemm2_y" in out[1] and "write   0.000 GB" in out[1]
    assert out[2].startswith("sum") and "4500.0 us" in out[2] and "read  13.500 GB" in out[2]


@pytest.mark.skipif(dram.target.has_gpu(), reason="it profiles on this GPU instead")
def test_dram_refuses_to_run_without_a_gpu_and_needs_its_tokens(capsys):
    assert dram.main(["8192"]) == 1
    assert "GPU" in capsys.readouterr().out
    assert dram.main([]) == 2


def test_dram_profiles_the_committed_h200_module_where_this_machine_has_none():
    assert dram.default_module().name == "h200_sm90_e256_h4096_i2048_k8_bfloat16.py"
    assert dram.default_module().exists()


twin_gemm = _tool("twin_gemm")


def test_twin_gemm_forms_compile_for_sm90_with_one_or_two_weight_boxes_a_stage():
    """Compiled here for sm_90: each consumer issues one wgmma per k16 step over its 64 rows and the
    full tile width, nothing spills, the ring fits Hopper's shared memory, and the own-B form's loader
    issues one more TMA copy a stage (its second B box) than the one-box form's."""
    reports = {form.b_copies: twin_gemm.compile_report(form) for form in twin_gemm.FORMS
               if form.block_n == 128 and form.b_copies}
    for r in reports.values():
        assert r["wgmma_shapes"] == ["m64n128k16"] and r["spill_bytes"] == 0
        assert 0 < r["shared_bytes"] <= twin_gemm.target.HOPPER_SMEM_BYTES
    assert reports[2]["tma_loads"] == reports[1]["tma_loads"] + 1


@pytest.mark.skipif(twin_gemm.target.has_gpu(), reason="it times on this GPU instead")
def test_twin_gemm_refuses_to_time_without_a_gpu(capsys):
    assert twin_gemm.main([]) == 1
    assert "--compile" in capsys.readouterr().out
