"""A local multi-process launcher for ``jax.distributed`` (like ``torchrun``), and its other half.

``python -m pipejax.launch --processes 2 --devices-per-process 2 script.py args...`` starts two
Python processes on this machine. Each process learns who it is from environment variables and
calls :func:`initialize` before any JAX computation; :func:`initialize` gives it its CPU devices
and joins it to the others through ``jax.distributed`` over loopback, with the gloo CPU
collectives. Together they then run one multi-controller JAX program: every process runs the same
script, a mesh may span the devices of all processes, and XLA collectives (``ppermute``,
``psum``) move data between processes.

The launcher owns the processes: it prefixes every output line with the process's index, stops
the others as soon as one fails (its exit code becomes the launcher's), stops all after
``--timeout`` seconds (exit code 124), and never leaves a process behind.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, NamedTuple

# The variables the launcher sets for each process and `initialize` reads.
COORDINATOR = "PIPEJAX_COORDINATOR"  # "host:port" of process 0's coordination service
NUM_PROCESSES = "PIPEJAX_NUM_PROCESSES"
PROCESS_ID = "PIPEJAX_PROCESS_ID"
DEVICES_PER_PROCESS = "PIPEJAX_DEVICES_PER_PROCESS"

TIMEOUT_EXIT_CODE = 124  # as coreutils' `timeout`
_HOST = "127.0.0.1"  # the launcher starts local processes only: loopback
_GRACE_S = 3.0  # after SIGTERM, how long a process may take to exit before SIGKILL
_POLL_S = 0.05


class ProcessInfo(NamedTuple):
    """Who this process is in a launched group; returned by :func:`initialize`."""

    process_id: int  # this process's index, 0 <= process_id < num_processes (jax.process_index())
    num_processes: int  # how many processes the launcher started (jax.process_count())
    coordinator: str  # "host:port" of the coordination service (run by process 0)
    devices_per_process: int  # CPU devices of this process (jax.local_device_count() on CPU)


# --- in each process ---------------------------------------------------------------------------


def initialize(*, initialization_timeout: int = 120) -> ProcessInfo:
    """Joins this process to the group :func:`launch` started: ``jax.distributed.initialize``.

    Reads the variables the launcher sets (``PIPEJAX_COORDINATOR``, ``PIPEJAX_NUM_PROCESSES``,
    ``PIPEJAX_PROCESS_ID``, ``PIPEJAX_DEVICES_PER_PROCESS``), gives this process its number of CPU
    devices (``jax_num_cpu_devices``), selects the gloo CPU collectives and calls
    ``jax.distributed.initialize``. Afterwards ``jax.devices()`` lists the devices of every
    process and ``jax.local_devices()`` this process's own. Call it once, at the top of the
    script, before any JAX computation (JAX fixes its devices at the first one).

    An uncaught exception then ends the process at once, with exit code 1, after printing its
    traceback: JAX's own exit handler would otherwise wait in a shutdown barrier for the other
    processes (which may be blocked in a collective waiting for this one), so the launcher
    would not see the failure for minutes. ``sys.exit(code)`` still passes through that
    barrier; raise an exception to fail fast.

    Args:
      initialization_timeout: seconds to wait for every process to join before failing.

    Returns:
      A :class:`ProcessInfo` ``(process_id, num_processes, coordinator, devices_per_process)``.

    Raises:
      RuntimeError: when the process was not started by the launcher (the variables are
        missing), or when JAX has already run a computation in this process.
      ValueError: when a variable holds something other than what the launcher writes.

    Examples:
      Outside the launcher there is nothing to join:

      >>> import os
      >>> from pipejax import launch
      >>> "PIPEJAX_COORDINATOR" in os.environ
      False
      >>> launch.initialize()
      Traceback (most recent call last):
        ...
      RuntimeError: pipejax.launch.initialize() found no PIPEJAX_COORDINATOR ...
    """
    info = _read_environment(os.environ)
    import jax  # imported here: the launcher process itself never configures or starts JAX

    try:
        jax.config.update("jax_num_cpu_devices", info.devices_per_process)
    except RuntimeError as err:  # JAX raises it once a computation has fixed the devices
        raise RuntimeError(
            "pipejax.launch.initialize() must run before any JAX computation in the process (JAX "
            f"fixes its devices at the first one), but JAX has already started: {err}\nCall it at "
            "the top of the script, right after the imports."
        ) from err
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host, port = info.coordinator.rsplit(":", 1)
    jax.distributed.initialize(
        info.coordinator,
        num_processes=info.num_processes,
        process_id=info.process_id,
        initialization_timeout=initialization_timeout,
        # A loopback coordinator listens on loopback only, not on every interface.
        coordinator_bind_address=f"{host}:{port}" if host in (_HOST, "localhost") else None,
    )
    sys.excepthook = _exit_at_once(sys.excepthook)
    return info


def _exit_at_once(print_traceback):
    """An excepthook that prints the traceback, then ends the process without exit handlers."""

    def hook(kind, value, traceback):
        print_traceback(kind, value, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    return hook


def _read_environment(env: Mapping[str, str]) -> ProcessInfo:
    if COORDINATOR not in env:
        raise RuntimeError(
            f"pipejax.launch.initialize() found no {COORDINATOR} in the environment, so this "
            "process was not started by the launcher. Start the script with "
            "`python -m pipejax.launch --processes 2 --devices-per-process 2 script.py`, or call "
            "`jax.distributed.initialize(...)` yourself."
        )

    def integer(name, least):
        raw = env.get(name)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = None
        if value is None or value < least:
            raise ValueError(
                f"The environment variable {name} is {raw!r}, but must be an integer >= {least}. "
                "It is set by `python -m pipejax.launch`; do not set it by hand."
            )
        return value

    num = integer(NUM_PROCESSES, 1)
    pid = integer(PROCESS_ID, 0)
    if pid >= num:
        raise ValueError(f"{PROCESS_ID} is {pid}, but must be below {NUM_PROCESSES} ({num}).")
    coordinator = env[COORDINATOR]
    if ":" not in coordinator:
        raise ValueError(f"{COORDINATOR} is {coordinator!r}, but must be 'host:port'.")
    return ProcessInfo(pid, num, coordinator, integer(DEVICES_PER_PROCESS, 1))


# --- the launcher ------------------------------------------------------------------------------


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int = 1,
    timeout: float | None = None,
    port: int | None = None,
    out: IO[str] | None = None,
) -> int:
    """Runs ``python *command`` in ``processes`` local processes that form one JAX program.

    Process ``i`` gets the environment variables :func:`initialize` reads (the coordinator
    ``127.0.0.1:port``, the number of processes, ``i``, the devices per process), plus
    ``JAX_NUM_CPU_DEVICES`` and ``JAX_PLATFORMS=cpu`` (unless already set) so it runs on CPU
    devices, and ``PYTHONUNBUFFERED=1`` so its lines arrive as it prints them. Its standard
    output and error are merged and every line is written to ``out`` as ``[i] line``.

    The call returns when every process has exited with 0 (it returns 0), when one exits with
    another code (the others are stopped at once and that code is returned; a process killed
    by signal ``k`` counts as ``128 + k``), or after ``timeout`` seconds (all are stopped and
    124 is returned). Stopping sends SIGTERM to each process's session, then SIGKILL 3 s later.

    Args:
      command: the arguments after ``python``: ``["script.py", *args]`` or ``["-m", "module",
        *args]``.
      processes: how many processes to start, ``>= 1``.
      devices_per_process: CPU devices each process gets, ``>= 1``.
      timeout: seconds after which every process is stopped; ``None`` waits for ever.
      port: the coordinator's port on 127.0.0.1; ``None`` picks a free one.
      out: where the prefixed lines go (a text stream); ``None`` is ``sys.stdout``.

    Returns:
      The exit code: 0, the first failing process's code, or 124 on timeout.

    Raises:
      TypeError, ValueError: for bad arguments, before any process starts.

    Examples:
      >>> from pipejax import launch
      >>> launch.launch(["-c", "import os; print('I am', os.environ['PIPEJAX_PROCESS_ID'])"], processes=1)
      [0] I am 0
      0
    """
    command = _check_command(command)
    _check_int(processes, "processes", "--processes")
    _check_int(devices_per_process, "devices_per_process", "--devices-per-process")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"`timeout` must be a number of seconds or None, but got {timeout!r}.")
        if not (0 < timeout < math.inf):
            raise ValueError(f"`timeout` must be a finite number of seconds > 0, but got {timeout!r}.")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 1 <= port <= 65535:
            raise ValueError(f"`port` must be an int in [1, 65535] or None (pick a free one), got {port!r}.")
    out = sys.stdout if out is None else out
    coordinator = f"{_HOST}:{_free_port() if port is None else int(port)}"
    group = _Group(out)
    try:
        for i in range(processes):
            group.start(
                i, [sys.executable, *command], _environment(i, processes, devices_per_process, coordinator)
            )
        return group.wait(timeout)
    finally:
        group.stop()


def _environment(i, processes, devices_per_process, coordinator) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            COORDINATOR: coordinator,
            NUM_PROCESSES: str(processes),
            PROCESS_ID: str(i),
            DEVICES_PER_PROCESS: str(devices_per_process),
            "JAX_NUM_CPU_DEVICES": str(devices_per_process),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _free_port() -> int:
    """A port nobody listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


class _Group:
    """The started processes, one output-forwarding thread each, and how to stop them."""

    def __init__(self, out: IO[str]):
        self.out = out
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []

    def start(self, i: int, argv: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopping it stops its children too
        )
        self.procs.append(proc)
        thread = threading.Thread(target=self._forward, args=(i, proc.stdout), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _forward(self, i: int, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self.lock:
                self.out.write(f"[{i}] {line}\n")
                self.out.flush()
        stream.close()

    def say(self, message: str) -> None:
        with self.lock:
            self.out.flush()
            print(f"pipejax.launch: {message}", file=sys.stderr, flush=True)

    def wait(self, timeout: float | None) -> int:
        """Waits for all to succeed, the first to fail, or the deadline; returns the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i, code = failed[0]
                    code = 128 - code if code < 0 else code  # killed by signal k: 128 + k
                    running = sum(c is None for c in codes)
                    rest = f"; stopping the {running} still running" if running else ""
                    self.say(f"process {i} exited with code {code}{rest}.")
                    return code
                if all(c == 0 for c in codes):
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    self.say(f"timed out after {timeout:g} s; stopping all processes.")
                    return TIMEOUT_EXIT_CODE
                time.sleep(_POLL_S)
        except KeyboardInterrupt:
            self.say("interrupted; stopping all processes.")
            return 130

    def stop(self) -> None:
        """Stops every process still running (SIGTERM, then SIGKILL) and drains their output."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            _signal_group(p, signal.SIGTERM)
        end = time.monotonic() + _GRACE_S
        for p in running:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)  # while unreaped, its pid still names its group
                p.wait()
        for t in self.threads:
            t.join(timeout=_GRACE_S)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the session started for this process: pgid == its pid
    except (ProcessLookupError, PermissionError):
        pass


# --- validation --------------------------------------------------------------------------------


def _check_int(value, name, flag) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` ({flag}) must be an int >= 1, but got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"`{name}` ({flag}) must be >= 1, but got {value}.")


def _check_command(command) -> list[str]:
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(
            "`command` must be a list of strings, the arguments after `python` "
            f"(e.g. ['script.py', '--flag']), but got {type(command).__name__} {command!r}."
        )
    if not command or not all(isinstance(c, str) for c in command):
        raise ValueError(
            "`command` must be a non-empty list of strings, the arguments after `python` "
            f"(e.g. ['script.py'] or ['-m', 'package.module']), but got {command!r}."
        )
    return list(command)


# --- the command line --------------------------------------------------------------------------


def _positive_int(flag):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, but got {text!r}")
        return value

    return parse


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"--timeout must be a number of seconds > 0, but got {text!r}")
    return value


def _port(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be an integer in [1, 65535], but got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipejax.launch",
        description=(
            "Run a JAX script in several local processes that form one multi-controller program "
            "(jax.distributed over loopback, gloo CPU collectives). The script calls "
            "pipejax.launch.initialize() before any JAX computation."
        ),
        epilog=(
            "Example: python -m pipejax.launch --processes 2 --devices-per-process 2 train.py --steps 10. "
            "Exit code: 0, the first failing process's code, or 124 on timeout."
        ),
    )
    add = parser.add_argument
    add(
        "--processes",
        "-n",
        metavar="N",
        type=_positive_int("--processes"),
        required=True,
        help="processes to start",
    )
    add(
        "--devices-per-process",
        "-d",
        metavar="K",
        type=_positive_int("--devices-per-process"),
        default=1,
        help="CPU devices per process (default: 1)",
    )
    add("--timeout", metavar="SECONDS", type=_seconds, help="stop all processes after this many seconds")
    add("--port", type=_port, help="coordinator port on 127.0.0.1 (default: a free one)")
    add("-m", dest="module", action="store_true", help="run the target as a module, like python -m")
    parser.add_argument("target", help="the script (or, with -m, the module) each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m pipejax.launch [options] script.py [args...]``.

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      The exit code of :func:`launch`. Bad options exit with code 2 and a message.

    Examples:
      >>> from pipejax import launch
      >>> launch.main(["--processes", "1", "-m", "json.tool", "--help"])  # doctest: +ELLIPSIS
      [0] usage: ...
      0
    """
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.module:
        command = ["-m", opts.target, *opts.args]
    else:
        if not os.path.isfile(opts.target):
            parser.error(
                f"the script {opts.target!r} does not exist (to run a module, pass -m {opts.target})"
            )
        command = [opts.target, *opts.args]
    return launch(
        command,
        processes=opts.processes,
        devices_per_process=opts.devices_per_process,
        timeout=opts.timeout,
        port=opts.port,
    )
