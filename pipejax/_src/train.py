"""Training programs that own the backward pass: ``Pipeline.value_and_grad(loss_fn)``.

GPipe and circular pipelines are forward scans, and ``jax.value_and_grad`` of them is their
training step. The 1F1B and ZB-H1 schedules (:func:`pipejax._src.schedule.training`) interleave
forward and backward work of different micro-batches, which no transformation of a forward
program produces, so the program here runs their table itself, in one ``lax.scan`` over its ticks:

* **F** (micro-batch ``i``): the device runs its stage on its input -- micro-batch ``i`` of ``x``
  on stage 0, the activation the previous device sent otherwise -- and stashes that input (or
  its vjp residuals) in a ring buffer of
  :meth:`~pipejax._src.schedule.TrainingSchedule.stash_slots` slots (slot ``i`` mod the size).
  The last stage applies ``loss_fn`` and adds the masked sum of its per-example losses, over
  the batch size, to the loss.
* **B**: the stage's pullback (rebuilt from the residuals, or by running the stage again on its
  input under ``jax.vjp``) is applied to the cotangent the next device sent (the last stage
  seeds it with the loss): "1f1b" gets the parameter and the input cotangents, "zb-h1" the input
  cotangent only and stashes the output cotangent for W. Stage 0 computes no input cotangent.
* **W** ("zb-h1"): the parameter cotangent, from the stash and the stashed output cotangent.

After the slots, activations go one device forward and cotangents one device back (``ppermute``
on a mesh; without one the devices are virtual and run one after the other within the tick).
Idle slots compute nothing (a ``lax.switch`` branch, or ``lax.cond``, that returns zeros).
Side inputs (``context=``) are cut into micro-batches as ``targets`` are, and every slot hands its
stage the rows of its micro-batch (``stage(params, x, key, context=c)``), as the forward call does.

Memory and compute: a device keeps what B and W need of at most ``stash_slots`` micro-batches
(``2 n - 1``), however many run. With ``checkpoint="never"`` that is the residuals of the
stage's ``jax.vjp`` taken in F (those that depend on the micro-batch; parameter-only ones are
computed again in B and W); with any other mode it is the stage's input, and B (and W) recompute
the stage's forward, as ``checkpoint="always"`` does. Keys are those of the forward pipeline
(:func:`engine.stage_keys`), so recomputation replays the same dropout masks, and the loss and
gradients equal those of ``jax.value_and_grad`` of the GPipe pipeline, up to the order of
floating-point sums.

There is no ``custom_vjp``: the program is ordinary JAX (``jax.vjp`` inside the loop), so
``jax.jvp`` of it gives Hessian-vector products (forward-over-reverse).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from pipejax._src import boundaries as bnd
from pipejax._src import checkpoint as ckpt
from pipejax._src import checks, compat, engine, microbatch, options, stage_forms
from pipejax._src import schedule as sched
from pipejax._src.layout import Container, Layout, is_weak
from pipejax._src.placement import StageParams

PyTree = Any


def value_and_grad(pipe, loss_fn: Callable[[PyTree, PyTree], jax.Array]) -> Callable[..., Any]:
    """``f(params, x, targets, key=None, *, context=None) -> (loss, grads)`` for ``pipe``; see
    :meth:`pipejax.Pipeline.value_and_grad`."""
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be a callable `loss_fn(outputs, targets) -> losses` giving one loss per "
            f"example, but got {type(loss_fn).__name__} {loss_fn!r}."
        )
    owns_backward = pipe.schedule_name in sched.TRAINING_KINDS

    def traced(params, x, targets, key, context, state):
        if owns_backward:
            loss, grads, _, stats = _run(pipe, loss_fn, params, x, targets, key, context, state)
            return ((loss, stats), grads) if pipe.stateful else (loss, grads)
        side = {} if context is None else {"context": context}
        if pipe.stateful:
            side["state"] = state

        def loss_of(p):
            out = pipe(p, x, key, **side)
            y, stats = out if pipe.stateful else (out, None)
            return mean_loss(loss_fn, y, targets), stats

        (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return ((loss, stats), grads) if pipe.stateful else (loss, grads)

    jitted = jax.jit(traced)

    def f(params, x, targets, key=None, *, state=None, context=None):
        checks.check_key(key)
        _check_params(pipe, params)
        _check_float_params(params)
        pipe._check_batch(x, context, targets)
        if state is not None:
            if not pipe.stateful:
                raise TypeError(
                    "`state` was given, but the pipeline is not stateful, so its stages cannot "
                    "receive it. Build it with `pj.pipeline(..., stateful=True)`."
                )
            _check_params(pipe, state, name="state")
        # concrete inputs committed to other devices are moved where the pipeline runs
        params, (x, targets, context), key, state = pipe._commit(params, (x, targets, context), key, state)
        return jitted(params, x, targets, key, context, state)

    f.__doc__ = (
        f"(loss, grads) of `loss_fn` over the batch, with `schedule={pipe.schedule_name!r}`; "
        "((loss, stats), grads) for a stateful pipeline."
    )
    return f


def slot_counts(pipe, loss_fn, params, x, targets, key=None) -> np.ndarray:
    """int[n, 3]: the F, B and W slots each device executed, counted inside the program (a
    working branch adds one, an idle branch zero); ``int[p, n, 3]`` with a data axis of size
    ``p``. For tests and benchmarks."""
    _check_params(pipe, params)
    pipe._check_batch(x, None, targets)
    counts = jax.jit(lambda *a: _run(pipe, loss_fn, *a)[2])(params, x, targets, key)  # stateless
    return np.asarray(counts)


def mean_loss(loss_fn, outputs, targets) -> jax.Array:
    """The loss of the whole batch under the loss contract (see :func:`per_example`): the mean of
    the per-example losses, or their sum over the sum of the weights when ``loss_fn`` returns
    ``(losses, weights)``."""
    size = microbatch.batch_size(outputs, name="outputs")
    losses, weights = per_example(loss_fn, outputs, targets, size, size)
    if weights is None:
        return jnp.sum(losses) / losses.shape[0]
    return jnp.sum(losses) / jnp.sum(lax.stop_gradient(weights))


def per_example(loss_fn, outputs, targets, size: int, batch: int):
    """``(losses f[size], weights f[size] or None)``: what ``loss_fn(outputs, targets)`` returned,
    checked against the loss contract.

    ``loss_fn`` returns either one loss per example, ``f[size]`` (the loss is their mean over the
    real examples of the batch), or a pair ``(losses, weights)`` of two ``f[size]`` (the loss is
    ``sum(losses) / sum(weights)`` over the batch: per-token sums and token counts, for example).
    The weights are data: no gradient flows through them. ``size`` is the rows ``loss_fn`` saw
    (a micro-batch under the training schedules), ``batch`` the user's batch (for messages).
    """
    out = loss_fn(outputs, targets)
    weights = None
    if isinstance(out, (tuple, list)) and len(out) == 2:
        out, weights = out
    where = f"one per example of the batch of {batch}: shape ({size},)"
    if size != batch:
        where += (
            f" per call, as `loss_fn` sees the batch of {batch} in micro-batches of {size} "
            "examples under this schedule"
        )
    for name, a in (("losses", out), ("weights", weights)):
        if a is None:
            continue
        if jnp.shape(a) != (size,):
            raise ValueError(
                f"`loss_fn(outputs, targets)` must return {name} {where}, but returned shape "
                f"{jnp.shape(a)}. Return the per-example losses (e.g. `jnp.sum((y - t) ** 2, "
                "axis=-1)`), or a pair `(losses, weights)` of per-example sums and weights, not a "
                "mean: the pipeline divides by the batch's total (its size, or the sum of the "
                "weights), padding rows excluded."
            )
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise TypeError(
                f"`loss_fn(outputs, targets)` returned {name} of dtype {jnp.result_type(a)}, but a "
                "loss must be floating point to have a gradient (every schedule refuses integer and "
                "boolean losses). Return a float loss, e.g. cast with `.astype(jnp.float32)`."
            )
    return out, weights


def _check_float_params(params) -> None:
    """Every schedule differentiates every parameter leaf, so each must be floating point (the
    rule of ``jax.grad``, which GPipe's backward applies; one message for every schedule)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"`params` leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}, but "
                "`value_and_grad` differentiates every parameter, so every leaf must be floating "
                "point (`jax.grad`'s rule, under every schedule). Make it a float (e.g. `2.0`, "
                "`jnp.asarray(p, jnp.float32)`), or move integer constants out of `params` (into "
                "the stage function, or `context=`)."
            )


def _check_params(pipe, params, name="params"):
    options.check_params_shape(params, pipe, name=name)


# --- the program -----------------------------------------------------------------------------


class _Variant(NamedTuple):
    """What one branch of a device's slot computes: a stage function and its role."""

    fn: Callable[..., Any]
    first: bool  # stage 0: reads x, computes no input cotangent
    last: bool  # the last stage: applies the loss
    params_of: Callable[[Any], Any]  # device's parameter row -> the stage's parameter pytree
    x_layout: Layout
    y_layout: Layout
    stage: int | None = None  # the stage, when one variant runs one stage; None: a homogeneous role


def _run(pipe, loss_fn, params, x, targets, key, context=None, state=None):
    """``(loss, grads, counts int[n, 3], stats)`` of one training step on ``pipe.schedule_name``'s
    table; ``stats`` as the forward call of a stateful pipeline returns them (``None`` otherwise)."""
    # the per-call plan, once: side inputs and targets are cut as x (each slot's stage reads its
    # micro-batch's rows); num_micro per data shard
    call = pipe._cut(x, key, context, targets, stream=False)
    plan, num_micro, xs, mask, ts, cs, key_struct = (
        call.plan,
        call.num_micro,
        call.xs,
        call.mask,
        call.ts,
        call.cs,
        call.key_struct,
    )
    name = pipe.schedule_name
    if name == "interleaved-1f1b" and pipe.mesh is None:
        name = "1f1b"  # virtual devices: one per stage, no ring to share (the same keys and sums)
    elif name == "interleaved-1f1b" and num_micro % pipe.num_devices:
        n, p = pipe.num_devices, pipe.data_size
        per = f" per data shard ({plan.num_micro} in all)" if p > 1 else ""
        # chunks that give exactly that many micro-batches (chunks=5 and 4 both cut 12 into 4)
        fits = [
            c
            for c in range(1, plan.batch + 1)
            if c % (n * p) == 0 and microbatch.plan(plan.batch, c).num_micro == c
        ]
        fix = "a batch of at least that many examples"
        if fits:  # nearest first
            best, *others = sorted(fits, key=lambda c: (abs(c - pipe.chunks), c))
            also = f" (or {', '.join(map(str, others[:3]))})" if others else ""
            fix = f"e.g. `chunks={best}`{also} for this batch"
        raise ValueError(
            f"`schedule='interleaved-1f1b'` sends micro-batches round the {n} devices in groups of "
            f"{n}, so their number must be a multiple of {n}, but a batch of {plan.batch} with "
            f"`chunks={pipe.chunks}` gives {num_micro} micro-batches of {plan.micro_size}{per}. Use a "
            f"number of micro-batches that is a multiple of {n * p} ({fix}), or `schedule='1f1b'`."
        )
    table = sched.training(name, pipe.num_stages, num_micro, pipe.repeats if pipe.mesh is not None else 1)
    splits = pipe._splits(params)  # `param_specs` (or a placed StageParams' own), checked
    runner, to_user = jax.vjp(lambda p: stage_forms.runner_form(pipe, p, splits), params)
    param_specs = None if pipe.mesh is None else stage_forms.full_specs(pipe, runner, splits)
    state_r = stage_forms.runner_form(pipe, state) if pipe.stateful else None
    if pipe.homogeneous:
        boundaries, stats_layouts = bnd.homogeneous(pipe, runner, state_r, xs, key_struct, cs)
        xs = boundaries[0].cast(xs)
    else:
        boundaries, stats_layouts = bnd.heterogeneous(pipe, runner, state_r, xs, key_struct, cs)
    y_struct = boundaries[-1].structs()
    ys_struct = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((plan.micro_size, *a.shape[1:]), a.dtype, weak_type=a.weak_type),
        y_struct,
    )
    _, weights = jax.eval_shape(
        lambda y, t: per_example(loss_fn, y, t, plan.micro_size, plan.batch), ys_struct, _micro(ts)
    )
    cfg = engine.Config(
        pipe.stages,
        pipe.stateful,
        pipe.per_example_keys,
        pipe.checkpoint,
        pipe.axis_name,
        None,
        inner_axes=param_specs is not None,
    )
    prog = _Program(pipe, cfg, loss_fn, table, boundaries, plan, xs, mask, ts, key, cs, weights is not None)
    prog.param_specs = param_specs
    if pipe.stateful:  # every stage's state, whole (stage-major; a list of pytrees for stages that differ)
        prog.state, prog.stats_layouts = compat.replicate(_per_stage_state(pipe, state)), stats_layouts
    if pipe.mesh is None:
        totals, grads, counts, stats = prog.local(runner)
    else:
        totals, grads, counts, stats = prog.mesh(runner)
    loss = totals[0]
    if weights is not None:  # sums of losses and gradients over the batch's total weight
        loss = loss / totals[1]
        grads = jax.tree.map(lambda g: g / totals[1].astype(g.dtype) if _inexact(g) else g, grads)
    if _same_form(params, runner):  # already the engine's form (e.g. `place`d): keep its sharding
        return loss, grads, counts, stats
    # another form (a list of pytrees, or (S, ...) for (v, n, ...)): undo the conversion, which
    # unstacks or reshapes the stage axis, so the grads must not be split over stages there
    return loss, to_user(compat.replicate(grads))[0], counts, stats


def _per_stage_state(pipe, state):
    """A stateful pipeline's ``state`` as the slots read it: stacked stage-major ``(S, ...)``
    (homogeneous), or a list with one pytree per stage."""

    if pipe.homogeneous:
        return stage_forms.stage_major(pipe, state)
    if state is None:
        return [None] * pipe.num_stages
    if isinstance(state, StageParams):
        return stage_forms.stage_major(pipe, state).unpack()
    return list(state)


def _same_form(a, b) -> bool:
    """Whether two pytrees have the same structure and leaf shapes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        jnp.shape(x) == jnp.shape(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def check_targets(targets, batch: int) -> None:
    """``targets`` must have ``x``'s batch (one check for every schedule)."""
    t_size = microbatch.batch_size(targets, name="targets")
    if t_size != batch:
        raise ValueError(
            f"`targets` has a batch of {t_size} examples but `x` has {batch}; `loss_fn` pairs each "
            "output row with its target row (and the training schedules cut targets into "
            "micro-batches with `x`), so the leaves of `targets` need `x`'s leading batch axis."
        )


def _micro(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, weak_type=is_weak(a)), tree)


class _Program:
    def __init__(
        self, pipe, cfg, loss_fn, table, boundaries, plan, xs, mask, ts, key, cs=None, weighted=False
    ):
        self.pipe, self.cfg, self.loss_fn, self.table = pipe, cfg, loss_fn, table
        self.boundaries, self.plan = boundaries, plan
        self.xs, self.mask, self.ts, self.key = xs, mask, ts, key
        self.cs = cs  # micro-batched side inputs, or None
        self.S, self.m = pipe.num_stages, table.num_micro  # micro-batches of this data shard
        self.offset = 0  # index of its first micro-batch in the mini-batch (for the keys)
        self.K = table.stash_slots()  # stage inputs a device keeps
        self.zb = table.weight is not None
        # The loss contract (see `per_example`): a mean is scaled per micro-batch by 1 / batch; a
        # weighted loss adds up sums and weights, and `_run` divides both totals at the end.
        self.weighted = weighted
        self.scale = 1.0 if weighted else 1.0 / plan.batch
        # "always": F stashes the stage input and B and W recompute the stage from it; "never":
        # F keeps the residuals of the stage's vjp; a policy: the residuals of the vjp of the
        # stage checkpointed with that policy, i.e. what the policy saves (see `save`).
        self.keep = cfg.checkpoint != "always"
        self.policy = cfg.checkpoint if callable(cfg.checkpoint) else None
        self._meta = {}  # variant -> (treedef of its pullback, where its parameter leaves go)
        self.param_specs = None  # per parameter leaf its full PartitionSpec (see engine.MeshDevices)
        # stateful stages: every stage's state (a list, or stacked on a stage axis), read whole on
        # every device; the layouts of each stage's stats
        self.state, self.stats_layouts = None, None

    # -- the slots, on typed values ---------------------------------------------------------

    def _inputs(self, i, s):
        """``(k, targets, mask)`` of micro-batch ``i`` at stage ``s``: ``k`` is ``(key, context
        rows or None, s)``, what the stage reads besides its parameters and input (:meth:`_stage`)."""
        ic = engine.clip(i, self.m)
        key = engine.stage_keys(self.cfg, self.key, self.offset + ic, s, self.plan.micro_size)
        read = lambda tree: engine.read(self.cfg, tree, ic)
        rows = None if self.cs is None else read(self.cs)
        return (key, rows, jnp.asarray(s, jnp.int32)), read(self.ts), read(self.mask)

    def _stage(self, v: _Variant, p, x, k, mask):
        """``(y, stats)``: the stage function of ``v`` on ``x`` (with its micro-batch's
        ``context=``, if any; a stateful stage also reads its state and the row mask)."""
        key, rows, s = k
        kwargs = {} if rows is None else {"context": rows}
        if not self.cfg.stateful:
            return v.fn(p, x, key, **kwargs), None
        if not self.pipe.homogeneous:  # a heterogeneous stage (static): its own entry
            state = self.state[v.stage]
        else:  # homogeneous: row `s` of the stacked state
            state = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, s, keepdims=False), self.state)
        return tuple(v.fn(p, x, key, state, mask, **kwargs))

    def _loss(self, y, t, mask):
        """``(loss, weight)`` of a micro-batch: the masked sum of its losses (times ``1 / batch``
        for a mean) and the masked sum of its weights (zero for a mean)."""
        losses, weights = per_example(self.loss_fn, y, t, self.plan.micro_size, self.plan.batch)
        zero = jnp.zeros((), losses.dtype)
        loss = jnp.sum(jnp.where(mask, losses, zero)) * jnp.asarray(self.scale, losses.dtype)
        if weights is None:
            return loss, zero
        return loss, jnp.sum(jnp.where(mask, lax.stop_gradient(weights).astype(losses.dtype), zero))

    def forward(self, v: _Variant, prow, x, k, t, mask):
        """``(y or None, loss contribution f[2] (loss, weight) or None, stats)``."""
        y, stats = self._stage(v, v.params_of(prow), x, k, mask)
        if v.last:
            return None, jnp.stack(self._loss(y, t, mask)), stats
        return y, None, stats

    def save(self, v: _Variant, prow, x, k, t, mask):
        """F: ``(y or None, loss contribution or None, saved, stats)``; ``saved`` is what B and W
        read back: the stage input ``x``, or (``checkpoint="never"`` or a policy) the residuals
        of its vjp; ``stats`` what a stateful stage reported (``None`` otherwise)."""
        if not self.keep:
            y, dloss, stats = self.forward(v, prow, x, k, t, mask)
            return y, dloss, x, stats
        out, (weight, stats), saved = self._vjp(v, prow, x, k, t, mask)
        return (None, jnp.stack([out, weight]), saved, stats) if v.last else (out, None, saved, stats)

    def _residuals(self, v: _Variant, prow, x, k, t, mask):
        """``(value, (weight, stats), residual leaves, treedef)`` of the stage's (the last stage:
        its loss's) pullback; ``weight`` is the last stage's weight sum (``None`` on other
        stages), ``stats`` a stateful stage's statistics.

        ``jax.vjp``'s pullback is a pytree whose leaves are its residuals and whose treedef holds
        the rest (a closed program), so it can be taken apart, stashed and put back together.
        With a checkpoint policy the stage is checkpointed with it first, so the residuals are
        what the policy saves and the pullback recomputes the rest.
        """
        p = v.params_of(prow)
        xf, rebuild = _floats(x)

        def h(p, xf):
            y, stats = self._stage(v, p, rebuild(xf), k, mask)
            if v.last:
                loss, weight = self._loss(y, t, mask)
                return loss, (weight, stats)
            return y, (None, stats)

        if self.policy is not None:
            h = ckpt.remat_for(self.policy)(h)
        out, back, aux = jax.vjp(h, p, xf, has_aux=True)
        leaves, treedef = jax.tree.flatten(back)
        return out, aux, leaves, treedef

    def _meta_of(self, v: _Variant, prow):
        """``(treedef, per_micro, value type)`` of variant ``v``'s pullback; ``per_micro[j]``
        says whether residual ``j`` depends on the micro-batch (its input, key, targets or
        mask). Those are saved by F; the others are functions of the parameters alone (e.g.
        the slice ``w[j]`` of a stacked weight) and are computed again in B and W instead of
        being stored once per micro-batch."""
        if id(v) not in self._meta:
            info = {}

            def leaves(prow, x, k, t, mask):
                out, _, res, info["treedef"] = self._residuals(v, prow, x, k, t, mask)
                info["out"] = jax.tree.map(_struct, out)
                info["types"] = [_struct(a) for a in res]
                return res

            k, t, mask = self._inputs(jnp.zeros((), jnp.int32), 0)
            args = jax.tree.map(_struct, (prow, v.x_layout.structs(), k, t, mask))
            per_micro = _depends(leaves, args, (False, True, True, True, True))
            self._meta[id(v)] = (info["treedef"], per_micro, info["out"], info["types"])
        return self._meta[id(v)][:3]

    def saved_structs(self, v: _Variant, prow):
        """The type of what F saves for B and W (:meth:`save`)."""
        k, t, mask = self._inputs(jnp.zeros((), jnp.int32), 0)
        return jax.eval_shape(lambda p, x: self.save(v, p, x, k, t, mask)[2], prow, v.x_layout.structs())

    def _vjp(self, v: _Variant, prow, x, k, t, mask):
        """F with ``checkpoint="never"`` or a policy: the value, ``(weight, stats)`` (see
        :meth:`_residuals`) and the residuals that depend on the micro-batch."""
        _, per_micro, _ = self._meta_of(v, prow)
        out, aux, leaves, _ = self._residuals(v, prow, x, k, t, mask)
        # the analysis traced the program these residuals come from (same types, weak ones too)
        assert [_struct(a) for a in leaves] == self._meta[id(v)][3], "residuals of another program"
        return out, aux, [a for a, keep in zip(leaves, per_micro, strict=True) if keep]

    def pull(self, v: _Variant, prow, saved, g, k, t, mask, wrt_params: bool, wrt_input: bool):
        """B and W: :meth:`pullback` from what :meth:`save` kept."""
        if not self.keep:
            return self.pullback(v, prow, saved, g, k, t, mask, wrt_params, wrt_input)
        if not (wrt_params or wrt_input):
            return None, None
        treedef, per_micro, out = self._meta_of(v, prow)
        fresh = [None] * len(per_micro)
        if not all(per_micro):  # the parameter-only residuals, from the parameters (x unused)
            fresh = self._residuals(v, prow, engine.zeros(v.x_layout), k, t, mask)[2]
        it = iter(saved)
        back = jax.tree.unflatten(
            treedef, [next(it) if keep else a for keep, a in zip(per_micro, fresh, strict=True)]
        )
        seed = jnp.ones(out.shape, out.dtype) if v.last else _cotangent(g, out)
        dp, dxf = back(seed)
        dprow = jax.vjp(v.params_of, prow)[1](dp)[0] if wrt_params else None
        dx = _fill(v.x_layout.structs(), dxf) if wrt_input else None
        return dx, dprow

    def pullback(self, v: _Variant, prow, x, g, k, t, mask, wrt_params: bool, wrt_input: bool):
        """``(input cotangent or None, parameter-row cotangent or None)`` of the stage (the
        last stage: of its loss) at ``x``, pulled back with ``g``."""
        if not (wrt_params or wrt_input):  # ZB's B on stage 0: nothing to send back
            return None, None
        xf, rebuild = _floats(x)

        def h(prow, xf):
            y = self._stage(v, v.params_of(prow), rebuild(xf), k, mask)[0]
            return self._loss(y, t, mask)[0] if v.last else y

        if wrt_params and wrt_input:
            out, back = jax.vjp(h, prow, xf)
        elif wrt_params:
            out, back = jax.vjp(lambda p: h(p, xf), prow)
        else:
            out, back = jax.vjp(lambda a: h(prow, a), xf)
        seed = jnp.ones_like(out) if v.last else _cotangent(g, out)
        cts = back(seed)
        dp = cts[0] if wrt_params else None
        dx = _fill(x, cts[-1]) if wrt_input else None
        return dx, dp

    # -- without a mesh: virtual devices, one after the other in each tick -------------------

    def local(self, runner):
        S, K, zb, pipe = self.S, self.K, self.zb, self.pipe
        bnd = self.boundaries
        if pipe.homogeneous:
            prows = [jax.tree.map(lambda a, d=d: a[d], runner) for d in range(S)]
        else:
            prows = list(runner)
        variants = [
            _Variant(pipe.stages[d], d == 0, d == S - 1, lambda p: p, bnd[d], bnd[d + 1], d) for d in range(S)
        ]
        rows = tuple(jnp.asarray(a) for a in self._rows())

        def zero(layout, lead=()):
            return engine.zeros(layout, lead)

        init = []
        for d, v in enumerate(variants):
            init.append(
                dict(
                    fin=zero(v.x_layout),
                    bin=zero(v.y_layout),
                    stash=jax.tree.map(
                        lambda a: jnp.zeros((K, *a.shape), a.dtype), self.saved_structs(v, prows[d])
                    ),
                    gstash=zero(v.y_layout, (S,)) if zb and not v.last else None,
                    grad=jax.tree.map(jnp.zeros_like, prows[d]),
                    counts=jnp.zeros((3,), jnp.int32),
                    stats=engine.zeros(self._stats_layout(d), (1, self.m)) if self.cfg.stateful else None,
                )
            )
        loss0 = self._loss_zero(variants[-1])

        def body(c, r):
            devs, loss = c
            f, b, w = r[:3]  # virtual device d runs stage d
            sent_f, sent_b, new = [], [], []
            for d, v in enumerate(variants):
                dev, y, dx, dloss = self._device_tick(v, d, prows[d], devs[d], f[d], b[d], w[d])
                new.append(dev)
                sent_f.append(y)
                sent_b.append(dx)
                if v.last:
                    loss = loss + dloss
            for d in range(S):  # the sends: a local shift
                if d > 0:
                    new[d]["fin"] = sent_f[d - 1]
                if d < S - 1:
                    new[d]["bin"] = sent_b[d + 1]
            return (new, loss), None

        (devs, loss), _ = lax.scan(body, (init, loss0), rows)
        grads = [dev["grad"] for dev in devs]
        if pipe.homogeneous:
            grads = jax.tree.map(lambda *a: jnp.stack(a), *grads)
        counts = jnp.stack([dev["counts"] for dev in devs])
        stats = [jax.tree.map(lambda a: a[0], dev["stats"]) for dev in devs]  # per stage (m, ...)
        if pipe.homogeneous:
            stats = jax.tree.map(lambda *a: jnp.stack(a), *stats)
        return loss, grads, counts, stats

    def _stats_layout(self, s: int) -> Layout:
        """The layout of stage ``s``'s stats (one for every stage when they are homogeneous)."""
        return self.stats_layouts if self.pipe.homogeneous else self.stats_layouts[s]

    def _loss_zero(self, v):
        out = jax.eval_shape(
            lambda y, t, mask: self._loss(y, t, mask),
            v.y_layout.structs(),
            _micro(self.ts),
            _micro(self.mask),
        )
        return jnp.zeros((2,), out[0].dtype)  # (loss, weight)

    def _rows(self):
        t = self.table
        w = t.weight if t.weight is not None else np.full_like(t.forward, -1)
        return (t.forward, t.backward, w, *t.stages())

    def _device_tick(self, v, d, prow, dev, i, j, k):
        """One tick of virtual device ``d`` (static stage ``v``); ``lax.cond`` skips idle slots."""
        K, S, zb = self.K, self.S, self.zb
        dev = dict(dev)
        counts = dev["counts"]
        # F
        x_in = engine.take(self.xs, engine.clip(i, self.m)) if v.first else dev["fin"]

        def f_work(x_in, i):
            return *self.save(v, prow, x_in, *self._inputs(i, d)), jnp.ones((), jnp.int32)

        def f_idle(x_in, i):
            out = jax.eval_shape(lambda: self.save(v, prow, x_in, *self._inputs(i, d)))
            return *(_zeros_like(a) for a in out), jnp.zeros((), jnp.int32)

        y, dloss, saved, stats, c = lax.cond(i >= 0, f_work, f_idle, x_in, i)
        dev["stash"] = engine.put(dev["stash"], saved, i % K, i >= 0)
        if self.cfg.stateful:  # F records the stage's statistics of micro-batch i
            dev["stats"] = engine.write(dev["stats"], stats, 0, engine.clip(i, self.m), i >= 0)
        counts = counts.at[0].add(c)
        # B
        xb = engine.take(dev["stash"], j % K)

        # the parameter cotangent is added inside the branch: see `mesh`
        def b_work(xb, g, j, grad):
            dx, dp = self.pull(v, prow, xb, g, *self._inputs(j, d), wrt_params=not zb, wrt_input=not v.first)
            return dx, grad if dp is None else _add(grad, dp), jnp.ones((), jnp.int32)

        def b_idle(xb, g, j, grad):
            out = jax.eval_shape(lambda: b_work(xb, g, j, grad))
            return _zeros_like(out[0]), grad, jnp.zeros((), jnp.int32)

        dx, dev["grad"], c = lax.cond(j >= 0, b_work, b_idle, xb, dev["bin"], j, dev["grad"])
        counts = counts.at[1].add(c)
        if zb:
            if dev["gstash"] is not None:
                dev["gstash"] = engine.put(dev["gstash"], dev["bin"], j % S, j >= 0)
            xw = engine.take(dev["stash"], k % K)
            gw = None if dev["gstash"] is None else engine.take(dev["gstash"], k % S)

            def w_work(xw, gw, k, grad):
                dp = self.pull(v, prow, xw, gw, *self._inputs(k, d), wrt_params=True, wrt_input=False)[1]
                return _add(grad, dp), jnp.ones((), jnp.int32)

            def w_idle(xw, gw, k, grad):
                return grad, jnp.zeros((), jnp.int32)

            dev["grad"], c = lax.cond(k >= 0, w_work, w_idle, xw, gw, k, dev["grad"])
            counts = counts.at[2].add(c)
        dev["counts"] = counts
        if y is None:
            y = engine.zeros(v.y_layout)
        if dx is None:
            dx = engine.zeros(v.x_layout)
        return dev, y, dx, dloss

    # -- on a mesh: one SPMD program, a device per stage ------------------------------------

    def mesh(self, runner):
        pipe, S, K, zb = self.pipe, self.S, self.K, self.zb
        n, v_rep = pipe.num_devices, pipe.repeats  # device d holds stages d, d + n, ...
        axis, mesh = pipe.axis_name, pipe.mesh
        bnd = self.boundaries
        if pipe.homogeneous:
            variants, index = self._homogeneous_variants()
            prows_in = runner
            box = None
        else:
            pbox = Container.for_layouts(runner.layouts)
            variants = [
                _Variant(
                    pipe.stages[t],
                    t == 0,
                    t == S - 1,
                    lambda prow, t=t: pbox.unpack(prow, runner.layouts[t]),
                    bnd[t],
                    bnd[t + 1],
                    t,
                )
                for t in range(S)
            ]
            index = np.arange(S)
            prows_in = runner.buffers
            box = Container.for_layouts(bnd)
        # Values typed with Explicit axes inside a stage (param_specs over a "model" axis) are
        # replicated before they are flattened into a container (a reshape across a sharded
        # dimension is refused there); other values pass unchanged.
        pack = (lambda tree: tree) if box is None else (lambda tree: box.pack(compat.replicate(tree)))
        unpack = (lambda msg, layout: msg) if box is None else box.unpack
        msg_zeros = (lambda lead=(): engine.zeros(bnd[0], lead)) if box is None else box.zeros
        lead = 1 if v_rep == 1 else 2  # (S, ...) or, interleaved, (v, n, ...) stacked stages
        if self.keep:  # residuals differ per stage (and role): one container for all
            row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), prows_in)
            saved_layouts = [Layout.of(self.saved_structs(v, row)) for v in variants]
            sbox = Container.for_layouts(saved_layouts)
            s_pack, s_zeros = (lambda tree: sbox.pack(compat.replicate(tree))), sbox.zeros
            s_unpack = lambda msg, v: sbox.unpack(msg, saved_layouts[variants.index(v)])
        else:  # the stage input, as a message
            s_pack, s_zeros = pack, msg_zeros
            s_unpack = lambda msg, v: unpack(msg, v.x_layout)
        # stateful stages: a device records the stats of its F slots at (stage, micro-batch) of
        # an (S, m) buffer (heterogeneous: flat containers); a psum of exact zeros merges them
        st_pack, st_zeros, st_unpack = _stats_container(pipe, self.stats_layouts)
        loss0 = self._loss_zero(variants[-1])
        rows = tuple(jnp.asarray(a) for a in self._rows())
        data = pipe.data_axis_name
        spec = PartitionSpec(axis) if v_rep == 1 else PartitionSpec(None, axis)
        rep = PartitionSpec()
        batch_spec = rep if data is None else PartitionSpec(data)  # micro-batches split over data
        # the engine's device abstraction places the parameters (and, with `param_specs`, makes
        # the shard_map manual over the stage and data axes only: tensor / FSDP sharding inside)
        devices = engine.MeshDevices(
            self.cfg._replace(data_axis_name=data), mesh, v_rep, pipe.data_size, self.param_specs
        )
        prows_in, param_in, manual = devices.place_params(prows_in, spec)
        xs, mask, ts = (compat.constrain(a, mesh, batch_spec, axis) for a in (self.xs, self.mask, self.ts))
        key = compat.constrain(self.key, mesh, rep, axis)
        cs = None if self.cs is None else compat.constrain(self.cs, mesh, batch_spec, axis)

        def body(prows, xs, mask, ts, key, cs, state):
            # the device's stages as rows (v, ...); a slot picks row `stage // n`
            prows = devices.gather_data(prows)  # FSDP: dimensions stored over the data axis, whole
            rows_p = prows if v_rep == 1 else jax.tree.map(lambda a: a[:, 0], prows)
            d = lax.axis_index(axis)
            prog = _Program(
                pipe, self.cfg, self.loss_fn, self.table, bnd, self.plan, xs, mask, ts, key, cs, self.weighted
            )
            if data is not None:
                prog.offset = lax.axis_index(data) * self.m
            prog.state = state
            variant_of = jnp.asarray(index, jnp.int32)
            idle = len(variants)

            def branches(make):
                return [make(v) for v in variants]

            def tick(c, r):
                fin, bin_, stash, gstash, grad, loss, counts, stats = c
                f, b, w, fs, bs = (a[d] for a in r)  # micro-batches and stages of the slots
                # F
                fresh = pack(engine.read(self.cfg, xs, engine.clip(f, self.m)))  # stage 0 reads x
                x_in = jax.tree.map(lambda a, b: jnp.where(fs == 0, a, b), fresh, fin)

                def f_branch(v):
                    def run(rows_p, x_in, f):
                        prow = engine.take(rows_p, fs // n)
                        x = unpack(x_in, v.x_layout)
                        y, dloss, saved, st = prog.save(v, prow, x, *prog._inputs(f, fs))
                        y = msg_zeros() if y is None else pack(y)
                        dloss = jnp.zeros_like(loss) if dloss is None else dloss.astype(loss.dtype)
                        return y, dloss, s_pack(saved), st_pack(st), jnp.ones((), jnp.int32)

                    return run

                def f_idle(rows_p, x_in, f):
                    return msg_zeros(), jnp.zeros_like(loss), s_zeros(), st_zeros(), jnp.zeros((), jnp.int32)

                y, dloss, saved, st, c0 = lax.switch(
                    jnp.where(f >= 0, variant_of[fs], idle), [*branches(f_branch), f_idle], rows_p, x_in, f
                )
                stash = engine.put(stash, saved, (fs // n) * K + f % K, f >= 0)  # K slots per stage held
                stats = engine.write(stats, st, fs, engine.clip(f, self.m), f >= 0)
                # B
                xb = engine.take(stash, (bs // n) * K + b % K)

                # The parameter cotangent is added inside the branch (an idle branch returns the
                # accumulator as it is), so no parameter-sized temporary leaves the branch.
                def b_branch(v):
                    def run(rows_p, xb, g, b, grad):
                        dx, dp = prog.pull(
                            v,
                            engine.take(rows_p, bs // n),
                            s_unpack(xb, v),
                            None if v.last else unpack(g, v.y_layout),
                            *prog._inputs(b, bs),
                            wrt_params=not zb,
                            wrt_input=not v.first,
                        )
                        dx = msg_zeros() if dx is None else pack(dx)
                        grad = grad if dp is None else _add_row(grad, bs // n, dp)
                        return dx, grad, jnp.ones((), jnp.int32)

                    return run

                b_idle = lambda rows_p, xb, g, b, grad: (msg_zeros(), grad, jnp.zeros((), jnp.int32))
                dx, grad, c1 = lax.switch(
                    jnp.where(b >= 0, variant_of[bs], idle),
                    [*branches(b_branch), b_idle],
                    rows_p,
                    xb,
                    bin_,
                    b,
                    grad,
                )
                c2 = jnp.zeros((), jnp.int32)
                if zb:
                    # (ZB-H1 runs one stage per device: W's stage is B's, the device's)
                    gstash = engine.put(gstash, bin_, b % n, b >= 0)
                    xw, gw = engine.take(stash, w % K), engine.take(gstash, w % n)

                    def w_branch(v):
                        def run(rows_p, xw, gw, w, grad):
                            g = None if v.last else unpack(gw, v.y_layout)
                            _, dp = prog.pull(
                                v,
                                engine.take(rows_p, 0),
                                s_unpack(xw, v),
                                g,
                                *prog._inputs(w, d),
                                wrt_params=True,
                                wrt_input=False,
                            )
                            return _add_row(grad, 0, dp), jnp.ones((), jnp.int32)

                        return run

                    w_idle = lambda rows_p, xw, gw, w, grad: (grad, jnp.zeros((), jnp.int32))
                    grad, c2 = lax.switch(
                        jnp.where(w >= 0, variant_of[d], idle),
                        [*branches(w_branch), w_idle],
                        rows_p,
                        xw,
                        gw,
                        w,
                        grad,
                    )
                counts = counts + jnp.stack([c0, c1, c2])
                fin = engine.shift(y, axis, n, ring=v_rep > 1)
                bin_ = engine.shift(dx, axis, n, ring=v_rep > 1, back=True)
                return (fin, bin_, stash, gstash, grad, loss + dloss, counts, stats), None

            init = (
                msg_zeros(),
                msg_zeros(),
                s_zeros((v_rep * K,)),
                msg_zeros((n,)) if zb else None,
                _zeros_like(rows_p),
                loss0,
                jnp.zeros((3,), jnp.int32),
                st_zeros((S, self.m)),
            )
            c, _ = lax.scan(tick, init, rows)
            grad, loss, counts = c[4], c[5], c[6]
            stats = engine.sum_exact(c[7], axis)  # each (stage, micro-batch) written by one device
            # rows (v, ...) -> the device's block of the stacked stages: (1, ...) or (v, 1, ...)
            lead = lambda tree: jax.tree.map(lambda a: a if v_rep == 1 else a[:, None], tree)
            loss = lax.psum(loss, axis)
            if data is None:
                return loss, lead(grad), counts[None], stats
            # every data shard ran its own micro-batches: sum their losses and gradients
            return lax.psum(loss, data), devices.sum_over_data(lead(grad)), counts[None, None], stats

        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                param_in,
                batch_spec,
                batch_spec,
                batch_spec,
                None if key is None else rep,
                None if cs is None else batch_spec,
                None if self.state is None else rep,
            ),
            out_specs=(
                rep,
                param_in,
                PartitionSpec(axis) if data is None else PartitionSpec(data, axis),
                rep if data is None else PartitionSpec(None, data),  # stats (S, m, ...)
            ),
            axis_names=manual,
            check_vma=False,
        )
        state = None if self.state is None else compat.constrain(self.state, mesh, rep, axis)
        loss, grads, counts, stats = fn(prows_in, xs, mask, ts, key, cs, state)
        if not pipe.homogeneous:
            grads = type(runner).tree_unflatten(runner.tree_flatten()[1], grads)
        return loss, grads, counts, st_unpack(stats)

    def _homogeneous_variants(self):
        """One stage function, so one branch per role: (first, last) pairs that occur."""
        S, bnd, fn = self.S, self.boundaries, self.pipe.stages[0]
        roles = sorted({(t == 0, t == S - 1) for t in range(S)}, reverse=True)
        variants = [_Variant(fn, first, last, lambda p: p, bnd[0], bnd[0]) for first, last in roles]
        index = np.array([roles.index((t == 0, t == S - 1)) for t in range(S)])
        return variants, index


# --- small exact helpers ---------------------------------------------------------------------


def _stats_container(pipe, layouts):
    """``(pack, zeros, unpack)`` of the stats buffer of a stateful pipeline on a mesh: the stats
    of one slot as one value every stage's branch returns (heterogeneous: a flat container), and
    the ``(S, m, ...)`` buffer back as the stats of each stage (a list of ``(m, ...)`` pytrees;
    homogeneous: one pytree ``(S, m, ...)``, as the forward call returns them)."""
    if not pipe.stateful:
        return (lambda tree: None), (lambda lead=(): None), (lambda acc: None)
    if pipe.homogeneous:
        return (lambda tree: tree), (lambda lead=(): engine.zeros(layouts, lead)), (lambda acc: acc)
    box = Container.for_layouts(layouts)

    def unpack(acc):
        out = []
        for s, layout in enumerate(layouts):
            rows = tuple(a[s] for a in acc)
            out.append(
                jax.vmap(lambda r, layout=layout: box.unpack(r, layout))(rows)
                if layout.shapes
                else layout.structs()
            )
        return out

    return (lambda tree: box.pack(compat.replicate(tree))), box.zeros, unpack


def _add_row(acc, r, delta):
    """``acc[r] += delta``."""

    def one(a, g):
        return lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, r, keepdims=False) + g.astype(a.dtype), r, 0
        )

    return jax.tree.map(one, acc, delta)


def _add(acc, delta):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, delta)


def _zeros_like(tree):
    if tree is None:
        return None
    return jax.tree.map(lambda a: jnp.zeros_like(a), tree)  # sharding types too


def _struct(a):
    """The type of ``a``, weak type included: a weakly typed scalar parameter traces to another
    program (an extra ``convert_element_type``, so other residuals) than a strong one."""
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), weak_type=jax.typeof(a).weak_type)


def _depends(fn, args, varying) -> list[bool]:
    """For each output leaf of ``fn(*args)``: whether it depends on a leaf of an argument whose
    ``varying`` flag is set (conservatively: an equation with any such input taints all its
    outputs, nested programs included)."""
    closed = jax.make_jaxpr(fn)(*args)
    flags = [f for a, f in zip(args, varying, strict=True) for _ in jax.tree.leaves(a)]
    tainted = {var for var, f in zip(closed.jaxpr.invars, flags, strict=True) if f}
    for eqn in closed.jaxpr.eqns:
        if any(not isinstance(a, jex_core.Literal) and a in tainted for a in eqn.invars):
            tainted.update(eqn.outvars)
    return [not isinstance(a, jex_core.Literal) and a in tainted for a in closed.jaxpr.outvars]


def _inexact(a) -> bool:
    dtype = a.dtype if hasattr(a, "dtype") else jnp.result_type(a)
    return jnp.issubdtype(dtype, jnp.inexact)


def _floats(x):
    """The floating leaves of ``x`` (the ones that have cotangents) and how to put them back."""
    leaves, treedef = jax.tree.flatten(x)
    where = [_inexact(a) for a in leaves]
    floats = [a for a, f in zip(leaves, where, strict=True) if f]

    def rebuild(fl):
        it = iter(fl)
        return jax.tree.unflatten(treedef, [next(it) if f else a for a, f in zip(leaves, where, strict=True)])

    return floats, rebuild


def _fill(x, float_cts):
    """A cotangent of ``x``'s type: ``float_cts`` on its floating leaves, zeros elsewhere."""
    leaves, treedef = jax.tree.flatten(x)
    it = iter(float_cts)
    return jax.tree.unflatten(
        treedef, [next(it) if _inexact(a) else jnp.zeros(a.shape, a.dtype) for a in leaves]
    )


def _cotangent(g, out):
    """``g`` with ``out``'s dtypes (exact for the containers' round trip) and sharding types (a
    value typed with an Explicit axis inside a stage comes out of its container replicated)."""
    return jax.tree.map(lambda a, o: compat.like(a.astype(o.dtype), o), g, out)
