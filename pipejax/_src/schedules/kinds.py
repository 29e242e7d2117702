"""The schedules as objects: each one owns its tables, its checkpoint default and rule, and
whether it runs the backward pass itself.

:data:`SCHEDULES` maps a schedule's name to its object. The plan holds it
(:attr:`pipejax._src.plan.Plan.schedule`); the rest of the library asks it and never compares
schedule names. Two families:

- :class:`ForwardSchedule` (GPipe, circular): a forward table only; autodiff runs it backwards,
  so any JAX transformation differentiates the forward call.
- :class:`BackwardSchedule` (1F1B, ZB-H1, ZB-floor, interleaved 1F1B, V-Half, ZB-V): a
  training table whose F, B and W slots :meth:`pipejax.Pipeline.value_and_grad` runs; the
  forward call (inference) runs the forward table, and differentiating it is refused
  (:meth:`BackwardSchedule.guard_forward`).

Adding a schedule means adding its table to :mod:`pipejax._src.schedules.tables` and its object
here. A user's schedule is a table builder (``schedule=`` a callable), run as
:class:`TableSchedule`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pipejax._src import microbatch
from pipejax._src.schedules import table, tables


@dataclasses.dataclass(frozen=True)
class ForwardSchedule:
    """A schedule of forward slots only; autodiff runs its table backwards."""

    name: str
    takes_repeats: bool  # several stages per device (the circular schedule)

    owns_backward = False
    v_shape = False
    default_checkpoint = "except_last"
    activation_buffers = 2  # a tick's live activations in a step: input and output (memory model)

    def check_checkpoint(self, checkpoint):
        """Every checkpoint mode and policy applies."""
        return checkpoint

    def resolve_repeats(self, repeats: int) -> int:
        """``repeats`` as given (checked against :attr:`takes_repeats` by the options)."""
        return repeats

    def check_num_micro(self, pipe, plan, num_micro) -> None:
        """Any number of micro-batches runs."""

    def training_table(self, num_stages, num_micro, repeats, hop=1):
        """No training table: autodiff differentiates the forward table."""
        raise ValueError(
            f"`training=True` asks for the training table, but schedule {self.name!r} has none: "
            "autodiff runs its forward table backwards. Use `training=None` (or False) for its "
            "table, or a schedule with a training table ('1f1b', 'zb-h1', 'interleaved-1f1b')."
        )

    def guard_forward(self, forward):
        """The forward call as it is: any JAX transformation differentiates it."""
        return forward


@dataclasses.dataclass(frozen=True)
class BackwardSchedule:
    """A schedule whose training table holds the backward (B) and weight-gradient (W) slots."""

    name: str
    takes_repeats: bool  # several stages per device (interleaved 1F1B)
    groups_of_n: bool = False  # micro-batches go round the ring in groups of n (interleaved 1F1B)
    v_shape: bool = False  # two stages per device in a V (placement "v")

    owns_backward = True
    default_checkpoint = "always"
    activation_buffers = 4  # F's input and output, B's cotangents in and out (memory model)

    def check_checkpoint(self, checkpoint):
        """``"except_last"`` is GPipe's drain phase, which these schedules do not have."""
        if checkpoint == "except_last":
            raise ValueError(
                f"`checkpoint='except_last'` means GPipe's drain phase (the last micro-batch on every "
                f"stage) keeps its activations, but `schedule={self.name!r}` runs no drain phase: "
                "every stage's backward slots follow its forward slots all along. Choose what its "
                "forward slots keep for the backward ones: `'always'` (the stage input; the default "
                "for this schedule), `'never'` (every residual), or a `jax.checkpoint` policy such "
                "as `jax.checkpoint_policies.dots_saveable` (what it saves)."
            )
        return checkpoint

    def resolve_repeats(self, repeats: int) -> int:
        """A V-shaped schedule holds two stages per device: ``repeats`` is 2 (1, the default,
        means the same); anything else is refused."""
        if not self.v_shape:
            return repeats
        if repeats not in (1, 2):
            raise ValueError(
                f"`schedule={self.name!r}` holds two stages on each device (device d runs stages d "
                f"and 2 n - 1 - d of 2 n), so `repeats` is 2, but got `repeats={repeats}`. Drop "
                "`repeats` (or pass 2), and give the stage axis half as many devices as stages."
            )
        return 2

    def check_num_micro(self, pipe, plan, num_micro) -> None:
        """A schedule that sends micro-batches round the ring in groups of ``n`` needs their
        number per data shard to be a multiple of ``n`` (``2 n`` when sends overlap compute); the
        message names the ``chunks`` that fit this batch."""
        if not self.groups_of_n or num_micro % (pipe.hop * pipe.num_devices) == 0:
            return
        n, p = pipe.hop * pipe.num_devices, pipe.data_size
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
            f"`schedule={self.name!r}` sends micro-batches round the {pipe.num_devices} devices in "
            f"groups of {n}{' (`overlap=True`: twice the devices)' if pipe.hop == 2 else ''}, so "
            f"their number must be a multiple of {n}, but a batch of {plan.batch} with "
            f"`chunks={pipe.chunks}` gives {num_micro} micro-batches of {plan.micro_size}{per}. Use a "
            f"number of micro-batches that is a multiple of {n * p} ({fix}), or `schedule='1f1b'`."
        )

    def training_table(self, num_stages, num_micro, repeats, hop=1):
        """The table of F, B (and W) slots on the mesh's stage axis."""
        return tables.training(self.name, num_stages, num_micro, repeats, hop=hop)

    def guard_forward(self, forward):
        """``forward``, refusing autodiff: the backward of this schedule is
        :meth:`pipejax.Pipeline.value_and_grad`; differentiating the forward call would silently
        run GPipe's backward instead."""
        name = self.name

        @jax.custom_jvp
        def call(*args):
            return forward(*args)

        @call.defjvp
        def refuse(primals, tangents):
            raise TypeError(
                f"This pipeline was built with `schedule={name!r}`, whose backward pass is run "
                "by `Pipeline.value_and_grad(loss_fn)` only; differentiating its forward call "
                "(`jax.grad`, `jax.vjp`, `jax.jvp`, `nnx.value_and_grad`, ...) would run GPipe's "
                "backward instead, so it is refused. Train with `pipe.value_and_grad(loss_fn)(params, "
                "x, targets, key)` (the Flax adapters: `module.value_and_grad(loss_fn)`), or build "
                "the pipeline with `schedule='gpipe'` (or `'circular'`) to differentiate its forward "
                "call with any JAX transformation. Its forward call alone (inference) runs as usual."
            )

        return call


@dataclasses.dataclass(frozen=True)
class TableSchedule(BackwardSchedule):
    """A schedule a user writes: ``build(num_devices, num_micro)`` returns its training table (a
    :class:`~pipejax._src.schedules.table.Schedule` with B slots, e.g. from
    :func:`~pipejax._src.schedules.actions.from_actions`), checked as every built-in table is. It
    runs as the built-in training schedules do: a table equal to 1F1B's gives 1F1B's programs."""

    build: Callable[[int, int], Any] = None
    takes_repeats: bool = True  # the table says which chunk each slot runs

    def training_table(self, num_stages, num_micro, repeats, hop=1):
        n = num_stages // repeats
        t = self.build(n, num_micro)
        want = f"a training table for {n} devices, `num_micro={num_micro}` and `repeats={repeats}`"
        if not isinstance(t, table.Schedule) or not t.trains:
            raise TypeError(
                f"`schedule={self.name!r}` must return {want} (a `pj.Schedule` with B slots, e.g. from "
                f"`pj.schedule_from_actions`), but `{self.name}({n}, {num_micro})` returned "
                f"{type(t).__name__} {t!r:.120}."
            )
        got = (t.num_devices, t.num_micro, t.repeats)
        if got != (n, num_micro, repeats):
            raise ValueError(
                f"`schedule={self.name!r}` must return {want}, but `{self.name}({n}, {num_micro})` "
                f"returned one for {got[0]} devices, `num_micro={got[1]}` and `repeats={got[2]}`."
            )
        if t.hop != hop:
            how = "`overlap=True` asks for" if hop == 2 else "the pipeline (`overlap=False`) runs"
            raise ValueError(
                f"`schedule={self.name!r}` returned a table whose messages take `hop={t.hop}` "
                f"ticks, but {how} tables with `hop={hop}`: build it with "
                f"`pj.schedule_from_actions(..., hop={hop})`, or set `overlap={hop == 2}`."
            )
        return t


def table_schedule(build) -> TableSchedule:
    """The schedule object of a user's table builder ``build(num_devices, num_micro)``."""
    return TableSchedule(getattr(build, "__name__", type(build).__name__), build=build)


Kind = ForwardSchedule | BackwardSchedule

SCHEDULES: dict[str, Kind] = {
    s.name: s
    for s in (
        ForwardSchedule("gpipe", takes_repeats=False),
        ForwardSchedule("circular", takes_repeats=True),
        BackwardSchedule("1f1b", takes_repeats=False),
        BackwardSchedule("zb-h1", takes_repeats=False),
        BackwardSchedule("zb-floor", takes_repeats=False),
        BackwardSchedule("interleaved-1f1b", takes_repeats=True, groups_of_n=True),
        BackwardSchedule("v-half", takes_repeats=False, v_shape=True),
        BackwardSchedule("zb-v", takes_repeats=False, v_shape=True),
    )
}
