"""Boundary inference: the types of the activations at every stage boundary and of each stage's
stats, found with ``jax.eval_shape`` before anything runs; and the errors of a stage that cannot
be applied to what reaches it (:func:`stage_error`)."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp

from pipejax._src import aux_outputs, checks
from pipejax._src.containers import Layout, is_weak

PyTree = Any


# --- boundary shapes ---------------------------------------------------------------------------


def struct(tree):
    return jax.tree.map(lambda a: shape_struct(a, jnp.shape(a)), tree)


def shape_struct(a, shape):
    """The type of leaf ``a`` with ``shape``: its dtype and weak type (a Python float parameter
    keeps a bfloat16 activation bfloat16, as outside the pipeline)."""
    return jax.ShapeDtypeStruct(shape, jnp.result_type(a), weak_type=is_weak(a))


def micro_struct(xs):
    return jax.tree.map(lambda a: shape_struct(a, a.shape[1:]), xs)


def row_mask_struct(xs, pipe):
    """The type of the row mask a stateful stage receives, ``bool[b]``; ``None`` when stateless."""
    if not pipe.stateful:
        return None
    return jax.ShapeDtypeStruct(jax.tree.leaves(xs)[0].shape[1:2], jnp.bool_)


def stage_output(
    s, pipe, p_struct, st_struct, in_struct, key_struct, mask_struct, ctx_struct=None
) -> tuple[Layout, Layout]:
    """The layouts of stage ``s``'s output and stats on ``in_struct``, or a clear error."""
    micro_size = jax.tree.leaves(in_struct)[0].shape[0]
    stage = pipe.stages[s]
    args = (p_struct, in_struct, key_struct) + ((st_struct, mask_struct) if pipe.stateful else ())
    kwargs = {} if ctx_struct is None else {"context": ctx_struct}
    check_signature(stage, s, pipe, args, kwargs)
    try:
        out = jax.eval_shape(lambda a, kw: stage(*a, **kw), args, kwargs)
    except Exception as err:
        raise stage_error(err, s, in_struct) from err
    # (eval_shape has already rejected leaves that are not arrays)
    out, stats = aux_outputs.split_output(out, s, pipe.stateful, pipe.aux is not None)
    if not jax.tree.leaves(out):
        raise ValueError(
            f"Stage {s} returned {out!r}, which holds no arrays. A stage must return the "
            "activation for the next stage (an array or a pytree of arrays with the micro-batch "
            "axis first); check for a missing `return`."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, jax.ShapeDtypeStruct) or not leaf.shape or leaf.shape[0] != micro_size:
            got = getattr(leaf, "shape", leaf)
            raise ValueError(
                f"Stage {s} returned leaf {jax.tree_util.keystr(path) or '<root>'} with shape {got}, "
                f"but every output leaf must keep the micro-batch axis first (size {micro_size}). "
                "Stages may change every axis but the leading batch axis."
            )
    return Layout.of(out), Layout.of(stats)


def check_signature(stage, s: int, pipe, args, kwargs) -> None:
    """A stage whose signature cannot take the pipeline's arguments: say how stages are called
    (``inspect.signature`` binds ``*args``, defaults and ``functools.partial`` as a call would;
    callables without a signature are left to the call)."""
    try:
        signature = inspect.signature(stage)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        want = "params, x, key, state, mask" if pipe.stateful else "params, x, key"
        side = " and the keyword argument `context=` (the call passes `context`)" if kwargs else ""
        name = getattr(stage, "__qualname__", type(stage).__name__)
        raise TypeError(
            f"Stage {s}, `{name}{signature}`, cannot be called with the arguments every stage "
            f"takes, `({want})`{side}: {err}. A stage that needs no randomness still takes `key` "
            "and ignores it (`key` is None when the pipeline is called without one), e.g. "
            "`def stage(params, x, key): ...` or `lambda p, x, key: ...`."
        ) from None


def stage_error(err: Exception, s: int, in_struct) -> Exception:
    """What to raise when stage ``s`` fails while its output type is inferred (``eval_shape``).

    A shape or dtype mismatch raised inside JAX (an exact ``TypeError``/``ValueError`` from JAX's
    own code) becomes pipejax's ``ValueError`` naming the boundary. Anything else -- the user's
    own exception, a ``KeyError`` from params of the wrong structure, JAX's concretization and
    unbound-axis errors -- keeps its type, with pipejax's context added as a note, so
    ``except MyError`` keeps working.
    """
    source = "a micro-batch of `x`" if s == 0 else f"the output of stage {s - 1}"
    seen = f"Stage {s} failed while pipejax inferred its output type on {source}, whose type is "
    seen += f"{Layout.of(in_struct).describe()} (shapes include the micro-batch axis first)."
    if isinstance(err, NameError) and "axis name" in str(err):
        err.add_note(
            seen + " A stage runs on one device for one micro-batch: it must not call collectives "
            "over the pipeline's mesh axes (`lax.psum`, `lax.axis_index('stage')`, ...). Use the "
            "stage index you already know (a stage function per stage, or a parameter), and reduce "
            "over the batch after the pipeline."
        )
        return err
    if isinstance(err, jax.errors.ConcretizationTypeError | jax.errors.TracerBoolConversionError):
        err.add_note(
            seen + " Stages are traced: Python `if`/`while` on a traced value cannot work; use "
            "`jnp.where`, `lax.cond` or `lax.select`."
        )
        return err
    if type(err) in (TypeError, ValueError) and checks.raised_in_jax(err):
        where = "`x`" if s == 0 else f"stage {s - 1}"
        return ValueError(
            f"Stage {s} could not be applied to {source}, whose type is "
            f"{Layout.of(in_struct).describe()}: {type(err).__name__}: {err}\n"
            f"Make stage {s} accept what {where} produces (shapes include the micro-batch axis first)."
        )
    err.add_note(seen)
    return err


def heterogeneous(pipe, p_structs, st_structs, xs, key_struct, cs=None) -> tuple[list[Layout], list[Layout]]:
    """Layouts of the values entering stage 0, 1, ..., and leaving the last stage; and of each
    stage's stats. ``p_structs``, ``st_structs``: each stage's parameter and state types."""
    in_struct = micro_struct(xs)
    mask_struct = row_mask_struct(xs, pipe)
    layouts, stats = [Layout.of(in_struct)], []
    for s in range(pipe.num_stages):
        out, stat = stage_output(
            s, pipe, p_structs[s], st_structs[s], in_struct, key_struct, mask_struct, micro_struct(cs)
        )
        layouts.append(out)
        stats.append(stat)
        in_struct = out.structs()
    return layouts, stats


def homogeneous(pipe, params, state, xs, key_struct, cs=None) -> tuple[list[Layout], Layout]:
    in_struct = micro_struct(xs)
    lead = pipe.runner_stage_axes()  # (v, n, ...) on a circular mesh

    def unstacked(tree):  # one stage's slice of a stacked pytree
        return jax.tree.map(lambda a: shape_struct(a, jnp.shape(a)[lead:]), tree)

    def output(in_struct):
        p, st, mask, c = unstacked(params), unstacked(state), row_mask_struct(xs, pipe), micro_struct(cs)
        return stage_output(0, pipe, p, st, in_struct, key_struct, mask, c)

    layout_in = Layout.of(in_struct)
    layout_out, stats = output(in_struct)
    if layout_out != layout_in and layout_out.strong() == layout_in.strong():
        # a weak type gained or lost (weakly typed x such as `jnp.arange(8) / 2` meeting strong
        # parameters, or `(x > 0) * 1.5`): the activation travels strongly typed between stages
        # (the caller casts x: `Layout.cast`), like the stacked stages of `lax.scan`
        layout_in = layout_in.strong()
        layout_out, stats = output(layout_in.structs())
        layout_out = layout_out.strong()
    if layout_out != layout_in:
        raise ValueError(
            "Homogeneous stages must return activations of the type they take, so that each "
            f"stage can feed the next; the stage maps {layout_in.describe()} to "
            f"{layout_out.describe()}. Use a sequence of stage functions (heterogeneous stages) "
            "for stages that change the activation type."
        )
    return [layout_in] * (pipe.num_stages + 1), stats
