"""``Pipeline.value_and_grad(loss_fn)``: the training step of every schedule.

For GPipe and circular pipelines the step is ``jax.value_and_grad`` of the loss through the
forward pipeline (the engine's loop, differentiated by autodiff). The 1F1B and ZB-H1 schedules
(:func:`pipejax._src.schedules.tables.training`) interleave forward and backward work of different
micro-batches, which no transformation of a forward program produces: their step runs the
table's F, B and W slots in the engine's loop (:mod:`pipejax._src.training.slots`), each slot's stage
differentiated by hand (:mod:`pipejax._src.training.stage_grad`).

This module holds what every schedule shares: the checks of a step's arguments, the per-call
plan (micro-batches of ``x``, targets and side inputs, the table, the parameters' runner form,
the boundaries between stages), and the loss contract's last step (a weighted loss divides the
summed losses and gradients by the summed weights, see :func:`pipejax._src.training.loss.per_example`).
The loss and gradients equal those of ``jax.value_and_grad`` of the GPipe pipeline, up to the
order of floating-point sums; side inputs (``context=``) are cut into micro-batches as
``targets`` are, and every slot hands its stage the rows of its micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pipejax._src import aux_outputs, checks, compat, engine, microbatch, options
from pipejax._src.engine import boundaries as bnd
from pipejax._src.params import forms as stage_forms
from pipejax._src.training import stage_grad
from pipejax._src.training.loss import check_float_params, mean_loss, per_example

PyTree = Any


def value_and_grad(
    pipe,
    call: Callable[..., Any],
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    aux_loss: Callable[[PyTree], jax.Array] | None = None,
) -> Callable[..., Any]:
    """``f(params, x, targets, key=None, *, context=None) -> (loss, grads)`` for the pipeline
    whose plan is ``pipe`` and whose forward call is ``call``; see
    :meth:`pipejax.Pipeline.value_and_grad`."""
    aux_loss = aux_outputs.check_aux_loss(aux_loss, pipe)
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be a callable `loss_fn(outputs, targets) -> losses` giving one loss per "
            f"example, but got {type(loss_fn).__name__} {loss_fn!r}."
        )
    owns_backward = pipe.schedule.owns_backward

    def traced(params, x, targets, key, context, state):
        if owns_backward:
            loss, grads, _, stats, aux = _run(
                pipe, loss_fn, params, x, targets, key, context, state, aux_loss
            )
            return (pipe.returned(loss, stats, aux), grads)
        if pipe.aux is None:
            side = {} if context is None else {"context": context}
            if pipe.stateful:
                side["state"] = state

            def loss_of(p):
                out = call(p, x, key, **side)
                y, stats = out if pipe.stateful else (out, None)
                return mean_loss(loss_fn, y, targets), stats

            (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            return ((loss, stats), grads) if pipe.stateful else (loss, grads)
        batch = microbatch.batch_size(x)

        def loss_aux(p):  # the aux loss from the records of every (stage, micro-batch)
            y, stats, aux, mask = pipe.forward(p, x, key, state, context)
            loss = mean_loss(loss_fn, y, targets)
            extra = aux_outputs.total(aux_loss, aux, mask, batch, pipe.kind)
            loss = loss if extra is None else loss + extra.astype(loss.dtype)
            return loss, (stats, aux_outputs.reduce(pipe.aux, aux, mask, batch, pipe.kind))

        (loss, (stats, aux)), grads = jax.value_and_grad(loss_aux, has_aux=True)(params)
        return (pipe.returned(loss, stats, aux), grads)

    jitted = jax.jit(traced)

    def f(params, x, targets, key=None, *, state=None, context=None):
        checks.check_key(key)
        _check_params(pipe, params)
        options.check_not_abstract(params)
        check_float_params(params)
        pipe.check_batch(x, context, targets)
        if state is not None:
            if not pipe.stateful:
                raise TypeError(
                    "`state` was given, but the pipeline is not stateful, so its stages cannot "
                    "receive it. Build it with `pj.pipeline(..., stateful=True)`."
                )
            _check_params(pipe, state, name="state")
        # concrete inputs committed to other devices are moved where the pipeline runs
        params, (x, targets, context), key, state = pipe.commit(params, (x, targets, context), key, state)
        with pipe.own_mesh((params, x, targets, key, context, state)):
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
    gradient accumulation of :func:`slots.on_one_device`). For tests and benchmarks."""
    pipe = pipe.plan  # a Pipeline
    _check_params(pipe, params)
    pipe.check_batch(x, None, targets)
    counts = jax.jit(lambda *a: _run(pipe, loss_fn, *a)[2])(params, x, targets, key)  # stateless
    return np.asarray(counts)


def _check_params(pipe, params, name="params"):
    options.check_params_shape(params, pipe, name=name)


def _run(pipe, loss_fn, params, x, targets, key, context=None, state=None, aux_loss=None):
    """``(loss, grads, counts int[n, 3], stats, aux)`` of one training step on
    ``pipe.schedule_name``'s table; ``stats`` and ``aux`` as the forward call of a stateful or
    ``aux`` pipeline returns them (``None`` otherwise)."""
    # the per-call plan, once: side inputs and targets are cut as x (each slot's stage reads its
    # micro-batch's rows)
    call = pipe.cut(x, key, context, targets, stream=False)
    plan, xs, mask, ts, cs, key_struct = (
        call.plan,
        call.xs,
        call.mask,
        call.ts,
        call.cs,
        call.key_struct,
    )
    table = pipe.table(call, training=True)
    splits = pipe.splits(params)  # `param_specs` (or a placed StageParams' own), checked
    # tied copies: the same values; the gradients come back summed over each group (the transpose
    # of the tie), and a tangent of one copy reaches every copy (jvp of this step: HVPs)
    params, untie = jax.vjp(lambda p: stage_forms.tie(pipe, p), params)
    runner, to_user = jax.vjp(lambda p: pipe.runner_form(p, splits), params)
    param_specs = pipe.engine_specs(runner, splits)
    state_r = pipe.runner_form(state) if pipe.stateful else None
    boundaries, stats_layouts, xs = pipe.kind.boundaries(pipe, runner, state_r, xs, key_struct, cs)
    y_struct = boundaries[-1].structs()
    ys_struct = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((plan.micro_size, *a.shape[1:]), a.dtype, weak_type=a.weak_type),
        y_struct,
    )
    _, weights = jax.eval_shape(
        lambda y, t: per_example(loss_fn, y, t, plan.micro_size, plan.batch),
        ys_struct,
        bnd.micro_struct(ts),
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
    grad = stage_grad.StageGrad(
        pipe, cfg, loss_fn, plan, table.num_micro, ts, mask, key, cs, weights is not None
    )
    grad.aux_loss, grad.aux_scale = aux_loss, aux_scale
    if pipe.stateful:  # every stage's state, whole, in the one-device form (stage-major, or a list per stage)
        grad.state = compat.replicate(pipe.kind.local_form(pipe, state))
    totals, grads, counts, stats = pipe.train(grad, table, boundaries, xs, runner, stats_layouts, param_specs)
    loss = totals[0]
    if weights is not None:  # sums of losses and gradients over the batch's total weight
        loss = loss / totals[1]
        grads = jax.tree.map(lambda g: g / totals[1].astype(g.dtype) if stage_grad.inexact(g) else g, grads)
    if not _same_form(params, runner):
        # another form (a list of pytrees, or (S, ...) for (v, n, ...)): undo the conversion, which
        # unstacks or reshapes the stage axis, so the grads must not be split over stages there;
        # the engine's form (e.g. `place`d) is kept with its sharding
        grads = to_user(compat.replicate(grads))[0]
    if pipe.tied:  # each copy's gradient: the sum over its group (typed as the copies, for the vjp)
        grads = untie(jax.tree.map(_typed_as, grads, params))[0]
    stats, aux = aux_outputs.split(stats, pipe.stateful, pipe.aux is not None, pipe.kind)
    if aux is not None:
        aux = aux_outputs.reduce(pipe.aux, aux, call.mask, plan.batch, pipe.kind)
    return loss, grads, counts, stats, aux


def _total_weight(pipe, loss_fn, ys_struct, ts, mask, plan) -> jax.Array:
    """The batch's total weight ``W`` of a weighted ``loss_fn`` (one that returns ``(losses,
    weights)``), computed before the loop so that an aux loss can be scaled by it.

    The training schedules add up the sums of losses and weights over the micro-batches and
    divide by the total weight at the end, after the aux losses' gradients are summed in; each
    slot's aux term is therefore scaled by ``W`` (:meth:`stage_grad.StageGrad._extra`), and the division
    takes it back out. ``W`` is known up front when the weights do not depend on the outputs
    (they come from the targets, e.g. a padding mask): it is the masked sum of the weights of
    ``loss_fn(zeros, targets_i)`` over every micro-batch (the whole batch: with a data axis the
    targets are global arrays here)."""
    y_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ys_struct)

    def weights_of(y, t):
        return per_example(loss_fn, y, t, plan.micro_size, plan.batch)[1]

    if stage_grad.depends(weights_of, (ys_struct, bnd.micro_struct(ts)), (True, False))[0]:
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
        lambda y, t: per_example(loss_fn, y, t, plan.micro_size, plan.batch)[0],
        ys_struct,
        bnd.micro_struct(ts),
    ).dtype
    w = jax.vmap(lambda t: weights_of(y_zero, t))(ts)  # (m, micro_size), every micro-batch
    w = jnp.where(mask, lax.stop_gradient(w).astype(losses_dtype), jnp.zeros((), losses_dtype))
    return compat.replicate(jnp.sum(w))


def _typed_as(g, p):
    """``g`` with the sharding type of ``p`` (Explicit axes type them; values unchanged)."""
    if not any(getattr(jax.typeof(p).sharding, "spec", ())):
        return compat.replicate(g)
    return compat.like(g, p)


def _same_form(a, b) -> bool:
    """Whether two pytrees have the same structure and leaf shapes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        jnp.shape(x) == jnp.shape(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
