"""The Triton kernels as a GPU compiles them: tools/compile_kernels.py, on this CPU machine.

Each test runs the tool in a fresh process (the kernel tests around it run under ``TRITON_INTERPRET=1``,
which the tool must not see). The launches it compiles are recorded from the wrappers themselves, so
these tests see any change to a tile, ``num_warps``, ``num_stages`` or specialization in kernels/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compile_kernels.py"
# _backward_kernel: the atomic head backward, recorded under head_backward("atomic") ("atomic-bwd" variants)
KERNELS = {"_forward_kernel", "_grad_logits_kernel", "_backward_kernel", "_noise_kernel", "_rtd_kernel",
           "_colsum_kernel", "_sign_grad_kernel",
           "_attention_forward_kernel", "_attention_dq_kernel", "_attention_dkdv_kernel"}
TARGETS = {"sm_80", "sm_90a"}


@cache
def tool():
    """tools/compile_kernels.py as a module (it imports torch, not triton, until it compiles)."""
    spec = importlib.util.spec_from_file_location("compile_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tool(tmp_path: Path, *args: str, pythonpath: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(TOOL), *args, "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow  # a fresh process importing torch and triton: 5-12 s on 2 shared cores
def test_recorded_launches_are_what_the_wrappers_choose_for_each_gpu(tmp_path):
    """No compiling: the forward's vocabulary splits follow the target's SM count (4 programs per SM),
    TF32 follows torch's flag, and tiles and warps are the head's table entries."""
    from megakd.kernels.linear_head_triton import HEAD_CONFIGS

    proc, report = _tool(tmp_path, "--list", "--only", "head_ce", "--dtypes", "bf16", "tf32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["kernel"], r["dtype"], r["target"]): r for r in report["rows"]}
    assert len(rows) == 3 * 2 * 2
    row_blocks = -(-2458 // HEAD_CONFIGS["forward", "16bit", "sm80"]["BLOCK_N"])
    for target, generation, sms in (("sm_80", "sm80", 108), ("sm_90a", "sm90", 132)):
        v_tiles = -(-128_000 // HEAD_CONFIGS["forward", "16bit", generation]["BLOCK_V"])
        per_split = -(-v_tiles // -(-4 * sms // row_blocks))
        assert rows["_forward_kernel", "bf16", target]["grid"] == [row_blocks, -(-v_tiles // per_split)]
        for kernel, entry in (("_forward_kernel", "forward"), ("_grad_logits_kernel", "grad_logits"),
                              ("_backward_kernel", "backward")):
            for dtype, matmul, precision in (("bf16", "16bit", "ieee"), ("tf32", "tf32", "tf32")):
                options = rows[kernel, dtype, target]["options"]
                assert options["PREC"] == precision
                expected = HEAD_CONFIGS[entry, matmul, generation].kwargs()
                assert {k: options[k] for k in expected} == expected, (kernel, dtype, target)


def _check_compiled(proc: subprocess.CompletedProcess, report: dict, dtypes: set[str]) -> None:
    failures = [f"{r['kernel']} [{r['variant']}] {r['dtype']} {r['target']}: {r['failures']}"
                for r in report["rows"] if r["failures"]]
    assert not failures, "\n".join(failures)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["kernel"] for r in report["rows"]} == KERNELS
    head = {(r["dtype"], r["target"]) for r in report["rows"] if r["kernel"] == "_forward_kernel"}
    assert head == {(d, t) for d in dtypes for t in TARGETS}
    for r in report["rows"]:
        assert r["registers"] > 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0
        assert r["blocks_per_sm"] >= 1
        # FMA fusion said by every launch, so that Triton's default (off from 3.10) cannot change the rounding
        assert r["options"]["enable_fp_fusion"] is True, r["kernel"]


@pytest.mark.slow
def test_every_launch_compiles_spill_free_for_a100_and_h100(tmp_path):
    """Every kernel and launch variant the wrappers make at production shapes, one dtype per matmul class
    (fp32, tf32, bf16; `--quick`), for sm_80 and sm_90a: no compile error, no spill, shared memory
    within a block's limit. The tool without `--quick` adds fp16 and bf16 with fp32 weights."""
    proc, report = _tool(tmp_path, "--quick")
    _check_compiled(proc, report, {"fp32", "tf32", "bf16"})


def _triton_floor() -> Version:
    """The lowest Triton pyproject's ``triton`` extra allows (the line .ci/run reads too)."""
    return Version(re.search(r'^triton = \["triton>=([\d.]+)"\]', (REPO / "pyproject.toml").read_text(), re.M).group(1))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEGAKD_TRITON_FLOOR"),
                    reason="MEGAKD_TRITON_FLOOR (a folder with pyproject's lowest Triton) is unset; .ci/run sets it")
def test_every_kernel_compiles_under_the_lowest_triton_pyproject_allows(tmp_path):
    """pyproject's floor is a version that compiles: .ci/run installs its wheel into a side folder."""
    proc, report = _tool(tmp_path, "--dtypes", "bf16", pythonpath=os.environ["MEGAKD_TRITON_FLOOR"])
    assert Version(report["triton"]) == _triton_floor()
    _check_compiled(proc, report, {"bf16"})


# A loop in PTX as LLVM lays it out: entered at its header $L__BB0_2, one branch back to it.
PLAIN_LOOP = """
.visible .entry k(
	.param .u64 k_param_0
)
{
	.reg .pred 	%p<4>;
// %bb.0:
	ld.param.u64 	%rd1, [k_param_0];
	@%p1 bra 	$L__BB0_3;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=1
	@%p2 atom.global.gpu.acq_rel.add.f32 %r5, [ %rd6 + 0 ], %r4;
	red.global.gpu.relaxed.add.f32 [ %rd6 + 0 ], %r4;
	atom.global.add.f32 %r6, [ %rd6 + 0 ], %r4;
	add.f64 	%fd1, %fd1, %fd2;
	ld.global.f64 %fd3, [%rd1];
	@%p3 bra 	$L__BB0_2;
$L__BB0_3:                              // %._crit_edge
	atom.global.sys.acquire.add.f32 %r7, [ %rd6 + 0 ], %r4;
	cvt.rn.f32.f64 	%r1, %fd1;
	st.global.f64 [%rd1], %fd1;
	ret;
}
"""
# A rotated loop (the sampler's shape): two of its blocks lie above the header $L__BB0_2, which jumps
# back to them; the entry jumps forward to the header, the exit forward past the loop.
ROTATED_LOOP = """
	@%p1 bra 	$L__BB0_5;
	bra.uni 	$L__BB0_2;
$L__BB0_3:                              //   in Loop: Header=BB0_2 Depth=1
	mul.f64 	%fd2, %fd1, 0d4350000000000000;
$L__BB0_4:                              //   in Loop: Header=BB0_2 Depth=1
	add.f64 	%fd3, %fd3, %fd2;
	@!%p6 bra 	$L__BB0_5;
$L__BB0_2:                              // =>This Loop Header: Depth=1
	cvt.f64.f32 	%fd1, %r6;
	@%p2 bra 	$L__BB0_3;
	bra.uni 	$L__BB0_4;
$L__BB0_5:                              // %._crit_edge
	cvt.rn.f32.f64 	%r23, %fd3;
	ret;
"""


def _in_loop(ptx: str) -> dict[str, bool]:
    """Each instruction of ``ptx`` (all distinct here) -> whether the tool puts it inside a loop."""
    lines = tool().ptx_lines(ptx)
    return {line: inside for line, inside in zip(lines, tool().loop_lines(lines)) if not line.startswith("$")}


def test_a_loop_is_a_label_and_a_branch_back_to_it():
    inside = _in_loop(PLAIN_LOOP)
    assert [line for line, flag in inside.items() if flag] == [
        "@%p2 atom.global.gpu.acq_rel.add.f32 %r5, [ %rd6 + 0 ], %r4;",
        "red.global.gpu.relaxed.add.f32 [ %rd6 + 0 ], %r4;", "atom.global.add.f32 %r6, [ %rd6 + 0 ], %r4;",
        "add.f64 \t%fd1, %fd1, %fd2;", "ld.global.f64 %fd3, [%rd1];", "@%p3 bra \t$L__BB0_2;"]
    # the forward branches (the entry jump, the exit) start no loop
    assert [line for line, flag in _in_loop(ROTATED_LOOP).items() if not flag] == [
        "@%p1 bra \t$L__BB0_5;", "bra.uni \t$L__BB0_2;", "cvt.rn.f32.f64 \t%r23, %fd3;", "ret;"]


def test_atomics_are_read_with_the_ptx_defaults_and_float64_without_its_loads():
    facts = tool().read_ptx(PLAIN_LOOP)
    assert sorted((a["instruction"], a["sem"], a["scope"], a["in_loop"], a["count"]) for a in facts.atomics) == [
        ("atom.global.add.f32", "relaxed", "gpu", True, 1),  # no .sem, no scope: relaxed at .gpu
        ("atom.global.gpu.acq_rel.add.f32", "acq_rel", "gpu", True, 1),
        ("atom.global.sys.acquire.add.f32", "acquire", "sys", False, 1),
        ("red.global.gpu.relaxed.add.f32", "relaxed", "gpu", True, 1)]
    assert (facts.f64, facts.f64_in_loop) == (2, 1)  # add.f64 in the loop, the cvt after it; not ld/st
    rotated = tool().read_ptx(ROTATED_LOOP)
    assert (rotated.atomics, rotated.f64, rotated.f64_in_loop) == ((), 4, 3)


def _row(facts, fp32_head: bool, **options):
    return tool().Row("k", "", "bf16", "sm_90a", (1,), options, registers=32, spill_stores=0, spill_loads=0,
                      shared=0, atomics=facts.atomics, f64=facts.f64, f64_in_loop=facts.f64_in_loop,
                      fp32_head=fp32_head)


def test_ordered_atomics_in_loops_fail_and_float64_in_loops_fails_the_linear_head_only():
    failures = _row(tool().read_ptx(PLAIN_LOOP), fp32_head=False).failures
    # the acq_rel one in the loop; not the relaxed ones in it, nor the acquire one after it
    assert failures == ["1 atomics stronger than relaxed inside a loop (1 x atom.global.gpu.acq_rel.add.f32): "
                        "pass sem='relaxed'"]
    rotated = tool().read_ptx(ROTATED_LOOP)
    assert _row(rotated, fp32_head=False).failures == []
    assert _row(rotated, fp32_head=True).failures == ["3 float64 instructions inside a loop of a linear-head kernel"]
    assert tool().read_ptx(ROTATED_LOOP.replace("bra.uni \t$L__BB0_4;", "ret;").replace(
        "@%p2 bra \t$L__BB0_3;", "ret;")).f64_in_loop == 0  # no branch back: no loop


def test_the_grid_against_the_sms():
    grid_use = tool().grid_use
    # the atomic head backward's grid on an H100 at 2 blocks per SM
    assert grid_use((39, 1000), 132, 2) == (39_000, 39_000 / 264,
                                            "39 x 1,000 = 39,000 programs = 148 waves of 132 SMs x 2")
    assert grid_use((39,), 132, 2) == (39, None, "39 programs on 132 SMs: 30 % of the SMs")
    assert grid_use((256,), 132, 1)[1] == 256 / 132
    assert grid_use((39, 14), 108, None) == (546, None, "39 x 14 = 546 programs on 108 SMs")


def _llvm_loop_lines(ptx: str) -> dict[str, bool]:
    """Each instruction -> whether LLVM's block comments put it in a loop ("Loop Header", "in Loop"): the
    compiler's own loop analysis, which the tool's branch-back spans must cover."""
    out, in_loop = {}, False
    for raw in ptx.splitlines():
        block = re.match(r"^(\$L__BB\w+:|// %bb\.\d+:)(.*)", raw.strip())
        if block:
            in_loop = "Loop" in block.group(2)
            continue
        kept = tool().ptx_lines(raw)
        if kept and not kept[0].startswith("$"):
            out[kept[0]] = in_loop
    return out


@pytest.fixture(scope="module")
def tiny_kernels():
    """tests/kernels/ptx_kernels.py's kernels compiled for sm_90a in a process of their own, once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("ptx_kernels.py"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # a fresh process importing torch and triton, four compiles: 4-12 s on 2 shared cores
def test_real_kernels_atomics_and_float64_in_loops(tiny_kernels):
    """tl.atomic_add in a loop at Triton's default semantics is acq_rel and fails; sem="relaxed" passes;
    float64 math in a loop fails a linear-head kernel, float64 after the loop does not."""
    default, relaxed = tiny_kernels["atomic_default"], tiny_kernels["atomic_relaxed"]
    assert [(a["sem"], a["scope"], a["in_loop"], a["count"]) for a in default["row"]["atomics"]] == [
        ("acq_rel", "gpu", True, 1)]
    assert [f.split(" (")[0] for f in default["row"]["failures"]] == ["1 atomics stronger than relaxed inside a loop"]
    assert [(a["sem"], a["in_loop"]) for a in relaxed["row"]["atomics"]] == [("relaxed", True)]
    assert relaxed["row"]["failures"] == relaxed["failures_as_head"] == []
    loop, epilogue = tiny_kernels["float64_loop"]["row"], tiny_kernels["float64_epilogue"]["row"]
    assert loop["f64_in_loop"] > 10 and epilogue["f64"] > 10 and epilogue["f64_in_loop"] == 0  # a log is ~30
    assert loop["failures"] == []  # not a linear-head kernel
    assert tiny_kernels["float64_loop"]["failures_as_head"] == [
        f"{loop['f64_in_loop']} float64 instructions inside a loop of a linear-head kernel"]
    assert tiny_kernels["float64_epilogue"]["failures_as_head"] == []
    # every block LLVM's comments put in a loop, the branch-back spans put in one too (LLVM names some loop
    # blocks by their IR name only, "%.lr.ph", so its comments are no complete list)
    for name, kernel in tiny_kernels.items():
        ours, llvm = _in_loop(kernel["ptx"]), _llvm_loop_lines(kernel["ptx"])
        assert [line for line, flag in llvm.items() if flag and not ours[line]] == [], name
    assert sum(_llvm_loop_lines(tiny_kernels["float64_loop"]["ptx"]).values()) > 10  # a rotated loop, commented
