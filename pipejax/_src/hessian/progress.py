"""Progress reports of the Lanczos-based functions (``progress=``): checked, and called from
inside compiled code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

Progress = bool | Callable[[str, int, int], None]


def print_progress(task: str, done: int, total: int) -> None:
    """The default progress report: a line on stderr about every tenth of the work."""
    every = max(1, total // 10)
    if done % every == 0 or done == total:
        print(f"pipejax.hessian {task}: {done}/{total} HVPs", file=__import__("sys").stderr, flush=True)


def check_progress(progress: Any) -> None:
    """``progress`` must be a bool or a function ``f(task, done, total)``."""
    if not (isinstance(progress, bool) or callable(progress)):
        raise TypeError(
            f"`progress` must be True, False or a function `f(task, done, total)` called after each "
            f"step, but got {type(progress).__name__} {progress!r}."
        )


def report(progress: Progress, task: str, done: jax.Array, total: int) -> None:
    """Calls the progress function from inside compiled code (nothing when ``progress`` is off)."""
    check_progress(progress)
    if progress is False:
        return
    fn = print_progress if progress is True else progress
    jax.debug.callback(lambda d: fn(task, int(d), total), done)
