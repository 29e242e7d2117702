"""The command line, ``python -m pipejax.launch [options] script.py [args...]``: :func:`main`.

Its argument parser and the parsers of the option values; :func:`main` checks the target and
the port, then calls :func:`~pipejax._src.launch.launcher.launch`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from pipejax._src.launch.launcher import launch
from pipejax._src.launch.process import _HOST, _port_taken
from pipejax._src.launch.validation import MAX_PROCESSES, _module_problem, _script_problem, _too_many


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
