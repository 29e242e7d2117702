"""Argument checks shared by the public functions: one rule, one message, written once.

Every message names the argument, the value received, the rule, and (where there is one) the fix.
A value of the wrong type raises ``TypeError``; a value of the right type outside the rule
``ValueError``.
"""

from __future__ import annotations

import operator
from typing import Any


def integer(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer of any integral type (``np.int64`` too; not
    a bool), else None."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def count(value: Any, name: str, *, least: int = 1, what: str = "") -> int:
    """``value`` as an int ``>= least``, or a clear error naming ``name`` (``what``: what it counts)."""
    n = integer(value)
    rule = f"`{name}` must be an int >= {least}"
    about = f": {what}." if what else "."
    if n is None:
        raise TypeError(f"{rule}, but got {type(value).__name__} {value!r}{about}")
    if n < least:
        raise ValueError(f"{rule}, but got {n}{about}")
    return n


def axis_name(value: Any, name: str = "axis_name", *, or_none: bool = False) -> str:
    """A mesh axis name: a non-empty str (``or_none``: the argument may also be None, checked by
    the caller)."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be a str{' or None' if or_none else ''}, but got {type(value).__name__} "
            f"{value!r}; it names an axis of the mesh (e.g. `jax.make_mesh((4,), ('stage',))`)."
        )
    if not value:
        raise ValueError(
            f"`{name}` is the empty string; name an axis of the mesh, e.g. 'stage' with "
            "`jax.make_mesh((4,), ('stage',))`."
        )
    return value


def raised_in_jax(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is in JAX's own code (a shape or dtype
    error of JAX, as opposed to the user's own exception)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
    return "/jax/" in filename or "/jaxlib/" in filename
