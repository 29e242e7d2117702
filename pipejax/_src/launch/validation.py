"""The checks of what the launcher is given, before any process starts.

Counts (``MAX_PROCESSES`` at most), the ``python`` command of
:func:`~pipejax._src.launch.launcher.launch`, and for the command line a module name for ``-m``
and a script file, each with a message that says the fix.
"""

from __future__ import annotations

import numbers
import os
import stat
from collections.abc import Sequence

# The most processes one launcher starts: each is a whole JAX runtime on this machine (a launch
# of thousands is a typo, and forks faster than it can be stopped); more hosts: jax.distributed.
MAX_PROCESSES = 256


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


def _too_many(processes) -> str:
    return (
        f"`processes` (--processes) must be at most {MAX_PROCESSES}, but got {processes}: the launcher "
        "starts every process on this machine, each a whole JAX runtime. For more, start one process "
        "per host with your cluster's launcher and `jax.distributed.initialize` (docs/multihost.md)."
    )
