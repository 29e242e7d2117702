"""The slots of a training table in the engine's one tick loop: 1F1B, ZB-H1, interleaved 1F1B,
V-Half and ZB-V (:func:`pipejax._src.schedules.tables.training`).

Their table runs in the loop of the forward schedules (:meth:`engine.MeshDevices.loop` on a
mesh, :meth:`engine.LocalDevices.run` without one), with the slots of :class:`_MeshSlots` or
:class:`_LocalSlots` (:class:`engine.Slots`); what each slot computes on typed values is
:class:`~pipejax._src.training.stage_grad.StageGrad`'s:

* **F** (micro-batch ``i``, ``step``): the engine's tick delivers the device's input
  -- micro-batch ``i`` of ``x`` on stage 0, the activation the previous device sent otherwise --
  and the stage runs on it, keeping what B and W need in a ring buffer of
  :meth:`~pipejax._src.schedules.table.Schedule.stash_slots` slots (slot ``i`` mod the size;
  a table whose devices hold several stages, interleaved or a V: one pool per device,
  :meth:`~pipejax._src.schedules.table.Schedule.stash_pool`, decision 0036);
  the last stage adds its micro-batch's loss terms to the sums. Where it pays, the last stage's
  residuals (its loss's, a head's) are kept apart, so the stash's slots are sized for the other
  stages: handed straight to B in the tick, or kept in a ring of
  :meth:`~pipejax._src.schedules.table.Schedule.last_stage_slots` slots of their own (decision
  0033).
* **B** (``back``): the stage's pullback is applied to the cotangent the next device
  sent: "1f1b" gets the parameter and the input cotangents, "zb-h1" the input cotangent only and
  stashes the output cotangent for W. Stage 0 computes no input cotangent.
* **W** ("zb-h1"): the parameter cotangent, from the stash and the stashed output cotangent.

B and W follow F in the same tick, and their cotangents go one device back (``ppermute``). Idle
slots compute nothing (a ``lax.switch`` branch that returns zeros). Every slot picks its branch
with the engine's one stage dispatch (:func:`engine.dispatch`), and messages, stashes and stats
travel in the engine's stage objects' containers. The loop runs in the engine's
one ``shard_map`` (:meth:`engine.MeshDevices.spmd`), which checks varying types: every input is
cast to vary along the manual axes before the loop. Such a program owns its backward pass, so
the loop is one scan with no remat wrapper (:func:`pipejax._src.checkpoint.training_phases`).

Without a mesh there is one device and no bubble to fill: every training schedule is gradient
accumulation over the micro-batches, the table :func:`~pipejax._src.schedules.tables.sequential_training`
(:func:`on_one_device`), with the same keys, loss terms and checkpoint modes, and one
micro-batch's activations kept at a time.

Memory: a device keeps what B and W need of at most ``stash_slots`` micro-batches (``2 n - 1``)
per stage, or its pool's size, however many run.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from pipejax._src import checkpoint as ckpt
from pipejax._src import compat, engine
from pipejax._src.containers import Container, Layout
from pipejax._src.training.stage_grad import StageGrad, Variant


class _Slots:
    """What the slots of both kinds of device share (:class:`engine.Slots`)."""

    grad: StageGrad  # what each slot computes on typed values
    prows: Any  # the device's parameter rows
    loss0: Any  # f[2] zeros: a slot's loss part when it has none

    # the forward table's ways, none of which a training table takes (see `engine.Slots`): x is
    # read whole (a streamed queue is a carry whose temp memory grows with m, and the training
    # tables keep their memory flat in m); an idle F slot computes nothing; the interleaved
    # loop-back is a ring send
    may_stream = bubbles_compute = loop_buffer = False

    def step_for(self, cfg, ctx, inputs, phase, vary, global_micro):
        return self.step  # one phase, no remat wrapper: F keeps what B needs itself

    def fresh_index(self, row, d, D: int, k: int, m: int):
        return engine.clip(engine.at(row, d, D)[0], m)  # the micro-batch of the device's F slot

    def start(self, acc, prev):
        return None, None, self.init()  # no outputs, no bubble that returns the last one

    def arrive(self, dev, received):
        return dev._replace(bin=received)

    def back_zeros(self, dev):
        return dev.bin  # zeros at the first tick

    def columns_back(self, dev, outs, row, num_columns: int):
        """The B slots of every column of one device (no mesh), the last column first, handing
        the input cotangents on within the tick."""
        sent = None
        for d in reversed(range(num_columns)):
            dev, sent = self.back(self.arrive(dev, sent), outs[d], row, d)
        return self.arrive(dev, sent)  # (stage 0 sends none)

    def result(self, acc, dev):
        return dev


# --- on a mesh: one SPMD program, a device per stage ---------------------------------------------


class _MeshSlots(_Slots):
    """The slots of a device of the mesh (traced ``d``): one SPMD program, so a slot picks the
    branch of its stage's variant with the engine's one dispatch (an idle slot computes
    nothing), and messages, stashes and stats travel in the containers of the engine's stage
    objects (``stages``)."""

    keep_last_apart = True  # False: one container for every stage (benchmarks compare the two)

    def __init__(self, grad, table, stages, variants, index, axes):
        self.grad, self.stages, self.variants, self.axes = grad, stages, variants, axes
        self.n, self.repeats = table.num_devices, table.repeats  # stage s is row s // n of a device
        # what F keeps: K slots per stage the device holds, or one pool of K for the device's
        # stages, each input's slot given by the table (`Schedule.pooled`, `stash_pool`)
        self.pool, self.table = table.pooled, table
        self.K = table.stash_pool()[0] if self.pool else table.stash_slots()
        self.zb = table.weight is not None
        # the output cotangents W reads: a ring (slot b mod G; `Schedule.cotangent_slots`, n for
        # ZB-H1), or the pool's
        self.G = (table.cotangent_pool()[0] if self.pool else table.cotangent_slots()) if self.zb else self.n
        self.variant_of = jnp.asarray(index, jnp.int32)
        # the last stage's residuals (its loss's, a head's) kept apart from the other stages'
        # (`on_device`): in a ring of K_last slots of their own, or (K_last = 0: its F and B, or W, in one
        # tick) handed by F straight to B
        self.K_last, self.S = table.last_stage_slots(), table.num_stages
        # laid out on the device (`on_device`): the stash's container, and the last stage's
        self.saved_layouts, self.sbox, self.dbox = None, None, None
        self.loss_dtype = grad.loss_dtype(variants[-1])
        self.prows = None  # set on the device (`on_device`)

    @property
    def loss0(self):
        """f[2] zeros: a slot's loss part when it has none, made where it is read. (A value made
        outside the ``shard_map`` and closed over is typed with the context mesh's Explicit axes
        under ``jax.set_mesh``, which ``shard_map`` refuses; one made once on the device is a
        loop-invariant carry of the tick loop, 64-136 bytes of temp memory more.)"""
        return jnp.zeros((2,), self.loss_dtype)

    def on_device(self, grad: StageGrad, prows) -> _MeshSlots:
        """These slots on a device of the mesh, inside the ``shard_map``: ``grad`` computing on
        the device's values (:meth:`StageGrad.on_shard`), ``prows`` its parameter block.

        What F keeps is laid out here, from the types the slots trace: the residuals a
        checkpoint policy saves depend on them (with ``everything_saveable`` the last stage's
        loss scale, cast to vary along the manual axes inside the ``shard_map``, is a residual
        there and a constant outside)."""
        new = copy.copy(self)
        new.grad, new.prows = grad, prows
        if grad.keep:  # residuals differ per stage (and role): one container for all
            row = self.row(prows, 0)
            new.saved_layouts = [Layout.of(grad.saved_structs(v, row)) for v in self.variants]
            new.sbox = Container.for_layouts(new.saved_layouts)
            pairs = list(zip(self.variants, new.saved_layouts, strict=True))
            stashed = [lay for v, lay in pairs if not v.last]
            if self.keep_last_apart and stashed:
                direct = [lay for v, lay in pairs if v.last]
                sbox, dbox = Container.for_layouts(stashed), Container.for_layouts(direct)
                slots = (1 if self.pool else self.repeats) * self.K
                if last_apart_pays(slots, new.sbox.nbytes() - sbox.nbytes(), self.K_last, dbox.nbytes()):
                    new.sbox, new.dbox = sbox, dbox
        return new

    # messages (activations, cotangents), stash entries (what F kept) and stats entries

    def row(self, block, r):
        """Row ``r`` of the device's parameter block (:func:`engine._row`)."""
        return engine._row(block, r, self.repeats)

    def msg_zeros(self, lead=()):
        return self.stages.message_zeros(0, lead)[0]

    def s_pack(self, tree, v: Variant):
        """What F of variant ``v`` keeps, as F returns it: a stash entry, or (``dbox``) the pair
        of a stash entry and the last stage's entry, zeros in the one it does not fill."""
        if self.sbox is None:  # the stage input, as a message
            return self.stages.pack(tree)
        tree = engine.whole(self.grad.cfg, tree)
        if self.dbox is None:
            return self.sbox.pack(tree)
        if v.last:
            return self.sbox.zeros(), self.dbox.pack(tree)
        return self.sbox.pack(tree), self.dbox.zeros()

    def s_unpack(self, entry, v: Variant):
        """What B or W of variant ``v`` reads: a stash entry, or (``dbox``) the pair of the
        stash entry and the last stage's entry of this tick's F."""
        if self.sbox is None:
            return self.stages.unpack(entry, v.x_layout)
        layout = self.saved_layouts[self.variants.index(v)]
        if self.dbox is None:
            return self.sbox.unpack(entry, layout)
        stashed, direct = entry
        return self.dbox.unpack(direct, layout) if v.last else self.sbox.unpack(stashed, layout)

    def s_zeros(self, lead=()):
        return self.msg_zeros(lead) if self.sbox is None else self.sbox.zeros(lead)

    def kept_zeros(self):
        """What an idle F slot keeps (:meth:`s_pack`'s type)."""
        return self.s_zeros() if self.dbox is None else (self.sbox.zeros(), self.dbox.zeros())

    def dispatch(self, working, s, make, idle, *args):
        """``make(variant)(*args)`` of stage ``s``'s variant where ``working``, ``idle(*args)``
        elsewhere (:func:`engine.dispatch`).

        Every branch returns its values varying along the manual axes, so all branches have one
        type. Everything a slot reads is cast before the loop (see :func:`on_mesh`), so the
        only values cast here are constants (zeros; the cotangent of an integer leaf): no cast
        of a differentiated value sits in a branch, whose transpose (a psum) only some devices
        would reach."""
        vary = lambda f: lambda *a: compat.to_varying(f(*a), self.axes)
        branches = [vary(make(v)) for v in self.variants]
        return engine.dispatch(working, self.variant_of[s], branches, vary(idle), *args)

    # the slots

    def step(self, d, rows_p, state, x_in, prev, row, static_stage=None, fresh=None):
        """F: the device's stage on ``x_in`` (the engine's tick delivers micro-batch ``f`` of x
        to stage 0, the previous device's activation to the others); returns ``(message, stats,
        loss part, saved, count)``: what it sends on, its stats (the engine writes them), its
        ``(loss, weight)`` sums, what B and W read back (:meth:`StageGrad.save`) and 1 (0 when
        idle). ``rows_p`` holds the device's stages' parameters as rows (stage ``s`` is row
        ``s // n``)."""
        n, grad = self.n, self.grad
        f, fs = engine.at(row, d, n)
        one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)

        def f_branch(v):
            def run(rows_p, x_in, f):
                prow, x = self.row(rows_p, fs // n), self.stages.unpack(x_in, v.x_layout)
                y, dloss, saved, st = grad.save(v, prow, x, *grad.inputs(f, fs))
                y = self.msg_zeros() if y is None else self.stages.pack(y)
                dloss = self.loss0 if dloss is None else dloss.astype(self.loss0.dtype)
                return y, self.stages.stats_message(st), dloss, self.s_pack(saved, v), one

            return run

        def f_idle(rows_p, x_in, f):
            message = self.msg_zeros()
            return message, self.stages.message_zeros(0)[1], self.loss0, self.kept_zeros(), zero

        return self.dispatch(f >= 0, fs, f_branch, f_idle, rows_p, x_in, f)

    def init(self):
        """The B and W slots' state at the first tick (:class:`_Back`)."""
        return _Back(
            self.msg_zeros(),
            self.s_zeros(((1 if self.pool else self.repeats) * self.K,)),
            self.msg_zeros(lead=(self.G,)) if self.zb else None,
            _zeros_like(self.prows),
            self.loss0,
            jnp.zeros((3,), jnp.int32),
            self.dbox.zeros((self.K_last,)) if self.dbox is not None and self.K_last else None,
        )

    def back(self, dev: _Back, out, row, d):
        """B (and W) after F: ``(the new state, the input cotangent sent back)``.

        F's ``saved`` goes to the stash (``K`` slots per stage held), its loss part to the sums.
        B pulls the stage back, from what F kept, with the cotangent the next device sent; W
        ("zb-h1") the parameter cotangent, from the stash and B's stashed output cotangent.
        Every parameter cotangent is added inside its branch to the stage's row of the
        accumulator (B; ZB-H1's W: to the accumulator), which an idle branch returns as it is,
        so no cotangent leaves a branch."""
        K, n, zb, rows_p, grad = self.K, self.n, self.zb, self.prows, self.grad
        one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
        f, fs = engine.at(row, d, n)
        b, w, bs = (engine.at_device(a, d) for a in engine.read_row(row, n, ("B", "W", "B stage")))
        _, _, dloss, saved, c0 = out
        # the last stage's entry of this tick's F goes to B (W) beside the stash entry it reads
        saved, direct = saved if self.dbox is not None else (saved, None)
        lstash = dev.lstash
        if lstash is not None:  # the last stage's own ring (slot: micro-batch mod K_last)
            lstash = engine.put(lstash, direct, f % self.K_last, (f >= 0) & (fs == self.S - 1))

        def with_last(entry, i):
            """What B (W) of micro-batch ``i`` reads: the stash entry, and the last stage's."""
            if direct is None:
                return entry
            return entry, (direct if lstash is None else engine.take(lstash, i % self.K_last))

        # where F puts what it keeps and B (W) reads it: the device's pools, the table giving each stage
        # input (and each cotangent W reads) its slot; or a ring of K slots per stage (W: the
        # device's one stage, a ring of G cotangents). (Each index is computed where it is used.)
        pool = None
        if self.pool:  # the stash slots F writes and B, W read; W's stage; the cotangents' slots
            names = engine.pool_columns(self.table)
            read = engine.read_row(row, n, names, engine.columns(self.table))
            pool = {name: engine.at_device(a, d) for name, a in zip(names, read, strict=True)}
        stash = engine.put(dev.stash, saved, pool["F pool"] if pool else (fs // n) * K + f % K, f >= 0)
        xb = with_last(engine.take(stash, pool["B pool"] if pool else (bs // n) * K + b % K), b)

        def b_branch(v):
            def run(rows_p, xb, g, b, grow):
                dx, dp = grad.pull(
                    v,
                    self.row(rows_p, bs // n),
                    self.s_unpack(xb, v),
                    None if v.last else self.stages.unpack(g, v.y_layout),
                    *grad.inputs(b, bs),
                    wrt_params=not zb,
                    wrt_input=not v.first,
                )
                dx = self.msg_zeros() if dx is None else self.stages.pack(dx)
                return dx, grow if dp is None else _add_to(grow, dp), one

            return run

        def b_idle(rows_p, xb, g, b, grow):
            return self.msg_zeros(), grow, zero

        # the branch adds to the stage's row of the accumulator, which is written back here: an
        # accumulator passed through the branch was copied there whole (the branch cannot update
        # its operand in place); a row is half of it at 2 repeats, and then written in place
        grow = None if zb else engine.take(dev.grad, bs // n)
        dx, grow, c1 = self.dispatch(b >= 0, bs, b_branch, b_idle, rows_p, xb, dev.bin, b, grow)
        acc = dev.grad if zb else _set_row(dev.grad, bs // n, grow)
        gstash, c2 = dev.gstash, zero
        if zb:  # W: the parameter cotangent, from the stash and B's stashed output cotangent
            # W's stage and its row (a ring's W: the one stage, static)
            ws, wr = (pool["W stage"], pool["W stage"] // n) if pool else (d, 0)
            if gstash is not None:  # (the last stage seeds its own)
                gstash = engine.put(gstash, dev.bin, pool["B cotangent"] if pool else b % self.G, b >= 0)
            xw = with_last(engine.take(stash, pool["W pool"] if pool else w % K), w)
            gw = None if gstash is None else engine.take(gstash, pool["W cotangent"] if pool else w % self.G)

            def w_branch(v):
                def run(rows_p, xw, gw, w, acc):
                    g = None if v.last else self.stages.unpack(gw, v.y_layout)
                    _, dp = grad.pull(
                        v,
                        self.row(rows_p, wr),
                        self.s_unpack(xw, v),
                        g,
                        *grad.inputs(w, ws),
                        wrt_params=True,
                        wrt_input=False,
                    )
                    return _add_row(acc, wr, dp), one

                return run

            w_idle = lambda rows_p, xw, gw, w, acc: (acc, zero)
            acc, c2 = self.dispatch(w >= 0, ws, w_branch, w_idle, rows_p, xw, gw, w, acc)
        counts = dev.counts + jnp.stack([c0, c1, c2])
        new = dev._replace(
            stash=stash, gstash=gstash, grad=acc, loss=dev.loss + dloss, counts=counts, lstash=lstash
        )
        return new, dx


def on_mesh(grad: StageGrad, table, bnd, xs, runner, stats_layouts, param_specs):
    """On a mesh: the table runs in the engine's one tick loop (:meth:`engine.MeshDevices.loop`),
    with the F, B and W slots of :class:`_MeshSlots`."""
    pipe, cfg, m = grad.pipe, grad.cfg, table.num_micro
    S, n, v_rep = pipe.num_stages, pipe.num_devices, pipe.repeats  # device d: stages d, d + n, ...
    axis, data = pipe.axis_name, pipe.data_axis_name
    # the engine's stage objects: the containers of messages, stashes and stats
    stages, variants, index, prows_in = pipe.kind.mesh_training(
        pipe, cfg, bnd, stats_layouts, runner, Variant
    )
    axes = (axis,) if data is None else (axis, data)  # the shard_map's manual axes
    outer = _MeshSlots(grad, table, stages, variants, index, axes)
    spec = PartitionSpec(axis) if v_rep == 1 else PartitionSpec(None, axis)
    rep = PartitionSpec()
    batch_spec = rep if data is None else PartitionSpec(data)  # micro-batches split over data
    # the engine's device abstraction places the parameters (and, with `param_specs`, makes
    # the shard_map manual over the stage and data axes only: tensor / FSDP sharding inside)
    devices = engine.MeshDevices(
        cfg._replace(data_axis_name=data), pipe.mesh, v_rep, pipe.data_size, param_specs
    )
    ctx = engine._Ctx(S, n, v_rep, m, stages, stage_major=True)
    turn = _v_turn(axis, n) if table.placement == "v" else lambda rows: rows

    def body(d, prows, xs, mask, ts, key, cs, state, aux_scale):
        # the device's block of the stacked stages, (1, ...) or (v, 1, ...): a slot picks row
        # `stage // n` and drops the stage axis inside the tick (`engine._row`; dropped here,
        # XLA copied the parameters), and the gradients accumulate in blocks of that type.
        # Everything a slot reads varies along the manual axes (see `_MeshSlots.dispatch`).
        offset = 0 if data is None else lax.axis_index(data) * m
        prows = turn(prows)  # a V: device d's row 1 is stage 2 n - 1 - d
        slots = outer.on_device(grad.on_shard(ts, mask, key, cs, state, aux_scale, offset), prows)
        inputs = engine.Inputs(prows, None, xs, None, key)
        carry, _ = devices.loop(ctx, table, ckpt.training_phases(table), d, inputs, slots)
        dev = carry.back
        # each (stage, micro-batch) written by one device: a sum of exact zeros merges them
        stats = engine.sum_exact(carry.stats, axis)
        loss, grads, counts = engine.sum_exact(dev.loss, axis), turn(dev.grad), dev.counts
        if data is None:
            return loss, grads, counts[None], stats
        # every data shard ran its own micro-batches: sum their losses and gradients
        return lax.psum(loss, data), devices.sum_over_data(grads), counts[None, None], stats

    operands = [
        (xs, batch_spec, True),
        (grad.mask, batch_spec, True),
        (grad.ts, batch_spec, True),
        (grad.key, rep, True),
        (grad.cs, batch_spec, True),
        (grad.state, rep, True),
        (grad.aux_scale, rep, False),  # a weighted loss's total weight
    ]
    out_specs = lambda param_in: (
        rep,
        param_in,
        PartitionSpec(axis) if data is None else PartitionSpec(data, axis),
        rep if data is None else PartitionSpec(None, data),  # stats (S, m, ...)
    )
    loss, grads, counts, stats = devices.spmd(body, prows_in, spec, operands, out_specs)
    grads = pipe.kind.grads_like(runner, grads)
    # per stage, as the forward call returns them
    stats = stages.stage_rows(stats) if records(pipe) else None
    return loss, grads, counts, stats


def _v_turn(axis, n: int):
    """A V table's parameter rows from the placed ones, and its gradients back: the parameters
    are placed as the circular schedule's (device ``d``'s row 1 is stage ``n + d``), a V runs
    stage ``2 n - 1 - d`` there, so row 1 goes to device ``n - 1 - d`` (one ``ppermute`` of
    half the parameters at the start of the step, and of their gradients at its end; the same
    move is its own inverse)."""
    mirror = [(d, n - 1 - d) for d in range(n)]  # (the middle device of an odd n keeps its row)

    def turn(rows):
        def one(a):
            up = lax.ppermute(a[1:], axis, mirror) if n > 1 else a[1:]
            return jnp.concatenate([a[:1], up])

        return jax.tree.map(one, rows)

    return turn


# --- without a mesh: one device, the micro-batches one after the other ---------------------------


class _LocalSlots(_Slots):
    """The slots of virtual device ``d`` (a Python int, one per stage, no mesh): each runs its
    own stage, called directly, every slot kept apart (:func:`_computation`)."""

    def __init__(self, grad, xs, variants, prows):
        self.grad, self.xs, self.variants, self.prows = grad, xs, variants, prows
        self.S, self.kind = len(variants), grad.pipe.kind
        self.loss0 = jnp.zeros((2,), grad.loss_dtype(variants[-1]))

    def step(self, d, rows_p, state, x_in, prev, row, static_stage=None, fresh=None):
        """F of stage ``d`` on the tick's micro-batch (read as data by stage 0): ``(y, stats,
        loss part, kept)``."""
        i, v = self._tick_micro(row), self.variants[d]
        x = engine.read(self.grad.cfg, self.xs, i) if d == 0 else x_in

        def f_slot(params, x):
            return self.grad.save(v, self._row(params, d), x, *self.grad.inputs(i, d))

        y, dloss, kept, st = _computation(i, f_slot, rows_p, x)
        return y, st, dloss, kept

    def init(self):
        """The parameter cotangents and the loss sums (:class:`_Back`)."""
        return _Back(None, None, None, _zeros_like(self.prows), self.loss0, None)

    def back(self, dev: _Back, out, row, d: int):
        """B of stage ``d``, on what its F slot kept this tick: the parameter and input
        cotangents together; the parameter cotangent joins the sums as soon as it leaves the
        slot, the input cotangent goes to the previous column within the tick."""
        i, v = self._tick_micro(row), self.variants[d]
        _, _, dloss, kept = out

        def b_slot(params, kept, g):
            p = self._row(params, d)
            return self.grad.pull(v, p, kept, g, *self.grad.inputs(i, d), True, not v.first)

        g, dp = _computation(i, b_slot, self.prows, kept, dev.bin)
        acc = self.kind.add_row(dev.grad, d, dp)
        loss = dev.loss if dloss is None else dev.loss + dloss.astype(dev.loss.dtype)
        return dev._replace(grad=acc, loss=loss), g

    def _tick_micro(self, row):
        """The micro-batch of every slot of a tick of the one-device table (every column runs
        the same one, :func:`~pipejax._src.schedules.tables.sequential_training`), read once: a slot
        reading its own column gave every slot its own index and predicate, which XLA keeps
        apart: with 16 stacked stages 3,156 HLO lines against 2,701 and 58,808 temp bytes
        against 57,720 (CPU, jax 0.10.2)."""
        return engine.read_row(row, self.S, ("F",))[0][0]

    def _row(self, params, s: int):
        """Stage ``s``'s parameters, picked inside its slot at a static index (``a[s]``): with the
        mesh program's dynamic row and ``_add_row``, XLA kept copies of the stacked arrays (temp
        25.1 -> 73.9 KiB for 4 stacked stages on CPU: a dynamic index into an array that is also
        updated makes XLA copy it)."""
        return self.kind.row(params, s)


def on_one_device(grad: StageGrad, table, bnd, xs, runner, stats_layouts):
    """Without a mesh one device runs every stage, and no schedule has a bubble to fill: every
    training table runs as :func:`~pipejax._src.schedules.tables.sequential_training`, gradient
    accumulation in the engine's loop for one device (:class:`engine.LocalDevices`), one
    virtual device per stage. At tick ``i`` the F slots of stages ``0, ..., S - 1`` run on
    micro-batch ``i`` and keep what B needs (as on a mesh, :meth:`StageGrad.save`: the stage
    input for ``"always"``, the residuals for ``"never"`` or a policy), then the B slots of
    stages ``S - 1, ..., 0`` (:meth:`StageGrad.pull`, parameter and input cotangents together),
    and the parameter cotangents join the sums before micro-batch ``i + 1`` starts. So the
    device keeps one micro-batch's worth, whatever ``m`` is. Stage 0 reads its micro-batch as
    data. Keys, loss terms and the order of the sums over micro-batches are the mesh program's.
    """
    pipe, cfg, S, m = grad.pipe, grad.cfg, grad.pipe.num_stages, table.num_micro
    prows = pipe.kind.local_rows(runner)  # stacked (S, ...), or one per stage
    variants = [
        Variant(pipe.stages[s], s == 0, s == S - 1, lambda p: p, bnd[s], bnd[s + 1], s) for s in range(S)
    ]
    slots = _LocalSlots(grad, xs, variants, prows)
    layouts = pipe.kind.stage_layouts(stats_layouts, S)
    stages = engine.Heterogeneous(cfg, bnd, layouts, None, None, S, switch=False)
    devices = engine.LocalDevices(cfg, stacked=False)
    ctx = engine._Ctx(S, S, 1, m, stages)
    inputs = engine.Inputs(prows, None, xs, None, grad.key)
    dev, stats = devices.run(ctx, table, ckpt.training_phases(table), inputs, slots)
    # every stage runs F and B (with W) once per micro-batch
    counts = jnp.asarray(np.tile(np.array([m, m, 0], np.int32), (S, 1)))
    stats = pipe.kind.stack_records(stats) if records(pipe) else None
    return dev.loss, dev.grad, counts, stats


class _Back(NamedTuple):
    """A device's state of the B and W slots (:attr:`engine.Carry.back`)."""

    bin: Any  # the cotangent the next device sent at the last tick
    stash: Any  # what F kept for B and W: K slots per stage the device holds
    gstash: Any  # ZB-H1: output cotangents B received, for W (None: not ZB, or the last stage)
    grad: Any  # parameter cotangents, one row per stage the device holds
    loss: Any  # f[2]: the (loss, weight) sums of the micro-batches the device's last stage ran
    counts: Any  # int[3]: F, B and W slots run
    lstash: Any = None  # the last stage's entries kept apart, K_last slots (None: none, or none apart)


def last_apart_pays(slots: int, saved_per_slot: float, k_last: int, last_entry: float) -> bool:
    """Whether keeping the last stage's residuals apart from the stash saves memory: each of the
    stash's ``slots`` shrinks by ``saved_per_slot`` bytes, and the last stage's entries take
    ``k_last`` slots of their own and one entry F hands on in the tick, ``last_entry`` bytes
    each (decision 0033). Decided here for the engine (:meth:`_MeshSlots.on_device`, on the
    containers' bytes) and for ``pj.memory_estimate`` (on its terms). A wide head and its loss:
    1F1B's temp bytes 0.66x; a squared error's: 7 slots of 2 KiB against a 22.5 KiB entry,
    249.4 -> 255.0 KiB apart, so kept in the one container."""
    return slots * saved_per_slot > (k_last + 1) * last_entry


# --- small exact helpers ---------------------------------------------------------------------


def _add_row(acc, r, delta):
    """``acc[r] += delta`` (of ``(repeats, 1, ...)`` blocks: ``acc[r, 0] += delta``)."""
    return _set_row(acc, r, _add_to(engine.take(acc, r), delta))


def _set_row(acc, r, row):
    return jax.tree.map(lambda a, b: lax.dynamic_update_index_in_dim(a, b, r, 0), acc, row)


def _add_to(row, delta):
    """``row + delta``, ``delta`` without the unit stage axis of a ``(1, ...)`` row."""
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype).reshape(a.shape), row, delta)


def _computation(i, fn, *args):
    """``fn(*args)``, one slot of :class:`_LocalSlots`, kept apart from the loop body's other
    slots, so that XLA neither merges a stage's recomputation in B (``"always"``) with F's
    forward pass nor hoists the stage's parameter slices (``w[j]``) out of the loop (a copy of
    every parameter in temp memory). Written inline, XLA did both, on CPU and on GPU.

    On CPU the slot is the one branch of the engine's dispatch, taken where ``i >= 0`` (always,
    for the loop's index ``i``): a computation of its own, which starts once all its operands
    exist. XLA:CPU removes optimization barriers before it hoists loop invariants, so a barrier
    keeps the recomputation but not the parameters in place (temp 95.5 -> 322.7 KiB on
    ``benchmarks/gpu.py --quick``'s 1F1B ``"always"``). On other backends the slot reads its
    operands through an optimization barrier: on an H200 a branch per slot cost 2.8x (``"always"``)
    to 5.2x (``"never"``) the temp bytes and 13-14 % of the step (jax 0.11.2), since a branch
    there is a separate computation whose operands and results XLA materialises whole;
    :func:`_as_branch` chooses."""
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


def records(pipe) -> bool:
    """Whether the stages report per-(stage, micro-batch) records: stats, aux outputs or both."""
    return pipe.stateful or pipe.aux is not None
