"""The benchmark script runs end to end (its --quick smoke mode); its numbers live in docs/."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import PATIENT_COLLECTIVES

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pipeline_benchmark_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the script sets its own device count
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in ("Bubble", "Memory", "Overhead", "Compile"):
        assert section in proc.stdout, f"missing section {section!r}:\n{proc.stdout[-2000:]}"


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    plot = tmp_path / "memory.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--quick", "--plot", str(plot)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("Compiled temp bytes", "Time per training step", "Memory growth"):
        assert heading in proc.stdout, f"missing {heading!r}:\n{proc.stdout[-2000:]}"
    assert plot.stat().st_size > 10_000  # a real PNG was drawn


@pytest.mark.slow
def test_hessian_benchmark_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the script sets its own device count
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hessian.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("HVP / grad", "Lanczos / m HVPs", "float32", "float64"):
        assert heading in proc.stdout, f"missing {heading!r}:\n{proc.stdout[-2000:]}"


@pytest.mark.slow
def test_invertible_benchmark_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the script sets its own device count
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "invertible.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("Memory and time against depth", "constant / linear time", "Reconstruction drift"):
        assert heading in proc.stdout, f"missing {heading!r}:\n{proc.stdout[-2000:]}"


def test_simulate_benchmark_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the script sets its own device count
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "simulate.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("against theory", "measured on this CPU", "torchgpipe's published speed-ups"):
        assert heading in proc.stdout, f"missing {heading!r}:\n{proc.stdout[-2000:]}"
    assert "| False |" not in proc.stdout  # every simulated bubble equals the theory exactly
