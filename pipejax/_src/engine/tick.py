"""One tick of one device (:func:`device_tick`): take the input, run the stage, write the output and
stats, send; the training program's slots (:class:`Slots`), and the scan over the ticks of each
checkpoint phase (:func:`_scan`)."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from pipejax._src.engine.collectives import _unlead
from pipejax._src.engine.config import Config, Inputs, clip, stage_keys, take, write
from pipejax._src.engine.stages import _round
from pipejax._src.engine.table_rows import read_row, read_tick, rows


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
    sending: Any = None  # sends that overlap compute (a table's hop of 2): the (activation,
    # cotangent) this device made at the last tick, sent during this one; None: sent at once


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
            tick, size = read_tick(row, D), jax.tree.leaves(loop)[0].shape[0]
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
    return Carry(None, prev, acc, stats, loop, carry.back, carry.sending), out


def at(row, d, D: int, static_stage=None):
    """Device ``d``'s micro-batch and stage in the tick's row of the table (of ``D`` devices;
    ``static_stage``: the stage, when the phase runs one stage only)."""
    micro, stage = read_row(row, D, ("F", "F stage"))
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
    """What a table's program gives the loop (:meth:`MeshDevices.loop`, :meth:`LocalDevices.run`):
    the tick's stage computation and what runs after it. A forward table's is
    :class:`ForwardSlots`; a training table's runs its F slot as the stage computation and its B
    and W slots after it (see :mod:`pipejax._src.training.slots`). The loop asks the slots, never
    which kind of table it runs."""

    # the forward table's ways, which a training table does not take: stage 0's micro-batches
    # may stream to it over the stage axis; a homogeneous stage computes on a bubble; the
    # circular loop-back waits in a delay line
    may_stream: bool
    bubbles_compute: bool
    loop_buffer: bool

    def step_for(self, cfg, ctx, inputs, phase, vary, global_micro):
        """The tick's stage computation under checkpoint phase ``phase``, as :func:`make_step`'s
        step: ``(message, stats, ...)``."""

    def fresh_index(self, row, d, D: int, k: int, m: int):
        """The slot of the device's micro-batch queue that holds the micro-batch it reads."""

    def start(self, acc, prev):
        """``(acc, prev, back)`` at the first tick: ``acc()`` makes the output accumulator;
        ``back`` is the B and W slots' state (:attr:`Carry.back`)."""

    def back(self, state, out, row, d):
        """Device ``d``'s B and W slots after F (``out``: its F slot's): ``(state, the cotangent
        it sends back)``."""

    def arrive(self, state, received):
        """``state`` with the cotangent the next device sent."""

    def back_zeros(self, state):
        """What the B slots send when they send nothing (zeros of a cotangent; None: no B)."""

    def columns_back(self, state, outs, row, num_columns: int):
        """One device's B slots of every column (no mesh), the last column first."""

    def result(self, acc, state):
        """What the loop on one device returns: the outputs, or the B slots' state."""


class ForwardSlots:
    """A forward table's program (GPipe, circular): the tick's stage computation is
    :func:`make_step`'s, no slot runs after it, and the last stage's outputs are kept."""

    may_stream = bubbles_compute = loop_buffer = True

    def step_for(self, cfg, ctx, inputs, phase, vary, global_micro):
        return make_step(cfg, ctx, inputs, phase, vary, global_micro)

    def fresh_index(self, row, d, D: int, k: int, m: int):
        return read_tick(row, D) % k  # stage 0 starts micro-batch t at tick t

    def start(self, acc, prev):
        return acc(), prev, None

    def back(self, state, out, row, d):
        return state, None

    def arrive(self, state, received):
        return state

    def back_zeros(self, state):
        return None

    def columns_back(self, state, outs, row, num_columns: int):
        return state

    def result(self, acc, state):
        return _unlead(acc)


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
        return ctx.stages.compute(
            d, params, state, inbox, xs, mask, ic, s, key_for, like_prev, guard, fresh, phase.keeps
        )

    def step(d, params, state, inbox, prev, row, static_stage=None, fresh=None):
        # the micro-batch and stage are read from the tick's row inside the checkpoint, so the
        # backward pass reads that row again rather than a copy of them kept per tick (a static
        # stage stays static)
        def g(params, state, xs, mask, key, inbox, prev, fresh, row):
            return f(d, params, state, xs, mask, key, inbox, prev, fresh, *at(row, d, ctx.D, static_stage))

        return phase.remat(g)(params, state, xs, mask, key, inbox, prev, fresh, row)

    return step


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
