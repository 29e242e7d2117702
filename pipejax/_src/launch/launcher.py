"""Starting and stopping the local processes: :func:`launch`.

``_Group`` owns the started processes (their output, prefixed by index, their exits, and the
ending of their process groups), ``_Signals`` records SIGINT, SIGTERM and SIGHUP for it, and the
module-level helpers read exit codes and signal process groups.
"""

from __future__ import annotations

import io
import math
import numbers
import os
import pathlib
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from pipejax._src.launch.process import (
    _HOST,
    COORDINATOR,
    DEVICES_PER_PROCESS,
    LAUNCH_DIR,
    NUM_PROCESSES,
    PROCESS_ID,
    _port_taken,
)
from pipejax._src.launch.validation import MAX_PROCESSES, _check_command, _check_int, _too_many

TIMEOUT_EXIT_CODE = 124  # as coreutils' `timeout`
# Signals that stop the launch: Ctrl-C, a job scheduler's stop, a closed terminal.
_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_GRACE_S = 3.0  # after SIGTERM, how long a process may take to exit before SIGKILL
_POLL_S = 0.05  # the longest the wait loop sleeps
_STOP_POLL_S = 0.02
_DRAIN_S = 0.2  # after all processes have ended, how long to wait for a pipe's end


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
