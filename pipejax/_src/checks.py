"""Checks of user input shared by every part of pipejax: one rule, one message, written once.

An inner module: it imports only jax and numpy, never another part of pipejax, so every part may
use it. Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad
value) with a message that names the argument, the value received, the rule and the fix, and
runs in Python at trace time, before any compiled code.

``label`` arguments are how a message names the argument: ``"`key`"`` or ``"`key` of Flow.sample"``.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def label(name: str, where: str | None = None) -> str:
    """How a message names argument ``name`` of function ``where``: ```x` of f`` or ```x```."""
    return f"`{name}`" if where is None else f"`{name}` of {where}"


# --- PRNG keys ------------------------------------------------------------------------------------


def is_typed_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``), of any shape."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_raw_key(x: Any) -> bool:
    """Whether ``x`` is raw key data (``jax.random.PRNGKey``: ``uint32`` with a last axis of 2),
    one key or a batch of them."""
    shape = getattr(x, "shape", None)
    return (
        getattr(x, "dtype", None) == jnp.uint32 and shape is not None and len(shape) >= 1 and shape[-1] == 2
    )


def check_keys(key: Any, name: str, where: str, purpose: str) -> bool:
    """Raises unless ``key`` is one PRNG key or an array of them (typed of any shape, raw
    ``uint32[..., 2]``); returns whether it is typed. Anything else gets :func:`check_key`'s
    message, with ``purpose`` (which batches of keys are taken) appended."""
    if is_typed_key(key) or is_raw_key(key):
        return is_typed_key(key)
    check_key(key, name=name, where=where, purpose=purpose)
    raise AssertionError("check_key accepted what is not a key")  # pragma: no cover


def check_key(
    key: Any,
    *,
    name: str = "key",
    where: str | None = None,
    optional: bool = True,
    purpose: str = "",
    batch_fix: str = "",
) -> Any:
    """Returns ``key`` unchanged if it is one PRNG key (or ``None`` when ``optional``); raises otherwise.

    One key is a typed key of shape ``()`` (``jax.random.key(0)``) or a legacy raw key, ``uint32``
    of shape ``(2,)`` (``jax.random.PRNGKey(0)``). A batch of keys (typed of shape ``(n,)``, raw of
    shape ``(n, 2)``) is refused with ``batch_fix`` as the fix (default: pass one key).

    Args:
      key: what the user passed.
      name, where: how the message names the argument (see :func:`label`).
      optional: whether ``None`` is accepted (no randomness).
      purpose: a sentence appended to the "not a key" message (what the key is for).
      batch_fix: the fix named when a batch of keys is passed.

    Raises:
      TypeError: ``key`` is not one PRNG key.
    """
    arg = label(name, where)
    if key is None:
        if optional:
            return None
        raise TypeError(f"{arg} must be a PRNG key (e.g. jax.random.key(0)), but got None.{_space(purpose)}")
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed, raw = is_typed_key(key), is_raw_key(key)
    if (typed and shape == ()) or (raw and shape == (2,)):
        return key
    if typed or (raw and len(shape) >= 2):
        fix = batch_fix or "Pass one PRNG key (e.g. `jax.random.key(0)`); pipejax derives the keys it needs."
        raise TypeError(f"{arg} must be a single PRNG key, but got a batch of keys of shape {shape}. {fix}")
    none = "None or " if optional else ""
    raise TypeError(
        f"{arg} must be {none}a PRNG key such as `jax.random.key(0)`, but got {type(key).__name__} "
        f"with shape {shape} and dtype {dtype}.{_space(purpose)}"
    )


def typed_key(key: jax.Array) -> jax.Array:
    """A checked key as a typed key (a raw ``uint32[2]`` key is wrapped)."""
    return key if is_typed_key(key) else jax.random.wrap_key_data(key)


# --- Python values --------------------------------------------------------------------------------


def check_callable(value: Any, name: str, signature: str, where: str | None = None) -> Any:
    """Returns ``value`` if it is callable; raises ``TypeError`` naming the expected ``signature``."""
    if not callable(value):
        raise TypeError(
            f"{label(name, where)} must be a callable `{signature}`, but got "
            f"{type(value).__name__} {value!r}."
        )
    return value


def integer(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer of any integral type (``np.int64``, a concrete
    0-d integer array too; not a bool, Python's or numpy's), else None. The one rule for every
    count and index of the public API: check it with this (or :func:`check_int`, :func:`count`),
    never with ``isinstance(value, int)``, which refuses numpy's integers and accepts ``True``."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(
    value: Any, name: str, minimum: int = 1, where: str | None = None, rule: str = "", what: str = ""
) -> int:
    """Returns ``value`` as an int ``>= minimum`` (any integral type, not a bool); ``rule``
    explains the minimum (" for method='hutch++'"), ``what`` says what the argument counts."""
    n = integer(value)
    text = f"{label(name, where)} must be an int >= {minimum}{rule}"
    about = f": {what}." if what else "."
    if n is None:
        raise TypeError(f"{text}, but got {type(value).__name__} {value!r}{about}")
    if n < minimum:
        raise ValueError(f"{text}, but got {n}{about}")
    return n


def count(value: Any, name: str, *, least: int = 1, what: str = "") -> int:
    """:func:`check_int` as the pipeline's counts call it (``chunks``, ``num_stages``, ...)."""
    return check_int(value, name, least, what=what)


def check_bool(value: Any, name: str, where: str | None = None, alternative: str = "") -> bool:
    """Returns ``value`` if it is a bool (``True``/``False``, numpy's included)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{label(name, where)} must be True or False{alternative}, but got "
            f"{type(value).__name__} {value!r}."
        )
    return bool(value)


def index_value(value: Any) -> int | None:
    """The value of a concrete integer index (a Python or numpy int, or a concrete 0-d array);
    ``None`` for a traced one, whose value is not known at trace time."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, jax.core.Tracer):
        return None
    if np.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.integer):
        return int(value)
    return None


def types_text(tree: Any, limit: int | None = None) -> str:
    """``tree`` with each array leaf as its type (``float32[4, 3]``) and every other leaf as its
    Python type, for messages; cut to about ``limit`` characters when given."""

    def one(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return f"{getattr(a.dtype, 'name', a.dtype)}{list(a.shape)}"
        return type(a).__name__

    text = str(jax.tree.map(one, tree))
    return text if limit is None or len(text) <= limit else text[:limit] + " ...(cut)"


def array_like(x: Any) -> bool:
    """Whether ``x`` can stand for an array: an array, a tracer or a ``jax.ShapeDtypeStruct``
    (anything with a shape and a dtype), or a number."""
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, numbers.Number)


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array when its value is known in Python; ``None`` under a trace."""
    if isinstance(x, jax.core.Tracer) or isinstance(x, jax.ShapeDtypeStruct):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError):  # pragma: no cover - defensive
        return None


# --- arrays and pytrees ---------------------------------------------------------------------------


def check_float_array(x: Any, name: str, where: str | None = None, fix: str = "") -> None:
    """Raises unless ``x`` is an array (or ``ShapeDtypeStruct``) of a real floating dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{label(name, where)} must be an array, but got {type(x).__name__}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{label(name, where)} must be a floating array, but got dtype {x.dtype}; "
            f"{fix or 'cast it, e.g. with x.astype(jnp.float32)'}."
        )


def _space(text: str) -> str:
    return f" {text}" if text else ""


# --- mesh axes and errors ------------------------------------------------------------------------


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


def sequence(value: Any, name: str, what: str, fix: str = "") -> Any:
    """``value`` if it is a sequence (a list or tuple, not a str), else a ``TypeError``:
    ```name` must be a sequence with {what}, but got dict.`` and the ``fix``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"`{name}` must be a sequence with {what}, but got {type(value).__name__}.{fix}")
    return value


def mesh_axis(mesh: Any, axis: str, arg: str, example: str) -> None:
    """``axis`` (the value of argument ``arg``) must name an axis of ``mesh``; ``example`` is a
    ``jax.make_mesh(...)`` call that has it."""
    if axis not in mesh.axis_names:
        via = "" if arg == "axis_name" else f" for `{arg}`"
        raise ValueError(
            f"`mesh` has no axis named {axis!r}{via} (its axes are {tuple(mesh.axis_names)}). Add it, "
            f"e.g. `{example}`, or pass `{arg}=`."
        )
