"""The launcher's other half, in each launched process: :func:`initialize` and :class:`ProcessInfo`.

:func:`initialize` reads the environment variables the launcher sets for each process (named
here), gives the process its CPU devices and joins it to the others through
``jax.distributed``; afterwards a failure ends the process at once, without JAX's shutdown
barrier. The process marks how far it got in the launcher's directory (``_tell_launcher``).
"""

from __future__ import annotations

import atexit
import os
import pathlib
import socket
import sys
import threading
from collections.abc import Mapping
from typing import NamedTuple

# The variables the launcher sets for each process and `initialize` reads.
COORDINATOR = "PIPEJAX_COORDINATOR"  # "host:port" of process 0's coordination service
NUM_PROCESSES = "PIPEJAX_NUM_PROCESSES"
PROCESS_ID = "PIPEJAX_PROCESS_ID"
DEVICES_PER_PROCESS = "PIPEJAX_DEVICES_PER_PROCESS"
LAUNCH_DIR = "PIPEJAX_LAUNCH_DIR"  # a folder where `initialize` marks how far each process got

_HOST = "127.0.0.1"  # the launcher starts local processes only: loopback


class ProcessInfo(NamedTuple):
    """Who this process is in a launched group; returned by :func:`initialize`."""

    process_id: int  # this process's index, 0 <= process_id < num_processes (jax.process_index())
    num_processes: int  # how many processes the launcher started (jax.process_count())
    coordinator: str  # "host:port" of the coordination service (run by process 0)
    devices_per_process: int  # CPU devices of this process (jax.local_device_count() on CPU)


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
