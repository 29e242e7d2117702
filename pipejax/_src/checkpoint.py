"""Checkpoint modes of the pipeline: which stage computations are re-materialised in backward.

``"always"``       every stage computation is checkpointed: a device keeps only the activations
                   that enter its stage (one per tick), and recomputes the stage in backward.
``"except_last"``  GPipe/torchgpipe's default. The first ``m - 1`` ticks are checkpointed; the last
                   ``n`` ticks (the drain, which include the last micro-batch on every stage;
                   ``n`` = devices) keep their activations, because their backward starts at once.
``"never"``        no recomputation once the pipeline is full: ticks ``n - 1`` onwards keep the
                   stage's internal activations. The first ``n - 1`` ticks are checkpointed all
                   the same (see :func:`phases` for why).
a policy           a ``jax.checkpoint`` policy (e.g. ``jax.checkpoint_policies.dots_saveable``)
                   applied to every stage computation from tick ``n - 1`` on; the first ``n - 1``
                   ticks are fully checkpointed.

All modes compute bitwise-identical results: recomputation replays the same operations on the
same inputs, including the same PRNG keys (see :mod:`pipejax._src.keys`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pipejax._src.keys import check_key
from pipejax._src.layout import Layout
from pipejax._src.schedule import Schedule

MODES = ("always", "except_last", "never")

Remat = Callable[[Callable[..., Any]], Callable[..., Any]]


def check_mode(checkpoint: Any) -> None:
    """Raises unless ``checkpoint`` is one of :data:`MODES` or a callable policy."""
    if isinstance(checkpoint, str):
        if checkpoint not in MODES:
            raise ValueError(
                f"`checkpoint` must be one of {', '.join(repr(m) for m in MODES)} or a "
                f"jax.checkpoint policy, but got {checkpoint!r}."
            )
        return
    if not callable(checkpoint):
        raise TypeError(
            f"`checkpoint` must be one of {', '.join(repr(m) for m in MODES)} or a "
            "jax.checkpoint policy such as `jax.checkpoint_policies.dots_saveable`, but got "
            f"{type(checkpoint).__name__} {checkpoint!r}."
        )


def _remat(policy: Any = None) -> Remat:
    # prevent_cse=False: every checkpointed call sits inside lax.scan, where CSE cannot merge the
    # recomputation with the forward pass (jax.checkpoint's docs recommend False there).
    return functools.partial(jax.checkpoint, prevent_cse=False, policy=policy)


def _identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


STAGE_PARAMS = "pipejax_stage_params"  # the name of a device's per-tick parameter slice


# Primitives that only move or re-type values: cheap to recompute, so never worth a per-tick copy.
_STRUCTURAL = frozenset(
    ("slice", "squeeze", "dynamic_slice", "reshape", "broadcast_in_dim", "convert_element_type",
     "transpose", "gather", "copy", "copy_p", "expand_dims")
)


def _except_stage_params(policy: Callable[..., bool]) -> Callable[..., bool]:
    """``policy``, except that values named :data:`STAGE_PARAMS` and outputs of data-movement
    primitives (slices, reshapes, casts: what a stage does to pick its weights out of its
    parameters) are never saved; the backward pass recomputes them from what is.

    (Written out rather than built on ``jax.checkpoint_policies.save_anything_except_these_names``,
    which in jax 0.10.2 saves every value, named or not.)
    """

    def combined(prim, *args, **params):
        if prim.name in _STRUCTURAL or (prim.name == "name" and params.get("name") == STAGE_PARAMS):
            return False
        return policy(prim, *args, **params)

    return combined


class Phase(NamedTuple):
    """A range of ticks run as one ``lax.scan``."""

    start: int
    stop: int
    remat: Remat  # how each stage computation is wrapped
    skip_bubbles: bool  # True: bubble ticks run no stage (lax.cond); False: every tick computes


def phases(checkpoint: Any, schedule: Schedule) -> list[Phase]:
    """Splits the schedule's ticks into phases, each run as a separate ``lax.scan``.

    Two facts of JAX shape this. (1) A stage that has not yet received its first micro-batch
    (ticks ``t < s``) has no valid input, so those ticks must skip the stage with ``lax.cond``.
    (2) Reverse-mode autodiff of a ``lax.cond`` saves the cond's operands that the backward pass
    needs -- the stage parameters among them -- as per-tick outputs, so an un-checkpointed cond in
    a scan stores the parameters once per tick. So the first ``n - 1`` ticks (the only ones where a
    stage can be unfilled) always run the cond under full checkpointing, whose saved inputs are
    loop-invariant and hoisted out of the scan; later ticks that are not fully checkpointed run
    every stage without a cond. There a stage with no micro-batch recomputes on a real input (stage
    0 re-reads micro-batch 0; a later stage reads what its predecessor last produced, itself real),
    so it still sees only values it was written for, and its output is discarded. On a mesh those
    ticks are ones the device would idle anyway; with ``mesh=None`` they cost ``n (n - 1) / 2``
    extra stage executions per call.

    Every mode cuts the ticks at the same places -- ``n - 1`` and ``max(T - n, n - 1)`` for ``T``
    ticks on ``n`` devices (GPipe: ``max(m, n) - 1``) -- and differs only in how each phase
    computes. The backward pass sums each phase's parameter cotangents separately, so equal cuts
    make those floating-point sums, and hence the gradients, bitwise identical across modes.

    The circular schedule is cut the same way, with ``n`` the devices (not the stages): its
    last ``n`` ticks are the drain that ``"except_last"`` keeps. A device there picks one of its
    stages' parameters at every tick, and a slice that changes from tick to tick is not
    loop-invariant, so phases that keep residuals would store it once per tick; they save
    everything but the values named :data:`STAGE_PARAMS` (the pipeline names its per-tick
    parameter slices so), which the backward pass slices again.
    """
    n, ticks = schedule.num_devices, schedule.num_ticks
    fill = min(n - 1, ticks)  # ticks before this one may have unfilled stages
    drain = max(ticks - n, fill)  # "except_last" keeps the activations of the ticks from here on
    full, plain = _remat(), _identity
    if schedule.repeats > 1:
        plain = _remat(_except_stage_params(jax.checkpoint_policies.everything_saveable))
    if checkpoint == "always":
        kinds = [(full, True), (full, True), (full, True)]
    elif checkpoint == "never":
        kinds = [(full, True), (plain, False), (plain, False)]
    elif checkpoint == "except_last":
        kinds = [(full, True), (full, True), (plain, False)]
    else:
        policy = _remat(_except_stage_params(checkpoint) if schedule.repeats > 1 else checkpoint)
        kinds = [(full, True), (policy, False), (policy, False)]
    cuts = [0, fill, drain, ticks]
    bounds = itertools.pairwise(cuts)
    ranges = [Phase(a, b, remat, skip) for (a, b), (remat, skip) in zip(bounds, kinds, strict=True)]
    return [p for p in ranges if p.stop > p.start]


# --- checkpoint_sequential ------------------------------------------------------------------------


def checkpoint_sequential(
    layer: Callable[..., Any], *, segments: int | None = None, policy: Any = None
) -> Callable[..., Any]:
    """Applies ``L`` copies of ``layer`` in sequence, keeping O(sqrt L) activations for backward.

    The JAX form of ``torch.utils.checkpoint.checkpoint_sequential``. The ``L`` layers are cut into
    segments of ``ceil(L / segments)`` layers (the last may be shorter); the backward pass keeps
    only the activation entering each segment and recomputes the segment's internals when it gets
    there. With ``segments ~ sqrt(L)`` that is about ``2 sqrt(L)`` activations instead of ``L``,
    for about one extra forward pass of compute (Chen et al. 2016).

    Randomness: layer ``l`` (0-based) receives ``jax.random.fold_in(key, l)``, exactly what a plain
    ``lax.scan`` over the layers with that derivation draws. The recomputation replays the same
    keys, so the forward result is bitwise that of the plain scan and gradients match it.

    Args:
      layer: ``layer(params_l, x, key_l) -> x``, one layer; it must return an activation of the
        type it takes.
      segments: the number of segments, ``>= 1``; ``None`` picks about ``sqrt(L)``, preferring a
        divisor of ``L`` (see :func:`default_segments`). More segments than layers give one layer
        per segment.
      policy: an optional ``jax.checkpoint`` policy for what each segment may save besides its
        input (e.g. ``jax.checkpoint_policies.dots_saveable``).

    Returns:
      ``apply(stacked_params, x, key=None)``, where every leaf of ``stacked_params`` has a leading
      axis of length ``L`` (layer ``l`` gets ``tree.map(lambda a: a[l], stacked_params)``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> layer = lambda p, x, key: jnp.tanh(x @ p)
      >>> apply = pj.checkpoint_sequential(layer, segments=4)
      >>> w = jnp.stack([jnp.eye(3)] * 16)
      >>> apply(w, jnp.ones((2, 3))).shape
      (2, 3)

    References:
      Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016.
    """
    if not callable(layer):
        raise TypeError(
            f"`layer` must be a callable `layer(params_l, x, key_l) -> x`, but got {type(layer).__name__}."
        )
    if segments is not None:
        if isinstance(segments, bool) or not isinstance(segments, int):
            raise TypeError(f"`segments` must be an int >= 1 or None, but got {segments!r}.")
        if segments < 1:
            raise ValueError(
                f"`segments` must be >= 1 (the number of checkpointed segments), but got {segments}; "
                "pass None for about sqrt(L)."
            )
    remat = _remat(policy)

    def step(carry, xs, key):
        p, index = xs
        k = None if key is None else jax.random.fold_in(key, index)
        return layer(p, carry, k), None

    def run(params, x, index, key):
        """A plain scan over the layers in ``params`` (leading axis), numbered from ``index``."""
        return jax.lax.scan(lambda c, xs: step(c, xs, key), x, (params, index))[0]

    def apply(stacked_params: Any, x: Any, key: jax.Array | None = None) -> Any:
        num_layers = _num_layers(stacked_params)
        _check_key(key)
        _check_layer_keeps_type(layer, stacked_params, x, key)
        count = min(segments or default_segments(num_layers), num_layers)
        size = -(-num_layers // count)  # layers per full segment
        full = num_layers // size  # full segments; a shorter one may follow
        index = jnp.arange(num_layers, dtype=jnp.int32)
        head = jax.tree.map(lambda a: a[: full * size].reshape((full, size, *a.shape[1:])), stacked_params)
        segment = remat(run)
        x = jax.lax.scan(
            lambda c, xs: (segment(xs[0], c, xs[1], key), None),
            x,
            (head, index[: full * size].reshape(full, size)),
        )[0]
        if full * size < num_layers:
            tail = jax.tree.map(lambda a: a[full * size :], stacked_params)
            x = segment(tail, x, index[full * size :], key)
        return x

    return apply


def default_segments(num_layers: int) -> int:
    """The segment count ``segments=None`` picks for ``num_layers`` layers: about ``sqrt(L)``.

    Among the counts within a factor 1.5 of ``sqrt(L)``, a divisor of ``L`` is preferred (the
    largest of those nearest ``sqrt(L)``), so every segment has the same length: a shorter last
    segment is a second checkpointed call outside the scan, and XLA keeps its buffers apart
    (measured at L = 512: 23 segments, the last of 6 layers, took 1.5x the temp bytes of 32
    segments of 16). Without such a divisor it is ``round(sqrt(L))``.

    >>> [default_segments(n) for n in (1, 8, 16, 17, 64, 100, 512)]
    [1, 4, 4, 4, 8, 10, 32]
    """
    root = num_layers**0.5
    divisors = [k for k in range(1, num_layers + 1) if num_layers % k == 0 and root / 1.5 <= k <= root * 1.5]
    if not divisors:
        return max(1, round(root))
    return min(divisors, key=lambda k: (round(abs(math.log(k / root)), 9), -k))


def _num_layers(stacked_params: Any) -> int:
    leaves, _ = jax.tree_util.tree_flatten_with_path(stacked_params)
    if not leaves:
        raise ValueError(
            "`stacked_params` has no array leaves; stack the per-layer parameters on a leading "
            "axis of length L (e.g. `jax.tree.map(lambda *p: jnp.stack(p), *layers)`)."
        )
    sizes = {
        jax.tree_util.keystr(p) or "<root>": (jnp.shape(a)[0] if jnp.ndim(a) else None) for p, a in leaves
    }
    if None in sizes.values() or len(set(sizes.values())) != 1:
        listing = ", ".join(f"{p}: {n}" for p, n in sizes.items())
        raise ValueError(
            "Every leaf of `stacked_params` needs the same leading layer axis, but the leading "
            f"sizes are {listing} (None: a scalar). Stack every layer's parameters on axis 0."
        )
    (num_layers,) = set(sizes.values())
    if num_layers == 0:
        raise ValueError("`stacked_params` has zero layers (leading axis 0); pass at least one.")
    return num_layers


def _check_key(key: Any) -> None:
    """One key (or None): a batch of keys would reach ``fold_in`` and fail there without context."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and shape != ()) or (dtype == jnp.uint32 and shape is not None and len(shape) > 1):
        raise TypeError(
            f"`key` of checkpoint_sequential's apply must be one PRNG key (layer l draws from "
            f"`jax.random.fold_in(key, l)`), but got a batch of keys of shape {shape}. For one key per "
            "example or per run, map over the keys: `jax.vmap(apply, in_axes=(None, 0, 0))(params, x, keys)`."
        )
    check_key(key, name="key")


def _check_layer_keeps_type(layer, stacked_params, x, key) -> None:
    p0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), stacked_params)
    x_struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
    k_struct = None if key is None else jax.ShapeDtypeStruct(key.shape, key.dtype)
    before, after = Layout.of(x_struct), Layout.of(jax.eval_shape(layer, p0, x_struct, k_struct))
    if after != before:
        raise ValueError(
            "`layer` must return an activation of the type it takes, so that layers can be chained, "
            f"but it maps {before.describe()} to {after.describe()}."
        )
