"""Micro-batch pipeline parallelism: ``pipeline(stages, ...) -> apply(params, x, key=None)``.

How a call runs:

1. ``x`` is cut into ``m`` micro-batches (:mod:`pipejax._src.microbatch`).
2. The shapes of the activations at every stage boundary are found with ``jax.eval_shape``; this
   is also where a stage whose output cannot feed the next stage is reported.
3. The schedule (:mod:`pipejax._src.schedules.tables`) is a static table of which micro-batch each stage
   works on at each tick. A ``lax.scan`` over the ticks runs it.
   * With a mesh, the scan runs inside ``jax.shard_map``: device ``s`` runs stage ``s`` and sends its
     output to device ``s + 1`` with ``lax.ppermute`` after every tick. Heterogeneous stages are
     chosen with ``lax.switch`` on the device's stage index, and their activations travel in a flat
     :class:`~pipejax._src.containers.Container` so every device sends the same type.
   * Without a mesh, the same table runs on one device: each tick applies every stage to the
     output the previous stage produced on the tick before.
4. A stage with no micro-batch at a tick (a bubble) does not compute at all (``lax.cond``), so no
   value it was not written for ever reaches it and no ``nan``/``inf`` leaks into gradients.
5. The last stage's outputs are merged back into the original batch order.

The circular schedule (``repeats = v > 1``) runs ``S = v n`` stages on ``n`` devices with the
same machinery: the table also names the stage each device runs at each tick (device ``d`` holds
stages ``d, d + n, ...`` and picks one of its ``v`` parameter slices per tick), the last device
sends back to the first (``ppermute`` over a ring), and device 0 keeps activations that come
round early in a "loop" buffer indexed by micro-batch until their next round starts. Without a
mesh the same table runs on ``n`` virtual devices.

A data axis (``data_axis_name``) adds a second mesh axis to the ``shard_map``: the split batch
``(m, b, ...)`` is sharded over it on the micro-batch axis, every data shard runs the same
program on its ``m / p`` micro-batches (with the micro-batch indices of the whole mini-batch
for the keys), and everything a stage reads is cast to vary along both axes before the loop,
so the transposes of those casts -- the ``psum`` over the data axis that sums parameter
gradients -- sit outside every branch.

Stage state (``stateful=True``): a stage also reads its own ``state`` (e.g. BatchNorm running
statistics, placed on its device like its parameters) and the row mask of its micro-batch, and
returns ``(y, stats)``: a per-micro-batch contribution without the batch axis. Each device writes
its stage's stats into a per-device accumulator, indexed by micro-batch, only on ticks where the
schedule gives it a real micro-batch (never on bubble ticks, never on the discarded drain
re-executions). After the loop every device places its accumulator in its own row of an
``(n, m, ...)`` buffer of zeros and a ``psum`` replicates them, exactly as for the outputs. The
pipeline never changes ``state``: updating it from the stats once per mini-batch is a pure
function the caller applies afterwards (see :mod:`pipejax._src.batchnorm`).

The schedule, the cond, the switch, the scan and the collectives are ordinary JAX: there is no
``custom_vjp`` anywhere, so forward- and reverse-mode autodiff of every order compose with it.
Collectives are never placed inside a ``cond``/``switch`` branch: only some devices take a branch,
and a collective that not every device reaches deadlocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from pipejax._src import aux_outputs, checks, microbatch, options
from pipejax._src import plan as plan_mod
from pipejax._src.params import forms as stage_forms
from pipejax._src.params.placement import stage_index
from pipejax._src.schedules import tables as sched
from pipejax._src.training import step as train

PyTree = Any


class StageFn(Protocol):
    """A pipeline stage: ``stage(params, x, key) -> y``.

    ``x`` and ``y`` are pytrees of arrays whose leading axis is the micro-batch; ``key`` is a PRNG
    key, or ``None`` when the pipeline is called without one.
    """

    def __call__(self, params: PyTree, x: PyTree, key: jax.Array | None) -> PyTree: ...


class StatefulStageFn(Protocol):
    """A stage of a ``stateful=True`` pipeline: ``stage(params, x, key, state, mask) -> (y, stats)``.

    ``state`` is the stage's entry of the pipeline's ``state`` argument (or ``None``); ``mask`` is
    ``bool[b]``, ``True`` on the real rows of the micro-batch; ``stats`` is a pytree of arrays
    without the micro-batch axis, or ``None``.
    """

    def __call__(
        self, params: PyTree, x: PyTree, key: jax.Array | None, state: PyTree, mask: jax.Array
    ) -> tuple[PyTree, PyTree]: ...


def pipeline(
    stages: Sequence[StageFn] | StageFn | Sequence[StatefulStageFn] | StatefulStageFn,
    *,
    num_stages: int | None = None,
    chunks: int = 1,
    checkpoint: str | Callable[..., Any] | None = None,
    mesh: Mesh | None = None,
    axis_name: str = "stage",
    per_example_keys: bool = False,
    stateful: bool = False,
    schedule: str | Callable[[int, int], Any] = "gpipe",
    repeats: int = 1,
    data_axis_name: str | None = None,
    param_specs: Any = None,
    tied: Sequence[Sequence[tuple[int, Any]]] | None = None,
    aux: str | None = None,
    overlap: bool = False,
) -> Pipeline:
    """Builds a micro-batch pipeline over ``stages`` (by default with the GPipe schedule).

    The mini-batch ``x`` is cut into ``chunks`` micro-batches that stream through the stages: at
    tick ``t`` stage ``s`` works on micro-batch ``t - s``, so with a mesh the ``n`` devices work
    at once except during the ``n - 1`` fill and drain ticks. The idle ("bubble") fraction is
    ``(n - 1) / (m + n - 1)`` for ``m`` micro-batches.

    Checkpointing trades compute for memory (GPipe, Huang et al. 2019). With ``"always"`` a device
    keeps only the activations entering its stage, one per tick, and recomputes the stage's
    internals in the backward pass (about one extra forward). ``"never"`` keeps every internal
    activation of every tick. ``"except_last"`` (the default, as in torchgpipe) checkpoints the
    fill phase and keeps the drain phase, whose backward starts at once. A ``jax.checkpoint``
    policy checkpoints every stage with that policy. All modes give bitwise-identical results.

    Randomness: when called with a ``key``, stage ``s`` working on micro-batch ``i`` receives
    ``jax.random.fold_in(jax.random.fold_in(key, i), s)``, independent of the device, the mesh,
    the schedule, the data axis and the checkpoint mode; :func:`pipejax.stage_key` computes it.

    The circular schedule (``schedule="circular"``, ``repeats=v``) runs ``S = v n`` stages on the
    ``n`` devices of the stage axis: device ``d`` holds stages ``d, d + n, ..., d + (v - 1) n``
    and every micro-batch goes round the devices ``v`` times, so the bubble shrinks to
    ``(n - 1) / (v m + n - 1)`` (for ``m >= n``; fewer micro-batches run as ``n`` slots per
    round). Its results are those of GPipe over the same ``S`` stages.

    A data axis (``data_axis_name=``) splits the micro-batches over the data axis of the mesh:
    the mini-batch is cut into ``m`` micro-batches as without it, data shard ``q`` of ``p`` runs
    micro-batches ``q m / p, ..., (q + 1) m / p - 1`` through its own pipeline, and parameter
    gradients are summed over the data axis by autodiff. Outputs, keys and stats are those of the
    pipeline without a data axis.

    Args:
      stages: a sequence of stage functions ``stage(params, x, key) -> y``, one per stage, which
        may differ in parameters and in the type of their inputs and outputs
        (heterogeneous stages); or a single stage function used for every stage, with
        ``num_stages`` (homogeneous stages: the function is traced once and its parameters are
        stacked on a leading stage axis).
      num_stages: the number of stages when ``stages`` is a single function.
      chunks: the number of micro-batches to cut each mini-batch into, ``>= 1``. A batch of ``B``
        examples runs as ``ceil(B / ceil(B / chunks))`` micro-batches of ``ceil(B / chunks)``
        examples; the last is padded with copies of the last example, which are dropped again.
      checkpoint: ``"always"``, ``"except_last"``, ``"never"``, or a ``jax.checkpoint`` policy;
        ``None`` (the default) picks the schedule's default: ``"except_last"`` for ``"gpipe"``
        and ``"circular"``, ``"always"`` for the schedules that own the backward pass. Under
        those, :meth:`Pipeline.value_and_grad`'s forward slots keep what the mode says for the
        backward slots: the stage input (``"always"``), every residual of the stage's vjp
        (``"never"``), or what the policy saves (the rest is recomputed in the backward slots);
        ``"except_last"`` names GPipe's drain phase, which they do not have, and is refused.
      mesh: a ``jax.sharding.Mesh`` with an axis ``axis_name`` of size ``num_stages`` (``num_stages
        / repeats`` for the circular schedule); device ``s`` along it runs stage ``s``. ``None`` runs
        the same schedule on one device.
      axis_name: the name of the mesh axis that holds the stages.
      per_example_keys: if True, a stage receives one key per example of its micro-batch (an
        array of ``b`` keys) instead of one key: row ``r`` of micro-batch ``i`` gets
        ``fold_in(fold_in(key, i * b + r), s)``, which depends on the example's position in the
        mini-batch, not on ``chunks``. Random draws then do not change when only ``chunks``
        changes (torchgpipe issue #35). Cost: ``b`` extra ``fold_in`` per stage call and draws made
        row by row (``jax.vmap``); use it when results must not depend on how the batch is cut.
      stateful: if True, stages carry state and report statistics. A stage is then
        ``stage(params, x, key, state, mask) -> (y, stats)``: ``state`` is the stage's own
        entry of the ``state`` argument of ``apply`` (``None`` if none was given), ``mask`` is a
        ``bool[b]`` array that is ``True`` on the real rows of the micro-batch (``False`` on the
        padding rows of an uneven batch), and ``stats`` is a pytree of arrays *without* the
        micro-batch axis (e.g. per-channel counts, means and sums of squared deviations), or
        ``None``. ``apply(params, x, key=None, *, state=None)`` then returns ``(y, stats)``, where
        ``stats`` holds every stage's stats of the ``m`` micro-batches, stacked in micro-batch
        order on a leading axis of size ``m``: a list with one pytree per stage (heterogeneous
        stages) or one pytree with leading axes ``(num_stages, m)`` (homogeneous stages). The
        pipeline does not change ``state``; update it from ``stats`` after the call, once per
        mini-batch (e.g. :func:`pipejax.batch_norm_update`). Stats are bitwise identical across
        checkpoint modes and with or without a mesh.
      schedule: ``"gpipe"`` (fill-drain) or ``"circular"`` (interleaved; needs ``repeats``);
        or a schedule that owns the backward pass, ``"1f1b"``, ``"zb-h1"``, ``"zb-floor"``
        (ZB-H1 with its last W slots in the drain: a shorter step for ``2 n - 2`` cotangents
        kept where ZB-H1 keeps ``n``), ``"interleaved-1f1b"`` (with ``repeats``), ``"v-half"``
        or ``"zb-v"`` (two stages per
        device in a V, ``num_stages / 2`` devices), which :meth:`Pipeline.value_and_grad` runs
        (the forward call alone runs the GPipe or circular table); or a function ``(num_devices,
        num_micro) -> pj.Schedule`` that returns a training table you wrote
        (:func:`pipejax.schedule_from_actions`; docs/pipeline_tables.md), run as those are.
      repeats: with ``schedule="circular"`` or ``"interleaved-1f1b"``, the number ``v >= 1`` of
        stages each device holds; ``num_stages`` must be a multiple of it. ``1`` for GPipe;
        the V schedules hold 2 (``1``, the default, or ``2``).
      data_axis_name: the name of a second mesh axis to split the micro-batches over (data x
        pipeline parallelism), or ``None``. The number of micro-batches, ``ceil(B / ceil(B /
        chunks))``, must be a multiple of its size. Parameters are replicated over it; ``y`` comes
        back split over it along the batch axis (in contiguous blocks, in the original order).
      param_specs: how each parameter is sharded over the mesh's *other* axes inside its stage
        (tensor parallelism over a ``"model"`` axis; FSDP over the data axis), or ``None`` (every
        parameter whole on each device of its stage). A ``PartitionSpec`` per parameter leaf of
        one stage, without the stage axis (``None``: whole), as a pytree prefix of one stage's
        parameters (homogeneous stages) or a list of those, one per stage (heterogeneous). E.g. a
        Megatron MLP stage: ``{"w1": P(None, "model"), "w2": P("model", None)}``. The pipeline's
        ``shard_map`` is manual over the stage and data axes only, so XLA partitions each stage's
        computation over the other axes and keeps parameters and gradients sharded as given.
        A dimension sharded over the data axis (FSDP) is stored sharded, gathered on entry to
        the pipeline's program and its gradient reduce-scattered; shard it over the data axis
        alone. :meth:`Pipeline.place` lays parameters out this way. See docs/pipeline_meshes.md,
        "Pipelines in bigger meshes".
      tied: weights shared between stages, kept as one copy per holding stage (Megatron's
        embedding shared by the first and last stage), or ``None``. A list of groups, each a
        list of ``(stage, path)`` pairs naming one copy: ``path`` is the copy's leaf in that
        stage's parameters, a ``'/'``-separated string of its keys or a tuple of them
        (homogeneous stages: a path in one stage's pytree; the stage picks the row), e.g.
        ``[[(0, "embed"), (3, "head/table")]]``. Every copy's gradient (and tangent) is the sum
        over its group, under every schedule and every JAX derivative, while no value changes:
        copies that start equal stay bitwise equal under identical optimizer updates. The
        copies must start equal: :meth:`Pipeline.place` checks it (a call does not). See
        docs/pipeline_stages.md, "Tied weights across stages".
      aux: ``None``, or how the stages' auxiliary outputs are returned: ``"stack"``, ``"sum"``
        or ``"mean"``. A stage then returns ``(y, aux)`` (stateful: ``(y, stats, aux)``),
        ``aux`` a pytree of arrays of one micro-batch (an aux loss, router statistics), and the
        call returns ``(y, aux)`` (stateful: ``(y, stats, aux)``), ``aux`` per stage as stats
        are: every micro-batch's value stacked on a leading axis ``m`` (``"stack"``), their sum
        (``"sum"``), or ``sum_i w_i aux_i`` with ``w_i = n_i / B``, micro-batch ``i``'s real
        rows over the batch size (``"mean"``: the mean over micro-batches of an even cut;
        padding rows do not count). Recorded where stats are, in every schedule's loop, and
        differentiable; :meth:`Pipeline.value_and_grad`'s ``aux_loss`` adds losses of them. A
        stage that must leave the padding rows out of its own mean is built ``stateful`` (it
        then reads the row mask). See docs/pipeline_training.md, "Auxiliary outputs".
      overlap: if True, sends overlap compute on a mesh: a device reads a message one tick after
        it arrives, so each ``ppermute`` sends the previous tick's output (a loop carry) while
        both devices compute, as XLA's latency-hiding scheduler needs. The cost: every hop of the
        fill and drain takes two ticks (GPipe: ``m + 2 (n - 1)`` ticks instead of ``m + n - 1``;
        1F1B and ZB-H1: ``m + 4 (n - 1)`` instead of ``m + 2 (n - 1)``, with a deeper stash;
        interleaved 1F1B: micro-batches in groups of ``2 n``), and one more message per device
        is carried. Results are those of ``overlap=False``. Without a mesh there are no sends
        and it changes nothing. See docs/pipeline_gpu.md.

    Returns:
      A :class:`Pipeline`, called as ``apply(params, x, key=None)``. ``params`` is a sequence with
      one pytree per stage (heterogeneous), a pytree whose leaves have a leading axis of size
      ``num_stages`` (homogeneous), or what :meth:`Pipeline.place` returned. ``x`` is a pytree of
      arrays that share their leading batch axis. The result has the same leading batch axis, in
      the original order, and equals applying the stages in turn to the whole batch. With
      ``stateful=True`` the call returns ``(y, stats)`` (see ``stateful``).

    Raises:
      ValueError, TypeError: for bad arguments, at construction or when ``apply`` is traced.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> def affine(p, x, key):
      ...     return x * p["w"] + p["b"]
      >>> apply = pj.pipeline([affine, affine], chunks=4)
      >>> params = [{"w": 2.0, "b": 1.0}, {"w": 3.0, "b": 0.0}]
      >>> apply(params, jnp.arange(6.0)).tolist()
      [3.0, 9.0, 15.0, 21.0, 27.0, 33.0]

      A stateful stage sees the row mask of its micro-batch and reports a statistic per
      micro-batch (here: the sum of its real rows; 5 examples in micro-batches of 2, 2, 1 + 1
      padding row):

      >>> def summed(p, x, key, state, mask):
      ...     return x * p, jnp.sum(jnp.where(mask, x, 0.0))
      >>> apply = pj.pipeline([summed, summed], chunks=3, stateful=True)
      >>> y, stats = apply([2.0, 10.0], jnp.arange(5.0))
      >>> stats[0].tolist(), stats[1].tolist()
      ([1.0, 5.0, 4.0], [2.0, 10.0, 8.0])

      The circular schedule: four stages on two devices (``mesh=None`` runs the same table on
      one device), each micro-batch going round twice:

      >>> apply = pj.pipeline(affine, num_stages=4, chunks=2, schedule="circular", repeats=2)
      >>> params = {"w": jnp.array([1.0, 2.0, 3.0, 4.0]), "b": jnp.zeros(4)}
      >>> apply(params, jnp.arange(4.0)).tolist(), apply.schedule(4).bubble_fraction()
      ([0.0, 24.0, 48.0, 72.0], 0.2)

      Auxiliary outputs: each stage also returns a value per micro-batch (here its mean
      output), averaged over the micro-batches by their real rows:

      >>> def reports(p, x, key):
      ...     y = x * p
      ...     return y, jnp.mean(y)
      >>> y, aux = pj.pipeline([reports, reports], chunks=2, aux="mean")([2.0, 10.0], jnp.arange(4.0))
      >>> [float(a) for a in aux]
      [3.0, 30.0]

    References:
      Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
      Parallelism", NeurIPS 2019. Kim et al., "torchgpipe: On-the-fly Pipeline Parallelism for
      Training Giant Models", 2020. Narayanan et al., "Efficient Large-Scale Language Model
      Training on GPU Clusters Using Megatron-LM", SC 2021 (the interleaved schedule).
    """
    return Pipeline(
        stages,
        num_stages=num_stages,
        chunks=chunks,
        checkpoint=checkpoint,
        mesh=mesh,
        axis_name=axis_name,
        per_example_keys=per_example_keys,
        stateful=stateful,
        schedule=schedule,
        repeats=repeats,
        data_axis_name=data_axis_name,
        param_specs=param_specs,
        tied=tied,
        aux=aux,
        overlap=overlap,
    )


def _plan_field(name: str, doc: str) -> property:
    """A read-only view of the plan's field ``name`` on the facade."""
    return property(lambda self: getattr(self.plan, name), doc=doc)


class Pipeline:
    """A configured pipeline; see :func:`pipeline`. Call it as ``apply(params, x, key=None)``."""

    def __init__(
        self,
        stages: Sequence[StageFn] | StageFn,
        *,
        num_stages: int | None,
        chunks: int,
        checkpoint: Any,
        mesh: Mesh | None,
        axis_name: str,
        per_example_keys: bool = False,
        stateful: bool = False,
        schedule: Any = "gpipe",
        repeats: int = 1,
        data_axis_name: str | None = None,
        param_specs: Any = None,
        tied: Any = None,
        aux: str | None = None,
        overlap: bool = False,
    ):
        self.plan = plan_mod.Plan.build(
            stages,
            num_stages=num_stages,
            chunks=chunks,
            checkpoint=checkpoint,
            mesh=mesh,
            axis_name=axis_name,
            per_example_keys=per_example_keys,
            stateful=stateful,
            schedule=schedule,
            repeats=repeats,
            data_axis_name=data_axis_name,
            param_specs=param_specs,
            tied=tied,
            aux=aux,
            overlap=overlap,
        )
        self._jitted = jax.jit(self._apply)
        self._jitted = self.plan.schedule.guard_forward(self._jitted)

    def __repr__(self) -> str:
        kind = self.kind.name
        where = self.plan.describe_devices()
        how = "" if self.schedule_name == "gpipe" else f", schedule={self.schedule_name!r}"
        how += f", repeats={self.repeats}" if self.repeats > 1 else ""
        how += ", overlap=True" if self.overlap else ""
        return (
            f"Pipeline({self.num_stages} {kind} stages, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}{how}, {where})"
        )

    # the plan's fields, read-only: a Pipeline is not reconfigured after it is built
    homogeneous = _plan_field("homogeneous", "Whether the stages are one function stacked on a stage axis.")
    kind = _plan_field("kind", "The stage kind, which owns what differs between the kinds.")
    stages = _plan_field("stages", "The stage functions (one, for homogeneous stages).")
    num_stages = _plan_field("num_stages", "The number of stages.")
    schedule_name = _plan_field("schedule_name", "The schedule's name, e.g. 'gpipe' or '1f1b'.")
    overlap = _plan_field("overlap", "Whether sends overlap compute (messages take two ticks).")
    repeats = _plan_field("repeats", "The stages each device holds.")
    num_devices = _plan_field("num_devices", "The devices along the stage axis.")
    chunks = _plan_field("chunks", "The micro-batches a mini-batch is cut into.")
    checkpoint = _plan_field("checkpoint", "The checkpoint mode or policy.")
    mesh = _plan_field("mesh", "The mesh, or None.")
    axis_name = _plan_field("axis_name", "The mesh axis of the stages.")
    data_axis_name = _plan_field("data_axis_name", "The mesh axis of data parallelism, or None.")
    data_size = _plan_field("data_size", "The size of the data axis (1 without one).")
    per_example_keys = _plan_field("per_example_keys", "Whether each example gets its own key.")
    stateful = _plan_field("stateful", "Whether stages take and return state.")
    param_specs = _plan_field("param_specs", "The PartitionSpecs of parameters inside their stage, or None.")
    tied = _plan_field("tied", "The groups of tied parameters, or None.")
    aux = _plan_field("aux", "How stages' aux outputs are reduced, or None.")

    # -- public -----------------------------------------------------------------------------

    def __call__(
        self, params: Any, x: PyTree, key: jax.Array | None = None, *, state: Any = None, context: Any = None
    ) -> Any:
        """Runs the pipeline: ``y``, or ``(y, stats)`` for a ``stateful`` pipeline.

        ``state`` (stateful pipelines only) takes the forms ``params`` takes: one pytree per
        stage, a pytree stacked on a leading stage axis (homogeneous stages), or what
        :meth:`place` returned for it. ``None`` gives every stage ``state=None``.

        ``context``: side inputs every stage reads but none passes on (attention masks, segment
        ids, positions): a pytree of arrays with ``x``'s leading batch axis, cut into
        micro-batches exactly as ``x`` (padding rows included). Each stage is then called with
        the keyword argument ``context=`` holding its micro-batch's slice, e.g.
        ``stage(params, x, key, context=c)``. ``None`` (the default) passes no keyword.
        """
        checks.check_key(key)
        plan = self.plan
        options.check_params_shape(params, plan)
        options.check_not_abstract(params)
        options.check_not_abstract(state, "state")
        plan.check_batch(x, context)
        plan.check_eager_autodiff((params, x, state, context))
        if state is not None:
            if not self.stateful:
                raise TypeError(
                    "`state` was given, but the pipeline is not stateful, so its stages cannot "
                    "receive it. Build it with `pj.pipeline(..., stateful=True)` and stages "
                    "`stage(params, x, key, state, mask) -> (y, stats)`."
                )
            options.check_params_shape(state, plan, name="state")
        params, (x, context), key, state = plan.commit(params, (x, context), key, state)
        with plan.own_mesh((params, x, key, state, context)):
            return self._jitted(params, x, key, state, context)

    def value_and_grad(
        self,
        loss_fn: Callable[[PyTree, PyTree], jax.Array],
        *,
        aux_loss: Callable[[PyTree], jax.Array] | None = None,
    ) -> Callable[..., Any]:
        """A training step that returns the loss and its gradient, computed by this schedule.

        ``loss_fn(outputs, targets)`` gives one loss per example (``outputs`` and ``targets`` with
        the same leading batch axis); the loss is their mean over the batch (padding rows of an
        uneven last micro-batch excluded). Returns ``f(params, x, targets, key=None, *,
        context=None) -> (loss, grads)``, jitted, with ``grads`` in the form of ``params``;
        ``context`` (side inputs) is cut into micro-batches and handed to the stages as for a call.

        With ``schedule="gpipe"`` or ``"circular"`` this is ``jax.value_and_grad`` of the loss of
        the pipeline's output. With ``"1f1b"``, ``"zb-h1"`` or ``"interleaved-1f1b"`` one program
        interleaves forwards and backwards of different micro-batches
        (:mod:`pipejax._src.training.slots`): a device keeps what the backward needs of a bounded number
        of micro-batches (at most ``2 n`` per stage it holds) whatever their number: the
        stage inputs, recomputing each stage in its backward slot, or with
        ``checkpoint="never"`` the residuals of the stage's vjp. Keys are the forward
        pipeline's, so every schedule gives the same loss and gradients (up to the order of
        float sums), and ``jax.jvp`` of ``f`` gives Hessian-vector products.

        Auxiliary outputs (a pipeline built with ``aux=``): ``f`` returns ``((loss, aux),
        grads)`` (stateful: ``((loss, stats, aux), grads)``), ``aux`` reduced as the forward
        call reduces it, and ``aux_loss(aux) -> scalar`` (or ``None``: nothing), applied to the
        aux of each (stage, micro-batch), adds ``sum_s sum_i w_i aux_loss(aux_si)`` to the loss,
        ``w_i = n_i / B`` as for ``aux="mean"``: the same loss and gradients under every
        schedule (the training schedules seed the aux loss's cotangent in each stage's backward
        slot). With a ``loss_fn`` that returns :class:`pipejax.LossSums` ``(sums, weights)``
        the loss is ``sum(sums) / sum(weights)`` plus the aux losses under every schedule; the
        training schedules need weights computed from ``targets`` alone (not from ``outputs``)
        then.

        Args:
          loss_fn: ``loss_fn(outputs, targets) -> losses``, one per example (the loss is their
            mean), or :class:`pipejax.LossSums` ``(sums, weights)`` (the loss is ``sum(sums) /
            sum(weights)``: the weights divide, they do not multiply; for a weighted mean
            return :func:`pipejax.weighted_mean` ``(losses, weights)``).
          aux_loss: ``aux_loss(aux_of_one_stage_and_micro_batch) -> scalar``, or ``None``.

        Raises:
          TypeError: ``loss_fn`` or ``aux_loss`` is not callable.
          ValueError: ``aux_loss`` for a pipeline without ``aux=``, or one that does not
            return a scalar.

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import pipejax as pj
          >>> def affine(p, x, key):
          ...     return x * p["w"] + p["b"]
          >>> params = [{"w": 2.0, "b": 1.0}, {"w": 3.0, "b": 0.0}]
          >>> x, t = jnp.arange(5.0), jnp.ones(5)
          >>> sq = lambda y, t: (y - t) ** 2
          >>> for schedule in ("gpipe", "1f1b", "zb-h1"):
          ...     apply = pj.pipeline([affine, affine], chunks=3, schedule=schedule)
          ...     loss, grads = apply.value_and_grad(sq)(params, x, t)
          ...     print(schedule, float(loss), round(float(grads[1]["w"]), 9))  # equal to rounding
          gpipe 268.0 188.0
          1f1b 268.0 188.0
          zb-h1 268.0 188.0
        """
        return train.value_and_grad(self.plan, self, loss_fn, aux_loss)

    def place(self, params: Any) -> Any:
        """Lays ``params`` out for this pipeline; each device of the mesh gets its stage's share.

        Heterogeneous stages: returns a :class:`StageParams` (every stage's leaves packed into one
        buffer per dtype, stacked on a stage axis). Homogeneous stages: the stacked pytree. With
        a mesh, the stage axis is sharded over ``axis_name``, so a device stores only its own
        stage's parameters. Heterogeneous stages are padded per dtype: a device stores, for each
        dtype, the largest demand of any stage on that dtype (with one dtype: the largest
        stage; with several, possibly more, since the largest demands may come from different
        stages). Pass the result
        to the pipeline, to ``jax.grad`` and to optax in place of ``params``.

        With ``param_specs`` each leaf is also sharded over the mesh's other axes as its spec
        says; heterogeneous stages then store each ``(dtype, split)`` group in a buffer of its
        own, its sharded dimensions leading (see :class:`~pipejax._src.containers.Container`).

        The circular schedule on ``n > 1`` devices stacks the stages as ``(repeats, n, ...)``
        instead of ``(num_stages, ...)``: entry ``[r, d]`` is stage ``r n + d``, and device ``d``
        stores column ``d``, its ``repeats`` stages (heterogeneous: buffers of shape
        ``(repeats, n, size)``). The pipeline accepts both forms.

        The ``state`` of a stateful pipeline takes the same forms and may be placed the same way
        (``apply(placed_params, x, state=apply.place(state))``).

        With ``tied=``, the copies of each tied weight must be equal: ``place`` raises a
        ``ValueError`` naming the group if they differ (checked on concrete values held by this
        process; a traced or multi-process ``place`` does not check).
        """
        options.check_params_shape(params, self.plan)
        placed = self.plan.place(params)
        stage_forms.check_tied_equal(self.plan, placed)
        return placed

    def stage_params(self, params: Any, s: int) -> PyTree:
        """Stage ``s``'s parameter pytree, from any of the accepted ``params`` forms.

        Raises:
          IndexError: if ``s`` is not a stage of this pipeline.
        """
        s = stage_index(s, self.num_stages)
        options.check_params_shape(params, self.plan)
        return self.kind.stage_params(self.plan, params, s)

    def schedule(self, batch: int, training: bool | None = None) -> sched.Schedule:
        """The table a batch of ``batch`` examples runs with on the pipeline's stage devices (per
        data shard, with a data axis), one column per device (see
        :mod:`pipejax._src.schedules.tables`); without a mesh, the table it would run on one.

        ``training``: ``None`` (the default) gives the schedule's own table: for a schedule that
        holds the backward slots (``'1f1b'``, ``'zb-h1'``, ``'interleaved-1f1b'``) the training
        table :meth:`value_and_grad` runs (a :class:`~pipejax.Schedule` with B slots), for GPipe and
        the circular schedule the forward table. ``False`` gives the forward call's table
        (GPipe's, or the circular one, for every schedule).

        Raises:
          ValueError: if ``training=True`` for a schedule without a training table (GPipe and
            the circular schedule differentiate their forward table).
        """
        plan = self.plan
        if training is None:
            training = plan.schedule.owns_backward
        elif training is not False and training is not True:
            raise TypeError(f"`training` must be None, True or False, but got {training!r}.")
        cut = microbatch.plan(batch, self.chunks)
        call = plan_mod.Cut(cut, plan.micro_per_shard(cut), None, None, None, None, None)
        return plan.table(call, training, on_mesh=True)

    # -- input placement (eager calls) ------------------------------------------------------

    # -- traced -----------------------------------------------------------------------------

    def _apply(self, params, x, key, state, context=None):
        plan = self.plan
        y, stats, aux, mask = plan.forward(params, x, key, state, context)
        if plan.aux is not None:
            aux = aux_outputs.reduce(plan.aux, aux, mask, microbatch.batch_size(x), plan.kind)
        return plan.returned(y, stats, aux)
