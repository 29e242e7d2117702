"""The stage kinds (:class:`Heterogeneous`, :class:`Homogeneous`): how a device runs the stage the
table names at a tick, the containers of their messages and stats, and the one stage dispatch
(:func:`dispatch`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pipejax._src import compat
from pipejax._src.containers import Container, Layout
from pipejax._src.engine.collectives import _as_varying, _unstack
from pipejax._src.engine.config import named, read, stage_call, take, whole, zeros


class Heterogeneous:
    """Different stage functions, parameters and activation types per stage.

    ``params``/``state`` come as one packed buffer per dtype with the device's stages on a
    leading axis (``(v, size)``: a :class:`~pipejax._src.params.placement.StageParams`' buffers) when
    ``switch`` is True (a mesh: one SPMD program picks the stage with ``lax.switch``), and as a
    list of per-stage pytrees otherwise (virtual devices: device ``d`` calls stage ``d``).
    """

    def __init__(self, cfg, boundaries, stats_layouts, param_layouts, state_layouts, num_devices, switch):
        self.cfg, self.boundaries, self.stats_layouts = cfg, boundaries, stats_layouts
        self.param_layouts, self.state_layouts = param_layouts, state_layouts
        self.D, self.switch = num_devices, switch
        self.S = len(cfg.stages)
        self.v = self.S // num_devices
        # on a mesh the micro-batch of x travels in the same container (see MeshDevices)
        self.box = Container.for_layouts(boundaries if switch else boundaries[1:])
        self.statbox = Container.for_layouts(stats_layouts)
        if switch:  # the containers the packed parameters (and state) were built with
            self.pbox = Container.for_layouts(param_layouts)
            if state_layouts is not None:  # (the training program reads the state whole)
                self.sbox = Container.for_layouts(state_layouts)

    computes_bubbles = False  # a bubble is one more branch of the stage switch

    def packed(self, d) -> bool:
        """Whether device ``d``'s messages travel in containers (on a mesh, where every device
        sends one type)."""
        return self.switch

    def message_zeros(self, d, leading=()):
        if self.packed(d):
            return self.box.zeros(leading), self.statbox.zeros(leading)
        return zeros(self.boundaries[d + 1], leading), zeros(self.stats_layouts[d], leading)

    def acc_zeros(self, m):
        return zeros(self.boundaries[self.S], (m,))

    # The one container layout of every schedule's messages, stashes and stats on a mesh. A
    # value typed with Explicit axes inside a stage (``param_specs`` over a "model" axis) is
    # replicated before it is flattened (a reshape across a sharded dimension is refused).

    def pack(self, tree):
        """An activation (or its cotangent, or a micro-batch of ``x`` for stage 0) as the
        message every device sends."""
        return self.box.pack(whole(self.cfg, tree))

    def unpack(self, message, layout: Layout):
        return self.box.unpack(message, layout)

    def stats_message(self, stats):
        """A slot's stats (records) as the one type every stage's branch returns."""
        return self.statbox.pack(whole(self.cfg, stats))

    def output(self, d, message):
        """The last stage's output, read from the message of the last device ``d``."""
        return self.box.unpack(message, self.boundaries[self.S]) if self.packed(d) else message

    def compute(
        self, d, params, state, x_in, xs, mask, ic, s, key_for, vary, guard=None, fresh=None, keeps=False
    ):
        """Runs stage ``s`` of device ``d`` on ``x_in``; returns the (message, stats).

        ``guard``: ``(working, prev)``; where ``working`` is False (a bubble) nothing runs and
        ``prev`` is returned. ``fresh``: on a mesh, the micro-batch of ``x`` stage 0 reads; it
        equals ``x_in`` where stage 0 runs, and stage 0 reads ``x_in`` differentiated as
        ``fresh`` (:func:`_read_as`), so its input carries no tangent of the activations that
        share the message (a stage that calls ``jax.pure_callback`` on ``x`` differentiates
        with respect to the parameters).
        On a mesh the bubble is one more branch of the stage switch (one level of control flow,
        not a ``cond`` around a ``switch``).

        ``keeps``: the tick keeps residuals for the backward pass (a phase other than
        ``"always"``). Its stages' parameters are then unpacked outside the switch, each from its
        own row of the device's block (row ``t // D``, static): values of the loop's constants,
        which autodiff keeps once. Unpacked in a branch they are the branch's residuals, kept in
        every tick (GPipe ``"never"`` on ``benchmarks/planner.py``'s embedding model: 1,432.4 ->
        377.0 KiB; decision 0037). Where the ticks keep nothing, that would cost more: the
        backward pass gives every stage's parameters a cotangent in every tick (8 tanh blocks as a
        list, ``"always"``: 48.2 -> 64.1 KiB), so there they are unpacked in the branch.
        """
        if self.switch:
            r = _round(s, self.D, self.v)
            if keeps:  # the branches' operand: every stage's parameters, unpacked
                srow = _row(state, r, self.v)
                pin = [
                    self.pbox.unpack(_row(params, t // self.D, self.v), lay)
                    for t, lay in enumerate(self.param_layouts)
                ]
                stage_params = lambda pin, t: pin[t]
            else:  # the branches' operand: the device's packed row
                pin, srow = _row((params, state), r, self.v)
                stage_params = lambda pin, t: self.pbox.unpack(pin, self.param_layouts[t])

            def branch(t):
                call = stage_call(self.cfg, t)

                def f(pin, srow, x_in, xs, mask, ic, k):
                    p, st = stage_params(pin, t), self.sbox.unpack(srow, self.state_layouts[t])
                    if t == 0 and fresh is not None:  # the micro-batch of x, as data
                        x_in = jax.tree.map(_read_as, x_in, fresh)
                    x = self.box.unpack(x_in, self.boundaries[t])
                    y, stats = call(p, x, k, st, read(self.cfg, mask, ic))
                    return vary((self.pack(y), self.stats_message(stats)))

                return f

            working, prev = (True, None) if guard is None else guard
            idle = lambda *args: prev
            branches = [branch(t) for t in range(self.S)]
            return dispatch(working, s, branches, idle, pin, srow, x_in, xs, mask, ic, key_for(s))
        # a virtual device (no mesh) runs its own stage d on raw activations: a direct call
        assert guard is None and self.v == 1, "virtual devices run one stage each, without bubbles"
        x = take(xs, ic) if d == 0 else x_in
        return stage_call(self.cfg, d)(params[d], x, key_for(d), state[d], take(mask, ic))

    def device_rows(self, stats, num_devices: int):
        """The mesh loop's stats ``(D, ...)`` as a list with one entry per device."""
        return _unstack(stats, num_devices)

    def stats_rows(self, stats_by_device):
        """Per-device stats accumulators ``[d] -> (v, m, ...)`` -> a list with one pytree per stage."""
        rows = [
            jax.tree.map(lambda a, s=s: a[s // self.D], stats_by_device[s % self.D]) for s in range(self.S)
        ]
        return self.stage_rows(rows, self.switch)

    def stage_rows(self, rows, packed=True):
        """Stage-major stats, a buffer ``(S, m, ...)`` or a list ``[s] -> (m, ...)``, as a list
        of each stage's pytree (unpacked from the stats container when ``packed``)."""
        if not isinstance(rows, list):
            rows = [jax.tree.map(lambda a, s=s: a[s], rows) for s in range(self.S)]
        out = []
        for s in range(self.S):
            row, layout = rows[s], self.stats_layouts[s]
            if packed:
                row = (
                    layout.structs()
                    if not layout.shapes
                    else jax.vmap(lambda b, lay=layout: self.statbox.unpack(b, lay))(row)
                )
            out.append(row)
        return out


class Homogeneous:
    """One stage function for every stage; parameters stacked on a leading stage axis.

    ``params``/``state`` leaves are ``(rows, ...)``: the device's ``v`` stages on a mesh (row
    ``s // D``), every stage without one (row ``s``); ``local`` says which.
    """

    def __init__(self, cfg, boundaries, stats_layout, num_devices, local):
        self.cfg, self.layout, self.stats_layout = cfg, boundaries[0], stats_layout
        self.D, self.local = num_devices, local
        self.S = len(cfg.stages)
        self.v = self.S // num_devices
        self.call = stage_call(cfg, 0)

    def message_zeros(self, d, leading=()):
        return zeros(self.layout, leading), zeros(self.stats_layout, leading)

    def acc_zeros(self, m):
        return zeros(self.layout, (m,))

    def output(self, d, message):
        return message

    # One activation type: messages, stashes and stats are the values themselves, typed as the
    # stage's input. A value typed with Explicit axes inside the stage (``param_specs``: e.g. the
    # output of a column-parallel layer, sharded over a "model" axis) is replicated, as the
    # heterogeneous containers do, so that it has the input's type (a no-op otherwise).

    def pack(self, tree):
        return whole(self.cfg, tree)

    def unpack(self, message, layout: Layout):
        return message

    def stats_message(self, stats):
        return whole(self.cfg, stats)

    # On a mesh a bubble tick runs the stage on a micro-batch of x, delivered by the devices as
    # its input (`device_tick`'s ``bubbles_fresh`` or ``safe``), and its output goes only to
    # other bubbles: no guard.
    # A `lax.cond` guard made XLA carry the recomputed stage's intermediates out of the branch,
    # ~370 KiB more per device on benchmarks/maxtext_style.py (1,059.6 -> 689.6 KiB at m=4).
    computes_bubbles = True

    def compute(
        self, d, params, state, x_in, xs, mask, ic, s, key_for, vary, guard=None, fresh=None, keeps=False
    ):
        """Runs stage ``s`` on ``x_in`` (or micro-batch ``ic`` of ``xs`` for stage 0). ``guard``
        is not needed (see :attr:`computes_bubbles`), and ``fresh`` is unused: one stage
        function reads both ``x`` and the activations; ``keeps`` too: the parameters are the
        device's row, read as one (a named slice with several repeats), without a switch."""
        x = x_in  # on a mesh the devices deliver stage 0's micro-batch as the message
        if self.local:
            x = jax.tree.map(lambda a, b: jnp.where(s == 0, a, b), take(xs, ic), x_in)
        if self.local:
            p, st = named(
                jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, s, keepdims=False), (params, state))
            )
        else:
            p, st = _row((params, state), _round(s, self.D, self.v), self.v)
        y, stats = self.call(p, x, key_for(s), st, read(self.cfg, mask, ic))
        return vary((self.pack(y), self.stats_message(stats)))

    def device_rows(self, stats, num_devices: int):
        """The mesh loop's stats, ``(D, v, m, ...)`` as :meth:`stats_rows` reads them."""
        return stats

    def stats_rows(self, stats_by_device):
        """``(D, v, m, ...)`` stats -> ``(S, m, ...)`` in stage order (``s = r D + d``)."""
        return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1, *a.shape[2:])), stats_by_device)

    def stage_rows(self, rows, packed=True):  # stage-major (S, m, ...) already
        return rows


@jax.custom_jvp
def _read_as(value, data):
    """``value``, differentiated as ``data`` (which it equals wherever it is read).

    Stage 0 on a mesh reads its micro-batch from the message that also carries activations, so
    the message has their tangent; read through this, the input's tangent is ``data``'s, a
    symbolic zero unless ``x`` itself is differentiated. The primal never reads ``data``, so
    a checkpoint saves nothing more for it.
    """
    return value


def _read_as_jvp(primals, tangents):
    value, _ = primals
    t = tangents[1]
    if isinstance(t, SymbolicZero):  # x is not differentiated: no tangent at all
        return value, SymbolicZero(jax.typeof(value).to_tangent_aval())
    # the tangent typed like ``value`` (which may vary where ``data``'s tangent does not, e.g.
    # the zeros a container packs around integer tokens), without a collective in the branch
    axes = tuple(compat.varying_axes(value))
    return value, _as_varying(t, jnp.zeros_like(value), axes) if axes else t


_read_as.defjvp(_read_as_jvp, symbolic_zeros=True)


def dispatch(working, index, branches, idle, *args):
    """The one stage dispatch of every slot of every schedule: ``branches[index](*args)`` where
    ``working``, ``idle(*args)`` elsewhere (a bubble, an idle F, B or W slot).

    A traced ``index`` (a device of the mesh: one SPMD program picks its stage) is one
    ``lax.switch`` with ``idle`` as its last branch -- one level of control flow, not a ``cond``
    around a ``switch``; no ``idle`` branch when ``working`` is ``True``. A static ``index`` (a
    virtual device, which runs its own stage) is a direct call, under ``lax.cond`` when
    ``working`` is traced. Every branch returns one type; collectives never sit in a branch.
    """
    if isinstance(index, (int, np.integer)):
        if working is True:
            return branches[index](*args)
        return lax.cond(working, branches[index], idle, *args)
    if working is True:
        return lax.switch(index, branches, *args)
    return lax.switch(jnp.where(working, index, len(branches)), [*branches, idle], *args)


def _row(tree, r, repeats):
    """Row ``r`` of a device's stages: leaves ``(1, ...)`` for one repeat (static), ``(repeats,
    1, ...)`` otherwise (named). The stage axis is dropped after the pick, in the tick: dropped
    before the loop, XLA gave the ``(repeats, ...)`` parameters another layout than the loop's
    and copied them (circular on ``benchmarks/maxtext_style.py``, m = 4: 722.1 -> 561.6 KiB)."""
    if repeats == 1:
        return jax.tree.map(lambda a: a[0], tree)
    pick = lambda a: lax.dynamic_index_in_dim(a, r, keepdims=False, allow_negative_indices=False)[0]
    return named(jax.tree.map(pick, tree))


def _round(s, D: int, v: int):
    """The round ``s // D`` of stage ``s`` (``0 <= s < v D``), counted with comparisons: XLA
    computes those again where the round is read, where a division (an expensive operation to
    XLA) kept its result in a buffer of its own through the backward loop."""
    if isinstance(s, int):
        return s // D
    return sum(((s >= r * D).astype(s.dtype) for r in range(2, v)), (s >= D).astype(s.dtype))
