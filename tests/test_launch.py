"""The launcher (``pipejax.launch``) with scripts that fail: what it stops, reports and refuses.

Each test writes a small worker script into ``tmp_path`` and runs it through ``launch.launch``
(or ``launch.main``): a process that leaves a child behind, one that exits 0 before joining while
another waits in ``initialize()``, a coordinator port that is taken, ``initialize()`` after a JAX
computation, and ``sys.exit(3)`` while another process waits in a collective. The launcher's
``timeout`` bounds every test; the elapsed-time checks tell a prompt stop from a timeout (the
collective, initialization and shutdown timeouts are 30 s to 300 s). Then the launcher itself
is sent SIGINT, SIGTERM or SIGHUP, and given targets it must refuse with a message of its own.
"""

from __future__ import annotations

import io
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pipejax import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def this_checkout_on_the_path(monkeypatch):
    """The launched processes import this checkout's ``pipejax``, not another installed copy."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def running(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (ended, waiting for its parent or init to reap it) does not."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


LEAVES_A_CHILD = """
    import os, pathlib, subprocess, sys, time
    here, rank = pathlib.Path(sys.argv[1]), int(os.environ["PIPEJAX_PROCESS_ID"])

    def publish(name, value):  # atomically: the other process may be reading
        (here / f"{{name}}.tmp").write_text(str(value))
        (here / f"{{name}}.tmp").rename(here / name)

    child = subprocess.Popen(["sleep", "300"])  # in this process's group, holding its output pipe
    publish(f"child{{rank}}", child.pid)
    publish(f"worker{{rank}}", os.getpid())
    print(f"rank {{rank}} started a child", flush=True)
    if rank == 1:  # leaves last, once rank 0 has exited (a zombie until the launcher reaps it)
        deadline = time.monotonic() + 30
        while not (here / "worker0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        stat = pathlib.Path(f"/proc/{{(here / 'worker0').read_text()}}/stat")
        while stat.exists() and stat.read_text().split(") ")[1][0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit({code})
"""


@pytest.mark.parametrize("code", [0, 5])
def test_children_of_every_process_are_stopped_promptly(tmp_path, capfd, code):
    """Every process starts a child and exits (rank 1 last, with `code`): no child survives the
    launch, and the launch does not wait for the children's copies of the output pipe."""
    worker = script(tmp_path, LEAVES_A_CHILD.format(code=code))
    out = io.StringIO()
    start = time.monotonic()
    got = launch.launch([worker, str(tmp_path)], processes=2, timeout=60, out=out)
    elapsed = time.monotonic() - start
    assert got == code, out.getvalue()
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} started a child" in out.getvalue()
        assert not running(int((tmp_path / f"child{rank}").read_text())), f"the child of rank {rank} runs"
    # Before: 3 s more per process, waiting for the pipe that the child held open.
    assert elapsed < 5, elapsed
    if code:
        assert "pipejax.launch: process 1 exited with code 5." in capfd.readouterr().err


def test_a_process_that_leaves_before_joining_stops_the_group(tmp_path, capfd):
    """Process 1 exits 0 without calling initialize(): process 0 would wait there for 120 s."""
    worker = script(
        tmp_path,
        """
        import os
        if os.environ["PIPEJAX_PROCESS_ID"] == "1":
            print("process 1 leaves", flush=True)
            raise SystemExit(0)
        from pipejax import launch
        launch.initialize()  # waits for process 1 (for up to 120 s)
        print("unreachable", flush=True)
        """,
    )
    out = io.StringIO()
    start = time.monotonic()
    got = launch.launch([worker], processes=2, timeout=30, out=out)
    elapsed = time.monotonic() - start
    assert got == 1, out.getvalue()
    assert elapsed < 20, elapsed  # neither the 30 s launch timeout nor the 120 s one of initialize()
    assert "[1] process 1 leaves" in out.getvalue() and "unreachable" not in out.getvalue()
    err = capfd.readouterr().err
    assert (
        "pipejax.launch: process 1 exited with code 0 without joining the group (it did not call "
        "pipejax.launch.initialize(), or left before it returned), while process 0 waits for it in "
        "initialize(): the group cannot form; stopping the 1 still running." in err
    ), err


def test_a_port_in_use_is_refused_with_the_fix(tmp_path, monkeypatch):
    """JAX's coordination service fails on a taken port with a raw error (or a crash)."""
    worker = script(tmp_path, "print('unreachable')")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError) as err:
            launch.launch([worker], processes=2, port=port)
        assert f"`port` (--port) is {port}, but 127.0.0.1:{port} is already in use" in str(err.value)
        assert "leave --port out so that the launcher picks one" in str(err.value)
        # Process 0 checks again before it starts the service: the port may be taken meanwhile.
        monkeypatch.setenv("PIPEJAX_COORDINATOR", f"127.0.0.1:{port}")
        for name, value in [("NUM_PROCESSES", "2"), ("PROCESS_ID", "0"), ("DEVICES_PER_PROCESS", "1")]:
            monkeypatch.setenv(f"PIPEJAX_{name}", value)
        with pytest.raises(RuntimeError, match=rf"process 0 cannot start .* 127\.0\.0\.1:{port}: the port"):
            launch.initialize()


def test_command_line_names_the_port_in_use(capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            launch.main(["-n", "2", "--port", str(port), "-m", "json.tool"])
    assert exited.value.code == 2
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in capsys.readouterr().err


def test_initialize_after_a_computation_gives_pipejax_message(tmp_path):
    """Under the launcher JAX_NUM_CPU_DEVICES already holds the device count, so setting it again
    does not fail: initialize() must still see that JAX has started."""
    worker = script(
        tmp_path,
        """
        import jax.numpy as jnp
        print("sum", jnp.ones(2).sum(), flush=True)  # JAX starts its backends here
        from pipejax import launch
        launch.initialize()
        """,
    )
    out = io.StringIO()
    got = launch.launch([worker], processes=1, devices_per_process=2, timeout=60, out=out)
    assert got == 1, out.getvalue()
    assert "[0] sum 2.0" in out.getvalue()
    message = "[0] RuntimeError: pipejax.launch.initialize() must run before any JAX computation"
    assert message in out.getvalue(), out.getvalue()


def test_exit_code_of_a_process_leaving_during_a_collective(tmp_path, capfd):
    """Process 1 calls sys.exit(3) while process 0 waits for it in a collective: the launch
    fails with 3 at once (not 1 from process 0 when the collective times out), and process 1's
    `finally` block still runs."""
    worker = script(
        tmp_path,
        """
        import sys, time
        from pipejax import launch
        info = launch.initialize()
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec
        if info.process_id == 1:
            try:
                time.sleep(1)  # process 0 is in the collective by now
                sys.exit(3)
            finally:
                print("process 1 cleans up", flush=True)
        mesh = jax.make_mesh((2,), ("d",))
        x = jax.device_put(jnp.ones(2), NamedSharding(mesh, PartitionSpec("d")))
        print("unreachable", jax.jit(jnp.sum)(x), flush=True)  # a sum over both processes
        """,
    )
    out = io.StringIO()
    start = time.monotonic()
    got = launch.launch([worker], processes=2, timeout=60, out=out)
    elapsed = time.monotonic() - start
    assert got == 3, out.getvalue()
    assert elapsed < 25, elapsed  # the tests' collective timeout is 300 s (conftest.py)
    assert "[1] process 1 cleans up" in out.getvalue() and "unreachable" not in out.getvalue()
    err = capfd.readouterr().err
    assert "pipejax.launch: process 1 exited with code 3; stopping the 1 still running." in err, err


WAITS_WITH_A_CHILD = """
    import os, pathlib, subprocess, sys, time
    here, rank = pathlib.Path(sys.argv[1]), os.environ["PIPEJAX_PROCESS_ID"]
    child = subprocess.Popen(["sleep", "300"])  # in this process's group
    for name, pid in [(f"child{rank}", child.pid), (f"worker{rank}", os.getpid())]:
        (here / f"{name}.tmp").write_text(str(pid))  # atomically: the test may be reading
        (here / f"{name}.tmp").rename(here / name)
    print(f"rank {rank} waits", flush=True)
    time.sleep(300)
"""


def default_signal_actions():
    """In the launcher's process before it starts: SIGINT and SIGHUP as in a terminal's foreground
    job (a shell without job control starts background jobs with SIGINT ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_process(tmp_path, sig):
    """Ctrl-C sends SIGINT, a job scheduler stops a job with SIGTERM, a closed terminal sends
    SIGHUP. The processes run in sessions of their own, so the signal reaches the launcher
    only: it must stop them and their children, and exit with 128 + the signal's number
    (before, SIGTERM and SIGHUP ended the launcher alone, with -15 and -1, and left all four
    running)."""
    worker = script(tmp_path, WAITS_WITH_A_CHILD)
    argv = [sys.executable, "-m", "pipejax.launch", "-n", "2", "--timeout", "120", worker, str(tmp_path)]
    names = [f"{kind}{rank}" for kind in ("worker", "child") for rank in (0, 1)]
    launcher = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal goes to the launcher alone, as from a scheduler
        preexec_fn=default_signal_actions,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / name).exists() for name in names):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.02)
        start = time.monotonic()
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - start
        assert launcher.returncode == 128 + sig, (launcher.returncode, out, err)
        assert f"pipejax.launch: received {sig.name}; stopping all processes." in err, err
        assert "[0] rank 0 waits" in out and "[1] rank 1 waits" in out, out
        for name in names:
            assert not running(int((tmp_path / name).read_text())), f"{name} runs"
        assert elapsed < 10, elapsed  # SIGTERM ends these at once; 3 s grace at most before SIGKILL
    finally:  # whatever failed, leave nothing behind
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        for name in names:
            if (tmp_path / name).exists() and running(pid := int((tmp_path / name).read_text())):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """A current directory holding a script, a script in a folder, a folder without __main__.py,
    a folder with one, and a named pipe."""
    monkeypatch.chdir(tmp_path)
    pathlib.Path("train.py").write_text("print('train')")
    pathlib.Path("tools").mkdir()
    pathlib.Path("tools/train.py").write_text("print('tools/train')")
    pathlib.Path("app").mkdir()
    pathlib.Path("app/__main__.py").write_text("print('app/__main__')")
    os.mkfifo("pipe")
    return tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["-m", ""],
            "-m '': the module name is empty; pass the module each process runs, as to `python -m` "
            "(e.g. -m package.train), or leave out -m and pass a script file",
        ),
        (["-m", " "], "-m ' ': the module name is empty; pass the module each process runs"),
        (
            ["-m", "tools/train"],
            "-m 'tools/train': a module name is dotted names without spaces or '/', like "
            "package.module (python imports it from its path; it does not open a file): pass -m "
            "tools.train, or leave out -m to run a script file",
        ),
        (
            ["-m", "tools/train.py"],
            "-m 'tools/train.py': 'tools/train.py' is a script file, not a module name: leave out -m "
            "to run it (python -m pipejax.launch -n 2 tools/train.py), or pass -m tools.train",
        ),
        (["-m", "train.py"], "-m 'train.py': 'train.py' is a script file, not a module name: leave out -m"),
        (["-m", "my package"], "-m 'my package': a module name is dotted names without spaces or '/'"),
        (["-m", ".train"], "-m '.train': a module name is dotted names without spaces or '/', like"),
        (["-m"], "-m needs a module name after it (e.g. -m package.train)"),
        ([], "no script given: pass the script each process runs (python -m pipejax.launch -n 2 train.py)"),
        (
            ["tools"],
            "the script 'tools' is a directory, and python runs a directory only if it holds a "
            "__main__.py: pass a script file (e.g. tools/train.py), or add tools/__main__.py",
        ),
        ([""], "the script '' is an empty name: pass the path of a script file, or -m and a module name"),
        (
            ["pipe"],
            "the script 'pipe' is not a file but a pipe, a device or a socket: each of the processes "
            "reads the script, so pass a file",
        ),
        (["trian.py"], "the script 'trian.py' does not exist (in the current directory "),
        (["trainer"], "the script 'trainer' does not exist (in the current directory "),
    ],
    ids=[
        "empty-module",
        "blank-module",
        "module-path",
        "module-script-path",
        "module-script",
        "module-space",
        "module-relative",
        "m-alone",
        "no-target",
        "directory",
        "empty-script",
        "pipe",
        "missing-script",
        "missing-module-like",
    ],
)
def test_bad_targets_exit_2_with_pipejax_message(targets, argv, message, capsys):
    """Before, the module names reached python in every process ("No module named "), a
    directory was said not to exist, and no target at all named `args` as missing."""
    with pytest.raises(SystemExit) as exited:
        launch.main(["-n", "2", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize(
    "target, fix",
    [("trian.py", "; pass the path of a script file"), ("trainer", "; to run a module, pass -m trainer")],
)
def test_missing_script_suggests_m_only_for_a_module_name(targets, capsys, target, fix):
    """Before, `trian.py` got the fix `pass -m trian.py`, which python cannot run either."""
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", target])
    err = capsys.readouterr().err
    assert f"the script {target!r} does not exist (in the current directory {targets}){fix}\n" in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_unreadable_script_exits_2_with_pipejax_message(targets, capsys):
    os.chmod("train.py", 0)
    with pytest.raises(SystemExit) as exited:
        launch.main(["-n", "2", "train.py"])
    assert exited.value.code == 2
    assert (
        "the script 'train.py' cannot be read (permission denied): make it readable"
        in capsys.readouterr().err
    )


def test_a_directory_with_main_runs_as_python_runs_it(targets, capfd):
    """`python app` runs app/__main__.py: the launcher accepts what python accepts."""
    assert launch.main(["-n", "1", "--timeout", "60", "app"]) == 0
    assert "[0] app/__main__" in capfd.readouterr().out


@pytest.mark.parametrize(
    "command, message",
    [
        (["-m"], "`command` is ['-m'], but -m needs a module name after it (e.g. ['-m', 'package.train'])"),
        (["-m", ""], "`command` is ['-m', ''], but -m '': the module name is empty"),
        (["-m", "a/b", "x"], "`command` is ['-m', 'a/b', 'x'], but -m 'a/b': a module name is dotted"),
    ],
)
def test_launch_refuses_a_bad_module_before_starting(command, message):
    with pytest.raises(ValueError) as err:
        launch.launch(command, processes=2)
    assert message in str(err.value)


@pytest.mark.parametrize("out", ["x", io.BytesIO()])
def test_out_must_be_a_text_stream(out):
    # Refused before any process starts (a str once failed inside the launch, a bytes stream on
    # the first line written).
    with pytest.raises(
        TypeError, match=r"`out` must be a text stream \(with `write` and `flush`.*but got (str 'x'|BytesIO)"
    ):
        launch.launch(["-c", "print(1)"], processes=1, out=out)
