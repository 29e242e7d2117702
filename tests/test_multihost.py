"""Multi-process JAX: the launcher (``pipejax.launch``) and a pipeline whose mesh spans processes.

The pipeline test starts 2 processes x 2 CPU devices with ``python -m pipejax.launch`` and runs
``tests/multihost_worker.py`` in both: a 4-stage pipeline (heterogeneous, then homogeneous
stages) whose outputs and gradients every process checks against the composed stages. The other
tests run small plain-Python scripts through the launcher to check what it promises: the
environment each process gets, prefixed output, the first failure's exit code and output, prompt
stopping of the other processes, the timeout, and clear errors for bad options.
"""

from __future__ import annotations

import io
import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from pipejax import launch
from tests.conftest import PATIENT_COLLECTIVES, without_compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pipeline_across_two_processes():
    """4 stages on 2 processes x 2 CPU devices: outputs and gradients equal the composition."""
    env = without_compilation_cache(dict(os.environ, PYTHONPATH=str(ROOT)))  # (several processes)
    argv = [sys.executable, "-m", "pipejax.launch", "--processes", "2", "--devices-per-process", "2"]
    argv += ["--timeout", "240", str(ROOT / "tests" / "multihost_worker.py")]
    # The launcher's own --timeout stops the workers; this one guards against a hung launcher.
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False, cwd=ROOT)
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    for i in (0, 1):
        checks = ("outputs", "gradient wrt params", "gradient wrt x", "homogeneous gradients")
        for check in (*checks, "data x pipeline outputs", "data x pipeline gradients"):
            assert f"[{i}] {check}: matches the composition" in proc.stdout, output
        assert f"[{i}] process {i}: all checks passed" in proc.stdout, output


def test_3d_mesh_pipeline_on_two_processes_equals_one():
    """examples/pipeline_3d_mesh.py: a (data, stage, model) = 2 x 2 x 2 mesh with tensor-parallel
    stages, on 2 processes x 4 CPU devices and in 1 process of 8: the same loss and gradients."""
    env = without_compilation_cache(dict(os.environ, PYTHONPATH=str(ROOT)))  # (several processes)
    script = str(ROOT / "examples" / "pipeline_3d_mesh.py")
    argv = [sys.executable, "-m", "pipejax.launch", "--processes", "2", "--devices-per-process", "4"]
    argv += ["--timeout", "240", script, "--sharding", "tensor"]
    two = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False, cwd=ROOT)
    assert two.returncode == 0, two.stdout[-6000:] + two.stderr[-3000:]
    env_one = dict(env, XLA_FLAGS=PATIENT_COLLECTIVES)
    one = subprocess.run(
        [sys.executable, script, "--sharding", "tensor"],
        capture_output=True,
        text=True,
        env=env_one,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    assert ": ok" in one.stdout and "parameter bytes per device: 16640 (one whole stage: 33024)" in one.stdout
    single = {
        line.split(":")[0]: line
        for line in one.stdout.splitlines()
        if line.startswith(("sharding=", "gradient"))
    }
    assert len(single) == 2, one.stdout
    for i in (0, 1):
        for line in single.values():
            assert f"[{i}] {line}" in two.stdout, (line, two.stdout)
        assert f"[{i}] max |grad - composed grad|" in two.stdout and ": ok" in two.stdout


def test_docs_script_trains_the_same_on_two_processes_as_on_one(tmp_path):
    """The training script of docs/multihost.md, on 2 processes x 2 devices and in 1 process."""
    source = "\n".join(re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "multihost.md").read_text(), re.S))
    path = tmp_path / "train.py"
    path.write_text(source)
    env = without_compilation_cache(dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the script sets its own device count
    run = lambda argv: subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    launched = run(
        [sys.executable, "-m", "pipejax.launch", "-n", "2", "-d", "2", "--timeout", "240", str(path)]
    )
    single = run([sys.executable, str(path)])
    for proc in (launched, single):
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    for i in (0, 1):
        assert f"[{i}] process {i}: the trained pipeline equals the composed stages" in launched.stdout
    losses = [
        [float(v) for v in re.search(r"losses ([\d. ]+)", p.stdout)[1].split()] for p in (launched, single)
    ]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-3)  # printed with 4 decimals


def script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_environment_and_prefixed_output(tmp_path):
    worker = script(
        tmp_path,
        """
        import os, sys
        e = os.environ
        print("id", e["PIPEJAX_PROCESS_ID"], "of", e["PIPEJAX_NUM_PROCESSES"], "devices",
              e["PIPEJAX_DEVICES_PER_PROCESS"], e["JAX_NUM_CPU_DEVICES"], "coordinator",
              e["PIPEJAX_COORDINATOR"], "args", sys.argv[1:])
        print("to stderr", file=sys.stderr)
        """,
    )
    out = io.StringIO()
    argv = [worker, "--processes", "9"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a port free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = launch.launch(argv, processes=3, devices_per_process=2, port=port, out=out)
    assert code == 0
    lines = out.getvalue().splitlines()
    for i in range(3):
        line = f"[{i}] id {i} of 3 devices 2 2 coordinator 127.0.0.1:{port} args ['--processes', '9']"
        assert line in lines, lines
        assert f"[{i}] to stderr" in lines, lines
    assert len(lines) == 6, lines


def test_command_line_passes_script_options_through(tmp_path, capfd):
    worker = script(tmp_path, "import sys; print(sys.argv[1:])")
    code = launch.main(["--processes", "1", "--timeout", "30", worker, "--processes", "-m", "x"])
    assert code == 0
    assert "[0] ['--processes', '-m', 'x']" in capfd.readouterr().out


FAILING = """
    import os, pathlib, sys, time
    rank = int(os.environ["PIPEJAX_PROCESS_ID"])
    here = pathlib.Path(sys.argv[1])
    if rank == 1:  # fails once the others are up and waiting
        deadline = time.monotonic() + 30
        while not all((here / f"pid{{r}}").exists() for r in (0, 2)) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("rank 1 is about to fail", flush=True)
        {fail}
    (here / f"pid{{rank}}.tmp").write_text(str(os.getpid()))
    (here / f"pid{{rank}}.tmp").rename(here / f"pid{{rank}}")
    print(f"rank {{rank}} waits", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize(
    "fail, code, message",
    [
        ("raise ValueError('boom from rank 1')", 1, "[1] ValueError: boom from rank 1"),
        ("sys.exit(3)", 3, "[1] rank 1 is about to fail"),
        ("os.kill(os.getpid(), 9)", 128 + 9, "[1] rank 1 is about to fail"),
    ],
)
def test_first_failure_stops_the_others(tmp_path, capfd, fail, code, message):
    worker = script(tmp_path, FAILING.format(fail=fail))
    out = io.StringIO()
    start = time.monotonic()
    got = launch.launch([worker, str(tmp_path)], processes=3, timeout=120, out=out)
    elapsed = time.monotonic() - start
    assert got == code, out.getvalue()
    assert elapsed < 30, elapsed  # not the 60 s the others sleep, nor the 120 s timeout
    assert message in out.getvalue()
    assert "[0] rank 0 waits" in out.getvalue() and "[2] rank 2 waits" in out.getvalue()
    assert f"process 1 exited with code {code}; stopping the 2 still running" in capfd.readouterr().err
    for rank in (0, 2):  # nothing left behind
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_jax_process_that_raises_fails_the_launch_at_once(tmp_path, capfd, monkeypatch):
    """After `initialize`, an exception ends its process at once (no shutdown barrier), while
    the other process waits in a collective for it: the launcher must not wait for gloo's 30 s
    timeout or JAX's 300 s shutdown timeout."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the processes import this checkout's pipejax
    worker = script(
        tmp_path,
        """
        from pipejax import launch
        info = launch.initialize()
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec
        if info.process_id == 1:
            raise RuntimeError("process 1 fails before the collective")
        mesh = jax.make_mesh((2,), ("d",))
        x = jax.device_put(jnp.ones(2), NamedSharding(mesh, PartitionSpec("d")))  # a collective
        print("unreachable", jax.jit(jnp.sum)(x))
        """,
    )
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch([worker], processes=2, timeout=120, out=out)
    assert code == 1, out.getvalue()
    assert time.monotonic() - start < 25, out.getvalue()
    assert "[1] RuntimeError: process 1 fails before the collective" in out.getvalue()
    assert "unreachable" not in out.getvalue()


def test_timeout_stops_everything(tmp_path, capfd):
    worker = script(tmp_path, "import time; print('started', flush=True); time.sleep(60)")
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch([worker], processes=2, timeout=1.5, out=out)
    assert code == 124
    assert time.monotonic() - start < 20
    assert "timed out after 1.5 s" in capfd.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--processes", "0", "x.py"], "--processes must be an integer >= 1, but got '0'"),
        (["--processes", "two", "x.py"], "--processes must be an integer >= 1, but got 'two'"),
        (["--processes", "2", "--devices-per-process", "-1", "x.py"], "--devices-per-process must be"),
        (["--processes", "2", "--timeout", "0", "x.py"], "--timeout must be a number of seconds > 0"),
        (["--processes", "2", "--port", "70000", "x.py"], "--port must be an integer in [1, 65535]"),
        (["--processes", "2", "no_such_script.py"], "the script 'no_such_script.py' does not exist"),
        (["no_such_script.py"], "the following arguments are required: --processes"),
    ],
)
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        launch.main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"command": "x.py"}, TypeError, "`command` must be a list of strings"),
        ({"command": []}, ValueError, "`command` must be a non-empty list"),
        ({"processes": 0}, ValueError, "`processes` (--processes) must be >= 1, but got 0"),
        ({"processes": 2.0}, TypeError, "`processes` (--processes) must be an int >= 1, but got float"),
        ({"devices_per_process": True}, TypeError, "`devices_per_process` (--devices-per-process)"),
        ({"timeout": -1}, ValueError, "`timeout` must be a finite number of seconds > 0"),
        ({"timeout": "10"}, TypeError, "`timeout` must be a number of seconds or None"),
        ({"port": 0}, ValueError, "`port` must be an int in [1, 65535]"),
    ],
)
def test_bad_arguments_raise_before_starting(kwargs, error, message):
    args = {"command": ["-c", "pass"], "processes": 2} | kwargs
    with pytest.raises(error) as err:
        launch.launch(**args)
    assert message in str(err.value)


def test_initialize_reads_the_launcher_environment(monkeypatch):
    for name in ("PIPEJAX_COORDINATOR", "PIPEJAX_NUM_PROCESSES", "PIPEJAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"found no PIPEJAX_COORDINATOR.*python -m pipejax\.launch"):
        launch.initialize()
    monkeypatch.setenv("PIPEJAX_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("PIPEJAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("PIPEJAX_DEVICES_PER_PROCESS", "2")
    monkeypatch.setenv("PIPEJAX_PROCESS_ID", "two")
    with pytest.raises(ValueError, match="PIPEJAX_PROCESS_ID is 'two', but must be an integer >= 0"):
        launch.initialize()
    monkeypatch.setenv("PIPEJAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="PIPEJAX_PROCESS_ID is 2, but must be below"):
        launch.initialize()
    monkeypatch.setenv("PIPEJAX_PROCESS_ID", "1")
    jax.devices()  # JAX has started in this process: too late to join a group
    with pytest.raises(RuntimeError, match="must run before any JAX computation"):
        launch.initialize()
