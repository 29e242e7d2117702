"""One stage of a training table, differentiated by hand: what a forward (F) slot keeps and how
the backward (B) and weight (W) slots pull back from it.

The schedules that own the backward pass (1F1B, ZB-H1, interleaved 1F1B) run their slots in the
engine's loop (:mod:`pipejax._src.training.slots`); this module is what a slot computes on typed values,
whatever device it runs on:

* **F** (:meth:`StageGrad.save`): the stage on its input; the last stage applies ``loss_fn`` to
  the micro-batch and gives the masked sum of its per-example losses (over the batch size for a
  mean; with the weights' sum for a weighted loss, see :func:`pipejax._src.training.loss.per_example`).
  It keeps what B and W need: the stage input (``checkpoint="always"``, and B recomputes the
  stage), or the residuals of the stage's ``jax.vjp`` (``"never"``; a ``jax.checkpoint`` policy
  saves what the policy saves), those that depend on the micro-batch only: parameter-only
  residuals (e.g. the slice ``w[j]`` of a stacked weight) are computed again in B and W.
* **B** and **W** (:meth:`StageGrad.pull`): the stage's pullback, rebuilt from the residuals or
  taken again at the input, applied to the output cotangent (the last stage seeds its loss
  with one): the input cotangent, the parameter cotangent, or both.

Every stage with an aux loss (``value_and_grad(..., aux_loss=)``) adds its term in F and seeds
it in B and W (:class:`WithAux`). Keys are those of the forward pipeline
(:func:`engine.stage_keys`), so a recomputation replays the same dropout masks. There is no
``custom_vjp``: a slot is ordinary JAX (``jax.vjp``), so ``jax.jvp`` of a training step gives
Hessian-vector products.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

from pipejax._src import aux_outputs, compat, engine
from pipejax._src import checkpoint as ckpt
from pipejax._src.containers import Layout
from pipejax._src.engine import boundaries as bnd
from pipejax._src.training.loss import per_example


class Variant(NamedTuple):
    """What one branch of a device's slot computes: a stage function and its role."""

    fn: Callable[..., Any]
    first: bool  # stage 0: reads x, computes no input cotangent
    last: bool  # the last stage: applies the loss
    params_of: Callable[[Any], Any]  # device's parameter row -> the stage's parameter pytree
    x_layout: Layout
    y_layout: Layout
    stage: int | None = None  # the stage, when one variant runs one stage; None: a homogeneous role


class Pullback(NamedTuple):
    """What a variant's pullback looks like (:meth:`StageGrad._meta_of`), from one trace."""

    treedef: Any  # the pullback's pytree structure (a closed program), its leaves the residuals
    per_micro: list[bool]  # per residual: whether it depends on the micro-batch (input, key,
    # targets, mask); F saves those, B and W compute the parameter-only ones again
    out: Any  # the value's types, sharding types too (the cotangent seeds take them)
    axes: tuple[str, ...]  # the manual axes the value (beside y: its aux loss) varies along
    types: list[Any]  # each residual's type, weak types included (a weakly typed scalar
    # parameter traces to another program than a strong one: an extra convert_element_type)
    typed: list[Any]  # each residual's type with its sharding type


class StageGrad:
    """The F, B and W computations of a training table's stages (see the module), for one
    training step: the loss contract, the checkpoint mode and the per-micro-batch inputs (the
    targets, row masks, key and side inputs, cut into micro-batches)."""

    def __init__(self, pipe, cfg, loss_fn, plan, num_micro, ts, mask, key, cs=None, weighted=False):
        self.pipe, self.cfg, self.loss_fn, self.plan = pipe, cfg, loss_fn, plan
        self.ts, self.mask, self.key = ts, mask, key
        self.cs = cs  # micro-batched side inputs, or None
        self.m = num_micro  # micro-batches of this data shard
        self.offset = 0  # index of its first micro-batch in the mini-batch (for the keys)
        # The loss contract (see `per_example`): a mean is scaled per micro-batch by 1 / batch; a
        # weighted loss adds up sums and weights, and the step divides both totals at the end.
        self.scale = 1.0 if weighted else 1.0 / plan.batch
        # "always": F stashes the stage input and B and W recompute the stage from it; "never":
        # F keeps the residuals of the stage's vjp; a policy: the residuals of the vjp of the
        # stage checkpointed with that policy, i.e. what the policy saves (see `save`).
        self.keep = cfg.checkpoint != "always"
        self.policy = cfg.checkpoint if callable(cfg.checkpoint) else None
        self._meta = {}  # id(variant) -> its pullback's :class:`Pullback`
        # stateful stages: every stage's state (a list, or stacked on a stage axis), read whole
        self.state = None
        # `value_and_grad(..., aux_loss=)`: each slot adds w_i aux_loss(aux) to the loss (and seeds
        # its cotangent in B and W), see `_extra`; None: no aux loss
        self.aux_loss = None
        # a weighted loss with an aux loss: the batch's total weight W, by which each aux term is
        # scaled (the final division by the summed weights takes it back out; see
        # `train._total_weight`)
        self.aux_scale = None

    def on_shard(self, ts, mask, key, cs, state, aux_scale, offset=0) -> StageGrad:
        """The same computations on the values a device of the mesh reads inside the
        ``shard_map``; their pullbacks are traced again there, with those values' types."""
        new = copy.copy(self)
        new.ts, new.mask, new.key, new.cs, new.state, new.aux_scale = ts, mask, key, cs, state, aux_scale
        new.offset, new._meta = offset, {}
        return new

    def inputs(self, i, s):
        """``(k, targets, mask)`` of micro-batch ``i`` at stage ``s``: ``k`` is ``(key, context
        rows or None, s)``, what the stage reads besides its parameters and input (:meth:`_stage`)."""
        ic = engine.clip(i, self.m)
        key = engine.stage_keys(self.cfg, self.key, self.offset + ic, s, self.plan.micro_size)
        read = lambda tree: engine.read(self.cfg, tree, ic)
        rows = None if self.cs is None else read(self.cs)
        return (key, rows, jnp.asarray(s, jnp.int32)), read(self.ts), read(self.mask)

    def _stage(self, v: Variant, p, x, k, mask):
        """``(y, stats)``: the stage function of ``v`` on ``x`` (with its micro-batch's
        ``context=``, if any; a stateful stage also reads its state and the row mask)."""
        key, rows, s = k
        kwargs = {} if rows is None else {"context": rows}
        state = self.pipe.kind.stage_state(self.state, v.stage, s) if self.cfg.stateful else None
        return aux_outputs.call(v.fn, self.cfg.stateful, self.cfg.aux, p, x, key, state, mask, kwargs)

    def _extra(self, stats, mask):
        """The aux loss of a slot's (stage, micro-batch), ``w_i aux_loss(aux)`` (see
        :mod:`pipejax._src.aux_outputs`; with a weighted loss ``W w_i aux_loss(aux)``, ``W`` the
        batch's total weight, see :func:`pipejax._src.training.step._total_weight`), or ``None``
        without one."""
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

    def _objective(self, v: Variant, p, x, k, t, mask):
        """What a slot differentiates, ``(value, (weight, stats))``: the last stage's loss (its
        aux loss added), another stage's output (beside its aux loss, :class:`WithAux`, when it
        has one); ``weight`` is the last stage's weight sum (``None`` elsewhere), ``stats`` what
        a stateful stage reported."""
        y, stats = self._stage(v, p, x, k, mask)
        extra = self._extra(stats, mask)
        if v.last:
            loss, weight = self._loss(y, t, mask)
            return _plus(loss, extra), (weight, stats)
        return (y if extra is None else WithAux(y, extra)), (None, stats)

    def save(self, v: Variant, prow, x, k, t, mask):
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
        if isinstance(out, WithAux):  # the stage's aux loss joins the loss
            return out.y, jnp.stack([out.extra, jnp.zeros_like(out.extra)]), saved, stats
        return out, None, saved, stats

    def _residuals(self, v: Variant, prow, x, k, t, mask):
        """``(value, (weight, stats), residual leaves, treedef)`` of the stage's (the last stage:
        its loss's) pullback (:meth:`_objective`).

        ``jax.vjp``'s pullback is a pytree whose leaves are its residuals and whose treedef holds
        the rest (a closed program), so it can be taken apart, stashed and put back together.
        With a checkpoint policy the stage is checkpointed with it first, so the residuals are
        what the policy saves and the pullback recomputes the rest.
        """
        # typed as the analysis traced it (`zero_input`): an input that does not vary yet (stage
        # 0's micro-batch of x) would be cast inside the stage, and a policy that saves
        # everything would save the casts as residuals the analysis never saw
        xf, rebuild = _floats(compat.to_varying(x, _axes(prow)))

        def h(p, xf):
            return self._objective(v, p, rebuild(xf), k, t, mask)

        if self.policy is not None:
            h = ckpt.remat_for(self.policy)(h)
        out, back, aux = jax.vjp(h, v.params_of(prow), xf, has_aux=True)
        leaves, treedef = jax.tree.flatten(back)
        return out, aux, leaves, treedef

    def _meta_of(self, v: Variant, prow) -> Pullback:
        """What variant ``v``'s pullback looks like (:class:`Pullback`), traced once."""
        if id(v) not in self._meta:
            info = {}

            def leaves(prow, x, k, t, mask):
                out, _, res, info["treedef"] = self._residuals(v, prow, x, k, t, mask)
                info["out"] = jax.tree.map(_typed_struct, out)
                info["axes"] = _axes(out.extra if isinstance(out, WithAux) else out)
                info["types"] = bnd.struct(res)
                info["typed"] = [_typed_struct(a) for a in res]
                return res

            k, t, mask = self.inputs(jnp.zeros((), jnp.int32), 0)
            # traced with the types the slots see: inside the shard_map, values that vary along
            # its manual axes (the input too, as the parameters do)
            x = zero_input(v, prow)
            per_micro = depends(leaves, (prow, x, k, t, mask), (False, True, True, True, True))
            self._meta[id(v)] = Pullback(per_micro=per_micro, **info)
        return self._meta[id(v)]

    def saved_structs(self, v: Variant, prow):
        """The type of what F saves for B and W (:meth:`save`)."""
        k, t, mask = self.inputs(jnp.zeros((), jnp.int32), 0)
        return jax.eval_shape(lambda p, x: self.save(v, p, x, k, t, mask)[2], prow, v.x_layout.structs())

    def _vjp(self, v: Variant, prow, x, k, t, mask):
        """F with ``checkpoint="never"`` or a policy: the value, ``(weight, stats)`` (see
        :meth:`_residuals`) and the residuals that depend on the micro-batch."""
        meta = self._meta_of(v, prow)
        out, aux, leaves, _ = self._residuals(v, prow, x, k, t, mask)
        # the analysis traced the program these residuals come from (same types, weak ones too)
        assert bnd.struct(leaves) == meta.types, "residuals of another program"
        return out, aux, [a for a, keep in zip(leaves, meta.per_micro, strict=True) if keep]

    def pull(self, v: Variant, prow, saved, g, k, t, mask, wrt_params: bool, wrt_input: bool):
        """B and W: :meth:`pullback` from what :meth:`save` kept."""
        if not self.keep:
            return self.pullback(v, prow, saved, g, k, t, mask, wrt_params, wrt_input)
        if not (wrt_params or wrt_input):
            return None, None
        meta = self._meta_of(v, prow)
        per_micro = meta.per_micro
        fresh = [None] * len(per_micro)
        if not all(per_micro):  # the parameter-only residuals, from the parameters (x unused)
            fresh = self._residuals(v, prow, zero_input(v, prow), k, t, mask)[2]
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

    def pullback(self, v: Variant, prow, x, g, k, t, mask, wrt_params: bool, wrt_input: bool):
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

    def loss_dtype(self, v):
        """The dtype of the ``(loss, weight)`` sums (the loss's dtype)."""
        out = jax.eval_shape(
            lambda y, t, mask: self._loss(y, t, mask),
            v.y_layout.structs(),
            bnd.micro_struct(self.ts),
            bnd.micro_struct(self.mask),
        )
        return out[0].dtype


# --- small exact helpers ---------------------------------------------------------------------


class WithAux(NamedTuple):
    """A stage's value with an aux loss (``value_and_grad(..., aux_loss=)``): its output and the
    aux loss of its (stage, micro-batch), seeded with one in B and W."""

    y: Any
    extra: jax.Array


def _seed(v: Variant, out, g, ones):
    """The cotangent a pullback of :meth:`StageGrad._objective` is applied to: one for the loss
    (and for a stage's aux loss, beside its output's cotangent ``g``); ``ones(value)``."""
    if v.last:
        return ones(out)
    if isinstance(out, WithAux):
        return WithAux(_cotangent(g, out.y), ones(out.extra))
    return _cotangent(g, out)


def _plus(loss, extra):
    return loss if extra is None else loss + extra.astype(loss.dtype)


def _typed_struct(a):
    """A residual's type with its sharding type: a cotangent seed takes it (an output typed split
    over an Explicit axis inside a stage is seeded with a cotangent split alike)."""
    t = jax.typeof(a)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type, sharding=t.sharding)


def zero_input(v: Variant, prow):
    """A stage input of zeros, typed as the slots' inputs: inside the shard_map, varying along
    the manual axes the parameters vary along."""
    return compat.to_varying(engine.zeros(v.x_layout), _axes(prow))


def _axes(tree) -> tuple[str, ...]:
    """The manual axes along which some leaf of ``tree`` varies (none outside ``shard_map``)."""
    return tuple(sorted(set().union(*(compat.varying_axes(a) for a in jax.tree.leaves(tree)))))


def depends(fn, args, varying) -> list[bool]:
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


def inexact(a) -> bool:
    dtype = a.dtype if hasattr(a, "dtype") else jnp.result_type(a)
    return jnp.issubdtype(dtype, jnp.inexact)


def _floats(x):
    """The floating leaves of ``x`` (the ones that have cotangents) and how to put them back."""
    leaves, treedef = jax.tree.flatten(x)
    where = [inexact(a) for a in leaves]
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
        treedef, [next(it) if inexact(a) else jnp.zeros(a.shape, a.dtype) for a in leaves]
    )


def _cotangent(g, out):
    """``g`` with ``out``'s dtypes (exact for the containers' round trip) and sharding types (a
    value typed with an Explicit axis inside a stage comes out of its container replicated)."""
    return jax.tree.map(lambda a, o: compat.like(a.astype(o.dtype), o), g, out)
