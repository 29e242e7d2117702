"""The tick loop: one ``lax.scan`` that runs a schedule table on the devices of the stage axis.

Everything that differs between pipelines is a small object the loop is given:

* the **devices** (:class:`MeshDevices`, :class:`LocalDevices`): where the ``D`` devices of the
  table live and how a device's output reaches the next device. On a mesh the loop runs inside
  ``jax.shard_map``, once per device, and outputs move with ``lax.ppermute``. Without a mesh the
  ``D`` devices are virtual: each tick runs them one after the other on one device and the
  "send" is a local shift. Heterogeneous stages take one Python iteration per virtual device
  (each stage function appears once); homogeneous stages run one stage per tick, on one
  device (the one stage function appears once).
* the **stages** (:class:`Heterogeneous`, :class:`Homogeneous`): how a device runs the stage
  the table names at this tick. Heterogeneous stages on a mesh pick their function with
  ``lax.switch`` on the stage index, and their activations travel in a flat
  :class:`~pipejax._src.layout.Container` so every device sends one type; homogeneous stages
  slice their row out of parameters stacked on a stage axis.

A tick of a device (:func:`device_tick`): read the micro-batch ``i`` and stage ``s`` the table
gives it; take its input (a micro-batch of ``x`` for stage 0, the activation the previous device
sent, or, for a later round of the circular schedule on device 0, the activation that waited in
the "loop" buffer); run the stage; write the last stage's output and the stage's stats into
their accumulators; send the output on. On a bubble (``i < 0``) a stage never sees a value it
was not written for, so no ``nan`` reaches a gradient: heterogeneous stages skip it (one more
switch branch), and a homogeneous stage computes on a micro-batch of ``x`` (its function is
stage 0's) and the result goes nowhere but to other bubbles (see :class:`Homogeneous`).

A training table (1F1B, ZB-H1, interleaved 1F1B: :class:`~pipejax._src.schedule.TrainingSchedule`)
runs in the same loop, on a mesh (:meth:`MeshDevices.loop`) and without one
(:meth:`LocalDevices.run`, the table :func:`~pipejax._src.schedule.sequential_training`): its F
slot is the tick's stage computation (the training program's, :class:`Slots`), and its B and W
slots run after it in the same tick, their cotangents sent one device back. Such a program owns
its backward pass, so it is not differentiated; it is one scan with no remat wrapper.

Each checkpoint mode of a forward table is one wrapper around the device's stage computation,
and every mode but ``"except_last"`` is a single scan over all ticks (see
:func:`pipejax._src.checkpoint.phases`), so every stage function appears once in the forward
program. There is no ``custom_vjp``:
forward- and reverse-mode autodiff of every order compose with the loop. Collectives
(``ppermute``, ``psum``, ``pcast``) are never placed inside a ``cond``/``switch`` branch: a
collective that only some devices reach deadlocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec

from pipejax._src import aux_outputs, compat, keys
from pipejax._src import checkpoint as ckpt
from pipejax._src import schedule as sched
from pipejax._src.layout import Container, Layout
from pipejax._src.schedule import Schedule

PyTree = Any


class Config(NamedTuple):
    """What the loop needs to know of the pipeline (all static)."""

    stages: tuple[Callable[..., Any], ...]  # one function per stage (homogeneous: the same one)
    stateful: bool
    per_example_keys: bool
    checkpoint: Any
    axis_name: str
    data_axis_name: str | None
    # the shard_map is manual over the stage (and data) axes only (``param_specs``): the mesh's
    # other axes are XLA's to place, and micro-batches of the inputs are read pinned replicated
    # over them (see :func:`read`)
    inner_axes: bool = False
    aux: bool = False  # stages also return aux outputs, carried as stats (see `aux_outputs`)


class Inputs(NamedTuple):
    """What a run reads. ``params``/``state`` in the stage object's form; ``xs`` leaves
    ``(m, b, ...)``; ``mask`` the micro-batched side inputs ``(rows, context)``: ``bool[m, b]``
    real rows (``None`` when stateless) and the user's ``context`` (``None`` without one)."""

    params: Any
    state: Any
    xs: Any
    mask: Any
    key: Any


# --- small exact helpers ---------------------------------------------------------------------------


def take(xs, i):
    """Micro-batch ``i`` (a traced index) of the split batch."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)


def read(cfg: Config, xs, i):
    """Micro-batch ``i`` of a batch input (``x``, targets, row masks, ``context=``).

    With axes left to XLA inside the stages (``cfg.inner_axes``) the micro-batch is pinned
    replicated over them. Without the pin, sharding propagation shards the whole ``(m, b, ...)``
    batch the way a stage's first matmul reads it (e.g. its features over a "model" axis) and
    keeps that copy as a temporary: one micro-batch of memory per micro-batch, which is what a
    1F1B device must not grow with. Pinned, a micro-batch is resharded when it is read.
    """
    return _pinned_whole(cfg, take(xs, i))


def _pinned_whole(cfg: Config, tree):
    """``tree`` constrained replicated over the mesh's axes inside a stage (``cfg.inner_axes``);
    unchanged without them, or without a mesh context (a shape analysis outside the
    ``shard_map``, e.g. of what a training schedule's F slot saves, where nothing is placed)."""
    if not cfg.inner_axes or not compat.mesh_context_set():
        return tree
    return jax.tree.map(lambda a: lax.with_sharding_constraint(a, PartitionSpec()), tree)


def whole(cfg: Config, tree):
    """``tree`` replicated over the mesh axes inside a stage (``cfg.inner_axes``): what a stage
    sends on, records or stashes (the one rule of every container on a mesh). On Explicit axes
    a reshard; on Auto axes a sharding constraint, so that XLA gathers the value within each
    stage's group of devices. (Left to XLA, the resharding of an Auto-typed stats record landed
    inside the stage's switch branch, the stages' devices waited at different collectives, and
    the program deadlocked: ``tests/test_pipeline_sharded_stages.py``.)"""
    return _pinned_whole(cfg, compat.replicate(tree))


def clip(i, num_micro):
    return jnp.clip(i, 0, num_micro - 1)


def write(acc, y, r, i, enabled):
    """``acc[r, i] = y`` where ``enabled`` (``acc`` has two leading axes); unchanged otherwise."""

    def one(a, v):
        start = tuple(jnp.asarray(j, jnp.int32) for j in (r, i, *(0,) * v.ndim))
        old = lax.dynamic_slice(a, start, (1, 1, *v.shape))[0, 0]
        return lax.dynamic_update_slice(a, jnp.where(enabled, v, old)[None, None], start)

    return jax.tree.map(one, acc, y)


def zeros(layout: Layout, leading=()):
    return layout.retype(jax.tree.map(lambda s: jnp.zeros(leading + s.shape, s.dtype), layout.structs()))


def named(tree):
    """Marks a per-tick slice of stage parameters: saved by no phase (see ``checkpoint.phases``)."""
    return jax.tree.map(lambda a: checkpoint_name(a, ckpt.STAGE_PARAMS), tree)


def stage_call(cfg: Config, s: int):
    """Stage ``s`` as ``f(params, x, key, state, side) -> (y, stats)``, ``side = (mask, context)``
    of the micro-batch; stats ``None`` when stateless (with ``aux``: the aux outputs, or
    ``(stats, aux)``); ``context=`` passed only when given."""
    stage = cfg.stages[s]

    def call(p, x, key, state, side):
        mask, context = side
        kwargs = {} if context is None else {"context": context}
        return aux_outputs.call(stage, cfg.stateful, cfg.aux, p, x, key, state, mask, kwargs)

    return call


def stage_keys(cfg: Config, key, i, s, micro_size):
    """The key(s) stage ``s`` receives for (mini-batch-wide) micro-batch ``i`` (:mod:`keys`)."""
    if cfg.per_example_keys:
        return keys.example_keys_for(key, i, micro_size, s)
    return keys.key_for(key, i, s)


def rows(schedule):
    """The scan's per-tick input: one table ``int32[T, 2 D + 1]``, each row the tick's micro-batch
    and stage of every device and the tick itself (split by :func:`split_row`); a training table
    (:class:`~pipejax._src.schedule.TrainingSchedule`) has its F slots there and, after them,
    the micro-batches of its B and W slots and the stages of its B slots (:func:`back_row`):
    ``int32[T, 5 D + 1]``.

    One table, not a ``tick = arange(T)`` beside the others: XLA turns such a constant into an
    ``iota`` computed into a buffer of its own, kept through both loops; the table stays a
    constant of the program. A row is split where it is read, inside the checkpoints (the
    stage's, :func:`recomputed`): split outside, its pieces would be kept per tick for the
    backward pass."""
    tick = np.arange(schedule.num_ticks, dtype=np.int32)[:, None]
    if isinstance(schedule, sched.TrainingSchedule):
        fs, bs = schedule.stages()
        w = schedule.weight if schedule.weight is not None else np.full_like(schedule.forward, -1)
        return table(schedule.forward, fs, tick, schedule.backward, w, bs)
    return table(schedule.table, schedule.stages(), tick)


def table(*columns) -> jax.Array:
    """A schedule's integer columns ``[T, w]`` side by side: one ``int32[T, sum w]`` constant."""
    return jnp.asarray(np.concatenate(columns, axis=1).astype(np.int32))


def split_row(row, D: int):
    """A row of :func:`rows` as ``(micro[D], stage[D], tick)`` (a training table: of F slots)."""
    return row[:D], row[D : 2 * D], row[2 * D]


def back_row(row, D: int):
    """A training table's row of :func:`rows` as ``(B micro[D], W micro[D], B stage[D])``."""
    return row[2 * D + 1 : 3 * D + 1], row[3 * D + 1 : 4 * D + 1], row[4 * D + 1 : 5 * D + 1]


def loop_delay(schedule: Schedule) -> int:
    """Ticks a micro-batch waits on device 0 between two rounds of the circular schedule.

    Device 0 starts stage ``s >= D`` of micro-batch ``i`` a fixed number of ticks after the
    last device's output of stage ``s - 1`` reached it: ``max(m, n) - n`` for
    :func:`~pipejax._src.schedule.circular` (0 when ``m <= n``: it starts the tick it arrives).
    So the loop buffer is a delay line, not a slot per micro-batch: ``delay + 1`` slots; a tick
    writes what arrives into slot ``tick mod (delay + 1)`` and then reads slot ``(tick + 1) mod
    (delay + 1)``, written ``delay`` ticks before. (Reading before writing would need only
    ``delay`` slots, but XLA then copies the whole buffer every tick to keep the read's old
    value: 2,658.7 KiB against 2,322.9 KiB per device at m = 32 on
    ``benchmarks/maxtext_style.py``.) No buffer at all when the delay is 0.

    >>> [loop_delay(sched.circular(4, m, 2)) for m in (2, 4, 8, 16)]
    [0, 0, 4, 12]
    """
    micro, stage = schedule.table, schedule.stages()
    D = schedule.num_devices
    done = {(int(micro[t, -1]), int(stage[t, -1])): t for t in range(len(micro)) if micro[t, -1] >= 0}
    delays = {
        t - done[int(micro[t, 0]), int(stage[t, 0]) - 1] - 1
        for t in range(len(micro))
        if micro[t, 0] >= 0 and stage[t, 0] >= D
    }
    assert len(delays) == 1 and min(delays) >= 0, f"not a delay line: {sorted(delays)}"
    return delays.pop()


# --- the stages: what a device computes at a tick ------------------------------------------------


class Heterogeneous:
    """Different stage functions, parameters and activation types per stage.

    ``params``/``state`` come as one packed buffer per dtype with the device's stages on a
    leading axis (``(v, size)``: a :class:`~pipejax._src.placement.StageParams`' buffers) when
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

    def compute(self, d, params, state, x_in, xs, mask, ic, s, key_for, vary, guard=None, fresh=None):
        """Runs stage ``s`` of device ``d`` on ``x_in``; returns the (message, stats).

        ``guard``: ``(working, prev)``; where ``working`` is False (a bubble) nothing runs and
        ``prev`` is returned. ``fresh``: on a mesh, the micro-batch of ``x`` stage 0 reads; it
        equals ``x_in`` where stage 0 runs, and stage 0 reads ``x_in`` differentiated as
        ``fresh`` (:func:`_read_as`), so its input carries no tangent of the activations that
        share the message (a stage that calls ``jax.pure_callback`` on ``x`` differentiates
        with respect to the parameters).
        On a mesh the bubble is one more branch of the stage switch (one level of control flow,
        not a ``cond`` around a ``switch``).
        """
        if self.switch:
            r = _round(s, self.D, self.v)
            prow, srow = _row((params, state), r, self.v)

            def branch(t):
                call = stage_call(self.cfg, t)

                def f(prow, srow, x_in, xs, mask, ic, k):
                    p, st = (
                        self.pbox.unpack(prow, self.param_layouts[t]),
                        self.sbox.unpack(srow, self.state_layouts[t]),
                    )
                    if t == 0 and fresh is not None:  # the micro-batch of x, as data
                        x_in = jax.tree.map(_read_as, x_in, fresh)
                    x = self.box.unpack(x_in, self.boundaries[t])
                    y, stats = call(p, x, k, st, read(self.cfg, mask, ic))
                    return vary((self.pack(y), self.stats_message(stats)))

                return f

            working, prev = (True, None) if guard is None else guard
            idle = lambda *args: prev
            branches = [branch(t) for t in range(self.S)]
            return dispatch(working, s, branches, idle, prow, srow, x_in, xs, mask, ic, key_for(s))
        # a virtual device (no mesh) runs its own stage d on raw activations: a direct call
        assert guard is None and self.v == 1, "virtual devices run one stage each, without bubbles"
        x = take(xs, ic) if d == 0 else x_in
        return stage_call(self.cfg, d)(params[d], x, key_for(d), state[d], take(mask, ic))

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

    def compute(self, d, params, state, x_in, xs, mask, ic, s, key_for, vary, guard=None, fresh=None):
        """Runs stage ``s`` on ``x_in`` (or micro-batch ``ic`` of ``xs`` for stage 0). ``guard``
        is not needed (see :attr:`computes_bubbles`), and ``fresh`` is unused: one stage
        function reads both ``x`` and the activations."""
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


# --- one tick of one device ----------------------------------------------------------------------


class Carry(NamedTuple):
    """A device's part of the loop state."""

    inbox: Any  # the message the previous device sent at the last tick
    prev: Any  # this device's (message, stats) at the last tick (returned again on a bubble)
    acc: Any  # the last stage's outputs, (m, ...): written on the last device only (None: the
    # outputs leave through MeshDevices' drain queue instead)
    stats: Any  # this device's stats, (v, m, ...)
    loop: Any  # circular schedule: activations waiting for their next round (device 0), a
    # delay line of `loop_delay + 1` slots; () when they start it the tick they arrive
    back: Any = None  # a training table: the state of its B and W slots (`Slots`); None: none


def device_tick(
    ctx,
    d,
    params,
    state,
    carry: Carry,
    row,
    step,
    static_stage=None,
    fresh=None,
    safe=None,
    bubbles_fresh=False,
):
    """One tick of device ``d`` (a Python int, or traced on a mesh); returns its new carry
    without the inbox (the devices object delivers the message) and what ``step`` returned:
    ``(message, stats)``, or a training table's F slot ``(message, stats, ...)`` (:class:`Slots`).
    ``static_stage``: the stage, when the phase runs one stage only (no ``lax.switch``).
    ``fresh``: stage 0's input as a message, when the devices deliver it (on a mesh).
    ``safe``: what a bubble reads, for stages that compute their bubbles (a micro-batch of x);
    ``bubbles_fresh``: a bubble reads ``fresh`` instead (a micro-batch of x on every device)."""
    S, D, v, m = ctx.S, ctx.D, ctx.v, ctx.m

    def take_input(row, inbox, loop, fresh, safe):
        i, s = at(row, d, D, static_stage)
        if v > 1 and _may_be(d, 0) and jax.tree.leaves(loop):
            # device 0 starts a later round on what arrived `delay` ticks ago (see `loop_delay`);
            # with m <= n on what arrives now, the inbox itself (no buffer)
            tick, size = split_row(row, D)[2], jax.tree.leaves(loop)[0].shape[0]
            loop = jax.tree.map(
                lambda a, b: lax.dynamic_update_index_in_dim(a, b, tick % size, 0), loop, inbox
            )
            waiting = take(loop, (tick + 1) % size)
            again = (d == 0) & (s >= D)
            inbox = jax.tree.map(lambda a, b: jnp.where(again, a, b), waiting, inbox)
        if fresh is not None:  # stage 0 reads its micro-batch from the message too (see MeshDevices)
            first = (s == 0) | (i < 0) if bubbles_fresh else s == 0
            inbox = jax.tree.map(lambda a, b: jnp.where(first, a, b), fresh, inbox)
        if safe is not None:  # a bubble computes on a micro-batch of x (see Homogeneous.compute)
            inbox = jax.tree.map(lambda a, b: jnp.where(i < 0, a, b), safe, inbox)
        return inbox, loop

    def put_output(row, acc, y):
        i, s = at(row, d, D, static_stage)
        return write(acc, y, 0, clip(i, m), (i >= 0) & (s == S - 1))

    def put_stats(row, stats, new):
        i, s = at(row, d, D, static_stage)
        return write(stats, new, s if ctx.stage_major else _round(s, D, v), clip(i, m), i >= 0)

    inbox, loop = recomputed(take_input)(row, carry.inbox, carry.loop, fresh, safe)
    out = step(d, params, state, inbox, carry.prev, row, static_stage, fresh)
    acc = carry.acc
    if acc is not None and _may_be(d, D - 1):
        acc = recomputed(put_output)(row, acc, ctx.stages.output(d, out[0]))
    stats = recomputed(put_stats)(row, carry.stats, out[1])
    # the last output is kept only where a bubble returns it (a carry without `prev`: none)
    prev = None if carry.prev is None else out
    return Carry(None, prev, acc, stats, loop, carry.back), out


def at(row, d, D: int, static_stage=None):
    """Device ``d``'s micro-batch and stage in the tick's row of the table (of ``D`` devices;
    ``static_stage``: the stage, when the phase runs one stage only)."""
    micro, stage, _ = split_row(row, D)
    return at_device(micro, d), (at_device(stage, d) if static_stage is None else static_stage)


def at_device(column, d):
    """Device ``d``'s entry of a column of the tick's row."""
    if isinstance(d, int):
        return column[d]
    return lax.dynamic_index_in_dim(column, d, keepdims=False, allow_negative_indices=False)


def recomputed(fn):
    """``fn``, a tick's data movement, under ``jax.checkpoint``: its selects and slot updates
    take their predicates and indices from the tick's row of the table, and the backward pass
    computes them again from that row (an input of the scan) instead of keeping each one per
    tick. Each kept one is an array of ``T`` booleans or integers, with a buffer of its own:
    few bytes, but on ``benchmarks/maxtext_style.py`` at m = 4 they were what put GPipe and
    circular above the MaxText-style reference."""
    return jax.checkpoint(fn, prevent_cse=False)


def _may_be(d, target) -> bool:
    """False only when ``d`` is a Python int (a virtual device) other than ``target``."""
    return not isinstance(d, int) or d == target


class Slots(Protocol):
    """What a training table's program gives the loop (:meth:`MeshDevices.loop`,
    :meth:`LocalDevices.run`; see :mod:`pipejax._src.slots`)."""

    def step(self, d, params, state, inbox, prev, row, static_stage=None, fresh=None):
        """The F slot, as :func:`make_step`'s step: ``(message, stats, ...)``."""

    def init(self):
        """The B and W slots' state at the first tick (:attr:`Carry.back`)."""

    def back(self, state, out, row, d):
        """Device ``d``'s B and W slots after F (``out``: its F slot's): ``(state, the cotangent
        it sends back)``."""

    def arrive(self, state, received):
        """``state`` with the cotangent the next device sent."""


class _Ctx(NamedTuple):
    S: int
    D: int
    v: int
    m: int
    stages: Any
    # a device's stats buffer: (v, m, ...), row `s // D` for each of its stages, gathered after
    # the loop (the forward); or stage-major (S, m, ...), summed exactly after it (the training
    # tables: a device's (v, m) rows gathered cost a buffer more, 233.0 -> 241.2 KiB per device
    # for a stateful homogeneous 1F1B step of 8 micro-batches: the gather needs a second copy of
    # the rows, the exact sum of the stage-major buffer none)
    stage_major: bool = False


def make_step(cfg: Config, ctx: _Ctx, inputs: Inputs, phase, vary, global_micro):
    """The device's stage computation at a tick, guarded and wrapped by the phase's remat."""
    xs, mask, key = inputs.xs, inputs.mask, inputs.key
    micro_size = jax.tree.leaves(xs)[0].shape[1]

    def f(d, params, state, xs, mask, key, inbox, prev, fresh, i, s):
        ic = clip(i, ctx.m)
        key_for = lambda t: stage_keys(cfg, key, global_micro(ic), t, micro_size)
        like_prev = lambda tree: vary(tree, prev)  # outputs typed like the carry (see `_as_varying`)
        # guard: on a bubble (i < 0) the stage does not run and the device keeps its last output
        guard = (i >= 0, prev) if phase.guard else None
        return ctx.stages.compute(d, params, state, inbox, xs, mask, ic, s, key_for, like_prev, guard, fresh)

    def step(d, params, state, inbox, prev, row, static_stage=None, fresh=None):
        # the micro-batch and stage are read from the tick's row inside the checkpoint, so the
        # backward pass reads that row again rather than a copy of them kept per tick (a static
        # stage stays static)
        def g(params, state, xs, mask, key, inbox, prev, fresh, row):
            return f(d, params, state, xs, mask, key, inbox, prev, fresh, *at(row, d, ctx.D, static_stage))

        return phase.remat(g)(params, state, xs, mask, key, inbox, prev, fresh, row)

    return step


# --- the devices: where the table's columns run ---------------------------------------------------


def _scan(schedule, phases, carry, tick, inputs: Inputs):
    """Runs the ticks, one ``lax.scan`` per phase (see :mod:`pipejax._src.checkpoint`);
    ``tick(phase, inputs)`` is the scan body, which reads ``inputs`` as constants of its scan.

    Several phases (``"except_last"``) read the parameters through :func:`_port` with a
    ``link`` carried from scan to scan, so the backward pass adds every tick's parameter
    cotangent to one running sum, in the order one scan would: the gradients are bitwise those
    of ``"always"`` and ``"never"``. The parameters themselves stay constants of each scan
    (loop-invariant, so the checkpointed scan does not store them at every tick, as a carried
    copy would: 13.7 -> 25.9 MiB per device at n = 4, m = 16 in ``benchmarks/pipeline.py``'s
    memory section).
    """
    table = rows(schedule)
    if len(phases) == 1:
        phase = phases[0]
        carry, _ = lax.scan(tick(phase, inputs), carry, table[phase.start : phase.stop])
        return carry
    link = jax.tree.map(_tap, inputs.params)
    for phase in phases:

        def body(c, row, phase=phase):
            c, link = c
            params = jax.tree.map(_port, inputs.params, link)
            c, out = tick(phase, inputs._replace(params=params))(c, row)
            # the barrier keeps the link a carry: a carry returned as it came is turned into a
            # constant of the scan, whose cotangent has a sum of its own again
            return (c, lax.optimization_barrier(link)), out

        (carry, link), _ = lax.scan(body, (carry, link), table[phase.start : phase.stop])
    return carry


@jax.custom_jvp
def _tap(value):
    """Zeros of ``value``'s type whose tangent is ``value``'s: the start of a cotangent
    :func:`_port` (the gradient that reaches it goes to ``value``)."""
    return lax.full_like(value, 0)


@_tap.defjvp
def _tap_jvp(primals, tangents):
    return _tap(primals[0]), tangents[0]


@jax.custom_jvp
def _port(value, link):
    """``value``, whose tangent is ``link``'s (and ``value``'s own tangent is dropped).

    Read through this, a scan's constant ``value`` keeps its place as a loop invariant while
    its cotangent leaves through ``link``, a carry: the transposed scan adds each tick's
    cotangent to the carry's running sum instead of to a sum of its own. Under ``jax.jvp`` the
    primal is ``value`` itself (the rule returns it), so nothing in the scan depends on the
    link's value and a checkpoint stores nothing more.
    """
    return value


@_port.defjvp
def _port_jvp(primals, tangents):
    return primals[0], tangents[1]


class LocalDevices:
    """Without a mesh: one device runs every stage, in turn, on each micro-batch; no bubble, no
    guard and no switch.

    Heterogeneous stages run :func:`pipejax._src.schedule.sequential`, micro-batch ``t`` at tick
    ``t``: its ``S`` columns are virtual devices that hand their output to the next one within
    the tick, a Python loop over the columns (each stage function appears once, called
    directly). Homogeneous (stacked) stages run :func:`pipejax._src.schedule.one_device`, stage
    ``t mod S`` of micro-batch ``t // S`` at tick ``t``: one column, whose tick picks its stage's
    row of the parameters (the stage function appears once). The parameter cotangent is then
    summed in the one accumulator of the backward loop. (An inner ``lax.scan`` over the stages
    per micro-batch, the earlier form, built an ``(S, ...)`` cotangent per micro-batch in its
    transpose: a whole copy of the parameters in temp memory, 1,327,878 -> 278,532 KiB and
    36.9 -> 27.3 ms per step on an H200 with ``benchmarks/gpu.py``'s model, ``"always"``.)
    """

    def __init__(self, cfg: Config, stacked: bool):
        self.cfg, self.stacked = cfg, stacked

    def table(self, num_stages: int, num_micro: int, training: bool = False):
        """The table these devices run (see the class); ``training``: a training table's, the
        stages' F slots and then their B slots on each micro-batch in turn
        (:func:`~pipejax._src.schedule.sequential_training`)."""
        if training:
            return sched.sequential_training(num_stages, num_micro)
        return (sched.one_device if self.stacked else sched.sequential)(num_stages, num_micro)

    def run(self, ctx: _Ctx, schedule, phases, inputs: Inputs, slots=None):
        """The forward's ``(outputs, stats per stage)``; with ``slots`` (a training table, run on
        virtual devices, one per stage) the final state of its B slots and the stats."""
        cfg, S, m = self.cfg, ctx.S, ctx.m
        ident = lambda t: t
        untyped = lambda tree, template: tree
        stages = ctx.stages
        assert slots is None or not self.stacked, "a training table runs a virtual device per stage"

        def tick(phase, inputs):
            params, state = inputs.params, inputs.state
            step = make_step(cfg, ctx, inputs, phase, untyped, ident) if slots is None else slots.step

            def one(d, inbox, acc, stats, row, static=None):
                carry = Carry(inbox, None, acc, stats, ())
                carry, out = device_tick(ctx, d, params, state, carry, row, step, static)
                return out, carry.acc, carry.stats

            def body(c, row):
                if self.stacked:  # one column: the stage the row names
                    out, acc, stats = one(0, *c, row)
                    return (out[0], acc, stats), None
                acc, stats, back = c
                inbox, new, outs = None, [], []
                for d in range(S):  # a column per stage, each with its own stage
                    out, acc, st = one(d, inbox, acc, stats[d], row, static=d)
                    inbox = out[0]
                    new.append(st)
                    outs.append(out)
                if slots is not None:  # B: the columns backwards, handing cotangents on in the tick
                    sent = None
                    for d in reversed(range(S)):
                        back, sent = slots.back(slots.arrive(back, sent), outs[d], row, d)
                    back = slots.arrive(back, sent)  # (stage 0 sends none)
                return (acc, tuple(new), back), None

            return body

        if self.stacked:
            init = (
                stages.message_zeros(0)[0],
                _lead(stages.acc_zeros(m)),
                stages.message_zeros(0, (S, m))[1],
            )
            _, acc, stats = _scan(schedule, phases, init, tick, inputs)
            return _unlead(acc), stages.stats_rows(_lead(stats))
        stats = tuple(stages.message_zeros(d, (1, m))[1] for d in range(S))
        acc, back = (_lead(stages.acc_zeros(m)), None) if slots is None else (None, slots.init())
        acc, stats, back = _scan(schedule, phases, (acc, stats, back), tick, inputs)
        return (_unlead(acc) if slots is None else back), stages.stats_rows(list(stats))


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

    def run(self, ctx: _Ctx, schedule: Schedule, phases, inputs: Inputs):
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
            return self._body(ctx, schedule, phases, d, Inputs(params, state, xs, mask, key), finished)

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
        return acc, ctx.stages.stats_rows(
            stats if isinstance(ctx.stages, Homogeneous) else _unstack(stats, ctx.D)
        )

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

    def _body(self, ctx, schedule, phases, d, inputs, finished):
        """The forward schedules' device: the loop, then its outputs and stats."""
        carry, drain = self.loop(ctx, schedule, phases, d, inputs, finished)
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

    def loop(self, ctx, schedule, phases, d, inputs, finished=None, slots=None):
        """The one tick loop of device ``d``: every schedule's table, run by :func:`device_tick`.

        ``slots`` (:class:`Slots`): a training table's F slot (the tick's stage computation) and
        its B and W slots, which run after F and send cotangents one device back; ``None``: a
        forward table, whose stage computation is :func:`make_step`'s. Returns the final
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
            step = make_step(cfg, ctx, inputs, phase, vary, global_micro) if slots is None else slots.step

            def body(c, row):
                c, queue, drain = c
                if slots is None:  # stage 0 starts micro-batch t at tick t (see `streams`)
                    j = split_row(row, D)[2] % k
                else:  # the micro-batch of the device's F slot
                    j = clip(at(row, d, D)[0], m)
                fresh = stages.pack(read(cfg, queue, j))
                carry, out = device_tick(
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
                if slots is not None:  # B and W; their input cotangents go one device back
                    back, sent = slots.back(carry.back, out, row, d)
                    back = slots.arrive(back, shift(sent, axis, D, ring=ctx.v > 1, back=True))
                    carry = carry._replace(back=back)
                return (carry._replace(inbox=shift(out[0], axis, D, ring=ctx.v > 1)), queue, drain), None

            return body

        # (a training table reads the micro-batch of its F slot from x whole: a streamed queue is
        # a carry of the loop whose temp memory grows with m, and the training tables keep
        # their memory flat in m)
        streams = slots is None and self.streams(ctx)
        # a bubble's input (homogeneous stages of a forward table): the tick's micro-batch of x,
        # which every device reads when every device holds x; when x is streamed a later
        # device's queue slot may hold zeros, so a bubble there reads micro-batch 0
        # (loop-invariant: no per-tick residual). An idle F slot of a training table computes
        # nothing.
        computes_bubbles = stages.computes_bubbles and slots is None
        bubbles_fresh = computes_bubbles and not streams
        safe = None
        if computes_bubbles and streams:
            safe = stages.pack(take(inputs.xs, 0))
        queue = inputs.xs  # (k, b, ...) of this device; all m micro-batches when not streamed
        k = jax.tree.leaves(queue)[0].shape[0] if streams else 1
        if not streams:  # every device holds every micro-batch: read micro-batch t at tick t
            k = jax.tree.leaves(queue)[0].shape[0] + schedule.num_ticks
        message, stat = stages.message_zeros(0)
        delay = loop_delay(schedule) if ctx.v > 1 and slots is None else 0
        loop = stages.message_zeros(0, (delay + 1,))[0] if delay else ()
        drain, acc = None, _lead(stages.acc_zeros(m))
        if finished is not None:  # ceil(m / D) output slots per device instead of m
            drain, acc = compat.to_varying(stages.acc_zeros(-(-m // D)), axes), None
            pushes = self.pushes(finished, -(-m // D), D)
        prev, back = (message, stat), None
        if slots is not None:  # no outputs, no bubble that returns the last one
            acc, prev, back = None, None, slots.init()
        stats = stages.message_zeros(0, (ctx.S if ctx.stage_major else ctx.v, m))[1]
        init = Carry(message, prev, acc, stats, loop, back)
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
            t = 0 if row is None else split_row(row, D)[2]
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


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _lead(tree):
    """Every leaf with a leading axis of 1 (accumulators are written as ``acc[0, i]``)."""
    return jax.tree.map(lambda a: a[None], tree)


def _unlead(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _unstack(tree, n):
    return [jax.tree.map(lambda a, d=d: a[d], tree) for d in range(n)]


def shift(tree, axis_name, n, ring=False, back=False):
    """Sends every device's value to the next device along the stage axis (last to first:
    ``ring``); ``back``: to the previous one (first to last: ``ring``). Activations go forward,
    cotangents of the training schedules back."""
    if n == 1:
        return tree
    step = -1 if back else 1
    perm = [(s, s + step) for s in range(n) if 0 <= s + step < n]
    if ring:
        perm.append((n - 1, 0) if not back else (0, n - 1))
    return lax.ppermute(tree, axis_name, perm)


def put(buf, value, slot, enabled):
    """``buf[slot] = value`` where ``enabled``; unchanged otherwise (``buf`` leaves ``(K, ...)``)."""

    def one(a, v):
        old = lax.dynamic_index_in_dim(a, slot, keepdims=False)
        return lax.dynamic_update_index_in_dim(a, jnp.where(enabled, v, old), slot, 0)

    return jax.tree.map(one, buf, value)


def sum_exact(tree, axis_name):
    """The ``psum`` of buffers that every device but one holds as zeros: exact (booleans: or)."""

    def one(a):
        if a.dtype == jnp.bool_:
            return lax.psum(a.astype(jnp.int32), axis_name) > 0
        if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
            # bfloat16 / float16 summed as float32 (exact: one term is not zero). XLA:CPU
            # crashed compiling a bfloat16 all-reduce in a shard_map manual over some axes
            # only (``param_specs``): "Invalid binary instruction opcode copy".
            return lax.psum(a.astype(jnp.float32), axis_name).astype(a.dtype)
        return lax.psum(a, axis_name)

    return jax.tree.map(one, tree)


def _as_varying(tree, template, axes):
    """``tree`` with the sharding type of ``template`` (varying), values unchanged.

    Used inside branches, where ``pcast`` must not appear. A stage output that depends on no
    device-varying value is written into a varying buffer; ``dynamic_update_slice`` is exact and
    its transpose has no collective. (Everything a stage reads is cast to vary along every axis
    before the loop, so only constants get here.)
    """

    def fix(v, t):
        if set(axes) <= compat.varying_axes(v):
            return v
        return lax.dynamic_update_slice(t, v.astype(t.dtype), (0,) * t.ndim)

    return jax.tree.map(fix, tree, template)


def _gather_stages(tree, s, n, axis_name):
    """Every device's ``tree`` stacked on a new leading device axis, replicated on every device.

    Device ``s`` writes its value into row ``s`` of zeros and a ``psum`` adds the rows: every
    other term is an exact zero, so each row is bitwise its device's value.
    """
    place = lambda a: lax.dynamic_update_index_in_dim(jnp.zeros((n, *a.shape), a.dtype), a, s, 0)
    return sum_exact(jax.tree.map(place, tree), axis_name)


def run(cfg: Config, devices, stages, schedule: Schedule, inputs: Inputs):
    """Runs ``schedule`` on ``devices`` with ``stages``: ``(outputs (m, ...), stats per stage)``.

    Without a mesh the same work runs on one device, every stage in turn on each micro-batch
    (:func:`pipejax._src.schedule.sequential`, or for stacked stages
    :func:`~pipejax._src.schedule.one_device`): no bubble, no guard, no switch.
    """
    S = len(cfg.stages)
    if isinstance(devices, LocalDevices):
        schedule = devices.table(S, schedule.num_micro)
        phases = ckpt.sequential_phases(cfg.checkpoint, schedule)
    else:
        phases = ckpt.phases(cfg.checkpoint, schedule)
    ctx = _Ctx(S, schedule.num_devices, schedule.repeats, schedule.num_micro, stages)
    return devices.run(ctx, schedule, phases, inputs)


__all__: Sequence[str] = ()
