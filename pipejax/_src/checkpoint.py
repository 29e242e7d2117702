"""Checkpoint modes of the pipeline: which stage computations are re-materialised in backward.

``"always"``       every stage computation is checkpointed: a device keeps only the activations
                   that enter its stage (one per tick), and recomputes the stage in backward.
``"except_last"``  GPipe/torchgpipe's default. Every tick but the last ``n`` is checkpointed; the
                   last ``n`` ticks (the drain, which include the last micro-batch on every stage;
                   ``n`` = devices) keep their activations, because their backward starts at once.
``"never"``        no recomputation: every tick keeps the stage's internal activations.
a policy           a ``jax.checkpoint`` policy (e.g. ``jax.checkpoint_policies.dots_saveable``)
                   applied to every stage computation.

All modes compute bitwise-identical results: recomputation replays the same operations on the
same inputs, including the same PRNG keys (see :mod:`pipejax._src.keys`). Gradients are bitwise
identical across modes too, except that ``"except_last"`` (two scans) sums the parameter
cotangents in another order (see :func:`phases`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipejax._src import checks
from pipejax._src.containers import Layout
from pipejax._src.schedules.table import Schedule

MODES = ("always", "except_last", "never")

Remat = Callable[[Callable[..., Any]], Callable[..., Any]]


def check_mode(checkpoint: Any) -> None:
    """Raises unless ``checkpoint`` is one of :data:`MODES` or a ``jax.checkpoint`` policy
    (:func:`check_policy`)."""
    modes = ", ".join(repr(m) for m in MODES)
    if isinstance(checkpoint, str):
        if checkpoint not in MODES:
            raise ValueError(
                f"`checkpoint` must be one of {modes} or a jax.checkpoint policy, but got {checkpoint!r}."
            )
        return
    check_policy(checkpoint, "`checkpoint`", f"one of {modes} or a jax.checkpoint policy")


# The functions of jax.checkpoint_policies that build a policy from names or other policies: given
# uncalled, each would be called by JAX as if it were the policy.
_POLICY_FACTORIES = {
    "save_only_these_names": "save_only_these_names('name')",
    "save_any_names_but_these": "save_any_names_but_these('name')",
    "save_anything_except_these_names": "save_anything_except_these_names('name')",
    "save_and_offload_only_these_names": (
        "save_and_offload_only_these_names(names_which_can_be_saved=[...], "
        "names_which_can_be_offloaded=[...], offload_src='device', offload_dst='pinned_host')"
    ),
    "save_from_both_policies": "save_from_both_policies(policy_1, policy_2)",
    "offload_dot_with_no_batch_dims": "offload_dot_with_no_batch_dims('device', 'pinned_host')",
}


def check_policy(policy: Any, name: str, what: str) -> None:
    """Raises unless ``policy`` looks like a ``jax.checkpoint`` policy: a function that JAX calls
    as ``policy(primitive, *avals, **params)`` and that says whether to save the primitive's
    output. ``name`` names the argument and ``what`` what it accepts, for messages.

    Refused with a message: ``jax.checkpoint`` itself (pipejax applies it), a policy factory of
    ``jax.checkpoint_policies`` not called (``save_only_these_names``), a class, and a function
    whose signature cannot take ``(primitive, *avals, **params)``. What a policy returns is
    checked when it is called (:func:`_checked`)."""
    example = "e.g. `jax.checkpoint_policies.dots_saveable`"
    if policy is jax.checkpoint or policy is jax.remat:
        raise TypeError(
            f"{name} must be {what}, but got `jax.checkpoint` itself. pipejax applies jax.checkpoint "
            f"to each stage (or segment) already; pass what it may save instead: a policy, {example}."
        )
    for factory, call in _POLICY_FACTORIES.items():
        if policy is getattr(jax.checkpoint_policies, factory, None):
            raise TypeError(
                f"{name} must be {what}, but got `jax.checkpoint_policies.{factory}` uncalled: it "
                f"builds a policy. Call it, e.g. `jax.checkpoint_policies.{call}`."
            )
    if not callable(policy) or isinstance(policy, type):
        raise TypeError(f"{name} must be {what} ({example}), but got {type(policy).__name__} {policy!r}.")
    try:
        sig = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind(object(), object())  # a unary primitive
        sig.bind(object(), object(), object(), axes=(0,), name="x")  # more operands, parameters
    except TypeError:
        raise TypeError(
            f"{name} must be {what}, but got {getattr(policy, '__name__', type(policy).__name__)}"
            f"{sig}, which cannot be called as JAX calls a policy: `policy(primitive, *avals, "
            "**params) -> bool` (True: save the primitive's output). Write it as `def "
            "policy(prim, *args, **params): ...`, or use one of jax.checkpoint_policies "
            f"({example})."
        ) from None


def _checked(policy: Callable[..., Any]) -> Callable[..., Any]:
    """``policy``, refusing results that cannot be a decision: ``None`` (a missing ``return``) and
    a function (a policy factory called with a primitive instead of names). JAX's own policies
    pass unwrapped: newer JAX recognises some of them by identity or type."""
    if (getattr(policy, "__module__", None) or "").startswith("jax"):
        return policy

    @functools.wraps(policy)
    def checked(prim, *args, **params):
        out = policy(prim, *args, **params)
        if out is None or callable(out):
            got = "None" if out is None else f"a {type(out).__name__}"
            raise TypeError(
                f"The jax.checkpoint policy {getattr(policy, '__name__', policy)!r} returned {got} for "
                f"the primitive {prim}, but a policy returns whether to save the primitive's output "
                "(True or False). Return a bool; if it builds a policy from names, call it first."
            )
        return out

    return checked


def _remat(policy: Any = None) -> Remat:
    # prevent_cse=False: every checkpointed call sits inside lax.scan, where CSE cannot merge the
    # recomputation with the forward pass (jax.checkpoint's docs recommend False there).
    return functools.partial(jax.checkpoint, prevent_cse=False, policy=policy)


def _identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


STAGE_PARAMS = "pipejax_stage_params"  # the name of a device's per-tick parameter slice


# Primitives that only move or re-type values: cheap to recompute, so never worth a per-tick copy.
_STRUCTURAL = frozenset(
    (
        "slice",
        "squeeze",
        "dynamic_slice",
        "reshape",
        "broadcast_in_dim",
        "convert_element_type",
        "transpose",
        "gather",
        "copy",
        "copy_p",
        "expand_dims",
    )
)


def _except_stage_params(policy: Callable[..., bool]) -> Callable[..., bool]:
    """``policy``, except that values named :data:`STAGE_PARAMS` and outputs of data-movement
    primitives (slices, reshapes, casts: what a stage does to pick its weights out of its
    parameters) are never saved; the backward pass recomputes them from what is.

    (Written out rather than built on ``jax.checkpoint_policies.save_anything_except_these_names``,
    which in jax 0.10.2 saves every value, named or not.)
    """

    policy = _checked(policy)

    def combined(prim, *args, **params):
        if prim.name in _STRUCTURAL or (prim.name == "name" and params.get("name") == STAGE_PARAMS):
            return False
        return policy(prim, *args, **params)

    return combined


class Phase(NamedTuple):
    """A range of ticks run as one ``lax.scan``."""

    start: int
    stop: int
    remat: Remat  # how each stage computation (bubble guard included) is wrapped
    guard: bool = True  # whether a tick of the phase may be a bubble (then the stage kind guards it)
    keeps: bool = False  # whether its ticks keep residuals for the backward pass (not "always")


def phases(checkpoint: Any, schedule: Schedule) -> list[Phase]:
    """Splits the schedule's ticks into the scans that run them: one, or two for ``"except_last"``.

    Every tick's stage computation is guarded against bubbles as the stage kind does it (a
    switch branch for heterogeneous stages; a micro-batch of ``x`` as a homogeneous stage's
    input), and every mode wraps it in ``jax.checkpoint``; the modes differ only in the policy,
    i.e. in what the backward pass may reuse instead of recomputing:

    * ``"always"``: nothing; a device keeps the inputs of its stage, one per tick.
    * ``"never"``: everything but values that only move parameters around. Reverse-mode
      autodiff of a bare ``lax.cond`` inside a scan saves the cond's operands that the backward
      pass needs -- the stage parameters among them -- as per-tick outputs, i.e. a copy of the
      parameters per tick. Under a policy the parameters stay inputs of the checkpoint, which
      are loop-invariant and hoisted out of the scan, and the policy refuses to save the
      slices and reshapes that pick a stage's weights out of them (:data:`STAGE_PARAMS`).
    * a policy: the user's policy, with the same exception.
    * ``"except_last"``: ``"always"`` until the last ``n`` ticks (the drain, which includes the
      last micro-batch on every device; ``n`` = devices; ``2 n - 1`` when sends overlap
      compute, a hop of two ticks), ``"never"`` from there on. Memory per
      tick is a static property of a scan, so this is the one mode with two scans. The parameter
      cotangents of both reach one running sum (see ``engine._scan``), so its gradients are
      bitwise those of the other modes.

    With one scan every stage function appears once in the forward program.
    """
    ticks = schedule.num_ticks
    if checkpoint == "except_last":
        drain = max(ticks - schedule.drain_ticks, 0)
        cuts = [_guarded(0, drain, "always"), _guarded(drain, ticks, "never")]
        return [p for p in cuts if p.stop > p.start]
    return [_guarded(0, ticks, checkpoint)]


def _guarded(start: int, stop: int, checkpoint: Any) -> Phase:
    """A phase whose ticks may be bubbles: the guarded stage call under the mode's wrapper.

    (Checkpointing each stage branch inside the guard as well, under ``"always"``, cuts the
    jaxpr by a third -- a checkpointed branch's residuals are its operands, so the zero-filled
    slots autodiff gives every branch for the others' residuals disappear -- but XLA then fuses
    the backward pass differently, and on the demo's Flax model 150 gradient entries of
    ``"always"`` differed from ``"never"`` by an ulp. The bitwise contract wins.)
    """
    return Phase(start, stop, remat_for(checkpoint), keeps=checkpoint != "always")


def remat_for(checkpoint: Any) -> Remat:
    """The wrapper of one tick's stage computation in a mode other than ``"except_last"``."""
    if checkpoint == "always":
        return _remat()
    if checkpoint == "never":
        return _remat(_except_stage_params(jax.checkpoint_policies.everything_saveable))
    return _remat(_except_stage_params(checkpoint))


def sequential_phases(checkpoint: Any, schedule: Schedule) -> list[Phase]:
    """Phases for :func:`pipejax._src.schedules.tables.sequential` and
    :func:`~pipejax._src.schedules.tables.one_device` (``mesh=None``): no tick is a bubble, so none is
    guarded; ``"except_last"`` keeps the activations of the last micro-batch (as torchgpipe
    does) in a second scan, from its first tick on."""
    T = schedule.num_ticks
    if checkpoint == "except_last":
        cut = int(np.argmax(schedule.table[:, 0] == schedule.num_micro - 1))
        cuts = [
            Phase(0, cut, remat_for("always"), guard=False),
            Phase(cut, T, remat_for("never"), guard=False),
        ]
        return [p for p in cuts if p.stop > p.start]
    return [Phase(0, T, remat_for(checkpoint), guard=False)]


def training_phases(schedule) -> list[Phase]:
    """The phase of a training table (:class:`~pipejax._src.schedules.table.Schedule` with B slots): one scan
    over every tick, its slots unwrapped. Its program owns the backward pass (the slots save and
    recompute as the checkpoint mode says, :mod:`pipejax._src.training.stage_grad`), so nothing differentiates
    the loop and no slot is guarded by the phase."""
    return [Phase(0, schedule.num_ticks, _identity, guard=False)]


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
        input (e.g. ``jax.checkpoint_policies.dots_saveable``): a function, not one of the
        pipeline's checkpoint mode names (``None`` is the pipeline's ``"always"``).

    Returns:
      ``apply(stacked_params, x, key=None)``, where every leaf of ``stacked_params`` has a leading
      axis of length ``L`` (layer ``l`` gets ``tree.map(lambda a: a[l], stacked_params)``).

    Raises:
      TypeError: ``layer`` not callable, ``segments`` not an int, ``policy`` a string or another
        non-policy; from ``apply``, a ``key`` that is not one PRNG key.
      ValueError: ``segments < 1``; from ``apply``, parameters without one leading layer axis,
        or a ``layer`` that changes the activation's type.

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
    checks.check_callable(layer, "layer", "layer(params_l, x, key_l) -> x")
    if segments is not None:
        what = "the number of checkpointed segments (None: about sqrt(L))"
        segments = checks.count(segments, "segments", what=what)
    _check_policy(policy)
    remat = _remat(None if policy is None else _checked(policy))

    def step(carry, xs, key):
        p, index = xs
        k = None if key is None else jax.random.fold_in(key, index)
        return layer(p, carry, k), None

    def run(params, x, index, key):
        """A plain scan over the layers in ``params`` (leading axis), numbered from ``index``."""
        return jax.lax.scan(lambda c, xs: step(c, xs, key), x, (params, index))[0]

    def apply(stacked_params: Any, x: Any, key: jax.Array | None = None) -> Any:
        num_layers = _num_layers(stacked_params)
        checks.check_key(
            key,
            where="checkpoint_sequential's apply",
            batch_fix="Layer l draws from `jax.random.fold_in(key, l)`; for one key per example or per run, "
            "map over the keys: `jax.vmap(apply, in_axes=(None, 0, 0))(params, x, keys)`.",
        )
        try:  # binds *args, defaults and partials as the call would; no signature: left to the call
            inspect.signature(layer).bind(stacked_params, x, key)
        except ValueError:
            pass
        except TypeError as err:
            raise TypeError(
                f"`layer` of checkpoint_sequential, `{getattr(layer, '__qualname__', type(layer).__name__)}"
                f"{inspect.signature(layer)}`, cannot be called as `layer(params_l, x, key_l) -> x`: {err}. "
                "A layer that needs no randomness still takes `key_l` and ignores it (None when apply is "
                "called without a key), e.g. `lambda p, x, key: jnp.tanh(x @ p)`."
            ) from None
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


def _check_policy(policy: Any) -> None:
    """``policy`` of checkpoint_sequential: ``None`` or a ``jax.checkpoint`` policy (a function)."""
    if policy is None:
        return
    if isinstance(policy, str):
        raise TypeError(
            f"`policy` of checkpoint_sequential must be None or a jax.checkpoint policy (a function "
            f"from jax.checkpoint_policies), but got the string {policy!r}. Segments are always "
            "checkpointed; the policy says what else a segment may save: None (the default) saves "
            "only the segment's input, as the pipeline's checkpoint='always' does; "
            "`jax.checkpoint_policies.dots_saveable` also saves matmul outputs; "
            "`jax.checkpoint_policies.everything_saveable` saves everything (no recomputation, as "
            "checkpoint='never'; then plain jax.lax.scan is simpler)."
        )
    check_policy(policy, "`policy` of checkpoint_sequential", "None or a jax.checkpoint policy")


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


def _check_layer_keeps_type(layer, stacked_params, x, key) -> None:
    p0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), stacked_params)
    x_struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
    k_struct = None if key is None else jax.ShapeDtypeStruct(key.shape, key.dtype)
    before, after = Layout.of(x_struct), Layout.of(jax.eval_shape(layer, p0, x_struct, k_struct))
    if after.strong() != before.strong():  # weak types aside (`(x > 0) * 1.5` is weak)
        raise ValueError(
            "`layer` must return an activation of the type it takes, so that layers can be chained, "
            f"but it maps {before.describe()} to {after.describe()}."
        )
