"""The devices of a table without a mesh (:class:`LocalDevices`): every stage on one device."""

from __future__ import annotations

from pipejax._src import checkpoint as ckpt
from pipejax._src.engine import tick as ticks  # `ticks.device_tick`: one name a test can patch
from pipejax._src.engine.collectives import _lead, _unlead
from pipejax._src.engine.config import Config, Inputs
from pipejax._src.engine.tick import Carry, _Ctx, _scan


class LocalDevices:
    """Without a mesh: one device runs every stage, in turn, on each micro-batch; no bubble, no
    guard and no switch.

    Heterogeneous stages run :func:`pipejax._src.schedules.tables.sequential`, micro-batch ``t`` at tick
    ``t``: its ``S`` columns are virtual devices that hand their output to the next one within
    the tick, a Python loop over the columns (each stage function appears once, called
    directly). Homogeneous (stacked) stages run :func:`pipejax._src.schedules.tables.one_device`, stage
    ``t mod S`` of micro-batch ``t // S`` at tick ``t``: one column, whose tick picks its stage's
    row of the parameters (the stage function appears once). The parameter cotangent is then
    summed in the one accumulator of the backward loop. (An inner ``lax.scan`` over the stages
    per micro-batch, the earlier form, built an ``(S, ...)`` cotangent per micro-batch in its
    transpose: a whole copy of the parameters in temp memory, 1,327,878 -> 278,532 KiB and
    36.9 -> 27.3 ms per step on an H200 with ``benchmarks/gpu.py``'s model, ``"always"``.)
    """

    def __init__(self, cfg: Config, stacked: bool):
        self.cfg, self.stacked = cfg, stacked

    def phases(self, checkpoint, schedule):
        """The checkpoint phases of a forward table on one device (see
        :func:`~pipejax._src.checkpoint.sequential_phases`)."""
        return ckpt.sequential_phases(checkpoint, schedule)

    def run(self, ctx: _Ctx, schedule, phases, inputs: Inputs, slots):
        """``(what the slots return, stats per stage)``: a forward table's outputs
        (:class:`ForwardSlots`), or a training table's final state of its B slots (run on
        virtual devices, one per stage)."""
        cfg, S, m = self.cfg, ctx.S, ctx.m
        ident = lambda t: t
        untyped = lambda tree, template: tree
        stages = ctx.stages

        def tick(phase, inputs):
            params, state = inputs.params, inputs.state
            step = slots.step_for(cfg, ctx, inputs, phase, untyped, ident)

            def one(d, inbox, acc, stats, row, static=None):
                carry = Carry(inbox, None, acc, stats, ())
                carry, out = ticks.device_tick(ctx, d, params, state, carry, row, step, static)
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
                back = slots.columns_back(back, outs, row, S)  # a training table's B slots
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
        acc, _, back = slots.start(lambda: _lead(stages.acc_zeros(m)), None)
        acc, stats, back = _scan(schedule, phases, (acc, stats, back), tick, inputs)
        return slots.result(acc, back), stages.stats_rows(list(stats))
