"""Every benchmark script runs end to end in its --quick smoke mode; its numbers live in
BUILD_NOTES.md and docs/."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import PATIENT_COLLECTIVES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_quick(script: str, *args: str) -> str:
    """Runs ``benchmarks/<script> --quick *args`` in a fresh process; returns its stdout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
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
        ("pipeline.py", ("Bubble", "Memory", "Overhead", "Compile")),
        ("hessian.py", ("HVP / grad", "Lanczos / m HVPs", "float32", "float64")),
        ("invertible.py", ("Memory and time against depth", "constant / linear time", "drift")),
        ("schedules.py", ("Memory: compiled temp bytes", "Slots:", "Compile time", "Predicted step time")),
    ],
)
def test_benchmark_quick(script, headings):
    out = run_quick(script)
    for heading in headings:
        assert heading in out, f"{script}: missing {heading!r}:\n{out[-2000:]}"


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
    plot = tmp_path / "memory.png"
    out = run_quick("memory.py", "--plot", str(plot))
    for heading in ("Compiled temp bytes", "Time per training step", "Memory growth"):
        assert heading in out, f"missing {heading!r}:\n{out[-2000:]}"
    assert "reversible" in out
    assert plot.stat().st_size > 10_000  # a real PNG was drawn


def test_simulate_benchmark_quick():
    out = run_quick("simulate.py")
    for heading in ("against theory", "measured on this CPU", "torchgpipe's published speed-ups"):
        assert heading in out, f"missing {heading!r}:\n{out[-2000:]}"
    assert "| False |" not in out  # every simulated bubble equals the theory exactly
