"""Stage parameters moved shard by shard between the pipeline's placement and the layer form:
each device's shard unpacked, converted and packed on its own devices, so no process touches
another's shards (see :mod:`~pipejax._src.params.layer_form`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipejax._src import compat
from pipejax._src.containers import Container, Layout
from pipejax._src.params import forms as stage_forms
from pipejax._src.params.placement import StageParams


def put(a, sharding):
    """``a`` on ``sharding`` (already there: unchanged, nothing moves)."""
    a = jnp.asarray(a) if not isinstance(a, jax.Array) else a
    if a.sharding.is_equivalent_to(sharding, a.ndim):
        return a
    return jax.device_put(a, sharding)


def reshard_local(a, shape, sharding):
    """``a`` reshaped to ``shape``, each device reshaping its own shard (no communication).

    ``sharding`` must give every device the shard that its shard of ``a`` reshapes to: true
    here, where the two leading axes merge (or split) and only the first is sharded.
    """
    pieces = []
    for shard in a.addressable_shards:
        local = sharding.shard_shape(shape)
        pieces.append(shard.data.reshape(local))
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def moved(a, shape, sharding):
    """``a`` reshaped to ``shape`` on ``sharding`` by XLA (device to device, on a mesh with Auto
    axes: Explicit axes refuse reshapes of sharded dimensions)."""
    auto = compat.auto_mesh(sharding.mesh)
    a = (
        jax.device_put(a, NamedSharding(auto, a.sharding.spec))
        if isinstance(a.sharding, NamedSharding)
        else a
    )
    out = jax.jit(lambda x: x.reshape(shape), out_shardings=NamedSharding(auto, sharding.spec))(a)
    return jax.device_put(out, sharding)


def stage_layouts(pipe, stages):
    structs = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), st) for st in stages
    ]
    splits = pipe.splits(structs)
    layouts = tuple(Layout.of(st) for st in structs)
    if splits is not None:
        layouts = tuple(
            lay._replace(splits=sp) if any(sp) else lay for lay, sp in zip(layouts, splits, strict=True)
        )
    return layouts


def _stage_mesh(mesh: Mesh, axis: str, d: int) -> Mesh:
    """The devices of stage coordinate ``d``: ``mesh`` with its stage axis cut to that one
    entry, Auto axes (a stage's packing reshapes dimensions sharded over its other axes)."""
    devices = np.take(mesh.devices, [d], axis=mesh.axis_names.index(axis))
    return compat.auto_mesh(Mesh(devices, mesh.axis_names))


def _coords(pipe, s):
    """Stage ``s``'s device coordinate on the stage axis, and its row there (circular)."""
    n = pipe.num_devices
    return (s % n, s // n) if pipe.repeats > 1 and n > 1 else (s, None)


def layer_shardings(pipe, s, layout):
    d, _ = _coords(pipe, s)
    mesh = _stage_mesh(pipe.mesh, pipe.axis_name, d)
    specs = [
        NamedSharding(mesh, PartitionSpec(*stage_forms.split_spec(split, len(shape))))
        for shape, split in zip(layout.shapes, layout.leaf_splits(), strict=True)
    ]
    return jax.tree.unflatten(layout.treedef, specs)


def _local(devices):
    return [d for d in devices if d.process_index == jax.process_index()]


def _stage_row(shard, d: int, r: int | None):
    """Stage ``d``'s row (``(1, ...)``) of a buffer's shard on one of its devices (``r``: the
    repeat, for a device-major ``(v, n, ...)`` buffer). A shard placed as the pipeline places it
    is that row already; one that holds more of the stage axis (a buffer that arrived replicated,
    as JAX 0.11 can leave a jitted result) is sliced at its offset."""
    data = shard.data if r is None else shard.data[r]
    start = shard.index[0 if r is None else 1].start or 0
    return data[d - start : d - start + 1]


def unpack_on_devices(pipe, params: StageParams):
    """Every stage's parameter pytree, unpacked on that stage's devices from their own shards."""
    major = any(params.device_major())
    stages = []
    for s, layout in enumerate(params.layouts):
        d, r = _coords(pipe, s)
        sub = _stage_mesh(pipe.mesh, pipe.axis_name, d)
        shardings = layer_shardings(pipe, s, layout)
        structs = jax.tree.map(
            lambda st, sh: jax.ShapeDtypeStruct(st.shape, st.dtype, sharding=sh), layout.structs(), shardings
        )
        mine = set(_local(sub.devices.flat))
        if not mine:  # another process's stage: an array of which this process holds nothing
            stages.append(
                jax.tree.map(
                    lambda a: jax.make_array_from_single_device_arrays(
                        a.shape, a.sharding, [], dtype=a.dtype
                    ),
                    structs,
                )
            )
            continue
        rows = []
        for b, spec in zip(params.buffers, params.container.slot_specs((pipe.axis_name,)), strict=True):
            row_shape = (1, *b.shape[2 if major else 1 :])
            sharding = NamedSharding(sub, spec)
            held = [sh for sh in b.addressable_shards if sh.device in mine]
            pieces = [_stage_row(sh, d, r if major else None) for sh in held]
            rows.append(jax.make_array_from_single_device_arrays(row_shape, sharding, pieces))
        unpack = jax.jit(
            lambda rows, layout=layout: params.container.unpack(tuple(x[0] for x in rows), layout),
            out_shardings=shardings,
        )
        stages.append(unpack(tuple(rows)))
    return stages


def pack_on_devices(pipe, stages):
    """The :class:`StageParams` ``pipe.place(stages)`` gives, packed stage by stage on each
    stage's own devices and assembled from those shards."""
    layouts = stage_layouts(pipe, stages)
    container = Container.for_layouts(layouts)
    lead = (pipe.axis_name,)
    rows = []  # per stage: its buffers' rows, (1, ...) on its devices
    for s, (stage, layout) in enumerate(zip(stages, layouts, strict=True)):
        d, _ = _coords(pipe, s)
        sub = _stage_mesh(pipe.mesh, pipe.axis_name, d)
        shardings = tuple(NamedSharding(sub, spec) for spec in container.slot_specs(lead))
        if not _local(sub.devices.flat):
            rows.append(None)
            continue
        stage = jax.tree.map(lambda a, sh: put(a, sh), stage, layer_shardings(pipe, s, layout))
        pack = jax.jit(
            lambda p, layout=layout: tuple(b[None] for b in container.pack(p, layout)),
            out_shardings=shardings,
        )
        rows.append(pack(stage))
    circular = stage_forms.places_device_major(pipe)
    lead_shape = (pipe.repeats, pipe.num_devices) if circular else (pipe.num_stages,)
    specs = container.slot_specs(pipe.stage_lead())
    buffers = []
    for k, (shape, spec) in enumerate(zip(container.slot_shapes(lead_shape), specs, strict=True)):
        sharding = NamedSharding(pipe.mesh, spec)
        pieces = []
        for device in sharding.addressable_devices:
            if circular:
                d = _stage_coord(pipe, device)
                stack = [_shard_on(rows[r * pipe.num_devices + d][k], device) for r in range(pipe.repeats)]
                pieces.append(jnp.stack(stack))  # (repeats, 1, ...): column d
            else:
                pieces.append(_shard_on(rows[_stage_coord(pipe, device)][k], device))
        buffers.append(jax.make_array_from_single_device_arrays(shape, sharding, pieces))
    return StageParams(tuple(buffers), container, layouts)


def _stage_coord(pipe, device):
    where = np.argwhere(pipe.mesh.devices == device)[0]
    return int(where[pipe.mesh.axis_names.index(pipe.axis_name)])


def _shard_on(a, device):
    (shard,) = [sh for sh in a.addressable_shards if sh.device == device]
    return shard.data
