"""The plan of a pipeline: every option checked and resolved once, frozen, and read by every part
below the facade (:class:`~pipejax._src.pipeline.Pipeline`).

A :class:`Plan` holds the stages and their kind, the schedule, the devices (mesh, axes, repeats,
data axis) and the options. It decides what a call runs: how a batch is cut into micro-batches
(:meth:`Plan.cut`), which table runs them (:meth:`Plan.table`, the one place a table is chosen,
on a mesh or on one device, forward or training), how ``param_specs`` split each leaf
(:meth:`Plan.splits`), where concrete inputs go (:meth:`Plan.commit`), and the forward loop
(:meth:`Plan.forward`). The forward call and the training step
(:mod:`pipejax._src.training.step`) read the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pipejax._src import aux_outputs, checks, compat, engine, kinds, microbatch, options
from pipejax._src.params import forms as stage_forms
from pipejax._src.params import shard_moves
from pipejax._src.schedules import kinds as schedule_kinds
from pipejax._src.schedules import tables as sched
from pipejax._src.training import loss, slots

_REPLICATED = PartitionSpec()


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A pipeline's options, checked once (:meth:`build`) and frozen."""

    stages: tuple[Callable[..., Any], ...]
    homogeneous: bool  # one stage function stacked on a stage axis, or one function per stage
    num_stages: int
    schedule: schedule_kinds.Kind  # its tables, its checkpoint rule, whether it owns the backward
    repeats: int  # stages per device
    num_devices: int  # devices along the stage axis
    chunks: int
    checkpoint: Any
    mesh: Mesh | None
    axis_name: str
    data_axis_name: str | None
    data_size: int
    per_example_keys: bool
    stateful: bool
    param_specs: Any
    tied: Any
    aux: str | None
    overlap: bool = False  # sends overlap compute: the tables' messages take two ticks (hop 2)

    @classmethod
    def build(
        cls,
        stages,
        *,
        num_stages,
        chunks,
        checkpoint,
        mesh,
        axis_name,
        per_example_keys=False,
        stateful=False,
        schedule="gpipe",
        repeats=1,
        data_axis_name=None,
        param_specs=None,
        tied=None,
        aux=None,
        overlap=False,
    ) -> Plan:
        """Checks every option (each once, in :mod:`pipejax._src.options`) and resolves them."""
        homogeneous, stages = options.check_stages(stages, num_stages)
        aux = aux_outputs.check_mode(aux)
        tied = options.check_tied(tied, len(stages))
        num_stages = len(stages)
        schedule, repeats = options.check_schedule(schedule, repeats, num_stages)
        num_devices = num_stages // repeats
        chunks = options.check_chunks(chunks)
        checkpoint = options.check_checkpoint(checkpoint, schedule)
        checks.axis_name(axis_name)
        if mesh is None:
            options.check_no_mesh(data_axis_name, param_specs, axis_name)
            data_size = 1
        else:
            options.check_mesh(mesh, axis_name, num_devices, repeats)
            data_size = options.check_data_axis(data_axis_name, mesh, axis_name)
        per_example_keys = checks.check_bool(per_example_keys, "per_example_keys")
        stateful = checks.check_bool(stateful, "stateful")
        overlap = checks.check_bool(overlap, "overlap")
        return cls(
            stages, homogeneous, num_stages, schedule, repeats, num_devices, chunks, checkpoint, mesh,
            axis_name, data_axis_name, data_size, per_example_keys, stateful, param_specs, tied, aux,
            overlap,
        )  # fmt: skip

    @property
    def kind(self) -> kinds.Kind:
        """The stage kind (:mod:`pipejax._src.kinds`), which owns what differs between them."""
        return kinds.of(self.homogeneous)

    @property
    def schedule_name(self) -> str:
        """The schedule's name (a user's table builder: its function's name)."""
        return self.schedule.name

    def table(self, call: Cut, training: bool = False, *, on_mesh: bool = False):
        """The table a call runs on its ``call.num_micro`` micro-batches (per data shard): the one
        place a table is chosen, and where a table refuses a micro-batch count it cannot run.

        On a mesh: the forward table (:func:`~pipejax._src.schedules.tables.circular`, GPipe's
        with ``repeats = 1``), or, for a training step, the schedule's training table. Without a
        mesh one device runs every stage and no schedule has a bubble to fill: the stages in turn
        on each micro-batch (:func:`~pipejax._src.schedules.tables.sequential`, or for stacked
        stages :func:`~pipejax._src.schedules.tables.one_device`), or for a training step each
        micro-batch's F slots and then its B slots
        (:func:`~pipejax._src.schedules.tables.sequential_training`, gradient accumulation).
        ``on_mesh``: the mesh's table even without a mesh (:meth:`Pipeline.schedule`).
        """
        num_micro = call.num_micro
        if self.mesh is None and not on_mesh:
            if training:
                return sched.sequential_training(self.num_stages, num_micro)
            return self.kind.local_table(self.num_stages, num_micro)
        if training:
            self.schedule.check_num_micro(self, call.plan, num_micro)
            return self.schedule.training_table(self.num_stages, num_micro, self.repeats, self.hop)
        return sched.circular(self.num_devices, num_micro, self.repeats, hop=self.hop)

    @property
    def hop(self) -> int:
        """The ticks a message takes to the next device on the mesh: 2 when sends overlap compute."""
        return 2 if self.overlap else 1

    def describe_devices(self) -> str:
        """Where the stages run, for ``repr``: ``no mesh``, or the mesh's stage (and data) axis."""
        if self.mesh is None:
            return "no mesh"
        where = f"mesh axis {self.axis_name!r}"
        return where + (f", data axis {self.data_axis_name!r}" if self.data_axis_name is not None else "")

    def check_eager_autodiff(self, inputs) -> None:
        """Refuses eager autodiff of a pipeline on an Explicit mesh without a mesh context (JAX's
        own error would not say what to do)."""
        if (
            self.mesh is not None
            and compat.is_explicit(self.mesh, self.axis_name)
            and not compat.mesh_context_set()
            and compat.eager_autodiff(inputs)
        ):
            raise ValueError(
                "The pipeline is being differentiated outside `jax.jit` on a mesh with Explicit "
                f"axes ({dict(self.mesh.shape)}), and no mesh context is set. JAX needs one for "
                "eager autodiff of arrays typed with an Explicit mesh (its own error would be "
                "'Length of device assignment 1 is not equal to the size of the mesh'). Jit the "
                "function you differentiate (`jax.jit(jax.grad(loss))`), or run it inside "
                "`with jax.set_mesh(mesh):`, or build the mesh with Auto axes "
                "(`jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))`)."
            )

    def place(self, params):
        """``params`` (checked) as :meth:`pipejax.Pipeline.place` lays them out: packed
        (heterogeneous), and on a mesh in the placed layout with every leaf on its devices."""
        splits = self.splits(params)
        params = self.kind.pack(params, splits)
        if self.mesh is None:
            return params
        params = stage_forms.placed(self, params)
        specs = stage_forms.leaf_specs(self, params, splits)

        def put(a, spec):
            sharding = NamedSharding(self.mesh, spec)
            if isinstance(a, jax.core.Tracer) and not compat.is_explicit(self.mesh, self.axis_name):
                # inside `jit` on Auto axes (a Flax `init`, a restore target) `device_put` does
                # not constrain the result: it came out replicated, the first training step
                # returned another layout, and the second step compiled again
                return jax.lax.with_sharding_constraint(a, sharding)
            return jax.device_put(a, sharding)

        return self.kind.map_placed(put, params, specs)

    def runner_form(self, tree, splits=None):
        """``params``/``state`` in the one form the engine reads, converted once at the entry by
        the stage kind: on a mesh the placed layout, on one device the stages one by one."""
        if self.mesh is None:
            return self.kind.local_form(self, tree)
        return self.kind.mesh_form(self, tree, splits)

    def engine_specs(self, params, splits):
        """The ``PartitionSpec`` of every leaf the engine reads of runner-form ``params`` (on a
        mesh with ``param_specs``), or ``None``."""
        return None if self.mesh is None else stage_forms.full_specs(self, params, splits)

    def runner_stage_axes(self) -> int:
        """The leading stage axes of stacked runner-form leaves: 2 (``(v, n, ...)``) on a mesh
        with several stages per device, 1 (``(S, ...)``) otherwise."""
        return 2 if self.mesh is not None and self.repeats > 1 else 1

    def sharding(self, spec=_REPLICATED):
        """Where a leaf laid out as ``spec`` goes: ``spec`` on the mesh, or the first device."""
        return SingleDeviceSharding(jax.devices()[0]) if self.mesh is None else NamedSharding(self.mesh, spec)

    def put(self, tree, spec=_REPLICATED):
        """``tree`` laid out as ``spec`` on the mesh (replicated: ``P()``); as it is on one device."""
        return tree if self.mesh is None else jax.device_put(tree, self.sharding(spec))

    def structs(self, tree, specs=None):
        """``tree``'s leaves as ``jax.ShapeDtypeStruct`` where the plan puts them: on the mesh as
        ``specs()`` says (a ``PartitionSpec`` per leaf; ``None``: replicated), or on the first
        device."""
        specs = jax.tree.map(lambda _: _REPLICATED, tree) if specs is None or self.mesh is None else specs()
        return jax.tree.map(lambda a, spec: _struct(a, self.sharding(spec)), tree, specs)

    def buffer_spec(self, ndim: int = 2) -> PartitionSpec:
        """A placed buffer's ``PartitionSpec``: ``P(stage, None)`` (``P(None, stage, None)``
        circular), ``P()`` on one device."""
        if self.mesh is None:
            return PartitionSpec()
        if self.repeats > 1 and ndim == 3:
            return PartitionSpec(None, self.axis_name, None)
        return PartitionSpec(self.axis_name, *([None] * (ndim - 1)))

    @property
    def inner_axes(self) -> frozenset[str]:
        """The mesh axes a stage's leaves may be split over: all but the stage axis (none on one
        device)."""
        return frozenset() if self.mesh is None else frozenset(self.mesh.axis_names) - {self.axis_name}

    def relayout(self, tree, shape, specs, lead: int = 1):
        """Stacked leaves moved between the stage form and the layer form
        (:mod:`~pipejax._src.params.layer_form`), each reshaped to ``shape(a)``. On a mesh from
        the first of the ``PartitionSpec`` trees ``specs()`` gives to the second: each device
        reshapes its own shard, or, with ``lead = 2`` stage axes (the circular layout's stages are
        not contiguous per device), XLA moves them."""
        if self.mesh is None:
            return jax.tree.map(lambda a: jnp.reshape(a, shape(a)), tree)

        def one(a, source, target):
            target = NamedSharding(self.mesh, target)
            if lead == 2:
                return shard_moves.moved(jnp.asarray(a), shape(a), target)
            a = shard_moves.put(a, NamedSharding(self.mesh, source))
            return shard_moves.reshard_local(a, shape(a), target)

        return jax.tree.map(one, tree, *specs())

    def unstage(self, params):
        """A ``StageParams``' per-stage pytrees: unpacked on each stage's own devices when it is
        placed on the mesh, else as it is."""
        if self.mesh is None or not all(
            isinstance(b, jax.Array) and b.sharding.device_set == set(self.mesh.devices.flat)
            for b in params.buffers
        ):
            return params.unpack()
        return shard_moves.unpack_on_devices(self, params)

    def restage(self, stages):
        """Per-stage lists of layers as ``place`` lays them out: on a mesh a ``StageParams``
        packed on each stage's own devices; unchanged on one device."""
        return stages if self.mesh is None else shard_moves.pack_on_devices(self, stages)

    def layer_structs(self, stages):
        """Per-stage lists of layers as one list of ``jax.ShapeDtypeStruct`` per layer, where
        ``place`` puts them: on its stage's devices (split as ``param_specs`` says), or on the
        first device."""
        if self.mesh is None:
            return [self.structs(layer) for stage in stages for layer in stage]
        layouts = shard_moves.stage_layouts(self, stages)
        shardings = [shard_moves.layer_shardings(self, s, lay) for s, lay in enumerate(layouts)]
        return [
            layer
            for stage, sh in zip(stages, shardings, strict=True)
            for layer in jax.tree.map(_struct, stage, sh)
        ]

    def train(self, grad, table, boundaries, xs, runner, stats_layouts, param_specs):
        """One training step's slots (:mod:`~pipejax._src.training.slots`): on the mesh's tick
        loop, or the stages in turn on one device."""
        if self.mesh is None:
            return slots.on_one_device(grad, table, boundaries, xs, runner, stats_layouts)
        return slots.on_mesh(grad, table, boundaries, xs, runner, stats_layouts, param_specs)

    def stage_lead(self) -> tuple[Any, ...]:
        """The ``PartitionSpec`` entries of placed stage parameters' leading axes: ``(axis,)``
        for ``(S, ...)``; ``(None, axis)`` for the circular ``(repeats, n, ...)`` layout; ``(None,
        None)`` for several stages on one device."""
        if self.repeats == 1:
            return (self.axis_name,)
        return (None, self.axis_name) if self.num_devices > 1 else (None, None)

    def splits(self, params):
        """``param_specs`` checked against ``params``: per leaf (homogeneous) or per stage and leaf
        (heterogeneous), the splits over the non-stage axes; ``None`` without ``param_specs``."""
        if params is None or (self.param_specs is None and self.mesh is None):
            return None
        return self.kind.splits(self, params, self.param_specs)

    def check_data_splits(self, splits) -> None:
        """A dimension sharded over the (manual) data axis must be sharded over it alone."""
        if self.data_axis_name is None:
            return
        for stage_splits in splits:
            for leaf in stage_splits:
                for dim, axes, _ in leaf:
                    if self.data_axis_name in axes and len(axes) > 1:
                        raise ValueError(
                            f"`param_specs` shards a dimension {dim} over {axes}, mixing the data axis "
                            f"{self.data_axis_name!r} with other axes. Shard that dimension over the "
                            "data axis alone (FSDP), and another one over the others."
                        )

    def check_batch(self, x, context=None, targets=None) -> int:
        """``x``'s batch size, checked with ``context``'s and ``targets``' (before tracing)."""
        batch = microbatch.batch_size(x)
        if context is not None:
            microbatch.check_side_batch(context, batch)
        if targets is not None:
            loss.check_targets(targets, batch)
        return batch

    def micro_per_shard(self, plan: microbatch.Plan) -> int:
        """Micro-batches each data shard runs; raises unless the data axis divides their number."""
        batch = plan.batch
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

    def own_mesh(self, inputs) -> contextlib.AbstractContextManager:
        """The mesh context the pipeline's program runs in, when the caller set another with
        ``jax.set_mesh``: eagerly, its own mesh (``None``: no mesh context, one device), so that a
        pipeline on mesh A runs inside ``jax.set_mesh(B)``, and a ``mesh=None`` pipeline takes
        inputs committed to one device there. Traced inside the caller's program (``jax.jit``
        under the context), nothing can be switched: a pipeline on another mesh than the
        context's is refused with a message (JAX's ``shard_map`` needs the two to match)."""
        if not compat.mesh_context_set():
            return contextlib.nullcontext()
        context = jax.sharding.get_abstract_mesh()
        if self.mesh is not None and self.mesh.abstract_mesh == context:
            return contextlib.nullcontext()
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(inputs)):
            if self.mesh is None:  # traced into the caller's program, which places it
                return contextlib.nullcontext()
            raise ValueError(
                f"The pipeline runs on the mesh {_mesh_text(self.mesh.abstract_mesh)}, but it is "
                f"traced inside `jax.set_mesh` of another mesh, {_mesh_text(context)}; JAX's "
                "shard_map needs the context mesh to be the pipeline's. Trace the function that "
                "calls it (`jax.jit`) outside that block or inside `with jax.set_mesh(pipe.mesh):`, "
                "or build the pipeline with the context's mesh."
            )
        return jax.set_mesh(self.mesh)

    def commit(self, params, x, key, state):
        """Moves concrete inputs committed elsewhere onto the devices the pipeline runs on."""
        leaves = [a for a in jax.tree.leaves((params, x, key, state)) if options.is_concrete(a)]
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
                if options.is_concrete(a) and a.committed and a.sharding.device_set != mesh_devices:
                    return jax.device_put(a, sharding)
                return a

            return jax.tree.map(move, tree)

        def per_stage(tree):
            if not self.kind.stacks(tree):
                return put(tree, PartitionSpec())
            return put(tree, PartitionSpec(*stage_forms.stage_spec(self, tree)))

        return per_stage(params), put(x, PartitionSpec()), put(key, PartitionSpec()), per_stage(state)

    def cut(self, x, key, context=None, targets=None, *, stream=True) -> Cut:
        """The per-call plan (:class:`Cut`), computed once per call or training step: the batch
        cut into micro-batches, with ``context`` and ``targets`` cut alike.

        A batch sharded with Explicit axes cannot be cut up in place, except one split into whole
        micro-batches over the data axis, or (``stream``, the forward call) over the stage axis,
        which streams it to stage 0; anything else is replicated first.
        """
        p = microbatch.plan(microbatch.batch_size(x), self.chunks)
        if context is not None:
            microbatch.check_side_batch(context, p.batch)
        num_micro = self.micro_per_shard(p)
        data = PartitionSpec(self.data_axis_name) if self.data_axis_name and not p.padding else None
        keep = data if stream else None
        if stream and self.mesh is not None and not self.data_axis_name and not p.padding:
            keep = PartitionSpec(self.axis_name) if num_micro % self.num_devices == 0 else None
        xs = microbatch.cut(compat.replicate(x, keep=keep), p)
        cs = (
            None
            if context is None
            else microbatch.cut(compat.replicate(context, keep=data if stream else None), p)
        )
        ts = None if targets is None else microbatch.cut(compat.replicate(targets), p)
        key_struct = None
        if key is not None:
            lead = (p.micro_size,) if self.per_example_keys else ()
            key_struct = jax.ShapeDtypeStruct(lead + key.shape, key.dtype)
        return Cut(p, num_micro, xs, microbatch.row_mask(p), cs, ts, key_struct)

    def returned(self, y, stats, aux):
        """What a call returns: ``y``, ``(y, stats)``, ``(y, aux)`` or ``(y, stats, aux)``."""
        out = (y,) + ((stats,) if self.stateful else ()) + ((aux,) if self.aux is not None else ())
        return out if len(out) > 1 else y

    def forward(self, params, x, key, state, context=None):
        """``(y, stats, aux (m, ...) per stage, mask bool[m, b])``: the forward loop's results,
        aux unreduced (``None`` when off)."""
        call = self.cut(x, key, context)
        plan, xs, cs, key_struct = call.plan, call.xs, call.cs, call.key_struct
        mask = call.mask if self.stateful else None  # stateless stages take no mask
        schedule = self.table(call)
        splits = self.splits(params)
        params = stage_forms.tie(self, params)  # tied copies: one weight to autodiff, same values
        params, state = self.runner_form(params, splits), self.runner_form(state)
        param_specs = self.engine_specs(params, splits)
        cfg = engine.Config(
            self.stages,
            self.stateful,
            self.per_example_keys,
            self.checkpoint,
            self.axis_name,
            self.data_axis_name,
            inner_axes=param_specs is not None,
            aux=self.aux is not None,
        )
        local = self.mesh is None
        boundaries, stats, xs = self.kind.boundaries(self, params, state, xs, key_struct, cs)
        stages, params, state = self.kind.forward_stages(self, cfg, params, state, boundaries, stats, local)
        if local:
            devices = engine.LocalDevices(cfg, stacked=self.homogeneous)
        else:
            devices = engine.MeshDevices(cfg, self.mesh, self.repeats, self.data_size, param_specs)
        ys, stats = engine.run(
            cfg, devices, stages, schedule, engine.Inputs(params, state, xs, (mask, cs), key)
        )
        ys = boundaries[-1].retype(ys)  # the weak types of the last stage's output
        if plan.padding:  # dropping padding rows cuts across a data axis's Explicit sharding
            ys = compat.replicate(ys)
        y = microbatch.merge(ys, plan)
        stats, aux = aux_outputs.split(stats, self.stateful, self.aux is not None, self.kind)
        return y, stats, aux, call.mask


class Cut(NamedTuple):
    """The per-call plan: what one forward call or training step runs (all but the arrays
    static)."""

    plan: microbatch.Plan  # how the mini-batch is cut
    num_micro: int  # micro-batches each data shard runs
    xs: Any  # x cut into micro-batches: leaves (m, b, ...)
    mask: jax.Array  # bool[m, b]: the real rows (False: padding of an uneven last micro-batch)
    cs: Any  # context cut alike, or None
    ts: Any  # targets cut alike (training steps), or None
    key_struct: Any  # the type of the key a stage receives, or None without a key


def _struct(a, sharding):
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=sharding)


def _mesh_text(mesh) -> str:
    """``{'stage': 4} (Explicit)``: a mesh's axes and their types, for messages."""
    types = ", ".join(sorted({t.name for t in mesh.axis_types}))
    return f"{dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))} ({types})"
