"""Every benchmark script runs end to end in its --quick smoke mode; its numbers live in
benchmarks/RESULTS.md and docs/."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import PATIENT_COLLECTIVES, without_compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_quick(script: str, *args: str) -> str:
    """Runs ``benchmarks/<script> --quick *args`` in a fresh process; returns its stdout."""
    # (no compilation cache: the scripts time their compiles and read XLA's compile log)
    env = without_compilation_cache(dict(os.environ, PYTHONPATH=str(ROOT)))
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # each script sets its own device count
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "headings"),
    [
        (
            "pipeline.py",
            ("Bubble", "Memory", "Overhead", "Compile", "Flat in chunks", "Where XLA's time goes"),
        ),
        ("hessian.py", ("HVP / grad", "Lanczos / m HVPs", "partial, bfloat16 basis")),  # --quick: float32
        ("invertible.py", ("Memory and time against depth", "constant / linear time", "drift")),
        (
            "schedules.py",
            (
                "Memory: compiled temp bytes",
                "V-Half and ZB-V against 1F1B",
                "V-Half and ZB-V against 1F1B on residual MLP blocks",
                "A wide head's residuals out of the stash",
                "Without a mesh",
                "Slots:",
                "Compile time",
                "Predicted",
                "The stash write",
                "One stash pool per device",
                "pj.memory_estimate against XLA",
                "Stages not alike",
            ),
        ),
        (
            "maxtext_style.py",
            ("Numerical check", "Memory: compiled temp bytes", "ratio gpipe / MaxText-style", "Compile time"),
        ),
        (
            "gpu.py",  # any backend
            (
                "One device:",
                "composed (jax.value_and_grad)",
                "scan (no remat)",
                *(f"{s} never" for s in ("1f1b", "zb-h1", "zb-floor", "interleaved-1f1b", "v-half", "zb-v")),
                "their scan",
            ),
        ),
        ("programs.py", ("Fingerprints", "1f1b mesh hom never", "Lines", "all of them")),
        ("decisions.py", ("Decision sites", "private members", "Import circles", "Files over 600 lines")),
        (
            "planner.py",
            ("uniform: a loose budget", "uniform: a tight budget", "**chosen**", "runner-up", "same choice"),
        ),
    ],
)
def test_benchmark_quick(script, headings):
    out = run_quick(script)
    for heading in headings:
        assert heading in out, f"{script}: missing {heading!r}:\n{out[-2000:]}"


def test_gpu_rows_and_their_kernels_per_loop_iteration(tmp_path):
    """``gpu.py --rows`` runs the programs named, the composed model and their scans; its HLO
    dumps are what ``hlo_kernels.py`` counts: the one-device 1F1B program is one loop over the
    micro-batches (4 at --quick). The runtime-index probe's row has the plain row's loss."""
    out = run_quick("gpu.py", "--rows", "1f1b never", "--probe-runtime-row", "--dump-hlo", str(tmp_path))
    rows = lambda text: [ln.split("|") for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    labels = [row[1].strip() for row in rows(out)]
    probe = "1f1b never, accumulator row at a runtime index"
    assert labels[1:] == ["composed (jax.value_and_grad)", "scan (no remat)", "1f1b never", probe], labels
    assert rows(out)[3][-2] == rows(out)[4][-2], out  # the loss's difference from the composed model's
    assert "Rows within 1.10x of their scan" in out
    dumped = sorted(p.name for p in tmp_path.iterdir())
    files = ["1f1b_never.txt", "1f1b_never_accumulator_row_at_a_runtime_index.txt"]
    assert dumped == [*files, "composed_jax.value_and_grad.txt", "scan_no_remat.txt"], dumped
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hlo_kernels.py"), str(tmp_path / "1f1b_never.txt")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loops = rows(proc.stdout)
    assert [int(row[2]) for row in loops[1:]] == [4], proc.stdout  # one loop: m = 4 micro-batches
    assert all(int(row[3]) > 0 for row in loops[1:]), proc.stdout
    bad = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--quick", "--rows", "nosuch"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "--rows: no program's label starts with ['nosuch']" in bad.stderr


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
    plot = tmp_path / "memory.png"
    out = run_quick("memory.py", "--plot", str(plot))
    for heading in ("Compiled temp bytes", "Time per training step", "Memory growth"):
        assert heading in out, f"missing {heading!r}:\n{out[-2000:]}"
    assert "reversible" in out
    assert plot.stat().st_size > 10_000  # a real PNG was drawn


def test_simulate_benchmark_quick():
    """The simulator script runs every section; its lockstep simulation of pipejax's tables equals
    each table's own ``step_time`` with free links, and every schedule has its rows."""
    out = run_quick("simulate.py")
    headings = ("against theory", "measured on this CPU", "torchgpipe's published speed-ups")
    headings += ("Every schedule in lockstep ticks", "Step time against link bandwidth", "Where overlap wins")
    headings += ("against a measured one-device step", "The floor of one step")
    for heading in headings:
        assert heading in out, f"missing {heading!r}:\n{out[-2000:]}"
    # every simulated bubble equals the theory, every lockstep step the table's step_time
    assert "| False |" not in out
    assert out.count("| True  |") >= 20  # 5 schedules x 4 (n, m) in the lockstep table
    bandwidth = out[out.index("Step time against link bandwidth") : out.index("Where overlap wins")]
    wins = out[out.index("Where overlap wins") : out.index("against a measured one-device step")]
    measured = out[out.index("against a measured one-device step") :]
    for name in ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b"):
        assert bandwidth.count(f"| {name} ") == 5, name  # one row per link
        assert f"| {name} " in wins and f"| {name} " in measured, name
    assert "| scan (no remat) " in measured

    sys.path.insert(0, str(ROOT))
    import pipejax as pj
    from benchmarks import _simulate as sim

    f, b, w = 1.0, 1.0, 0.5  # f = b; exact in binary, so the sums are exact
    for n, m in ((1, 3), (3, 3), (4, 8)):
        for table in (pj.one_f_one_b_schedule(n, m), pj.zb_h1_schedule(n, m)):
            has_w = "W" in table.slot_fields()
            plain = sim.ticks(table, f, b, w)
            assert plain.step() == table.step_time(f, b if has_w else b + w, w), (table, n, m)
            assert plain.work == n * m * (f + b + w)
            # overlap: every hop one more tick, the 2 (n - 1) hops of a micro-batch's round trip
            over = sim.ticks(table, f, b, w, overlap=True)
            assert len(over.compute) == table.num_ticks + 2 * (n - 1)
            assert over.step() >= plain.step()  # free links: overlap only adds ticks
    gpipe = pj.gpipe_schedule(4, 8)  # forward ticks, then reversed ones: 2 (m + n - 1) in all
    assert sim.ticks(gpipe, f, b, w).step() == (8 + 4 - 1) * (f + b + w)
    assert len(sim.ticks(gpipe, f, b, w, overlap=True).compute) == 2 * (8 + 2 * (4 - 1))
    # slow links: a training table's tick sends two messages; overlap hides the compute under them
    t = pj.one_f_one_b_schedule(4, 8)
    plain, over = sim.ticks(t, f, b, w), sim.ticks(t, f, b, w, overlap=True)
    assert plain.step(10.0) == plain.step() + 20.0 * t.num_ticks
    assert over.step(10.0) == 20.0 * (t.num_ticks + 6)
    lo, hi = sim.overlap_wins(plain, over)
    for x in (lo * 0.99, hi * 1.01):
        assert over.step(x) > plain.step(x)
    for x in (lo * 1.01, (lo + hi) / 2, hi * 0.99):
        assert over.step(x) < plain.step(x)


def test_xla_log_parser_reads_the_program_compile():
    """The compile benchmark's reader of XLA:CPU's timers picks the largest compilation and adds
    its kernels (a log in the format of jaxlib 0.10)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.pipeline import parse_xla_log

    hlo = "I1124 04:15:37.71 1 cpu_compiler.cc:1269] Running HLO passes on [{}] for CPU time: {}"
    llvm = "I1124 04:15:37.72 1 ir_compiler.cc:293] Compiled LLVM module: __compute_module_{}_kernel_module"
    llvm += " time: {}"
    done = "I1124 04:15:37.79 1 cpu_compiler.cc:2094] Compiling [{}] for CPU using JIT time: {}"
    log = "\n".join(
        [
            hlo.format("jit_a", "915 us (915 us)"),
            llvm.format("x", "3 ms"),
            done.format("jit_a", "12.6 ms (12600 us)"),
            hlo.format("jit_b", "0.2 s (0.2 s)"),
            llvm.format("add_tanh_fusion.3", "40 ms (40000 us)"),
            llvm.format("wrapped_broadcast.2", "500 us (500 us)"),
            done.format("jit_b", "1.5 s (1500000 us)"),
        ]
    )
    info = parse_xla_log(log)
    assert info["kernels"] == 2 and info["total"] == 1.5 and info["hlo"] == 0.2
    assert abs(info["llvm"] - 0.0405) < 1e-12
    assert info["kinds"] == {"add_tanh_fusion": 0.04, "wrapped_broadcast": 0.0005}
    assert parse_xla_log("no XLA log here") is None


def test_suite_time_splits_each_test_by_its_timings(tmp_path, capsys):
    """`benchmarks/suite_time.py` maps each JUnit test case to its pytest node id (the module's
    file, then classes), sums the jax timings of every test process per test and per file, and
    leaves the rest of a test's seconds as "rest"."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.suite_time import EVENTS, main

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" time="10.0">'
        '<testcase classname="tests.test_planner" name="test_a[x]" time="6.0"/>'
        '<testcase classname="tests.test_planner" name="test_b" time="1.0"/>'
        '<testcase classname="tests.test_overlap" name="test_c" time="3.0"/>'
        "</testsuite></testsuites>"
    )
    timings = tmp_path / "timings"
    timings.mkdir()
    one = {
        "tests/test_planner.py::test_a[x]": {EVENTS["trace"]: 1.0, EVENTS["compile"]: 3.0, EVENTS["hits"]: 2}
    }
    two = {"tests/test_overlap.py::test_c": {EVENTS["compile"]: 2.0, EVENTS["misses"]: 5}}
    (timings / "1.json").write_text(json.dumps(one))
    (timings / "2.json").write_text(json.dumps(two))
    main(["--junit", str(junit), "--timings", str(timings), "--files", "1"])
    out = capsys.readouterr().out
    assert "3 tests in 10.0 s of wall time; 10 worker-seconds" in out, out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= set(":-"):
            rows.setdefault(cells[1] if cells[1].startswith("`") else cells[2], cells)
    # the slowest tests: seconds, node id, trace, lower, compile, rest
    assert rows["`tests/test_planner.py::test_a[x]`"] == [
        "6.00",
        "`tests/test_planner.py::test_a[x]`",
        "1",
        "0",
        "3",
        "2",
    ]
    # by file: worker-seconds, share, file, trace, lower, compile, rest
    assert rows["`tests/test_planner.py`"] == ["7", "70.0%", "`tests/test_planner.py`", "1", "0", "3", "3"]
    assert rows["the other 1 files"] == ["3", "30.0%", "the other 1 files", "0", "0", "2", "1"]
    assert rows["all"][3:] == ["1", "0", "5", "4"], rows["all"]
    assert "2 hits and 5 misses" in out, out
