"""The devices of a table on a mesh (:class:`MeshDevices`): the one ``shard_map``, the tick loop
inside it, parameter placement, ring sends and exact sums over the data axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from pipejax._src import checkpoint as ckpt
from pipejax._src import compat
from pipejax._src.engine import tick as ticks  # `ticks.device_tick`: one name a test can patch
from pipejax._src.engine.collectives import (
    _as_varying,
    _gather_stages,
    _is_spec,
    _lead,
    _unlead,
    shift,
    sum_exact,
)
from pipejax._src.engine.config import Config, Inputs, read, take
from pipejax._src.engine.table_rows import LEFT, RIGHT, columns, loop_delay, read_row, read_tick
from pipejax._src.engine.tick import Carry, _Ctx, _scan, at_device, recomputed
from pipejax._src.schedules.table import Schedule


class MeshDevices:
    """The table's devices as the devices of the mesh's stage axis, under ``jax.shard_map``."""

    def __init__(self, cfg: Config, mesh, repeats: int, data_size: int, param_specs=None):
        self.cfg, self.mesh, self.repeats, self.data_size = cfg, mesh, repeats, data_size
        self.axes = (cfg.axis_name,) if cfg.data_axis_name is None else (cfg.axis_name, cfg.data_axis_name)
        # per parameter leaf its full PartitionSpec (stage axis and the axes inside a stage), or None
        self.param_specs = param_specs

    def spmd(self, body, params, stage_spec, operands, out_specs):
        """``body(d, params, *values)`` run by every device ``d`` of the stage axis: the one
        ``jax.shard_map`` of every program (the forward schedules and the training schedules).

        ``params`` are placed by :meth:`place_params` (the ``shard_map`` is manual over the stage
        and data axes only with ``param_specs``, over every axis otherwise) and reach ``body``
        gathered whole over the data axis (FSDP, :meth:`gather_data`). ``operands`` are
        ``(value, spec, vary)`` triples: each value is constrained to ``spec`` and, where
        ``vary``, cast to vary along the manual axes before ``body`` reads it (a ``None`` value
        passes as ``None``). ``out_specs(param_in)`` gives the outputs' specs from the
        parameters' (the specs of their gradients).
        """
        axis = self.cfg.axis_name
        params, param_in, manual = self.place_params(params, stage_spec)
        values = [None if v is None else compat.constrain(v, self.mesh, sp, axis) for v, sp, _ in operands]
        vary = [f for _, _, f in operands]

        def inner(params, *values):
            params = self.gather_data(params)
            cast = compat.to_varying((params, [v for v, f in zip(values, vary, strict=True) if f]), self.axes)
            it = iter(cast[1])
            values = [next(it) if f else v for v, f in zip(values, vary, strict=True)]
            return body(lax.axis_index(axis), cast[0], *values)

        in_specs = (
            param_in,
            *(None if v is None else sp for v, (_, sp, _) in zip(values, operands, strict=True)),
        )
        fn = jax.shard_map(
            inner, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs(param_in), axis_names=manual
        )
        return fn(params, *values)

    def phases(self, checkpoint, schedule):
        """The checkpoint phases of a forward table on the mesh (see
        :func:`~pipejax._src.checkpoint.phases`)."""
        return ckpt.phases(checkpoint, schedule)

    def run(self, ctx: _Ctx, schedule: Schedule, phases, inputs: Inputs, slots):
        axis, data = self.cfg.axis_name, self.cfg.data_axis_name
        rep = PartitionSpec()
        stage_spec = PartitionSpec(axis) if self.repeats == 1 else PartitionSpec(None, axis)
        batch_spec = rep if data is None else PartitionSpec(data)
        stats_spec = rep if data is None else PartitionSpec(None, None, data)
        params, state, xs, mask, key = inputs
        xs_spec = batch_spec
        if self.streams(ctx):  # micro-batches spread over the stage axis, k per device
            k = -(-ctx.m // ctx.D)
            pad = k * ctx.D - ctx.m
            if pad:  # never read: copies of the last micro-batch
                xs = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]), xs)
            xs_spec = PartitionSpec(axis)

        finished = self.finished(ctx, schedule)  # None: the outputs are summed, not drained
        drains = finished is not None

        def body(d, params, state, xs, mask, key):
            return self._body(ctx, schedule, phases, d, Inputs(params, state, xs, mask, key), finished, slots)

        operands = [
            (state, stage_spec, True),
            (xs, xs_spec, True),
            (mask, batch_spec, True),
            (key, rep, True),
        ]
        acc, stats = self.spmd(
            body,
            params,
            stage_spec,
            operands,
            lambda _: (PartitionSpec(axis) if drains else batch_spec, stats_spec),
        )
        if drains:  # the outputs, split over the stage axis (ceil(m / D) per device, padded)
            if compat.is_explicit(self.mesh, axis):
                # an Explicit type is what the user sees (and it refuses reshapes across the
                # stage axis): replicated, as the stages composed would give it
                acc = compat.replicate(acc)
            acc = jax.tree.map(lambda a: a[: ctx.m], acc)
        return acc, ctx.stages.stats_rows(ctx.stages.device_rows(stats, ctx.D))

    def place_params(self, params, stage_spec):
        """``(params, in_specs, manual axes)``: stage parameters constrained for the ``shard_map``.

        With ``param_specs``, each leaf is constrained exactly as they say and the ``shard_map``
        is manual over the stage (and data) axes only, so XLA partitions each stage's computation
        over the mesh's other axes (tensor / FSDP sharding inside a stage). Without, it is manual
        over every axis, and parameters are whole on each device of their stage. The same
        ``in_specs`` serve as the ``out_specs`` of parameter gradients.
        """
        axis = self.cfg.axis_name
        if self.param_specs is None:
            return (
                compat.constrain(params, self.mesh, stage_spec, axis),
                stage_spec,
                frozenset(self.mesh.axis_names),
            )
        params = jax.tree.map(
            lambda a, sp: compat.constrain(a, self.mesh, sp, axis), params, self.param_specs
        )
        param_in = jax.tree.map(self._manual, self.param_specs, is_leaf=_is_spec)
        return params, param_in, frozenset(self.axes)

    def sum_over_data(self, grads):
        """Parameter gradients of every data shard summed over the data axis, sharded as the
        parameters are stored: a reduce-scatter on a dimension stored sharded over the data axis
        (FSDP; the transpose of :meth:`gather_data`), a ``psum`` elsewhere."""
        data = self.cfg.data_axis_name
        if data is None:
            return grads
        if self.param_specs is None:
            return lax.psum(grads, data)

        def reduce(g, spec):
            for dim, p in enumerate(spec):
                if p == data or p == (data,):
                    return lax.psum_scatter(g, data, scatter_dimension=dim, tiled=True)
            return lax.psum(g, data)

        return jax.tree.map(reduce, grads, self.param_specs)

    def _manual(self, spec: PartitionSpec) -> PartitionSpec:
        """``spec`` restricted to the axes the ``shard_map`` is manual over (stage, data)."""
        keep = lambda p: (
            p if p is None or (p in self.axes if isinstance(p, str) else set(p) <= set(self.axes)) else None
        )
        return PartitionSpec(*(keep(p) for p in spec))

    def gather_data(self, params):
        """Parameter dimensions stored sharded over the data axis (FSDP), gathered whole: each data
        shard needs its stage's whole parameters. The transpose of the gather is a reduce-scatter,
        so gradients come back summed over the data axis and sharded as stored."""
        data = self.cfg.data_axis_name
        if self.param_specs is None or data is None:
            return params

        def gather(a, spec):
            for dim, p in enumerate(spec):
                if p == data or p == (data,):
                    a = lax.all_gather(a, data, axis=dim, tiled=True)
            return a

        return jax.tree.map(gather, params, self.param_specs)

    def streams(self, ctx) -> bool:
        """Whether ``x`` is spread over the stage axis and streamed to device 0 (not replicated).

        Device ``d`` holds micro-batches ``d k, ..., d k + k - 1`` (``k = ceil(m / n)``) in a
        queue. At tick ``t`` every device hands slot ``t mod k`` of its queue to device
        ``d - 1``, which puts it in the same slot; so after ``r`` hand-overs of a slot, device 0's
        slot ``j`` holds micro-batch ``r k + j``, and at tick ``t = r k + j`` it holds micro-batch
        ``t``: the one stage 0 starts then. Cost: one ``ppermute`` of one micro-batch per tick;
        a device stores ``k`` micro-batches of ``x`` instead of ``m``. (With a data axis ``x`` is
        split over that axis only, and on Auto axes the batch stays replicated: see below.)
        """
        # On Auto axes XLA's sharding propagation is left to reshard the queue around the
        # micro-batch reshapes, and did so in forward-over-reverse programs (an "involuntary full
        # rematerialization" in Lanczos through a pipeline); Explicit axes reshard where told.
        explicit = compat.is_explicit(self.mesh, self.cfg.axis_name)
        return self.cfg.data_axis_name is None and ctx.D > 1 and explicit

    def _body(self, ctx, schedule, phases, d, inputs, finished, slots):
        """The forward schedules' device: the loop, then its outputs and stats."""
        carry, drain = self.loop(ctx, schedule, phases, d, inputs, slots, finished)
        stats = _gather_stages(carry.stats, d, ctx.D, self.cfg.axis_name)
        if drain is not None:
            slots = jax.tree.leaves(drain)[0].shape[0]
            for i in range(ctx.m, slots * ctx.D):  # padding entries, so every output reaches its device
                pad = self.pushes(np.array([i]), slots, ctx.D)
                drain = self._drain(drain, jax.tree.map(lambda a: a[0], drain), pad, None, d)
            return drain, stats
        # Only the last device wrote its accumulator; the others hold zeros, and adding exact
        # zeros is exact, so the sum is bitwise the last device's outputs.
        return sum_exact(_unlead(carry.acc), self.cfg.axis_name), stats

    def loop(self, ctx, schedule, phases, d, inputs, slots, finished=None):
        """The one tick loop of device ``d``: every schedule's table, run by :func:`device_tick`.

        ``slots`` (:class:`Slots`): the table's program, the tick's stage computation and what
        runs after it (a forward table's :class:`ForwardSlots`; a training table's F slot, then
        its B and W slots, which send cotangents one device back). Returns the final
        :class:`Carry` and the drain queue (``None`` unless ``finished``, see :meth:`finished`).
        """
        cfg, axes, axis, D, m = self.cfg, self.axes, self.cfg.axis_name, ctx.D, ctx.m
        stages = ctx.stages

        def vary(tree, template):  # inside a branch: give outputs the sharding type of the carry
            return _as_varying(tree, template, axes)

        def global_micro(i):
            if cfg.data_axis_name is None:
                return i
            return lax.axis_index(cfg.data_axis_name) * m + i

        def tick(phase, inputs):
            step = slots.step_for(cfg, ctx, inputs, phase, vary, global_micro)

            def body(c, row):
                c, queue, drain = c
                j = slots.fresh_index(row, d, D, k, m)  # the micro-batch the device reads
                fresh = stages.pack(read(cfg, queue, j))
                carry, out = ticks.device_tick(
                    ctx,
                    d,
                    inputs.params,
                    inputs.state,
                    c,
                    row,
                    step,
                    fresh=fresh,
                    safe=safe,
                    bubbles_fresh=bubbles_fresh,
                )
                if streams:  # hand slot j on towards device 0
                    moved = lax.ppermute(take(queue, j), axis, [(e, e - 1) for e in range(1, D)])
                    queue = jax.tree.map(
                        lambda a, v: lax.dynamic_update_index_in_dim(a, v, j, 0), queue, moved
                    )
                if drain is not None:  # the last stage's output joins the drain queue
                    drain = self._drain(drain, stages.output(d, out[0]), pushes, row, d)
                # B and W (a training table); their input cotangents go one device back
                back, sent = slots.back(carry.back, out, row, d)
                message = own = out[0]
                own_sent = sent
                if overlap:  # send what the last tick made (a carry) while this tick computes
                    (message, sent), sending = c.sending, (message, sent)
                    carry = carry._replace(sending=sending)
                if v_shape:  # down or up the V, or the turn on the device itself
                    sources = read_row(row, D, ("F source", "B source"), columns(schedule))
                    fsrc, bsrc = (at_device(a, d) for a in sources)
                    odd = read_tick(row, D) % 2  # the tick's parity picks where messages go
                    if overlap:  # a shift each way; the turn (own) takes one tick. What goes out
                        # now was made last tick: activations made on an even tick (sent on an
                        # odd one) go down the V, to d + 1, and cotangents to d - 1
                        received = _shift_v(sent, bsrc, odd == 0, own_sent, axis, D)
                        inbox = _shift_v(message, fsrc, odd == 1, own, axis, D)
                    else:  # the pairs that swap
                        received = _deliver(sent, bsrc, 1 - odd, axis, D)
                        inbox = _deliver(message, fsrc, odd, axis, D)
                else:
                    received = shift(sent, axis, D, ring=ctx.v > 1, back=True)
                    inbox = shift(message, axis, D, ring=ctx.v > 1)
                carry = carry._replace(back=slots.arrive(back, received))
                return (carry._replace(inbox=inbox), queue, drain), None

            return body

        # (a training table reads the micro-batch of its F slot from x whole: a streamed queue is
        # a carry of the loop whose temp memory grows with m, and the training tables keep
        # their memory flat in m)
        streams = slots.may_stream and self.streams(ctx)
        # a bubble's input (homogeneous stages of a forward table): the tick's micro-batch of x,
        # which every device reads when every device holds x; when x is streamed a later
        # device's queue slot may hold zeros, so a bubble there reads micro-batch 0
        # (loop-invariant: no per-tick residual). An idle F slot of a training table computes
        # nothing.
        computes_bubbles = stages.computes_bubbles and slots.bubbles_compute
        bubbles_fresh = computes_bubbles and not streams
        safe = None
        if computes_bubbles and streams:
            safe = stages.pack(take(inputs.xs, 0))
        queue = inputs.xs  # (k, b, ...) of this device; all m micro-batches when not streamed
        k = jax.tree.leaves(queue)[0].shape[0] if streams else 1
        if not streams:  # every device holds every micro-batch: read micro-batch t at tick t
            k = jax.tree.leaves(queue)[0].shape[0] + schedule.num_ticks
        message, stat = stages.message_zeros(0)
        delay = loop_delay(schedule) if ctx.v > 1 and slots.loop_buffer else 0
        loop = stages.message_zeros(0, (delay + 1,))[0] if delay else ()
        drain, acc = None, lambda: _lead(stages.acc_zeros(m))
        if finished is not None:  # ceil(m / D) output slots per device instead of m
            drain, acc = compat.to_varying(stages.acc_zeros(-(-m // D)), axes), lambda: None
            pushes = self.pushes(finished, -(-m // D), D)
        # a training table keeps no outputs and no bubble that returns the last one
        acc, prev, back = slots.start(acc, (message, stat))
        stats = stages.message_zeros(0, (ctx.S if ctx.stage_major else ctx.v, m))[1]
        # sends that overlap compute: the next device reads a message a tick after it arrives
        # (the table's hop is 2), so the ppermutes send the last tick's outputs, loop carries
        overlap = schedule.hop == 2
        v_shape = schedule.placement == "v"
        sending = (message, slots.back_zeros(back)) if overlap else None
        init = Carry(message, prev, acc, stats, loop, back, sending)
        carry, _, drain = _scan(schedule, phases, (compat.to_varying(init, axes), queue, drain), tick, inputs)
        return carry, drain

    def finished(self, ctx, schedule):
        """``int[T]``: the micro-batch the last stage finishes at each tick (-1: none), when the
        outputs leave through the drain queue (:meth:`_drain`); ``None`` when they are summed
        into a replicated accumulator instead (a data axis; one device; a table whose last
        stage does not finish its micro-batches in order)."""
        if self.cfg.data_axis_name is not None or ctx.D == 1:
            return None
        micro, stage = schedule.table[:, -1], schedule.stages()[:, -1]
        done = np.where((micro >= 0) & (stage == ctx.S - 1), micro, -1).astype(np.int32)
        order = done[done >= 0]
        if not np.array_equal(order, np.arange(ctx.m)):
            return None
        return done

    @staticmethod
    def pushes(finished, k, D):
        """The drain queue's moves as tables over ticks: ``(code[T, D], slot[T])``. ``code`` is 0
        where no output is finished (nothing moves), 1 where a device takes the slot from the
        next device, 2 on the last device, which puts the output there; ``slot`` is ``i mod k``
        for the micro-batch ``i`` finished at the tick."""
        code = np.where(finished >= 0, 1, 0)[:, None] * np.ones(D, np.int32)
        code[:, -1] *= 2
        return code.astype(np.int32), (np.maximum(finished, 0) % k).astype(np.int32)

    def _drain(self, queue, y, pushes, row, d):
        """Puts output ``y`` into the drain queue as the tables ``pushes`` (:meth:`pushes`) say
        at the tick of ``row`` (a row of :func:`rows`; ``None``: the tables' first row).

        A device holds ``k = ceil(m / D)`` output slots. When the last device finishes micro-batch
        ``i``, every device takes slot ``i mod k`` from the device after it (one ``ppermute`` of one
        micro-batch) and the last device puts ``y`` there. An output is pushed one device on by
        each later output of the same slot, and ``D - 1 - i // k`` of them follow it (counting the
        padding entries up to ``k D``), so output ``i`` ends in slot ``i mod k`` of device
        ``i // k``: the queue is the outputs split over the stage axis, in order. The transpose
        sends cotangents back the same way; values are moved, never added, so they are bitwise
        the last stage's. The slot and its update are :func:`recomputed` from ``row``; the
        code is one table entry (no predicate ``d == D - 1`` kept beside the loop).
        """
        D = pushes[0].shape[1]

        def where_to(row):
            t = 0 if row is None else read_tick(row, D)
            code = lax.dynamic_index_in_dim(
                jnp.asarray(pushes[0])[t], d, keepdims=False, allow_negative_indices=False
            )
            return code, jnp.asarray(pushes[1])[t]

        slot = recomputed(lambda row, queue: take(queue, where_to(row)[1]))(row, queue)
        moved = lax.ppermute(slot, self.cfg.axis_name, [(e, e - 1) for e in range(1, D)])

        def put(row, queue, slot, moved, y):
            code, j = where_to(row)

            def one(a, old, new, y):
                return lax.dynamic_update_index_in_dim(
                    a, jnp.where(code == 2, y, jnp.where(code == 1, new, old)), j, 0
                )

            return jax.tree.map(one, queue, slot, moved, y)

        return recomputed(put)(row, queue, slot, moved, y)


def _deliver(tree, source, start, axis_name, D: int):
    """What a device of a V table receives: ``tree`` from the neighbour it is paired with, or its
    own (``source`` is neither ``LEFT`` nor ``RIGHT``: the V's turn). The devices ``(d, d + 1)``
    with ``d`` of parity ``start`` swap their values, one ``ppermute`` a tick: the table's
    check keeps every V message on such a pair (activations to ``d + 1`` and cotangents to
    ``d - 1`` when ``t - d`` is even, the other ways when it is odd), so each device receives
    what it reads from the neighbour that sent it. ``start`` is the same on every device (the
    tick's parity), so the branch is uniform."""
    if tree is None:
        return None
    swap = lambda first: lambda x: lax.ppermute(x, axis_name, _pairs(first, D))
    got = lax.cond(start == 0, swap(0), swap(1), tree) if D > 1 else tree
    pick = lambda a, own: jnp.where((source == LEFT) | (source == RIGHT), a, own)
    return jax.tree.map(pick, got, tree)


def _shift_v(tree, source, forward, own, axis_name, D: int):
    """What a device of a V table receives when sends overlap compute (``hop = 2``): ``tree`` (the
    last tick's messages) from the neighbour that sent it, all moving to ``d + 1`` where
    ``forward`` (the same on every device: the tick's parity), else to ``d - 1``, one
    ``ppermute``; or ``own``, this tick's message of the device itself, where ``source`` is
    neither ``LEFT`` nor ``RIGHT`` (the V's turn, one tick)."""
    if tree is None:
        return None
    send = lambda pairs: lambda x: lax.ppermute(x, axis_name, pairs)
    on = send([(d, d + 1) for d in range(D - 1)])
    back = send([(d + 1, d) for d in range(D - 1)])
    got = lax.cond(forward, on, back, tree) if D > 1 else tree
    pick = lambda a, o: jnp.where((source == LEFT) | (source == RIGHT), a, o)
    return jax.tree.map(pick, got, own)


def _pairs(first: int, D: int) -> list[tuple[int, int]]:
    """The permutation that swaps the devices ``(d, d + 1)`` for ``d = first, first + 2, ...``."""
    return [p for d in range(first, D - 1, 2) for p in ((d, d + 1), (d + 1, d))]
