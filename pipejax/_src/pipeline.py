"""GPipe pipeline parallelism: ``pipeline(stages, ...) -> apply(params, x, key=None)``.

How a call runs:

1. ``x`` is cut into ``m`` micro-batches (:mod:`pipejax._src.microbatch`).
2. The shapes of the activations at every stage boundary are found with ``jax.eval_shape``; this
   is also where a stage whose output cannot feed the next stage is reported.
3. The schedule (:mod:`pipejax._src.schedule`) is a static table of which micro-batch each stage
   works on at each tick. A ``lax.scan`` over the ticks runs it.
   * With a mesh, the scan runs inside ``jax.shard_map``: device ``s`` runs stage ``s`` and sends its
     output to device ``s + 1`` with ``lax.ppermute`` after every tick. Heterogeneous stages are
     chosen with ``lax.switch`` on the device's stage index, and their activations travel in a flat
     :class:`~pipejax._src.layout.Container` so every device sends the same type.
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
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pipejax._src import checkpoint as ckpt
from pipejax._src import compat, keys, microbatch
from pipejax._src import schedule as sched
from pipejax._src.layout import Container, Layout
from pipejax._src.placement import StageParams
from pipejax._src.placement import pack as pack_params

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
    checkpoint: str | Callable[..., Any] = "except_last",
    mesh: Mesh | None = None,
    axis_name: str = "stage",
    per_example_keys: bool = False,
    stateful: bool = False,
    schedule: str = "gpipe",
    repeats: int = 1,
    data_axis_name: str | None = None,
) -> Pipeline:
    """Builds a GPipe pipeline over ``stages``.

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
      checkpoint: ``"always"``, ``"except_last"``, ``"never"``, or a ``jax.checkpoint`` policy.
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
      schedule: ``"gpipe"`` (fill-drain) or ``"circular"`` (interleaved; needs ``repeats``).
      repeats: with ``schedule="circular"``, the number ``v >= 1`` of stages each device holds;
        ``num_stages`` must be a multiple of it. ``1`` for GPipe.
      data_axis_name: the name of a second mesh axis to split the micro-batches over (data x
        pipeline parallelism), or ``None``. The number of micro-batches, ``ceil(B / ceil(B /
        chunks))``, must be a multiple of its size. Parameters are replicated over it; ``y`` comes
        back split over it along the batch axis (in contiguous blocks, in the original order).

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
    )


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
        schedule: str = "gpipe",
        repeats: int = 1,
        data_axis_name: str | None = None,
    ):
        self.homogeneous, self.stages = _check_stages(stages, num_stages)
        self.num_stages = len(self.stages)
        _check_schedule(schedule, repeats, self.num_stages)
        self.schedule_name = schedule
        self.repeats = repeats
        self.num_devices = self.num_stages // repeats  # devices along the stage axis
        _check_chunks(chunks)
        ckpt.check_mode(checkpoint)
        _check_mesh(mesh, axis_name, self.num_devices, repeats)
        self.data_size = _check_data_axis(data_axis_name, mesh, axis_name)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.mesh = mesh
        self.axis_name = axis_name
        self.data_axis_name = data_axis_name
        if not isinstance(per_example_keys, bool):
            raise TypeError(f"`per_example_keys` must be a bool, but got {per_example_keys!r}.")
        self.per_example_keys = per_example_keys
        if not isinstance(stateful, bool):
            raise TypeError(f"`stateful` must be a bool, but got {stateful!r}.")
        self.stateful = stateful
        self._jitted = jax.jit(self._apply)

    def __repr__(self) -> str:
        kind = "homogeneous" if self.homogeneous else "heterogeneous"
        where = "no mesh" if self.mesh is None else f"mesh axis {self.axis_name!r}"
        if self.data_axis_name is not None:
            where += f", data axis {self.data_axis_name!r}"
        how = "" if self.schedule_name == "gpipe" else f", schedule='circular', repeats={self.repeats}"
        return (
            f"Pipeline({self.num_stages} {kind} stages, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}{how}, {where})"
        )

    # -- public -----------------------------------------------------------------------------

    def __call__(self, params: Any, x: PyTree, key: jax.Array | None = None, *, state: Any = None) -> Any:
        """Runs the pipeline: ``y``, or ``(y, stats)`` for a ``stateful`` pipeline.

        ``state`` (stateful pipelines only) takes the forms ``params`` takes: one pytree per
        stage, a pytree stacked on a leading stage axis (homogeneous stages), or what
        :meth:`place` returned for it. ``None`` gives every stage ``state=None``.
        """
        keys.check_key(key)
        _check_params_shape(params, self)
        if state is not None:
            if not self.stateful:
                raise TypeError(
                    "`state` was given, but the pipeline is not stateful, so its stages cannot "
                    "receive it. Build it with `pj.pipeline(..., stateful=True)` and stages "
                    "`stage(params, x, key, state, mask) -> (y, stats)`."
                )
            _check_params_shape(state, self, name="state")
        params, x, key, state = self._commit(params, x, key, state)
        return self._jitted(params, x, key, state)

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

        The circular schedule on ``n > 1`` devices stacks the stages as ``(repeats, n, ...)``
        instead of ``(num_stages, ...)``: entry ``[r, d]`` is stage ``r n + d``, and device ``d``
        stores column ``d``, its ``repeats`` stages (heterogeneous: buffers of shape
        ``(repeats, n, size)``). The pipeline accepts both forms.

        The ``state`` of a stateful pipeline takes the same forms and may be placed the same way
        (``apply(placed_params, x, state=apply.place(state))``).
        """
        _check_params_shape(params, self)
        if not self.homogeneous and not isinstance(params, StageParams):
            params = pack_params(params)
        if self.mesh is None:
            return params
        if self.repeats > 1:
            params = _device_major(self, params) if self.num_devices > 1 else params
            spec = PartitionSpec(None, self.axis_name) if self.num_devices > 1 else PartitionSpec()
        else:
            spec = PartitionSpec(self.axis_name)
        return jax.device_put(params, NamedSharding(self.mesh, spec))

    def stage_params(self, params: Any, s: int) -> PyTree:
        """Stage ``s``'s parameter pytree, from any of the accepted ``params`` forms."""
        if isinstance(params, StageParams):
            return params.stage(s)
        if self.homogeneous:
            if _is_device_major(self, params):
                n = self.num_devices
                return jax.tree.map(lambda a: compat.replicate(a)[s // n, s % n], params)
            return jax.tree.map(lambda a: a[s], params)
        return params[s]

    def schedule(self, batch: int) -> sched.Schedule:
        """The schedule a batch of ``batch`` examples runs with (per data shard, with a data axis).

        Its table has one column per device of the stage axis (see :mod:`pipejax._src.schedule`).
        """
        return sched.circular(self.num_devices, self._micro_per_shard(batch), self.repeats)

    def _micro_per_shard(self, batch: int) -> int:
        """Micro-batches each data shard runs; raises unless the data axis divides their number."""
        plan = microbatch.plan(batch, self.chunks)
        if plan.num_micro % self.data_size:
            raise ValueError(
                f"The batch of {batch} examples with `chunks={self.chunks}` is cut into "
                f"{plan.num_micro} micro-batches of {plan.micro_size}, which the data axis "
                f"{self.data_axis_name!r} of size {self.data_size} does not divide; every data "
                "shard runs the same number of whole micro-batches. Use a `chunks` that is a "
                f"multiple of {self.data_size} and a batch of at least `chunks` examples (e.g. "
                f"`chunks={self.data_size * max(1, plan.num_micro // self.data_size)}`)."
            )
        return plan.num_micro // self.data_size

    # -- input placement (eager calls) ------------------------------------------------------

    def _commit(self, params, x, key, state):
        """Moves concrete inputs committed elsewhere onto the devices the pipeline runs on."""
        leaves = [a for a in jax.tree.leaves((params, x, key, state)) if _is_concrete(a)]
        if self.mesh is None:
            # One device runs everything: gather inputs spread over several devices onto one.
            device_sets = {frozenset(a.sharding.device_set) for a in leaves if a.committed}
            if len(device_sets) <= 1 and all(len(d) == 1 for d in device_sets):
                return params, x, key, state
            target = min((d for ds in device_sets for d in ds), key=lambda d: d.id)
            return jax.device_put((params, x, key, state), SingleDeviceSharding(target))
        mesh_devices = set(self.mesh.devices.flat)

        def put(tree, spec):
            sharding = NamedSharding(self.mesh, spec)

            def move(a):
                if _is_concrete(a) and a.committed and a.sharding.device_set != mesh_devices:
                    return jax.device_put(a, sharding)
                return a

            return jax.tree.map(move, tree)

        def per_stage(tree):
            if not (self.homogeneous or isinstance(tree, StageParams)):
                return put(tree, PartitionSpec())
            if _is_device_major(self, tree):
                return put(tree, PartitionSpec(None, self.axis_name))
            return put(tree, PartitionSpec(self.axis_name))

        return per_stage(params), put(x, PartitionSpec()), put(key, PartitionSpec()), per_stage(state)

    # -- traced -----------------------------------------------------------------------------

    def _apply(self, params, x, key, state):
        plan = microbatch.plan(microbatch.batch_size(x), self.chunks)
        num_micro = self._micro_per_shard(plan.batch)
        # A batch sharded with Explicit axes cannot be cut up in place, except one split over the
        # data axis into whole micro-batches.
        keep = PartitionSpec(self.data_axis_name) if self.data_axis_name and not plan.padding else None
        x = compat.replicate(x, keep=keep)
        xs, mask, plan = microbatch.split(x, self.chunks)
        if not self.stateful:
            mask = None  # stateless stages take no mask
        if state is None and not self.homogeneous:
            state = [None] * self.num_stages
        schedule = sched.circular(self.num_devices, num_micro, self.repeats)
        key_struct = None
        if key is not None:
            lead = (plan.micro_size,) if self.per_example_keys else ()
            key_struct = jax.ShapeDtypeStruct(lead + key.shape, key.dtype)
        # Stacked stages in the runner's form: (S, ...) without a mesh, (n, ...) on a GPipe mesh,
        # (v, n, ...) on a circular one.
        if self.mesh is None:
            params, state = (_stage_major(self, t) for t in (params, state))
        elif self.repeats > 1:
            if not self.homogeneous:
                params, state = (t if isinstance(t, StageParams) else pack_params(t) for t in (params, state))
            params, state = (_device_major(self, t) for t in (params, state))
        if self.homogeneous:
            boundaries, stats = _homogeneous_boundaries(self, params, state, xs, key_struct)
            run = _run_homogeneous_mesh if self.mesh is not None else _run_homogeneous_local
        else:
            if self.mesh is None and isinstance(params, StageParams):
                params = params.unpack()
            if self.mesh is None and isinstance(state, StageParams):
                state = state.unpack()
            boundaries, stats = _heterogeneous_boundaries(self, params, state, xs, key_struct)
            if self.mesh is not None:
                params, state = (t if isinstance(t, StageParams) else pack_params(t) for t in (params, state))
            run = _run_heterogeneous_mesh if self.mesh is not None else _run_heterogeneous_local
        inputs = _Inputs(params, state, xs, mask, key)
        ys, stats = run(self, inputs, schedule, boundaries, stats)
        y = microbatch.merge(ys, plan)
        return (y, stats) if self.stateful else y


# --- validation ------------------------------------------------------------------------------


def _check_stages(stages, num_stages) -> tuple[bool, tuple[StageFn, ...]]:
    if callable(stages) and not isinstance(stages, Sequence):
        if num_stages is None:
            raise TypeError(
                "`stages` is a single function, so the pipeline is homogeneous and needs "
                "`num_stages` (e.g. `pipeline(stage, num_stages=4)`). For different stages pass "
                "a sequence of functions instead."
            )
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"`num_stages` must be an int >= 1, but got {num_stages!r}.")
        return True, (stages,) * num_stages
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise TypeError(
            "`stages` must be a sequence of stage functions `stage(params, x, key) -> y`, or one "
            f"such function with `num_stages`; got {type(stages).__name__}."
        )
    if len(stages) == 0:
        raise ValueError(
            "`stages` is empty; a pipeline needs at least one stage function `stage(params, x, key) -> y`."
        )
    for s, stage in enumerate(stages):
        if not callable(stage):
            raise TypeError(
                f"`stages[{s}]` must be a callable `stage(params, x, key) -> y`, but got "
                f"{type(stage).__name__} {stage!r}."
            )
    if num_stages is not None and num_stages != len(stages):
        raise ValueError(
            f"`num_stages` is {num_stages} but {len(stages)} stage functions were given; drop "
            "`num_stages` (it is only needed for a single homogeneous stage function)."
        )
    return False, tuple(stages)


def _check_chunks(chunks) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"`chunks` must be an int >= 1, but got {type(chunks).__name__} {chunks!r}.")
    if chunks < 1:
        raise ValueError(
            f"`chunks` must be >= 1 (the number of micro-batches per mini-batch), but got {chunks}."
        )


def _check_schedule(schedule, repeats, num_stages) -> None:
    kinds = ", ".join(repr(k) for k in sched.KINDS)
    if not isinstance(schedule, str):
        raise TypeError(f"`schedule` must be one of {kinds}, but got {type(schedule).__name__} {schedule!r}.")
    if schedule not in sched.KINDS:
        raise ValueError(f"`schedule` must be one of {kinds}, but got {schedule!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise TypeError(f"`repeats` must be an int >= 1, but got {type(repeats).__name__} {repeats!r}.")
    if repeats < 1:
        raise ValueError(
            f"`repeats` must be >= 1 (the number of stages each device holds), but got {repeats}."
        )
    if schedule == "gpipe" and repeats != 1:
        raise ValueError(
            f"`repeats={repeats}` needs `schedule='circular'`: the GPipe schedule runs one stage "
            "per device. Pass `schedule='circular'` or drop `repeats`."
        )
    if num_stages % repeats:
        raise ValueError(
            f"The circular schedule with `repeats={repeats}` needs a number of stages that is a "
            f"multiple of {repeats} (each device holds {repeats} stages), but the pipeline has "
            f"{num_stages} stages. Use {repeats * max(1, round(num_stages / repeats))} stages or "
            "change `repeats`."
        )


def _check_mesh(mesh, axis_name, num_devices, repeats=1) -> None:
    if not isinstance(axis_name, str):
        raise TypeError(f"`axis_name` must be a str, but got {type(axis_name).__name__} {axis_name!r}.")
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh or None, but got {type(mesh).__name__}. Make one "
            f"with `jax.make_mesh(({num_devices},), ({axis_name!r},))`."
        )
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`mesh` has no axis named {axis_name!r} (its axes are {tuple(mesh.axis_names)}). "
            f"Add a stage axis of size {num_devices}, e.g. "
            f"`jax.make_mesh(({num_devices},), ({axis_name!r},))`, or pass `axis_name=`."
        )
    size = mesh.shape[axis_name]
    if size != num_devices and repeats > 1:
        raise ValueError(
            f"`mesh` axis {axis_name!r} has size {size}, but the circular pipeline has "
            f"{num_devices * repeats} stages with `repeats={repeats}`, which need {num_devices} "
            f"devices ({repeats} stages each). Use `jax.make_mesh(({num_devices},), "
            f"({axis_name!r},))` or change `repeats`."
        )
    if size != num_devices:
        raise ValueError(
            f"`mesh` axis {axis_name!r} has size {size}, but the pipeline has {num_devices} stages; "
            "each device along the stage axis runs one stage, so the sizes must be equal. Use "
            f"`jax.make_mesh(({num_devices},), ({axis_name!r},))` or change the number of stages "
            "(or hold several stages per device with `schedule='circular', repeats=...`)."
        )


def _check_data_axis(data_axis_name, mesh, axis_name) -> int:
    """Validates the data axis; returns its size (1 without one)."""
    if data_axis_name is None:
        return 1
    if not isinstance(data_axis_name, str):
        raise TypeError(
            f"`data_axis_name` must be a str or None, but got {type(data_axis_name).__name__} "
            f"{data_axis_name!r}."
        )
    if mesh is None:
        raise ValueError(
            f"`data_axis_name={data_axis_name!r}` needs a mesh with that axis, but `mesh` is None. "
            f"Pass e.g. `mesh=jax.make_mesh((2, n), ({data_axis_name!r}, {axis_name!r}))`, or drop "
            "`data_axis_name`."
        )
    if data_axis_name == axis_name:
        raise ValueError(
            f"`data_axis_name` and `axis_name` are both {axis_name!r}; the data axis must be another "
            "axis of the mesh than the stage axis."
        )
    if data_axis_name not in mesh.axis_names:
        raise ValueError(
            f"`mesh` has no axis named {data_axis_name!r} for `data_axis_name` (its axes are "
            f"{tuple(mesh.axis_names)}). Add a data axis, e.g. `jax.make_mesh((2, "
            f"{mesh.shape[axis_name]}), ({data_axis_name!r}, {axis_name!r}))`, or pass its name."
        )
    if compat.is_explicit(mesh, data_axis_name) != compat.is_explicit(mesh, axis_name):
        raise ValueError(
            f"The data axis {data_axis_name!r} and the stage axis {axis_name!r} of `mesh` have "
            "different axis types (one Explicit, one Auto); give both the same type in "
            "`jax.make_mesh(..., axis_types=...)`."
        )
    return mesh.shape[data_axis_name]


def _check_params_shape(params, pipe: Pipeline, name: str = "params") -> None:
    """Static checks on ``params`` (or ``state``, which takes the same forms) that need no tracing."""
    n = pipe.num_stages
    if isinstance(params, StageParams):
        if pipe.homogeneous:
            raise TypeError(
                f"`{name}` is a StageParams (packed heterogeneous stages), but this pipeline "
                f"has homogeneous stages; pass `{name}` stacked on a leading stage axis."
            )
        if params.num_stages != n:
            raise ValueError(f"`{name}` packs {params.num_stages} stages, but the pipeline has {n} stages.")
        return
    if pipe.homogeneous:
        leaves, _ = jax.tree_util.tree_flatten_with_path(params)
        major = _is_device_major(pipe, params)
        lead = (pipe.repeats, pipe.num_devices) if major else (n,)
        placed = ""
        if pipe.repeats > 1 and pipe.num_devices > 1:
            placed = f" (or {pipe.repeats}, {pipe.num_devices} as `place` lays them out)"
        for path, leaf in leaves:
            shape = jnp.shape(leaf)
            if tuple(shape[: len(lead)]) != lead:
                raise ValueError(
                    f"Homogeneous stages take `{name}` stacked on a leading stage axis of size "
                    f"{n}{placed}, but `{name}` leaf {jax.tree_util.keystr(path) or '<root>'} has "
                    f"shape {shape}. Stack the per-stage values, e.g. "
                    f"`jax.tree.map(lambda *p: jnp.stack(p), *per_stage_{name})`; every leaf alike."
                )
        return
    what = "parameter" if name == "params" else name
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(
            f"`{name}` must be a sequence with one {what} pytree per stage ({n} stages), but "
            f"got {type(params).__name__}. Wrap a single stage's {what} in a list."
        )
    if len(params) != n:
        raise ValueError(
            f"`{name}` has {len(params)} {'entry' if len(params) == 1 else 'entries'} but the "
            f"pipeline has {n} stages; pass exactly one "
            f"{what} pytree per stage (use None or {{}} for a stage without any)."
        )


def _is_concrete(a) -> bool:
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)


# --- stacked stage layouts ------------------------------------------------------------------------
# Stacked stages (homogeneous pytrees, StageParams buffers) come stage-major, ``(S, ...)``, or, for
# the circular schedule on n > 1 devices, device-major as ``place`` lays them out: ``(v, n, ...)``,
# entry [r, d] = stage r n + d, so that sharding axis 1 gives device d its v stages.


def _is_device_major(pipe, tree) -> bool:
    """Whether stacked stages come as ``(repeats, n, ...)`` (never ambiguous: needs n > 1)."""
    if pipe.repeats == 1 or pipe.num_devices == 1 or tree is None:
        return False
    if isinstance(tree, StageParams):
        return bool(tree.buffers) and tree.buffers[0].ndim == 3
    if not pipe.homogeneous:
        return False
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and jnp.ndim(leaves[0]) >= 1 and jnp.shape(leaves[0])[0] == pipe.repeats


def _reshape_stacked(tree, lead, drop):
    """Every stacked leaf with its ``drop`` leading stage axes reshaped to ``lead``."""

    def fix(a):
        a = compat.replicate(jnp.asarray(a))  # Explicit sharding refuses reshapes of sharded axes
        return a.reshape((*lead, *a.shape[drop:]))

    if isinstance(tree, StageParams):
        return StageParams(tuple(fix(b) for b in tree.buffers), tree.container, tree.layouts)
    return jax.tree.map(fix, tree)


def _device_major(pipe, tree):
    """Stacked stages as ``(repeats, n, ...)``; other trees (per-stage lists, None) unchanged."""
    stacked = pipe.homogeneous or isinstance(tree, StageParams)
    if tree is None or not stacked or _is_device_major(pipe, tree):
        return tree
    return _reshape_stacked(tree, (pipe.repeats, pipe.num_devices), 1)


def _stage_major(pipe, tree):
    """Stacked stages as ``(S, ...)``; other trees unchanged."""
    if not _is_device_major(pipe, tree):
        return tree
    return _reshape_stacked(tree, (pipe.num_stages,), 2)


# --- boundary shapes ---------------------------------------------------------------------------


def _struct(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _micro_struct(xs):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)


def _mask_struct(xs, pipe):
    """The type of the row mask a stateful stage receives, ``bool[b]``; ``None`` when stateless."""
    if not pipe.stateful:
        return None
    return jax.ShapeDtypeStruct(jax.tree.leaves(xs)[0].shape[1:2], jnp.bool_)


def _stage_call(pipe, s):
    """Stage ``s`` as ``f(params, x, key, state, mask) -> (y, stats)``; stats ``None`` when stateless."""
    stage = pipe.stages[s]
    if not pipe.stateful:
        return lambda p, x, key, state, mask: (stage(p, x, key), None)

    def call(p, x, key, state, mask):
        y, stats = stage(p, x, key, state, mask)
        return y, stats

    return call


def _stage_output(s, pipe, p_struct, st_struct, in_struct, key_struct, mask_struct) -> tuple[Layout, Layout]:
    """The layouts of stage ``s``'s output and stats on ``in_struct``, or a clear error."""
    micro_size = jax.tree.leaves(in_struct)[0].shape[0]
    stage = pipe.stages[s]
    args = (p_struct, in_struct, key_struct) + ((st_struct, mask_struct) if pipe.stateful else ())
    try:
        out = jax.eval_shape(stage, *args)
    except Exception as err:
        source = "a micro-batch of `x`" if s == 0 else f"the output of stage {s - 1}"
        raise ValueError(
            f"Stage {s} could not be applied to {source}, whose type is "
            f"{Layout.of(in_struct).describe()}: {type(err).__name__}: {err}\n"
            f"Make stage {s} accept what {('`x`' if s == 0 else f'stage {s - 1}')} produces "
            "(shapes include the micro-batch axis first)."
        ) from err
    stats = None
    if pipe.stateful:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(
                f"Stage {s} returned {out!r}, but the pipeline is stateful, so every stage must "
                "return a pair `(y, stats)`: the activation for the next stage and a pytree of "
                "per-micro-batch statistics without the batch axis (None if it has none), e.g. "
                "`return y, None`."
            )
        out, stats = out  # (eval_shape has already rejected leaves that are not arrays)
    if not jax.tree.leaves(out):
        raise ValueError(
            f"Stage {s} returned {out!r}, which holds no arrays. A stage must return the "
            "activation for the next stage (an array or a pytree of arrays with the micro-batch "
            "axis first); check for a missing `return`."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, jax.ShapeDtypeStruct) or not leaf.shape or leaf.shape[0] != micro_size:
            got = getattr(leaf, "shape", leaf)
            raise ValueError(
                f"Stage {s} returned leaf {jax.tree_util.keystr(path) or '<root>'} with shape {got}, "
                f"but every output leaf must keep the micro-batch axis first (size {micro_size}). "
                "Stages may change every axis but the leading batch axis."
            )
    return Layout.of(out), Layout.of(stats)


def _per_stage_structs(tree, n):
    """The per-stage types of a heterogeneous ``params``/``state`` (list or StageParams)."""
    if isinstance(tree, StageParams):
        return [layout.structs() for layout in tree.layouts]
    if tree is None:
        return [None] * n
    return [_struct(t) for t in tree]


def _heterogeneous_boundaries(pipe, params, state, xs, key_struct) -> tuple[list[Layout], list[Layout]]:
    """Layouts of the values entering stage 0, 1, ..., and leaving the last stage; and of each
    stage's stats."""
    in_struct = _micro_struct(xs)
    p_structs = _per_stage_structs(params, pipe.num_stages)
    st_structs = _per_stage_structs(state, pipe.num_stages)
    mask_struct = _mask_struct(xs, pipe)
    layouts, stats = [Layout.of(in_struct)], []
    for s in range(pipe.num_stages):
        out, stat = _stage_output(s, pipe, p_structs[s], st_structs[s], in_struct, key_struct, mask_struct)
        layouts.append(out)
        stats.append(stat)
        in_struct = out.structs()
    return layouts, stats


def _homogeneous_boundaries(pipe, params, state, xs, key_struct) -> tuple[list[Layout], Layout]:
    in_struct = _micro_struct(xs)
    lead = 2 if pipe.mesh is not None and pipe.repeats > 1 else 1  # (v, n, ...) on a circular mesh

    def unstacked(tree):  # one stage's slice of a stacked pytree
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[lead:], jnp.result_type(a)), tree)

    layout_in = Layout.of(in_struct)
    layout_out, stats = _stage_output(
        0, pipe, unstacked(params), unstacked(state), in_struct, key_struct, _mask_struct(xs, pipe)
    )
    if layout_out != layout_in:
        raise ValueError(
            "Homogeneous stages must return activations of the type they take, so that each "
            f"stage can feed the next; the stage maps {layout_in.describe()} to "
            f"{layout_out.describe()}. Use a sequence of stage functions (heterogeneous stages) "
            "for stages that change the activation type."
        )
    return [layout_in] * (pipe.num_stages + 1), stats


# --- shared pieces of the tick loop ---------------------------------------------------------------
# A schedule runs over D devices (the stage axis; D = S stages for GPipe, S / repeats for the
# circular schedule). Each tick, device d reads (micro-batch i, stage s) from the tables; i < 0 is
# a bubble. With repeats > 1, device 0 starts every round after the first on an activation that
# left the last device some ticks earlier: it keeps those in a buffer indexed by micro-batch (the
# "loop" buffer, m activations), written when they arrive over the ring and read when their
# round starts.


class _Inputs(NamedTuple):
    """What a run reads. ``params`` and ``state`` come in the runner's per-stage form; ``xs`` has
    leaves ``(m, b, ...)``; ``mask`` is ``bool[m, b]`` (real rows), ``None`` when stateless."""

    params: Any
    state: Any
    xs: Any
    mask: Any
    key: Any


def _take(xs, i):
    """Micro-batch ``i`` (a traced index) of the split batch."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)


def _clip(i, num_micro):
    return jnp.clip(i, 0, num_micro - 1)


def _write(acc, y, i, enabled):
    """``acc[i] = y`` where ``enabled``; ``acc`` unchanged otherwise."""

    def one(a, v):
        old = lax.dynamic_index_in_dim(a, i, keepdims=False)
        return lax.dynamic_update_index_in_dim(a, jnp.where(enabled, v, old), i, 0)

    return jax.tree.map(one, acc, y)


def _write_at(acc, y, r, i, enabled):
    """``acc[r, i] = y`` where ``enabled`` (``acc`` has two leading axes)."""

    def one(a, v):
        start = tuple(jnp.asarray(j, jnp.int32) for j in (r, i, *(0,) * v.ndim))
        old = lax.dynamic_slice(a, start, (1, 1, *v.shape))[0, 0]
        return lax.dynamic_update_slice(a, jnp.where(enabled, v, old)[None, None], start)

    return jax.tree.map(one, acc, y)


def _zeros(layout: Layout, leading=()):
    return jax.tree.map(lambda s: jnp.zeros(leading + s.shape, s.dtype), layout.structs())


def _stage_keys(pipe, key, i, s, xs):
    """The key(s) stage ``s`` receives for micro-batch ``i`` (see :mod:`pipejax._src.keys`)."""
    if pipe.per_example_keys:
        return keys.example_keys_for(key, i, jax.tree.leaves(xs)[0].shape[1], s)
    return keys.key_for(key, i, s)


def _named(tree):
    """Marks a per-tick slice of stage parameters: saved by no phase (see ``checkpoint.phases``)."""
    return jax.tree.map(lambda a: checkpoint_name(a, ckpt.STAGE_PARAMS), tree)


def _slice_stage(tree, r, repeats):
    """Row ``r`` of a device's ``(repeats, ...)`` stages: static for one repeat, named otherwise."""
    if repeats == 1:
        return jax.tree.map(lambda a: a[0], tree)
    return _named(jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, keepdims=False), tree))


def _guard(skip_bubbles, i, run, prev):
    """Runs the stage, or on a bubble tick (``i < 0``) returns the stage's previous output.

    With ``skip_bubbles`` the stage does not run on bubble ticks at all (``lax.cond``). Without,
    it always runs: the caller guarantees that its input is then a real (stale) activation.
    Returning the previous output on a skipped tick keeps every activation in flight real, so a
    later un-guarded tick never sees a value a stage was not written for.
    """
    if skip_bubbles:
        return lax.cond(i >= 0, run, lambda: prev)
    return run()


def _rows(schedule):
    """The scan's per-tick inputs: ``(micro[T, D], stage[T, D], back_micro[T], back_stage[T])``.

    ``back_*`` is the last device's entry at the previous tick: what reaches device 0 over the
    ring at this tick.
    """
    micro, stage = schedule.table, schedule.stages()
    back_micro = np.concatenate([[-1], micro[:-1, -1]]).astype(np.int32)
    back_stage = np.concatenate([[0], stage[:-1, -1]]).astype(np.int32)
    return tuple(jnp.asarray(a) for a in (micro, stage, back_micro, back_stage))


def _scan_phases(pipe, schedule, make_step, carry):
    """Runs the schedule's ticks, one ``lax.scan`` per phase (see ``checkpoint.phases``)."""
    rows = _rows(schedule)
    for phase in ckpt.phases(pipe.checkpoint, schedule):
        carry, _ = lax.scan(make_step(phase), carry, tuple(r[phase.start : phase.stop] for r in rows))
    return carry


def _arrived(back_i, back_s, num_stages):
    """Whether what reaches device 0 at this tick is an activation to keep for a later round."""
    return (back_i >= 0) & (back_s < num_stages - 1)


# --- without a mesh ------------------------------------------------------------------------------
# The same tables run on one device. The carry holds every device's previous (output, stats),
# which is what the next device reads at this tick, the output accumulator, the stats
# accumulators (a stage writes slot i only on a tick where it works on i) and the loop buffer.


def _run_heterogeneous_local(pipe, inputs, schedule, boundaries, stats_layouts):
    if schedule.repeats > 1:
        return _run_heterogeneous_local_circular(pipe, inputs, schedule, boundaries, stats_layouts)
    n, m = pipe.num_stages, schedule.num_micro
    params, state, xs, mask, key = inputs

    def compute(s, skip):
        call = _stage_call(pipe, s)

        def f(p, st, xs, mask, inbox, prev, i, key):
            ic = _clip(i, m)
            x_in = _take(xs, ic) if s == 0 else inbox
            k = _stage_keys(pipe, key, ic, s, xs)
            return _guard(skip, i, lambda: call(p, x_in, k, st, _take(mask, ic)), prev)

        return f

    def make_step(phase):
        fns = [phase.remat(compute(s, phase.skip_bubbles)) for s in range(n)]

        def step(carry, rows):
            row = rows[0]
            prev, acc, stats = carry  # prev[s]: stage s's (output, stats) at the previous tick
            outs = tuple(
                fns[s](params[s], state[s], xs, mask, prev[s - 1][0] if s else None, prev[s], row[s], key)
                for s in range(n)
            )
            acc = _write(acc, outs[-1][0], _clip(row[n - 1], m), row[n - 1] >= 0)
            stats = tuple(_write(stats[s], outs[s][1], _clip(row[s], m), row[s] >= 0) for s in range(n))
            return (outs, acc, stats), None

        return step

    prev = tuple((_zeros(boundaries[s + 1]), _zeros(stats_layouts[s])) for s in range(n))
    acc = _zeros(boundaries[n], (m,))
    stats = tuple(_zeros(layout, (m,)) for layout in stats_layouts)
    _, acc, stats = _scan_phases(pipe, schedule, make_step, (prev, acc, stats))
    return acc, list(stats)


def _run_heterogeneous_local_circular(pipe, inputs, schedule, boundaries, stats_layouts):
    """Heterogeneous stages on the circular tables, one device: ``D`` virtual devices, each picking
    one of its ``v`` stages with ``lax.switch``; activations travel in a flat container."""
    S, D, v, m = pipe.num_stages, schedule.num_devices, schedule.repeats, schedule.num_micro
    params, state, xs, mask, key = inputs
    box = Container.for_layouts(boundaries[1:])
    statbox = Container.for_layouts(stats_layouts)

    def branch(s, j):  # stage s = j * D + d, the j-th of its device
        call = _stage_call(pipe, s)

        def f(ps, sts, xs, mask, inbox, ic, k):
            p, st = _named((ps[j], sts[j]))
            x_in = _take(xs, ic) if s == 0 else box.unpack(inbox, boundaries[s])
            y, stats = call(p, x_in, k, st, _take(mask, ic))
            return box.pack(y), statbox.pack(stats)

        return f

    def compute(d, skip):
        branches = [branch(j * D + d, j) for j in range(v)]

        def f(ps, sts, xs, mask, inbox, prev, i, s, key):
            ic = _clip(i, m)
            args = (ps, sts, xs, mask, inbox, ic, _stage_keys(pipe, key, ic, s, xs))
            return _guard(skip, i, lambda: lax.switch(s // D, branches, *args), prev)

        return f

    own = [tuple(range(d, S, D)) for d in range(D)]  # the stages of device d
    dev_params = [tuple(params[s] for s in own[d]) for d in range(D)]
    dev_state = [tuple(state[s] for s in own[d]) for d in range(D)]

    def make_step(phase):
        fns = [phase.remat(compute(d, phase.skip_bubbles)) for d in range(D)]

        def step(carry, rows):
            micro, stage, back_i, back_s = rows
            prev, acc, stats, loop = carry  # prev[d]: device d's (message, stats) at the previous tick
            loop = _write(loop, prev[D - 1][0], _clip(back_i, m), _arrived(back_i, back_s, S))
            outs = []
            for d in range(D):
                i, s = micro[d], stage[d]
                inbox = _take(loop, _clip(i, m)) if d == 0 else prev[d - 1][0]
                outs.append(fns[d](dev_params[d], dev_state[d], xs, mask, inbox, prev[d], i, s, key))
            i, s = micro[D - 1], stage[D - 1]
            acc = _write(acc, box.unpack(outs[-1][0], boundaries[S]), _clip(i, m), (i >= 0) & (s == S - 1))
            stats = tuple(
                _write_at(stats[d], outs[d][1], stage[d] // D, _clip(micro[d], m), micro[d] >= 0)
                for d in range(D)
            )
            return (tuple(outs), acc, stats, loop), None

        return step

    prev = tuple((box.zeros(), statbox.zeros()) for _ in range(D))
    acc = _zeros(boundaries[S], (m,))
    stats = tuple(statbox.zeros((v, m)) for _ in range(D))
    _, acc, stats, _ = _scan_phases(pipe, schedule, make_step, (prev, acc, stats, box.zeros((m,))))
    rows = [tuple(b[s // D] for b in stats[s % D]) for s in range(S)]  # stage s = r D + d: row r of device d
    return acc, [_unpack_rows(statbox, rows[s], stats_layouts[s]) for s in range(S)]


def _run_homogeneous_local(pipe, inputs, schedule, boundaries, stats_layout):
    S, D, v, m = pipe.num_stages, schedule.num_devices, schedule.repeats, schedule.num_micro
    params, state, xs, mask, key = inputs
    call = _stage_call(pipe, 0)
    layout = boundaries[0]

    def compute(skip):
        def f(params, state, mask, x_in, prev, i, s, key):
            ic = _clip(i, m)
            p, st = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, s, keepdims=False), (params, state))
            if v > 1:
                p, st = _named((p, st))
            k = _stage_keys(pipe, key, ic, s, xs)
            return _guard(skip, i, lambda: call(p, x_in, k, st, _take(mask, ic)), prev)

        return f

    def make_step(phase):
        f = phase.remat(compute(phase.skip_bubbles))

        def step(carry, rows):
            micro, stage, back_i, back_s = rows
            prev, acc, stats, loop = carry  # stacked (outputs, stats) of every device at the previous tick
            x0 = _take(xs, _clip(micro[0], m))
            if v > 1:
                last = jax.tree.map(lambda a: a[D - 1], prev[0])
                loop = _write(loop, last, _clip(back_i, m), _arrived(back_i, back_s, S))
                again = _take(loop, _clip(micro[0], m))
                x0 = jax.tree.map(lambda a, b: jnp.where(stage[0] >= D, a, b), again, x0)
            inputs = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b[: D - 1]]), x0, prev[0])

            def one_stage(_, args):
                x_in, prev_s, i, s = args
                return None, f(params, state, mask, x_in, prev_s, i, s, key)

            _, outs = lax.scan(one_stage, None, (inputs, prev, micro, stage))
            last = jax.tree.map(lambda a: a[D - 1], outs[0])
            done = (micro[D - 1] >= 0) & (stage[D - 1] == S - 1)
            acc = _write(acc, last, _clip(micro[D - 1], m), done)
            if jax.tree.leaves(stats):
                if v == 1:
                    stats = jax.vmap(_write)(stats, outs[1], _clip(micro, m), micro >= 0)
                else:
                    for d in range(D):
                        out = jax.tree.map(lambda a, d=d: a[d], outs[1])
                        stats = _write_at(stats, out, stage[d], _clip(micro[d], m), micro[d] >= 0)
            return (outs, acc, stats, loop), None

        return step

    prev = (_zeros(layout, (D,)), _zeros(stats_layout, (D,)))
    acc = _zeros(layout, (m,))
    stats = _zeros(stats_layout, (S, m))
    loop = _zeros(layout, (m,)) if v > 1 else ()
    _, acc, stats, _ = _scan_phases(pipe, schedule, make_step, (prev, acc, stats, loop))
    return acc, stats


# --- on a mesh -----------------------------------------------------------------------------------
# Device d runs the stages d, d + D, ... (one of them for GPipe). The carry holds the activation
# received from device d - 1 (the inbox), the device's own previous (output, stats), the output
# accumulator (written on the last device only), the device's stats accumulator (one row per
# stage it holds) and, for repeats > 1, the loop buffer (read on device 0 only). With a data axis
# every data shard runs the same program on its own micro-batches.


def _axes(pipe):
    """The mesh axes a value inside the shard_map varies along."""
    if pipe.data_axis_name is None:
        return (pipe.axis_name,)
    return (pipe.axis_name, pipe.data_axis_name)


def _global_micro(pipe, i, num_micro):
    """The mini-batch's index of a data shard's micro-batch ``i`` (shard ``q`` runs ``q m`` on)."""
    if pipe.data_axis_name is None:
        return i
    return lax.axis_index(pipe.data_axis_name) * num_micro + i


def _shift(tree, axis_name, n, ring=False):
    """Sends every device's value to the next device along the stage axis (last to first: ``ring``)."""
    if n == 1:
        return tree
    perm = [(s, s + 1) for s in range(n - 1)] + ([(n - 1, 0)] if ring else [])
    return lax.ppermute(tree, axis_name, perm)


def _local_stages(tree, repeats):
    """A device's block of stacked stages, ``(repeats, ...)``.

    GPipe blocks come as ``(1, ...)`` (``P(stage)`` on ``(n, ...)``), circular ones as
    ``(repeats, 1, ...)`` (``P(None, stage)`` on ``(repeats, n, ...)``).
    """
    if repeats == 1:
        return tree
    return jax.tree.map(lambda a: a[:, 0], tree)


def _spmd(pipe, body, inputs):
    """Runs ``body(params, state, xs, mask, key)`` under shard_map.

    Every leaf of ``params`` and ``state`` is stacked on the stage axis (``(n, ...)``, or
    ``(repeats, n, ...)`` for the circular schedule) and sharded over the mesh's stage axis;
    ``xs`` and ``mask`` are replicated over it (split over the data axis, if any); ``key`` is
    replicated. ``body`` returns the output accumulator ``(m, ...)`` and the stats ``(n, v, m,
    ...)``, replicated over the stage axis.
    """
    axis, data, mesh = pipe.axis_name, pipe.data_axis_name, pipe.mesh
    rep = PartitionSpec()
    stage_spec = PartitionSpec(axis) if pipe.repeats == 1 else PartitionSpec(None, axis)
    batch_spec = rep if data is None else PartitionSpec(data)
    stats_spec = rep if data is None else PartitionSpec(None, None, data)
    params, state, xs, mask, key = inputs
    params = compat.constrain(params, mesh, stage_spec, axis)
    state = compat.constrain(state, mesh, stage_spec, axis)
    xs, mask = (compat.constrain(t, mesh, batch_spec, axis) for t in (xs, mask))
    key = compat.constrain(key, mesh, rep, axis)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(stage_spec, stage_spec, batch_spec, batch_spec, None if key is None else rep),
        out_specs=(batch_spec, stats_spec),
    )
    return fn(params, state, xs, mask, key)


def _as_varying(tree, template, axes):
    """``tree`` with the sharding type of ``template`` (varying), values unchanged.

    Used inside cond branches, where ``pcast`` must not appear (see :mod:`pipejax._src.compat`).
    A stage output that depends on no device-varying value is written into a varying buffer;
    ``dynamic_update_slice`` is exact and its transpose has no collective. (Everything a stage
    reads is cast to vary along every axis before the loop, so only constants get here.)
    """

    def fix(v, t):
        if set(axes) <= compat.varying_axes(v):
            return v
        return lax.dynamic_update_slice(t, v.astype(t.dtype), (0,) * t.ndim)

    return jax.tree.map(fix, tree, template)


def _gather_stages(tree, s, n, axis_name):
    """Every device's ``tree`` stacked on a new leading stage axis, replicated on every device.

    Device ``s`` writes its value into row ``s`` of zeros and a ``psum`` adds the rows: every
    other term is an exact zero, so each row is bitwise its device's value.
    """

    def gather(a):
        rows = lax.dynamic_update_index_in_dim(jnp.zeros((n, *a.shape), a.dtype), a, s, 0)
        if a.dtype == jnp.bool_:
            return lax.psum(rows.astype(jnp.int32), axis_name) > 0
        return lax.psum(rows, axis_name)

    return jax.tree.map(gather, tree)


def _mesh_loop(pipe, schedule, d, compute, init, out_of):
    """The per-device tick loop shared by both stage kinds on a mesh.

    ``compute(phase)`` returns ``f(inbox, prev, i, s) -> (message, stats)``; ``out_of(message)``
    reads the last stage's output from a message. Returns the replicated output accumulator and
    every device's stats accumulator stacked on a leading device axis.
    """
    S, D, v, m = pipe.num_stages, schedule.num_devices, schedule.repeats, schedule.num_micro
    axis = pipe.axis_name

    def make_step(phase):
        f = compute(phase)

        def step(carry, rows):
            micro, stage, back_i, back_s = rows
            inbox, prev, acc, stats, loop = carry
            i, s = micro[d], stage[d]
            if v > 1:
                loop = _write(loop, inbox, _clip(back_i, m), (d == 0) & _arrived(back_i, back_s, S))
                again = (d == 0) & (s >= D)  # device 0 starts a later round: its input waited in the loop
                inbox = jax.tree.map(lambda a, b: jnp.where(again, a, b), _take(loop, _clip(i, m)), inbox)
            out = f(inbox, prev, i, s)
            acc = _write(acc, out_of(out[0]), _clip(i, m), (i >= 0) & (s == S - 1))
            stats = _write_at(stats, out[1], s // D, _clip(i, m), i >= 0)
            return (_shift(out[0], axis, D, ring=v > 1), out, acc, stats, loop), None

        return step

    message, stat, acc, stats, loop = init
    carry = (message, (message, stat), acc, stats, loop)
    _, _, acc, stats, _ = _scan_phases(pipe, schedule, make_step, carry)
    # Only the last device wrote its accumulator; the others hold zeros, and adding exact zeros
    # is exact, so the sum is bitwise the last device's outputs.
    return lax.psum(acc, axis), _gather_stages(stats, d, D, axis)


def _by_stage(stats, repeats):
    """``(n, v, m, ...)`` stats of every device -> ``(S, m, ...)`` in stage order (``s = r n + d``)."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1, *a.shape[2:])), stats)


def _run_homogeneous_mesh(pipe, inputs, schedule, boundaries, stats_layout):
    D, v, m, axes = schedule.num_devices, schedule.repeats, schedule.num_micro, _axes(pipe)
    call = _stage_call(pipe, 0)
    layout = boundaries[0]

    def body(params, state, xs, mask, key):
        d = lax.axis_index(pipe.axis_name)
        params, state = _local_stages((params, state), v)
        params, state, xs, mask, key = compat.to_varying((params, state, xs, mask, key), axes)

        def compute(phase):
            def f(params, state, xs, mask, inbox, prev, i, s, key):
                ic = _clip(i, m)
                x_in = jax.tree.map(lambda a, b: jnp.where(s == 0, a, b), _take(xs, ic), inbox)

                def run():
                    p, st = _slice_stage((params, state), s // D, v)
                    k = _stage_keys(pipe, key, _global_micro(pipe, ic, m), s, xs)
                    return _as_varying(call(p, x_in, k, st, _take(mask, ic)), prev, axes)

                return _guard(phase.skip_bubbles, i, run, prev)

            f = phase.remat(f)
            return lambda inbox, prev, i, s: f(params, state, xs, mask, inbox, prev, i, s, key)

        loop = _zeros(layout, (m,)) if v > 1 else ()
        acc, stats = _zeros(layout, (m,)), _zeros(stats_layout, (v, m))
        init = (_zeros(layout), _zeros(stats_layout), acc, stats, loop)
        return _mesh_loop(pipe, schedule, d, compute, compat.to_varying(init, axes), lambda out: out)

    acc, stats = _spmd(pipe, body, inputs)
    return acc, _by_stage(stats, v)


def _unpack_rows(box, buffers, layout):
    """``box.unpack`` for buffers with a leading axis: the values of ``layout`` stacked on it."""
    if not layout.shapes:
        return layout.structs()  # no leaves: the empty pytree itself (e.g. None)
    return jax.vmap(lambda bufs: box.unpack(bufs, layout))(buffers)


def _run_heterogeneous_mesh(pipe, inputs, schedule, boundaries, stats_layouts):
    S, D, v, m = pipe.num_stages, schedule.num_devices, schedule.repeats, schedule.num_micro
    axes = _axes(pipe)
    params, state = inputs[:2]
    pbox, playouts = params.container, params.layouts
    sbox, slayouts = state.container, state.layouts
    box = Container.for_layouts(boundaries[1:])
    statbox = Container.for_layouts(stats_layouts)

    def branch(s):
        call = _stage_call(pipe, s)

        def f(prow, srow, xs, mask, inbox, prev, ic, k):
            p, st = pbox.unpack(prow, playouts[s]), sbox.unpack(srow, slayouts[s])
            if v > 1:
                p, st = _named((p, st))
            x_in = _take(xs, ic) if s == 0 else box.unpack(inbox, boundaries[s])
            y, stats = call(p, x_in, k, st, _take(mask, ic))
            return _as_varying((box.pack(y), statbox.pack(stats)), prev, axes)

        return f

    branches = [branch(s) for s in range(S)]

    def body(pbufs, sbufs, xs, mask, key):
        d = lax.axis_index(pipe.axis_name)
        pbufs, sbufs = _local_stages((pbufs, sbufs), v)
        pbufs, sbufs, xs, mask, key = compat.to_varying((pbufs, sbufs, xs, mask, key), axes)

        def compute(phase):
            def f(pbufs, sbufs, xs, mask, inbox, prev, i, s, key):
                ic = _clip(i, m)
                prow, srow = _slice_stage((pbufs, sbufs), s // D, v)
                k = _stage_keys(pipe, key, _global_micro(pipe, ic, m), s, xs)
                args = (prow, srow, xs, mask, inbox, prev, ic, k)
                return _guard(phase.skip_bubbles, i, lambda: lax.switch(s, branches, *args), prev)

            f = phase.remat(f)
            return lambda inbox, prev, i, s: f(pbufs, sbufs, xs, mask, inbox, prev, i, s, key)

        loop = box.zeros((m,)) if v > 1 else ()
        init = (box.zeros(), statbox.zeros(), _zeros(boundaries[S], (m,)), statbox.zeros((v, m)), loop)
        out_of = lambda message: box.unpack(message, boundaries[S])
        return _mesh_loop(pipe, schedule, d, compute, compat.to_varying(init, axes), out_of)

    acc, stats = _spmd(pipe, body, inputs._replace(params=params.buffers, state=state.buffers))
    # stats: one (n, v, m, size) buffer per dtype; stage s = r n + d is row (d, r), laid out by its layout.
    rows = [tuple(b[s % D, s // D] for b in stats) for s in range(S)]
    return acc, [_unpack_rows(statbox, rows[s], stats_layouts[s]) for s in range(S)]
