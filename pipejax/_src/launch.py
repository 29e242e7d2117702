"""A local multi-process launcher for ``jax.distributed`` (like ``torchrun``), and its other half.

``python -m pipejax.launch --processes 2 --devices-per-process 2 script.py args...`` starts two
Python processes on this machine. Each process learns who it is from environment variables and
calls :func:`initialize` before any JAX computation; :func:`initialize` gives it its CPU devices
and joins it to the others through ``jax.distributed`` over loopback, with the gloo CPU
collectives. Together they then run one multi-controller JAX program: every process runs the same
script, a mesh may span the devices of all processes, and XLA collectives (``ppermute``,
``psum``) move data between processes.

The launcher owns the processes: it prefixes every output line with the process's index, stops
the others as soon as one fails (its exit code becomes the launcher's) or leaves without joining
while the others wait to, stops all after ``--timeout`` seconds (exit code 124) or when it is sent
SIGINT, SIGTERM or SIGHUP (exit code 128 + the signal's number: 130, 143, 129), and ends every
process group when it returns, so that no child of any process is left behind.
"""

from __future__ import annotations

import argparse
import atexit
import io
import math
import numbers
import os
import pathlib
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, NamedTuple

# The variables the launcher sets for each process and `initialize` reads.
COORDINATOR = "PIPEJAX_COORDINATOR"  # "host:port" of process 0's coordination service
NUM_PROCESSES = "PIPEJAX_NUM_PROCESSES"
PROCESS_ID = "PIPEJAX_PROCESS_ID"
DEVICES_PER_PROCESS = "PIPEJAX_DEVICES_PER_PROCESS"
LAUNCH_DIR = "PIPEJAX_LAUNCH_DIR"  # a folder where `initialize` marks how far each process got

TIMEOUT_EXIT_CODE = 124  # as coreutils' `timeout`
# The most processes one launcher starts: each is a whole JAX runtime on this machine (a launch
# of thousands is a typo, and forks faster than it can be stopped); more hosts: jax.distributed.
MAX_PROCESSES = 256
# Signals that stop the launch: Ctrl-C, a job scheduler's stop, a closed terminal.
_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_HOST = "127.0.0.1"  # the launcher starts local processes only: loopback
_GRACE_S = 3.0  # after SIGTERM, how long a process may take to exit before SIGKILL
_POLL_S = 0.05  # the longest the wait loop sleeps
_STOP_POLL_S = 0.02
_DRAIN_S = 0.2  # after all processes have ended, how long to wait for a pipe's end


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

    Afterwards a failure ends the process without JAX's exit handler, which would wait in a
    shutdown barrier for the other processes (they may be blocked in a collective waiting for
    this one, so the launcher would not see the failure until a timeout fires, 30 s to
    minutes): an uncaught exception prints its traceback and ends the process at once with exit
    code 1; ``sys.exit(code)`` with ``code != 0`` unwinds as usual (``finally`` blocks run) and
    then ends the process with ``code``, skipping the barrier. ``sys.exit()``, ``sys.exit(0)``
    and the end of the script pass through the barrier, so that process 0, which runs the
    coordination service, outlives the others.

    Args:
      initialization_timeout: seconds to wait for every process to join before failing.

    Returns:
      A :class:`ProcessInfo` ``(process_id, num_processes, coordinator, devices_per_process)``.

    Raises:
      RuntimeError: when the process was not started by the launcher (the variables are
        missing), when JAX has already started its backends in this process (a computation,
        ``jax.devices()``), or, in process 0, when the coordinator's port is taken.
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
    host, port = info.coordinator.rsplit(":", 1)
    local = host in (_HOST, "localhost")  # a loopback coordinator listens on loopback only
    if info.process_id == 0 and local:
        _check_port_is_free(host, int(port))
    import jax  # imported here: the launcher process itself never configures or starts JAX

    if _backends_started(jax):
        raise RuntimeError(
            "pipejax.launch.initialize() must run before any JAX computation in the process, but "
            "JAX has already started its backends here (a computation, jax.devices() or "
            "jax.device_put ran before it): JAX fixes its devices then, and "
            "jax.distributed.initialize() can no longer join the other processes. Call "
            "initialize() at the top of the script, right after the imports."
        )
    jax.config.update("jax_num_cpu_devices", info.devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _tell_launcher(info.process_id, "joining")
    jax.distributed.initialize(
        info.coordinator,
        num_processes=info.num_processes,
        process_id=info.process_id,
        initialization_timeout=initialization_timeout,
        coordinator_bind_address=info.coordinator if local else None,
    )
    _tell_launcher(info.process_id, "joined")
    sys.excepthook = _exit_at_once(sys.excepthook)
    sys.exit, skip_barrier = _remember_failing_exit(sys.exit)
    atexit.register(skip_barrier)  # runs before JAX's handler, which was registered earlier
    return info


def _backends_started(jax) -> bool:
    """Whether JAX has started its backends in this process (they fix the devices).

    ``jax_num_cpu_devices`` may change only until then, but JAX accepts setting the value it
    already has at any time (under the launcher, ``JAX_NUM_CPU_DEVICES`` already holds it), so
    try a different value, and put the old one back.
    """
    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", current + 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


def _check_port_is_free(host: str, port: int) -> None:
    """Raises a clear error where JAX's coordination service would fail (or crash) on a taken port."""
    err = _port_taken(host, port)
    if err is not None:
        raise RuntimeError(
            f"pipejax.launch.initialize(): process 0 cannot start JAX's coordination service on "
            f"{host}:{port}: the port is already in use ({err.strerror}). If you passed `--port "
            f"{port}`, pass a free port or leave --port out (the launcher then picks a free one); "
            "otherwise another program took the port the launcher picked: start again."
        )


def _port_taken(host: str, port: int) -> OSError | None:
    """The error binding ``host:port`` gives, or None where the port is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: ignores TIME_WAIT
        try:
            s.bind((host, port))
        except OSError as err:
            return err
    return None


def _tell_launcher(process_id: int, stage: str) -> None:
    """Leaves a mark in the launcher's directory: how far this process got in `initialize`."""
    folder = os.environ.get(LAUNCH_DIR)
    if folder:
        try:
            pathlib.Path(folder, f"{process_id}.{stage}").touch()
        except OSError:  # the launcher has gone (and removed it): nobody to tell
            pass


def _exit_at_once(print_traceback):
    """An excepthook that prints the traceback, then ends the process without exit handlers."""

    def hook(kind, value, traceback):
        print_traceback(kind, value, traceback)
        _flush()
        os._exit(1)

    return hook


def _remember_failing_exit(original_exit):
    """A ``sys.exit`` that remembers a failing code, and an exit handler that exits with it.

    ``sys.exit`` raises ``SystemExit`` as before (``finally`` blocks run), but Python keeps no
    record of the code for exit handlers: the new ``sys.exit`` keeps it, and the handler, run
    before JAX's, ends the process with it before JAX's shutdown barrier. Only the main thread's
    calls count (``sys.exit`` in another thread ends that thread only).
    """
    failing = []

    def exit(status=None):
        if threading.current_thread() is threading.main_thread():
            code = 0 if status is None else status & 0xFF if isinstance(status, int) else 1
            failing[:] = [code] if code else []
        original_exit(status)

    def skip_barrier():
        if failing:
            _flush()
            os._exit(failing[0])

    return exit, skip_barrier


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass


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
    by signal ``k`` counts as ``128 + k``), when one exits with 0 without joining the group
    while another waits for it in :func:`initialize` (the others are stopped, 1 is returned), or
    after ``timeout`` seconds (all are stopped and 124 is returned), or when SIGINT, SIGTERM or
    SIGHUP is sent to the launcher (all are stopped and ``128 + k`` is returned for signal ``k``:
    130, 143, 129). In every case it then ends the process group of every process, those that
    have exited too, so that no child a process started is left running: SIGTERM, then SIGKILL
    to what is left 3 s later (at once to a process that joined JAX's group: JAX catches
    SIGTERM).

    The processes run in sessions of their own, so a signal sent to the launcher (Ctrl-C, a job
    scheduler's SIGTERM, a closed terminal's SIGHUP) reaches it alone; while the call runs in the
    main thread it handles those three itself, except one that already has a handler of your own
    or is ignored (``nohup`` ignores SIGHUP), and puts the previous handlers back when it returns.

    Args:
      command: the arguments after ``python``: ``["script.py", *args]`` or ``["-m", "module",
        *args]``.
      processes: how many processes to start, ``>= 1``.
      devices_per_process: CPU devices each process gets, ``>= 1``.
      timeout: seconds after which every process is stopped; ``None`` waits for ever.
      port: the coordinator's port on 127.0.0.1; ``None`` picks a free one.
      out: where the prefixed lines go (a text stream); ``None`` is ``sys.stdout``.

    Returns:
      The exit code: 0, the first failing process's code, 124 on timeout, or ``128 + k`` when
      signal ``k`` stopped the launch.

    Raises:
      TypeError, ValueError: for bad arguments (a ``port`` in use too, a bad module after
        ``"-m"``), before any process starts.

    Examples:
      >>> from pipejax import launch
      >>> launch.launch(["-c", "import os; print('I am', os.environ['PIPEJAX_PROCESS_ID'])"], processes=1)
      [0] I am 0
      0
    """
    command = _check_command(command)
    _check_int(processes, "processes", "--processes")
    if processes > MAX_PROCESSES:
        raise ValueError(_too_many(processes))
    _check_int(devices_per_process, "devices_per_process", "--devices-per-process")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"`timeout` must be a number of seconds or None, but got {timeout!r}.")
        if not (0 < timeout < math.inf):
            raise ValueError(f"`timeout` must be a finite number of seconds > 0, but got {timeout!r}.")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 1 <= port <= 65535:
            raise ValueError(f"`port` must be an int in [1, 65535] or None (pick a free one), got {port!r}.")
        err = _port_taken(_HOST, int(port))
        if err is not None:
            raise ValueError(
                f"`port` (--port) is {port}, but {_HOST}:{port} is already in use ({err.strerror}), so "
                "process 0 could not start JAX's coordination service there. Pass a free port, or "
                "leave --port out so that the launcher picks one."
            )
    text = callable(getattr(out, "write", None)) and callable(getattr(out, "flush", None))
    if out is not None and (not text or isinstance(out, io.RawIOBase | io.BufferedIOBase)):
        raise TypeError(
            f"`out` must be a text stream (with `write` and `flush`, e.g. `sys.stdout` or an "
            f"`io.StringIO()`) or None for sys.stdout, but got {type(out).__name__} {out!r}; to write "
            "to a file, pass `open(path, 'w')`."
        )
    out = sys.stdout if out is None else out
    coordinator = f"{_HOST}:{_free_port() if port is None else int(port)}"
    folder = pathlib.Path(tempfile.mkdtemp(prefix="pipejax-launch-"))
    group = _Group(out, folder)
    with _Signals() as signals:  # until `stop` has ended every group: it must not be interrupted
        try:
            for i in range(processes):
                if signals.received is not None:  # stopped while starting: start no more
                    break
                env = _environment(i, processes, devices_per_process, coordinator, folder)
                group.start(i, [sys.executable, *command], env)
            return group.wait(timeout, signals)
        finally:
            group.stop()
            shutil.rmtree(folder, ignore_errors=True)


def _environment(i, processes, devices_per_process, coordinator, folder) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            COORDINATOR: coordinator,
            LAUNCH_DIR: str(folder),
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


class _Signals:
    """Records SIGINT, SIGTERM and SIGHUP for :meth:`_Group.wait`, instead of acting on them at once.

    The processes run in sessions of their own, so a signal sent to the launcher reaches it
    alone, and its default action (ending the launcher, or ``KeyboardInterrupt`` anywhere in it)
    would leave them running. The handler only records the first signal: ``wait`` sees it
    within ``_POLL_S`` and returns ``128 + k``, and ``stop`` then ends every group without being
    interrupted (a later signal is ignored: the processes are being stopped already). A signal
    with a handler of the caller's own, or ignored (``nohup`` ignores SIGHUP), is left as it is;
    outside the main thread, where Python sets no handlers, all are.
    """

    def __init__(self):
        self.received: int | None = None  # the first stop signal's number, once one came
        self.previous: dict[int, object] = {}  # the handlers to put back, by signal

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for name in _STOP_SIGNALS:
                sig = getattr(signal, name, None)  # Windows has no SIGHUP
                if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                    self.previous[sig] = signal.signal(sig, self.record)
        return self

    def record(self, sig, frame) -> None:
        if self.received is None:
            self.received = sig

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class _Group:
    """The started processes: their output, their exits, and how to stop them and their children.

    One loop, in the calling thread, forwards the output and notices exits: ``selectors`` wakes
    it when a process writes, or (where ``os.pidfd_open`` exists) ends, and at least every
    ``_POLL_S`` seconds. A process that has exited is not reaped until :meth:`stop` (``waitid``
    with ``WNOWAIT`` reads its code): until then its pid cannot be reused, so it still names the
    process group of the children the process left behind, and ``stop`` can end them.
    """

    def __init__(self, out: IO[str], folder: pathlib.Path):
        self.out = out
        self.folder = folder  # where `initialize` marks how far each process got
        self.procs: list[subprocess.Popen] = []
        self.codes: dict[int, int] = {}  # exit codes seen so far (128 + k for signal k), by index
        self.partial: dict[int, bytes] = {}  # per process still writing: its unfinished last line
        self.selector = selectors.DefaultSelector()
        self.pidfds: list[int] = []

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
        os.set_blocking(proc.stdout.fileno(), False)
        self.selector.register(proc.stdout, selectors.EVENT_READ, ("output", i))
        self.partial[i] = b""
        if hasattr(os, "pidfd_open"):  # Linux: readable once the process has exited
            try:
                self.pidfds.append(os.pidfd_open(proc.pid))
            except OSError:  # an old kernel: the poll interval finds the exit instead
                pass
            else:
                self.selector.register(self.pidfds[-1], selectors.EVENT_READ, ("exit", i))

    def pump(self, timeout: float) -> None:
        """Forwards the output that arrives within ``timeout`` seconds, line by line."""
        for key, _ in self.selector.select(timeout):
            kind, i = key.data
            if kind == "exit":  # stays readable: stop watching it, `exits` reads the code
                self.selector.unregister(key.fileobj)
                continue
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if chunk:
                *lines, self.partial[i] = (self.partial[i] + chunk).split(b"\n")
            else:  # every writer has closed the pipe: the process and its children
                self.selector.unregister(key.fileobj)
                rest = self.partial.pop(i)
                lines = [rest] if rest else []
            self.write(i, lines)

    def write(self, i: int, lines: list[bytes]) -> None:
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip("\r")
            self.out.write(f"[{i}] {line}\n")
        if lines:
            self.out.flush()

    def exits(self) -> list[int]:
        """The processes that have exited since the last call; their codes go to ``codes``."""
        new = []
        for i, proc in enumerate(self.procs):
            if i not in self.codes:
                code = _exit_code(proc)
                if code is not None:
                    self.codes[i] = code
                    new.append(i)
        return new

    def marked(self, i: int, stage: str) -> bool:
        return (self.folder / f"{i}.{stage}").exists()

    def say(self, message: str) -> None:
        self.out.flush()
        print(f"pipejax.launch: {message}", file=sys.stderr, flush=True)

    def wait(self, timeout: float | None, signals: _Signals) -> int:
        """Waits for all to succeed, the first to fail, the deadline or a stop signal; returns the code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self.pump(_POLL_S)
                if signals.received is not None:
                    self.say(f"received {signal.Signals(signals.received).name}; stopping all processes.")
                    return 128 + signals.received
                for i in self.exits():
                    code = self.codes[i]
                    if code != 0:
                        self.say(f"process {i} exited with code {code}{self.stopping()}.")
                        return code
                if len(self.codes) == len(self.procs):
                    return 0
                stranded = self.stranded()
                if stranded is not None:
                    gone, waiting = stranded
                    self.say(
                        f"process {gone} exited with code 0 without joining the group (it did not call "
                        f"pipejax.launch.initialize(), or left before it returned), while process "
                        f"{waiting} waits for it in initialize(): the group cannot form{self.stopping()}."
                    )
                    return 1
                if deadline is not None and time.monotonic() > deadline:
                    self.say(f"timed out after {timeout:g} s; stopping all processes.")
                    return TIMEOUT_EXIT_CODE
        except KeyboardInterrupt:  # SIGINT with a handler of the caller's own that raises it
            self.say("interrupted; stopping all processes.")
            return 130

    def stopping(self) -> str:
        running = len(self.procs) - len(self.codes)
        return f"; stopping the {running} still running" if running else ""

    def stranded(self) -> tuple[int, int] | None:
        """``(gone, waiting)``: a process that left with 0 without joining, and one waiting to join."""
        gone = [i for i, c in self.codes.items() if c == 0 and not self.marked(i, "joined")]
        if gone:
            for i in range(len(self.procs)):
                if i not in self.codes and self.marked(i, "joining") and not self.marked(i, "joined"):
                    return gone[0], i
        return None

    def stop(self) -> None:
        """Ends every process group, those of exited processes too, and forwards the last output.

        SIGTERM to each group, then SIGKILL to the groups left after ``_GRACE_S`` seconds. A
        process that joined JAX's group gets SIGKILL at once: JAX's preemption notifier catches
        SIGTERM, so it would only delay the end by the grace period.
        """
        for i, proc in enumerate(self.procs):
            _signal_group(proc, signal.SIGTERM)
            if i not in self.codes and self.marked(i, "joined"):
                _signal(proc.pid, signal.SIGKILL)
        if not self.end_groups(time.monotonic() + _GRACE_S):
            for proc in self.procs:
                if _group_alive(proc):  # only then is its pid still certain to name its group
                    _signal_group(proc, signal.SIGKILL)
            self.end_groups(time.monotonic() + _GRACE_S)
        # Every writer has gone, except a child that started a session of its own: drain briefly.
        end = time.monotonic() + _DRAIN_S
        while self.partial and time.monotonic() < end:
            self.pump(_DRAIN_S)
        for i in list(self.partial):
            self.write(i, [self.partial.pop(i)] if self.partial[i] else [])
        self.selector.close()
        for proc in self.procs:
            proc.stdout.close()
        for fd in self.pidfds:
            os.close(fd)

    def end_groups(self, deadline: float) -> bool:
        """Reaps the processes and waits until their groups are empty; whether all ended in time."""
        while True:
            for proc in self.procs:
                proc.poll()  # reaps it; a group holding only its unreaped leader is not empty
            if not any(_group_alive(proc) for proc in self.procs):
                return True
            if time.monotonic() > deadline:
                return False
            self.pump(_STOP_POLL_S)  # a process blocked on a full pipe must be able to write


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The exit code of a process that has exited (128 + k if signal k ended it), without reaping it."""
    if proc.returncode is None and hasattr(os, "waitid"):
        result = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if result is None:
            return None
        return result.si_status if result.si_code == os.CLD_EXITED else 128 + result.si_status
    code = proc.poll()  # without waitid: reaps it
    return None if code is None else 128 - code if code < 0 else code


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether a process of the group runs: one that has exited but is not yet reaped does not."""
    if proc.poll() is None:
        return True
    try:
        os.killpg(proc.pid, 0)  # the session started for this process: pgid == its pid
    except (ProcessLookupError, PermissionError):
        return False
    # killpg counts zombies too: a child left behind is reaped by init (here PID 1 took ~1.5 s).
    return _live_member(proc.pid)


def _live_member(pgid: int) -> bool:
    """Whether the group has a process that is not a zombie (without /proc: assume it has)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return True
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        state, _, group = stat[stat.rindex(")") + 2 :].split()[:3]  # after "pid (command) "
        if int(group) == pgid and state != "Z":
            return True
    return False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
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
    if command[0] == "-m":
        if len(command) == 1:
            raise ValueError(
                f"`command` is {list(command)!r}, but -m needs a module name after it "
                "(e.g. ['-m', 'package.train'])."
            )
        problem = _module_problem(command[1], None)
        if problem is not None:
            raise ValueError(f"`command` is {list(command)!r}, but -m {command[1]!r}: {problem}.")
    return list(command)


def _module_problem(name: str, launcher: str | None) -> str | None:
    """What makes ``name`` no module for ``python -m``, and the fix; None where python may find it.

    A module name is dotted names that python looks up on its path. Python finds names that are
    not identifiers (``my-tool`` from ``my-tool.py``), so only what can never name a module is
    refused: nothing, spaces, a path separator, an empty part (``.train``), and a script file's
    path (``-m train.py`` would import ``train``, running its code, to look for ``train.py``). A
    name python does not find is left to python, whose message names it. ``launcher``, where
    given, is how the command line starts, for the fix (``python -m pipejax.launch -n 2``).
    """
    if not name.strip():
        return (
            "the module name is empty; pass the module each process runs, as to `python -m` "
            "(e.g. -m package.train), or leave out -m and pass a script file"
        )
    dotted = name.removesuffix(".py").strip("/").replace("/", ".")  # tools/train.py: tools.train
    instead = f"pass -m {dotted}" if _dotted(dotted) else None
    if os.path.isfile(name) and (name.endswith(".py") or not _dotted(name)):
        run = f" ({launcher} {name})" if launcher else ""
        also = f", or {instead}" if instead else ""
        return f"{name!r} is a script file, not a module name: leave out -m to run it{run}{also}"
    if not _dotted(name):
        fix = "leave out -m to run a script file"
        fix = f"{instead}, or {fix}" if instead else fix
        return (
            "a module name is dotted names without spaces or '/', like package.module (python "
            f"imports it from its path; it does not open a file): {fix}"
        )
    return None


def _dotted(name: str) -> bool:
    """Whether ``name`` is names without spaces or path separators, joined by single dots."""
    return all(part and not any(c.isspace() or c in "/\\" for c in part) for part in name.split("."))


def _script_problem(path: str) -> str | None:
    """What keeps every process from running the script ``path`` as python would, and the fix.

    Python runs a file, or a directory (or zip file) holding a ``__main__.py``. Each process
    opens the script, so a pipe (``<(...)``) cannot serve them all.
    """
    if not path.strip():
        return (
            f"the script {path!r} is an empty name: pass the path of a script file, or -m and a module name"
        )
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        where = "" if os.path.isabs(path) else f" (in the current directory {os.getcwd()})"
        fix = "pass the path of a script file"
        if not path.endswith(".py") and _module_problem(path, None) is None:
            fix = f"to run a module, pass -m {path}"
        return f"the script {path!r} does not exist{where}; {fix}"
    except OSError as err:  # a part of the path is a file, a folder without search permission, ...
        return f"the script {path!r} cannot be opened ({err.strerror}): pass the path of a script file"
    if stat.S_ISDIR(mode):
        if os.path.isfile(os.path.join(path, "__main__.py")):
            return None
        return (
            f"the script {path!r} is a directory, and python runs a directory only if it holds a "
            f"__main__.py: pass a script file (e.g. {os.path.join(path, 'train.py')}), or add "
            f"{os.path.join(path, '__main__.py')}"
        )
    if not stat.S_ISREG(mode):
        return (
            f"the script {path!r} is not a file but a pipe, a device or a socket: each of the processes "
            "reads the script, so pass a file (write a script from <(...) to a file first)"
        )
    if not os.access(path, os.R_OK):
        return f"the script {path!r} cannot be read (permission denied): make it readable (chmod u+r {path})"
    return None


# --- the command line --------------------------------------------------------------------------


def _too_many(processes) -> str:
    return (
        f"`processes` (--processes) must be at most {MAX_PROCESSES}, but got {processes}: the launcher "
        "starts every process on this machine, each a whole JAX runtime. For more, start one process "
        "per host with your cluster's launcher and `jax.distributed.initialize` (docs/multihost.md)."
    )


def _positive_int(flag):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, but got {text!r}")
        if flag == "--processes" and value > MAX_PROCESSES:
            raise argparse.ArgumentTypeError(_too_many(value))
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
            "Exit code: 0, the first failing process's code, 124 on timeout, or 128 + k when signal k "
            "stops the launcher (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP)."
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
    # Optional for argparse, so that a missing target gets pipejax's message (argparse would
    # name `args` as missing too).
    parser.add_argument("target", nargs="?", help="the script (or, with -m, the module) each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m pipejax.launch [options] script.py [args...]``.

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      The exit code of :func:`launch`. Bad options print a message and raise ``SystemExit(2)``
      (argparse's convention: ``python -m pipejax.launch`` then exits with code 2).

    Examples:
      >>> from pipejax import launch
      >>> launch.main(["--processes", "1", "-m", "json.tool", "--help"])  # doctest: +ELLIPSIS
      [0] usage: ...
      0
    """
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.target is None:
        parser.error(
            "-m needs a module name after it (e.g. -m package.train)"
            if opts.module
            else "no script given: pass the script each process runs (python -m pipejax.launch -n 2 "
            "train.py), or -m and a module name"
        )
    if opts.module:
        problem = _module_problem(opts.target, f"python -m pipejax.launch -n {opts.processes}")
        if problem is not None:
            parser.error(f"-m {opts.target!r}: {problem}")
        command = ["-m", opts.target, *opts.args]
    else:
        problem = _script_problem(opts.target)
        if problem is not None:
            parser.error(problem)
        command = [opts.target, *opts.args]
    if opts.port is not None and (err := _port_taken(_HOST, opts.port)) is not None:
        parser.error(
            f"--port {opts.port}: {_HOST}:{opts.port} is already in use ({err.strerror}); pass a free "
            "port, or leave --port out so that the launcher picks one"
        )
    return launch(
        command,
        processes=opts.processes,
        devices_per_process=opts.devices_per_process,
        timeout=opts.timeout,
        port=opts.port,
    )
