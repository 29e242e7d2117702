"""Training programs that own the backward pass: ``Pipeline.value_and_grad(loss_fn)``.

GPipe and circular pipelines are forward scans, and ``jax.value_and_grad`` of them is their
training step. The 1F1B and ZB-H1 schedules (:func:`pipejax._src.schedule.training`) interleave
forward and backward work of different micro-batches, which no transformation of a forward
program produces. Their table runs in the engine's one tick loop, the loop of the forward
schedules (:meth:`engine.MeshDevices.loop` on a mesh, :meth:`engine.LocalDevices.run` without
one), with the slots this program gives it (:class:`engine.Slots`):

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

The engine's tick runs F as the stage computation of every table: its input selection (the
micro-batch of ``x`` for stage 0), its stats buffer and its forward send; B and W follow in the
same tick (:meth:`_Program.back`), and their cotangents go one device back (``ppermute``). Idle
slots compute nothing (a ``lax.switch`` branch that returns zeros). Every slot picks its branch
with the engine's one stage dispatch (:func:`engine.dispatch`), and messages, stashes and stats
travel in the engine's stage objects' containers (:class:`_IO`). The loop runs in the engine's
one ``shard_map`` (:meth:`engine.MeshDevices.spmd`), which checks varying types: every input is
cast to vary along the manual axes before the loop.

Without a mesh there is one device and no bubble to fill: every training schedule is gradient
accumulation over the micro-batches, the table :func:`~pipejax._src.schedule.sequential_training`
(:meth:`_Program.local`), with the same keys, loss terms and checkpoint modes, and one
micro-batch's activations kept at a time.
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

from pipejax._src import aux_outputs, checks, compat, engine, microbatch, options, stage_forms
from pipejax._src import boundaries as bnd
from pipejax._src import checkpoint as ckpt
from pipejax._src import schedule as sched
from pipejax._src.layout import Container, Layout, is_weak
from pipejax._src.loss import check_float_params, mean_loss, per_example
from pipejax._src.placement import StageParams

PyTree = Any


def value_and_grad(
    pipe,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    aux_loss: Callable[[PyTree], jax.Array] | None = None,
) -> Callable[..., Any]:
    """``f(params, x, targets, key=None, *, context=None) -> (loss, grads)`` for ``pipe``; see
    :meth:`pipejax.Pipeline.value_and_grad`."""
    aux_loss = aux_outputs.check_aux_loss(aux_loss, pipe)
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be a callable `loss_fn(outputs, targets) -> losses` giving one loss per "
            f"example, but got {type(loss_fn).__name__} {loss_fn!r}."
        )
    owns_backward = pipe.schedule_name in sched.TRAINING_KINDS

    def traced(params, x, targets, key, context, state):
        if owns_backward:
            loss, grads, _, stats, aux = _run(
                pipe, loss_fn, params, x, targets, key, context, state, aux_loss
            )
            return (pipe._returned(loss, stats, aux), grads)
        if pipe.aux is None:
            side = {} if context is None else {"context": context}
            if pipe.stateful:
                side["state"] = state

            def loss_of(p):
                out = pipe(p, x, key, **side)
                y, stats = out if pipe.stateful else (out, None)
                return mean_loss(loss_fn, y, targets), stats

            (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            return ((loss, stats), grads) if pipe.stateful else (loss, grads)
        batch = microbatch.batch_size(x)

        def loss_aux(p):  # the aux loss from the records of every (stage, micro-batch)
            y, stats, aux, mask = pipe._forward(p, x, key, state, context)
            loss = mean_loss(loss_fn, y, targets)
            extra = aux_outputs.total(aux_loss, aux, mask, batch, pipe.homogeneous)
            loss = loss if extra is None else loss + extra.astype(loss.dtype)
            return loss, (stats, aux_outputs.reduce(pipe.aux, aux, mask, batch, pipe.homogeneous))

        (loss, (stats, aux)), grads = jax.value_and_grad(loss_aux, has_aux=True)(params)
        return (pipe._returned(loss, stats, aux), grads)

    jitted = jax.jit(traced)

    def f(params, x, targets, key=None, *, state=None, context=None):
        checks.check_key(key)
        _check_params(pipe, params)
        check_float_params(params)
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
        "((loss, stats), grads) for a stateful pipeline, ((loss, aux), grads) with `aux=`, "
        "((loss, stats, aux), grads) with both."
    )
    return f


def slot_counts(pipe, loss_fn, params, x, targets, key=None) -> np.ndarray:
    """int[n, 3]: the F, B and W slots each device executed, counted inside the program (a
    working branch adds one, an idle branch zero); ``int[p, n, 3]`` with a data axis of size
    ``p``; without a mesh ``int[S, 3]``, one F and one B slot per stage and micro-batch (the
    gradient accumulation of :meth:`_Program.local`). For tests and benchmarks."""
    _check_params(pipe, params)
    pipe._check_batch(x, None, targets)
    counts = jax.jit(lambda *a: _run(pipe, loss_fn, *a)[2])(params, x, targets, key)  # stateless
    return np.asarray(counts)


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


def _run(pipe, loss_fn, params, x, targets, key, context=None, state=None, aux_loss=None):
    """``(loss, grads, counts int[n, 3], stats, aux)`` of one training step on
    ``pipe.schedule_name``'s table; ``stats`` and ``aux`` as the forward call of a stateful or
    ``aux`` pipeline returns them (``None`` otherwise)."""
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
        name = "1f1b"  # one device: gradient accumulation (`_Program.local`), no ring to share
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
    # tied copies: the same values; the gradients come back summed over each group (the transpose
    # of the tie), and a tangent of one copy reaches every copy (jvp of this step: HVPs)
    params, untie = jax.vjp(lambda p: stage_forms.tie(pipe, p), params)
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
    aux_scale = None
    if weights is not None and aux_loss is not None:
        aux_scale = _total_weight(pipe, loss_fn, ys_struct, ts, call.mask, plan)
    cfg = engine.Config(
        pipe.stages,
        pipe.stateful,
        pipe.per_example_keys,
        pipe.checkpoint,
        pipe.axis_name,
        None,
        inner_axes=param_specs is not None,
        aux=pipe.aux is not None,
    )
    prog = _Program(pipe, cfg, loss_fn, table, boundaries, plan, xs, mask, ts, key, cs, weights is not None)
    prog.param_specs, prog.aux_loss, prog.aux_scale = param_specs, aux_loss, aux_scale
    if pipe.stateful:  # every stage's state, whole (stage-major; a list of pytrees for stages that differ)
        prog.state = compat.replicate(_per_stage_state(pipe, state))
    prog.stats_layouts = stats_layouts  # each stage's records (stats, aux outputs or both), if any
    if pipe.mesh is None:
        totals, grads, counts, stats = prog.local(runner)
    else:
        totals, grads, counts, stats = prog.mesh(runner)
    loss = totals[0]
    if weights is not None:  # sums of losses and gradients over the batch's total weight
        loss = loss / totals[1]
        grads = jax.tree.map(lambda g: g / totals[1].astype(g.dtype) if _inexact(g) else g, grads)
    if not _same_form(params, runner):
        # another form (a list of pytrees, or (S, ...) for (v, n, ...)): undo the conversion, which
        # unstacks or reshapes the stage axis, so the grads must not be split over stages there;
        # the engine's form (e.g. `place`d) is kept with its sharding
        grads = to_user(compat.replicate(grads))[0]
    if pipe.tied:  # each copy's gradient: the sum over its group (typed as the copies, for the vjp)
        grads = untie(jax.tree.map(_typed_as, grads, params))[0]
    stats, aux = aux_outputs.split(stats, pipe.stateful, pipe.aux is not None, pipe.homogeneous)
    if aux is not None:
        aux = aux_outputs.reduce(pipe.aux, aux, call.mask, plan.batch, pipe.homogeneous)
    return loss, grads, counts, stats, aux


def _total_weight(pipe, loss_fn, ys_struct, ts, mask, plan) -> jax.Array:
    """The batch's total weight ``W`` of a weighted ``loss_fn`` (one that returns ``(losses,
    weights)``), computed before the loop so that an aux loss can be scaled by it.

    The training schedules add up the sums of losses and weights over the micro-batches and
    divide by the total weight at the end, after the aux losses' gradients are summed in; each
    slot's aux term is therefore scaled by ``W`` (:meth:`_Program._extra`), and the division
    takes it back out. ``W`` is known up front when the weights do not depend on the outputs
    (they come from the targets, e.g. a padding mask): it is the masked sum of the weights of
    ``loss_fn(zeros, targets_i)`` over every micro-batch (the whole batch: with a data axis the
    targets are global arrays here)."""
    y_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ys_struct)

    def weights_of(y, t):
        return per_example(loss_fn, y, t, plan.micro_size, plan.batch)[1]

    if _depends(weights_of, (ys_struct, _micro(ts)), (True, False))[0]:
        raise NotImplementedError(
            f"`aux_loss` with a `loss_fn` whose weights depend on its `outputs` is not supported "
            f"under `schedule={pipe.schedule_name!r}`: this schedule adds the aux losses' gradients "
            "in as it goes, scaled by the batch's total weight, which it must know before the first "
            "micro-batch, so the weights of `loss_fn(outputs, targets) -> (losses, weights)` must "
            "come from the targets alone (e.g. a padding mask in the targets). Compute the weights "
            "from `targets`, or train with `schedule='gpipe'` (or 'circular'), whose "
            "`value_and_grad` supports weights of any kind."
        )
    losses_dtype = jax.eval_shape(
        lambda y, t: per_example(loss_fn, y, t, plan.micro_size, plan.batch)[0], ys_struct, _micro(ts)
    ).dtype
    w = jax.vmap(lambda t: weights_of(y_zero, t))(ts)  # (m, micro_size), every micro-batch
    w = jnp.where(mask, lax.stop_gradient(w).astype(losses_dtype), jnp.zeros((), losses_dtype))
    return compat.replicate(jnp.sum(w))


def _records(pipe) -> bool:
    """Whether the stages report per-(stage, micro-batch) records: stats, aux outputs or both."""
    return pipe.stateful or pipe.aux is not None


def _typed_as(g, p):
    """``g`` with the sharding type of ``p`` (Explicit axes type them; values unchanged)."""
    if not any(getattr(jax.typeof(p).sharding, "spec", ())):
        return compat.replicate(g)
    return compat.like(g, p)


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
        self._meta = {}  # id(variant) -> its pullback's :class:`_Pullback`
        self.param_specs = None  # per parameter leaf its full PartitionSpec (see engine.MeshDevices)
        # stateful stages: every stage's state (a list, or stacked on a stage axis), read whole on
        # every device; the layouts of each stage's stats
        self.state, self.stats_layouts = None, None
        # `value_and_grad(..., aux_loss=)`: each slot adds w_i aux_loss(aux) to the loss (and seeds
        # its cotangent in B and W), see `_extra`; None: no aux loss
        self.aux_loss = None
        # a weighted loss with an aux loss: the batch's total weight W, by which each aux term is
        # scaled (the final division by the summed weights takes it back out; see `_total_weight`)
        self.aux_scale = None
        # the slots' device (see `mesh` and `local`): containers and dispatch (None: virtual
        # devices, no mesh), the device's parameter rows, each stage's variant, a zero loss part
        self.io, self.prows, self.variants, self.loss0 = None, None, None, None

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
        state = None
        if self.cfg.stateful and not self.pipe.homogeneous:  # a heterogeneous stage (static): its own entry
            state = self.state[v.stage]
        elif self.cfg.stateful:  # homogeneous: row `s` of the stacked state
            state = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, s, keepdims=False), self.state)
        return aux_outputs.call(v.fn, self.cfg.stateful, self.cfg.aux, p, x, key, state, mask, kwargs)

    def _extra(self, stats, mask):
        """The aux loss of a slot's (stage, micro-batch), ``w_i aux_loss(aux)`` (see
        :mod:`pipejax._src.aux_outputs`; with a weighted loss ``W w_i aux_loss(aux)``, ``W`` the
        batch's total weight, see :func:`_total_weight`), or ``None`` without one."""
        if self.aux_loss is None:
            return None
        aux = stats[1] if self.cfg.stateful else stats
        value = aux_outputs.term(self.aux_loss, aux, mask, self.plan.batch)
        if value is None or self.aux_scale is None:
            return value
        return value * self.aux_scale.astype(value.dtype)  # a weighted loss: W w_i aux_loss(aux)

    def _loss(self, y, t, mask):
        """``(loss, weight)`` of a micro-batch: the masked sum of its losses (times ``1 / batch``
        for a mean) and the masked sum of its weights (zero for a mean)."""
        losses, weights = per_example(self.loss_fn, y, t, self.plan.micro_size, self.plan.batch)
        zero = jnp.zeros((), losses.dtype)
        loss = jnp.sum(jnp.where(mask, losses, zero)) * jnp.asarray(self.scale, losses.dtype)
        if weights is None:
            return loss, zero
        return loss, jnp.sum(jnp.where(mask, lax.stop_gradient(weights).astype(losses.dtype), zero))

    def _objective(self, v: _Variant, p, x, k, t, mask):
        """What a slot differentiates, ``(value, (weight, stats))``: the last stage's loss (its
        aux loss added), another stage's output (beside its aux loss, :class:`_WithAux`, when it
        has one); ``weight`` is the last stage's weight sum (``None`` elsewhere), ``stats`` what
        a stateful stage reported."""
        y, stats = self._stage(v, p, x, k, mask)
        extra = self._extra(stats, mask)
        if v.last:
            loss, weight = self._loss(y, t, mask)
            return _plus(loss, extra), (weight, stats)
        return (y if extra is None else _WithAux(y, extra)), (None, stats)

    def save(self, v: _Variant, prow, x, k, t, mask):
        """F: ``(y or None, loss contribution f[2] (loss, weight) or None, saved, stats)``;
        ``saved`` is what B and W read back: the stage input ``x``, or (``checkpoint="never"``
        or a policy) the residuals of its vjp. Every stage with an aux loss contributes it."""
        if self.keep:
            out, (weight, stats), saved = self._vjp(v, prow, x, k, t, mask)
        else:
            out, (weight, stats) = self._objective(v, v.params_of(prow), x, k, t, mask)
            saved = x
        if v.last:
            return None, jnp.stack([out, weight]), saved, stats
        if isinstance(out, _WithAux):  # the stage's aux loss joins the loss
            return out.y, jnp.stack([out.extra, jnp.zeros_like(out.extra)]), saved, stats
        return out, None, saved, stats

    def _residuals(self, v: _Variant, prow, x, k, t, mask):
        """``(value, (weight, stats), residual leaves, treedef)`` of the stage's (the last stage:
        its loss's) pullback (:meth:`_objective`).

        ``jax.vjp``'s pullback is a pytree whose leaves are its residuals and whose treedef holds
        the rest (a closed program), so it can be taken apart, stashed and put back together.
        With a checkpoint policy the stage is checkpointed with it first, so the residuals are
        what the policy saves and the pullback recomputes the rest.
        """
        xf, rebuild = _floats(x)

        def h(p, xf):
            return self._objective(v, p, rebuild(xf), k, t, mask)

        if self.policy is not None:
            h = ckpt.remat_for(self.policy)(h)
        out, back, aux = jax.vjp(h, v.params_of(prow), xf, has_aux=True)
        leaves, treedef = jax.tree.flatten(back)
        return out, aux, leaves, treedef

    def _meta_of(self, v: _Variant, prow) -> _Pullback:
        """What variant ``v``'s pullback looks like (:class:`_Pullback`), traced once."""
        if id(v) not in self._meta:
            info = {}

            def leaves(prow, x, k, t, mask):
                out, _, res, info["treedef"] = self._residuals(v, prow, x, k, t, mask)
                info["out"] = jax.tree.map(_typed_struct, out)
                info["axes"] = _axes(out.extra if isinstance(out, _WithAux) else out)
                info["types"] = [_struct(a) for a in res]
                info["typed"] = [_typed_struct(a) for a in res]
                return res

            k, t, mask = self._inputs(jnp.zeros((), jnp.int32), 0)
            # traced with the types the slots see: inside the shard_map, values that vary along
            # its manual axes (the input too, as the parameters do)
            x = _zero_input(v, prow)
            per_micro = _depends(leaves, (prow, x, k, t, mask), (False, True, True, True, True))
            self._meta[id(v)] = _Pullback(per_micro=per_micro, **info)
        return self._meta[id(v)]

    def saved_structs(self, v: _Variant, prow):
        """The type of what F saves for B and W (:meth:`save`)."""
        k, t, mask = self._inputs(jnp.zeros((), jnp.int32), 0)
        return jax.eval_shape(lambda p, x: self.save(v, p, x, k, t, mask)[2], prow, v.x_layout.structs())

    def _vjp(self, v: _Variant, prow, x, k, t, mask):
        """F with ``checkpoint="never"`` or a policy: the value, ``(weight, stats)`` (see
        :meth:`_residuals`) and the residuals that depend on the micro-batch."""
        meta = self._meta_of(v, prow)
        out, aux, leaves, _ = self._residuals(v, prow, x, k, t, mask)
        # the analysis traced the program these residuals come from (same types, weak ones too)
        assert [_struct(a) for a in leaves] == meta.types, "residuals of another program"
        return out, aux, [a for a, keep in zip(leaves, meta.per_micro, strict=True) if keep]

    def pull(self, v: _Variant, prow, saved, g, k, t, mask, wrt_params: bool, wrt_input: bool):
        """B and W: :meth:`pullback` from what :meth:`save` kept."""
        if not self.keep:
            return self.pullback(v, prow, saved, g, k, t, mask, wrt_params, wrt_input)
        if not (wrt_params or wrt_input):
            return None, None
        meta = self._meta_of(v, prow)
        per_micro = meta.per_micro
        fresh = [None] * len(per_micro)
        if not all(per_micro):  # the parameter-only residuals, from the parameters (x unused)
            fresh = self._residuals(v, prow, _zero_input(v, prow), k, t, mask)[2]
        # a residual typed split over an Explicit axis inside the stage comes out of the stash
        # container replicated: its own type back, as the pullback was traced with
        typed = [a for a, keep in zip(meta.typed, per_micro, strict=True) if keep]
        it = iter(compat.like(a, want) for a, want in zip(saved, typed, strict=True))
        back = jax.tree.unflatten(
            meta.treedef, [next(it) if keep else a for keep, a in zip(per_micro, fresh, strict=True)]
        )
        # the loss's seeds typed as the values the pullback was traced with
        ones = lambda a: compat.to_varying(jnp.ones(a.shape, a.dtype), meta.axes)
        dp, dxf = back(_seed(v, meta.out, g, ones))
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
            return self._objective(v, v.params_of(prow), rebuild(xf), k, t, mask)[0]

        if wrt_params and wrt_input:
            out, back = jax.vjp(h, prow, xf)
        elif wrt_params:
            out, back = jax.vjp(lambda p: h(p, xf), prow)
        else:
            out, back = jax.vjp(lambda a: h(prow, a), xf)
        cts = back(_seed(v, out, g, jnp.ones_like))
        dp = cts[0] if wrt_params else None
        dx = _fill(x, cts[-1]) if wrt_input else None
        return dx, dp

    # -- one tick of one device: its F, B (and W) slots --------------------------------------

    # A device runs these as the slots of the engine's one tick loop (:class:`engine.Slots`):
    # ``step`` is its F slot, ``back`` its B (and W) slots after it. On a mesh the device is
    # traced, ``self.io`` holds the containers and the dispatch (:func:`_mesh_io`) and a slot
    # picks its stage's branch with ``lax.switch`` (an idle slot computes nothing); without one
    # each virtual device runs its own stage, called directly.

    def step(self, d, rows_p, state, x_in, prev, row, static_stage=None, fresh=None):
        """F: the device's stage on ``x_in`` (the engine's tick delivers micro-batch ``f`` of x
        to stage 0, the previous device's activation to the others); returns ``(message, stats,
        loss part, saved, count)``: what it sends on, its stats (the engine writes them), its
        ``(loss, weight)`` sums, what B and W read back (:meth:`save`) and 1 (0 when idle).
        ``rows_p`` holds the device's stages' parameters as rows (stage ``s`` is row ``s // n``)."""
        if isinstance(d, int):  # a virtual device (no mesh): its own stage, called directly
            i, v = self._tick_micro(row), self.variants[d]
            x = engine.read(self.cfg, self.xs, i) if d == 0 else x_in

            def f_slot(params, x):
                return self.save(v, self._local_row(params, d), x, *self._inputs(i, d))

            y, dloss, kept, st = _computation(i, f_slot, rows_p, x)
            return y, st, dloss, kept
        io = self.io
        f, fs = engine.at(row, d, io.n)
        one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)

        def f_branch(v):
            def run(rows_p, x_in, f):
                prow, x = io.row(rows_p, fs // io.n), io.unpack(x_in, v.x_layout)
                y, dloss, saved, st = self.save(v, prow, x, *self._inputs(f, fs))
                y = io.msg_zeros() if y is None else io.pack(y)
                dloss = self.loss0 if dloss is None else dloss.astype(self.loss0.dtype)
                return y, io.st_pack(st), dloss, io.s_pack(saved), one

            return run

        def f_idle(rows_p, x_in, f):
            return io.msg_zeros(), io.st_zeros(), self.loss0, io.s_zeros(), zero

        return io.dispatch(f >= 0, fs, f_branch, f_idle, rows_p, x_in, f)

    def init(self):
        """The B and W slots' state at the first tick (:class:`_Back`)."""
        if self.io is None:  # virtual devices: the parameter cotangents and the loss sums
            return _Back(None, None, None, _zeros_like(self.prows), self.loss0, None)
        io, K = self.io, self.K
        return _Back(
            io.msg_zeros(),
            io.s_zeros((self.pipe.repeats * K,)),
            io.msg_zeros(lead=(io.n,)) if self.zb else None,
            _zeros_like(self.prows),
            self.loss0,
            jnp.zeros((3,), jnp.int32),
        )

    def arrive(self, dev, received):
        return dev._replace(bin=received)

    def back(self, dev: _Back, out, row, d):
        """B (and W) after F: ``(the new state, the input cotangent sent back)``.

        F's ``saved`` goes to the stash (``K`` slots per stage held), its loss part to the sums.
        B pulls the stage back, from what F kept, with the cotangent the next device sent; W
        ("zb-h1") the parameter cotangent, from the stash and B's stashed output cotangent.
        Every parameter cotangent is added inside its branch to the stage's row of the
        accumulator (B; ZB-H1's W: to the accumulator), which an idle branch returns as it is,
        so no cotangent leaves a branch."""
        if isinstance(d, int):
            return self._back_local(dev, out, row, d)
        io, K, n, zb, rows_p = self.io, self.K, self.io.n, self.zb, self.prows
        one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
        f, fs = engine.at(row, d, n)
        b, w, bs = (engine.at_device(a, d) for a in engine.back_row(row, n))
        _, _, dloss, saved, c0 = out
        stash = engine.put(dev.stash, saved, (fs // n) * K + f % K, f >= 0)
        xb = engine.take(stash, (bs // n) * K + b % K)

        def b_branch(v):
            def run(rows_p, xb, g, b, grow):
                dx, dp = self.pull(
                    v,
                    io.row(rows_p, bs // n),
                    io.s_unpack(xb, v),
                    None if v.last else io.unpack(g, v.y_layout),
                    *self._inputs(b, bs),
                    wrt_params=not zb,
                    wrt_input=not v.first,
                )
                dx = io.msg_zeros() if dx is None else io.pack(dx)
                return dx, grow if dp is None else _add_to(grow, dp), one

            return run

        def b_idle(rows_p, xb, g, b, grow):
            return io.msg_zeros(), grow, zero

        # the branch adds to the stage's row of the accumulator, which is written back here: an
        # accumulator passed through the branch was copied there whole (the branch cannot update
        # its operand in place); a row is half of it at 2 repeats, and then written in place
        grow = None if zb else engine.take(dev.grad, bs // n)
        dx, grow, c1 = io.dispatch(b >= 0, bs, b_branch, b_idle, rows_p, xb, dev.bin, b, grow)
        grad = dev.grad if zb else _set_row(dev.grad, bs // n, grow)
        gstash, c2 = dev.gstash, zero
        if zb:  # W: the parameter cotangent, from the stash and B's stashed output cotangent
            if gstash is not None:  # (the last stage seeds its own)
                gstash = engine.put(gstash, dev.bin, b % n, b >= 0)
            xw = engine.take(stash, w % K)
            gw = None if gstash is None else engine.take(gstash, w % n)

            def w_branch(v):
                def run(rows_p, xw, gw, w, grad):
                    g = None if v.last else io.unpack(gw, v.y_layout)
                    _, dp = self.pull(
                        v,
                        io.row(rows_p, 0),
                        io.s_unpack(xw, v),
                        g,
                        *self._inputs(w, d),
                        wrt_params=True,
                        wrt_input=False,
                    )
                    return _add_row(grad, 0, dp), one

                return run

            w_idle = lambda rows_p, xw, gw, w, grad: (grad, zero)
            grad, c2 = io.dispatch(w >= 0, d, w_branch, w_idle, rows_p, xw, gw, w, grad)
        counts = dev.counts + jnp.stack([c0, c1, c2])
        new = dev._replace(stash=stash, gstash=gstash, grad=grad, loss=dev.loss + dloss, counts=counts)
        return new, dx

    def _loss_zero(self, v):
        out = jax.eval_shape(
            lambda y, t, mask: self._loss(y, t, mask),
            v.y_layout.structs(),
            _micro(self.ts),
            _micro(self.mask),
        )
        return jnp.zeros((2,), out[0].dtype)  # (loss, weight)

    # -- without a mesh: one device, the micro-batches one after the other -------------------

    def _back_local(self, dev: _Back, out, row, d: int):
        """B of virtual device ``d`` (no mesh), on what its F slot kept this tick: the parameter
        and input cotangents together; the parameter cotangent joins the sums as soon as it
        leaves the slot, the input cotangent goes to the previous column within the tick."""
        i, v = self._tick_micro(row), self.variants[d]
        _, _, dloss, kept = out

        def b_slot(params, kept, g):
            p = self._local_row(params, d)
            return self.pull(v, p, kept, g, *self._inputs(i, d), wrt_params=True, wrt_input=not v.first)

        g, dp = _computation(i, b_slot, self.prows, kept, dev.bin)
        if self.pipe.homogeneous:
            grad = jax.tree.map(lambda a, t: a.at[d].add(t.astype(a.dtype)), dev.grad, dp)
        else:
            grad = [_add(a, dp) if t == d else a for t, a in enumerate(dev.grad)]
        loss = dev.loss if dloss is None else dev.loss + dloss.astype(dev.loss.dtype)
        return dev._replace(grad=grad, loss=loss), g

    def _tick_micro(self, row):
        """The micro-batch of every slot of a tick of the one-device table (every column runs
        the same one, :func:`~pipejax._src.schedule.sequential_training`), read once: a slot
        reading its own column gave every slot its own index and predicate: with 16 stacked
        stages 3,156 HLO lines against 2,701 and 58,808 temp bytes against 57,720 (BUILD_NOTES,
        sixteenth session)."""
        return engine.split_row(row, self.S)[0][0]

    def _local_row(self, params, s: int):
        """Stage ``s``'s parameters, picked inside its slot at a static index (``a[s]``): with the
        mesh program's dynamic row and ``_add_row``, XLA kept copies of the stacked arrays (temp
        25.1 -> 73.9 KiB on the 4-stage probe of the thirteenth session)."""
        return jax.tree.map(lambda a: a[s], params) if self.pipe.homogeneous else params[s]

    def local(self, runner):
        """Without a mesh one device runs every stage, and no schedule has a bubble to fill: every
        training table runs as :func:`~pipejax._src.schedule.sequential_training`, gradient
        accumulation in the engine's loop for one device (:class:`engine.LocalDevices`), one
        virtual device per stage. At tick ``i`` the F slots of stages ``0, ..., S - 1`` run on
        micro-batch ``i`` and keep what B needs (as on a mesh, :meth:`save`: the stage input
        for ``"always"``, the residuals for ``"never"`` or a policy), then the B slots of stages
        ``S - 1, ..., 0`` (:meth:`pull`, parameter and input cotangents together), and the
        parameter cotangents join the sums before micro-batch ``i + 1`` starts. So the device
        keeps one micro-batch's worth, whatever ``m`` is. Stage 0 reads its micro-batch as data.
        Keys, loss terms and the order of the sums over micro-batches are the mesh program's.
        """
        S, m, pipe = self.S, self.m, self.pipe
        bnd = self.boundaries
        self.prows = runner if pipe.homogeneous else list(runner)  # stacked (S, ...), or one per stage
        self.variants = [
            _Variant(pipe.stages[s], s == 0, s == S - 1, lambda p: p, bnd[s], bnd[s + 1], s) for s in range(S)
        ]
        self.loss0 = self._loss_zero(self.variants[-1])
        layouts = [self.stats_layouts] * S if pipe.homogeneous else self.stats_layouts
        stages = engine.Heterogeneous(self.cfg, bnd, layouts, None, None, S, switch=False)
        devices = engine.LocalDevices(self.cfg, stacked=False)
        table = devices.table(S, m, training=True)
        ctx = engine._Ctx(S, S, 1, m, stages)
        inputs = engine.Inputs(self.prows, None, self.xs, None, self.key)
        dev, stats = devices.run(ctx, table, ckpt.training_phases(table), inputs, slots=self)
        # every stage runs F and B (with W) once per micro-batch
        counts = jnp.asarray(np.tile(np.array([m, m, 0], np.int32), (S, 1)))
        if pipe.homogeneous and _records(pipe):
            stats = jax.tree.map(lambda *a: jnp.stack(a), *stats)
        elif not _records(pipe):
            stats = None
        return dev.loss, dev.grad, counts, stats

    # -- on a mesh: one SPMD program, a device per stage ------------------------------------

    def mesh(self, runner):
        """On a mesh: the table runs in the engine's one tick loop (:meth:`engine.MeshDevices.loop`),
        with this program's F, B and W slots (:meth:`step`, :meth:`back`)."""
        pipe, S = self.pipe, self.S
        n, v_rep = pipe.num_devices, pipe.repeats  # device d holds stages d, d + n, ...
        axis, mesh = pipe.axis_name, pipe.mesh
        bnd = self.boundaries
        # the engine's stage objects: the containers of messages, stashes and stats
        if pipe.homogeneous:
            variants, index = self._homogeneous_variants()
            prows_in = runner
            stages = engine.Homogeneous(self.cfg, bnd, self.stats_layouts, n, local=False)
        else:
            stages = engine.Heterogeneous(self.cfg, bnd, self.stats_layouts, runner.layouts, None, n, True)
            variants = [
                _Variant(
                    pipe.stages[t],
                    t == 0,
                    t == S - 1,
                    lambda prow, t=t: stages.pbox.unpack(prow, runner.layouts[t]),
                    bnd[t],
                    bnd[t + 1],
                    t,
                )
                for t in range(S)
            ]
            index = np.arange(S)
            prows_in = runner.buffers
        lead = 1 if v_rep == 1 else 2  # (S, ...) or, interleaved, (v, n, ...) stacked stages
        row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), prows_in)
        loss0 = self._loss_zero(variants[-1])
        data = pipe.data_axis_name
        axes = (axis,) if data is None else (axis, data)  # the shard_map's manual axes
        io = _mesh_io(self, stages, variants, index, row, n, axes)
        spec = PartitionSpec(axis) if v_rep == 1 else PartitionSpec(None, axis)
        rep = PartitionSpec()
        batch_spec = rep if data is None else PartitionSpec(data)  # micro-batches split over data
        # the engine's device abstraction places the parameters (and, with `param_specs`, makes
        # the shard_map manual over the stage and data axes only: tensor / FSDP sharding inside)
        devices = engine.MeshDevices(
            self.cfg._replace(data_axis_name=data), mesh, v_rep, pipe.data_size, self.param_specs
        )
        ctx = engine._Ctx(S, n, v_rep, self.m, stages, stage_major=True)

        def body(d, prows, xs, mask, ts, key, cs, state, aux_scale):
            # the device's block of the stacked stages, (1, ...) or (v, 1, ...): a slot picks row
            # `stage // n` and drops the stage axis inside the tick (`engine._row`; dropped here,
            # XLA copied the parameters), and the gradients accumulate in blocks of that type.
            # Everything a slot reads varies along the manual axes (see `_mesh_io`'s dispatch).
            prog = _Program(
                pipe, self.cfg, self.loss_fn, self.table, bnd, self.plan, xs, mask, ts, key, cs, self.weighted
            )
            if data is not None:
                prog.offset = lax.axis_index(data) * self.m
            prog.state, prog.aux_loss, prog.aux_scale = state, self.aux_loss, aux_scale
            prog.io, prog.prows, prog.loss0 = io, prows, loss0
            inputs = engine.Inputs(prows, None, xs, None, key)
            carry, _ = devices.loop(ctx, self.table, ckpt.training_phases(self.table), d, inputs, slots=prog)
            dev = carry.back
            # each (stage, micro-batch) written by one device: a sum of exact zeros merges them
            stats = engine.sum_exact(carry.stats, axis)
            loss, grad, counts = engine.sum_exact(dev.loss, axis), dev.grad, dev.counts
            if data is None:
                return loss, grad, counts[None], stats
            # every data shard ran its own micro-batches: sum their losses and gradients
            return lax.psum(loss, data), devices.sum_over_data(grad), counts[None, None], stats

        operands = [
            (self.xs, batch_spec, True),
            (self.mask, batch_spec, True),
            (self.ts, batch_spec, True),
            (self.key, rep, True),
            (self.cs, batch_spec, True),
            (self.state, rep, True),
            (self.aux_scale, rep, False),  # a weighted loss's total weight
        ]
        out_specs = lambda param_in: (
            rep,
            param_in,
            PartitionSpec(axis) if data is None else PartitionSpec(data, axis),
            rep if data is None else PartitionSpec(None, data),  # stats (S, m, ...)
        )
        loss, grads, counts, stats = devices.spmd(body, prows_in, spec, operands, out_specs)
        if not pipe.homogeneous:
            grads = type(runner).tree_unflatten(runner.tree_flatten()[1], grads)
        # per stage, as the forward call returns them
        stats = stages.stage_rows(stats) if _records(pipe) else None
        return loss, grads, counts, stats

    def _homogeneous_variants(self):
        """One stage function, so one branch per role: (first, last) pairs that occur."""
        S, bnd, fn = self.S, self.boundaries, self.pipe.stages[0]
        roles = sorted({(t == 0, t == S - 1) for t in range(S)}, reverse=True)
        variants = [_Variant(fn, first, last, lambda p: p, bnd[0], bnd[0]) for first, last in roles]
        index = np.array([roles.index((t == 0, t == S - 1)) for t in range(S)])
        return variants, index


# --- where a device runs its slots ------------------------------------------------------------


class _Pullback(NamedTuple):
    """What a variant's pullback looks like (:meth:`_Program._meta_of`), from one trace."""

    treedef: Any  # the pullback's pytree structure (a closed program), its leaves the residuals
    per_micro: list[bool]  # per residual: whether it depends on the micro-batch (input, key,
    # targets, mask); F saves those, B and W compute the parameter-only ones again
    out: Any  # the value's types, sharding types too (the cotangent seeds take them)
    axes: tuple[str, ...]  # the manual axes the value (beside y: its aux loss) varies along
    types: list[Any]  # each residual's type, weak types included
    typed: list[Any]  # each residual's type with its sharding type


class _Back(NamedTuple):
    """A device's state of the B and W slots (:attr:`engine.Carry.back`)."""

    bin: Any  # the cotangent the next device sent at the last tick
    stash: Any  # what F kept for B and W: K slots per stage the device holds
    gstash: Any  # ZB-H1: output cotangents B received, for W (None: not ZB, or the last stage)
    grad: Any  # parameter cotangents, one row per stage the device holds
    loss: Any  # f[2]: the (loss, weight) sums of the micro-batches the device's last stage ran
    counts: Any  # int[3]: F, B and W slots run


class _IO(NamedTuple):
    """How a device of the training loop runs: messages, stashes and the dispatch of a slot."""

    n: int  # stage s is row s // n of the device's stages
    row: Callable[[Any, Any], Any]  # (the device's parameter block, row) -> that row's parameters
    pack: Callable[[Any], Any]  # a typed activation or cotangent -> its message
    unpack: Callable[[Any, Layout], Any]  # (message, layout) -> the typed value
    msg_zeros: Callable[..., Any]  # (lead=()) -> a message of zeros
    s_pack: Callable[[Any], Any]  # what F saved -> a stash entry
    s_unpack: Callable[[Any, _Variant], Any]
    s_zeros: Callable[..., Any]  # (lead=()) -> stash entries of zeros
    st_pack: Callable[[Any], Any]  # a stateful stage's stats -> a stats entry
    st_zeros: Callable[..., Any]
    dispatch: Callable[..., Any]  # (working, stage, make_branch, idle, *args) -> the slot's outputs


def _mesh_io(prog: _Program, stages, variants, index, row, n, axes) -> _IO:
    """A device of the mesh: one SPMD program, so a slot picks the branch of its stage's variant
    (:func:`engine.dispatch`), and messages, stashes and stats have the containers of the
    engine's stage objects (``stages``; ``row``: the type of one of the device's parameter
    rows)."""
    msg_zeros = lambda lead=(): stages.message_zeros(0, lead)[0]
    if prog.keep:  # residuals differ per stage (and role): one container for all
        saved_layouts = [Layout.of(prog.saved_structs(v, row)) for v in variants]
        sbox = Container.for_layouts(saved_layouts)
        s_pack, s_zeros = (lambda tree: sbox.pack(engine.whole(prog.cfg, tree))), sbox.zeros
        s_unpack = lambda msg, v: sbox.unpack(msg, saved_layouts[variants.index(v)])
    else:  # the stage input, as a message
        s_pack, s_zeros = stages.pack, msg_zeros
        s_unpack = lambda msg, v: stages.unpack(msg, v.x_layout)
    # the stats of a device's F slots, as the engine's tick writes them at (stage, micro-batch)
    # of an (S, m) buffer (empty without records)
    st_pack, st_zeros = stages.stats_message, (lambda lead=(): stages.message_zeros(0, lead)[1])
    variant_of = jnp.asarray(index, jnp.int32)

    def dispatch(working, s, make, idle, *args):
        # Every branch returns its values varying along the manual axes, so all branches have
        # one type. Everything a slot reads is cast before the loop (see `mesh`), so the only
        # values cast here are constants (zeros; the cotangent of an integer leaf): no cast of
        # a differentiated value sits in a branch, whose transpose (a psum) only some devices
        # would reach.
        vary = lambda f: lambda *a: compat.to_varying(f(*a), axes)
        return engine.dispatch(working, variant_of[s], [vary(make(v)) for v in variants], vary(idle), *args)

    return _IO(
        n,
        lambda block, r: engine._row(block, r, prog.pipe.repeats),
        stages.pack,
        stages.unpack,
        msg_zeros,
        s_pack,
        s_unpack,
        s_zeros,
        st_pack,
        st_zeros,
        dispatch,
    )


# --- small exact helpers ---------------------------------------------------------------------


class _WithAux(NamedTuple):
    """A stage's value with an aux loss (``value_and_grad(..., aux_loss=)``): its output and the
    aux loss of its (stage, micro-batch), seeded with one in B and W."""

    y: Any
    extra: jax.Array


def _seed(v: _Variant, out, g, ones):
    """The cotangent a pullback of :meth:`_Program._objective` is applied to: one for the loss
    (and for a stage's aux loss, beside its output's cotangent ``g``); ``ones(value)``."""
    if v.last:
        return ones(out)
    if isinstance(out, _WithAux):
        return _WithAux(_cotangent(g, out.y), ones(out.extra))
    return _cotangent(g, out)


def _plus(loss, extra):
    return loss if extra is None else loss + extra.astype(loss.dtype)


def _add_row(acc, r, delta):
    """``acc[r] += delta`` (of ``(repeats, 1, ...)`` blocks: ``acc[r, 0] += delta``)."""
    return _set_row(acc, r, _add_to(engine.take(acc, r), delta))


def _set_row(acc, r, row):
    return jax.tree.map(lambda a, b: lax.dynamic_update_index_in_dim(a, b, r, 0), acc, row)


def _add_to(row, delta):
    """``row + delta``, ``delta`` without the unit stage axis of a ``(1, ...)`` row."""
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype).reshape(a.shape), row, delta)


def _add(acc, delta):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, delta)


def _computation(i, fn, *args):
    """``fn(*args)``, one slot of :meth:`_Program.local`, kept apart from the loop body's other
    slots, so that XLA neither merges a stage's recomputation in B (``"always"``) with F's
    forward pass nor hoists the stage's parameter slices (``w[j]``) out of the loop (a copy of
    every parameter in temp memory). Written inline, XLA did both, on CPU and on GPU.

    On CPU the slot is the one branch of the engine's dispatch, taken where ``i >= 0`` (always,
    for the loop's index ``i``): a computation of its own, which starts once all its operands
    exist. XLA:CPU removes optimization barriers before it hoists loop invariants, so a barrier
    keeps the recomputation but not the parameters in place (temp 95.5 -> 322.7 KiB on
    ``benchmarks/gpu.py --quick``'s 1F1B ``"always"``). On other backends the slot reads its
    operands through an optimization barrier: on an H200 a branch per slot cost 2.8x (``"always"``)
    to 5.2x (``"never"``) the temp bytes and 13-14 % of the step (see BUILD_NOTES, fourteenth
    session); :func:`_as_branch` chooses."""
    if not _as_branch():
        return fn(*lax.optimization_barrier(args))
    idle = lambda *args: _zeros_like(jax.eval_shape(fn, *args))  # never taken: the branch's type
    return engine.dispatch(i >= 0, 0, [fn], idle, *args)


def _as_branch() -> bool:
    """Whether :func:`_computation` runs a slot as a branch (XLA:CPU) or behind a barrier."""
    return jax.default_backend() == "cpu"


def _zeros_like(tree):
    if tree is None:
        return None
    return jax.tree.map(lambda a: jnp.zeros_like(a), tree)  # sharding types too


def _struct(a):
    """The type of ``a``, weak type included: a weakly typed scalar parameter traces to another
    program (an extra ``convert_element_type``, so other residuals) than a strong one."""
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), weak_type=jax.typeof(a).weak_type)


def _typed_struct(a):
    """:func:`_struct` with the sharding type: a cotangent seed takes it (an output typed split
    over an Explicit axis inside a stage is seeded with a cotangent split alike)."""
    t = jax.typeof(a)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type, sharding=t.sharding)


def _zero_input(v: _Variant, prow):
    """A stage input of zeros, typed as the slots' inputs: inside the shard_map, varying along
    the manual axes the parameters vary along."""
    return compat.to_varying(engine.zeros(v.x_layout), _axes(prow))


def _axes(tree) -> tuple[str, ...]:
    """The manual axes along which some leaf of ``tree`` varies (none outside ``shard_map``)."""
    return tuple(sorted(set().union(*(compat.varying_axes(a) for a in jax.tree.leaves(tree)))))


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
