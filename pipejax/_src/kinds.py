"""The two stage kinds, each one object that owns everything that differs between them.

A pipeline's stages are **homogeneous** (:data:`HOMOGENEOUS`: one stage function, every
parameter and state leaf stacked on a leading stage axis) or **heterogeneous**
(:data:`HETEROGENEOUS`: a function, a parameter pytree and an activation type per stage; on a
mesh the parameters travel packed as a :class:`~pipejax._src.params.placement.StageParams`).
The plan holds its kind (:attr:`pipejax._src.plan.Plan.kind`), chosen once by :func:`of`; the
rest of the library asks the kind and never which kind it is. A kind owns:

- the forms of ``params`` and ``state``: their checks (:meth:`check_params`), ``param_specs``'
  splits (:meth:`splits`), the engine's form (:meth:`local_form`, :meth:`mesh_form`), one stage's
  parameters (:meth:`stage_params`), placement (:meth:`pack`) and the tied-weight view
  (:meth:`tie_view`);
- boundary inference (:meth:`boundaries`) and the engine's stage object of a forward call
  (:meth:`forward_stages`) or a training step (:meth:`mesh_training`), which dispatch the stages;
- the one-device tables and rows (:meth:`local_table`, :meth:`row`, :meth:`add_row`);
- the per-(stage, micro-batch) records (stats and aux outputs): stacked ``(S, m, ...)`` or one
  ``(m, ...)`` pytree per stage (:meth:`unzip`, :attr:`micro_axis`, :meth:`record_groups`).

The engine's per-call stage objects (:class:`pipejax._src.engine.Homogeneous`,
:class:`pipejax._src.engine.Heterogeneous`) are built here and own what a tick runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pipejax._src import checks, compat, engine
from pipejax._src.engine import boundaries as bnd
from pipejax._src.params import forms, placement
from pipejax._src.params.placement import StageParams
from pipejax._src.schedules import tables as sched


class HomogeneousKind:
    """One stage function; parameters, state and records stacked on a leading stage axis."""

    name = "homogeneous"
    micro_axis = 1  # the micro-batch axis of a record: (S, m, ...)

    # -- parameter forms --------------------------------------------------------------------

    def stacks(self, tree) -> bool:
        """Whether ``tree`` carries the stages on leading axes (every form of this kind does)."""
        return True

    def check_params(self, params, pipe, name) -> None:
        """The leaves stacked on the stage axis, ``(S, ...)`` or as ``place`` lays them out."""
        n = pipe.num_stages
        if isinstance(params, StageParams):
            raise TypeError(
                f"`{name}` is a StageParams (packed heterogeneous stages), but this pipeline "
                f"has homogeneous stages; pass `{name}` stacked on a leading stage axis."
            )
        leaves, _ = jax.tree_util.tree_flatten_with_path(params)
        lead, placed = forms.stage_lead(pipe, params), forms.placed_layouts(pipe)
        for path, leaf in leaves:
            shape = jnp.shape(leaf)
            if tuple(shape[: len(lead)]) != lead:
                raise ValueError(
                    f"Homogeneous stages take `{name}` stacked on a leading stage axis of size "
                    f"{n}{placed}, but `{name}` leaf {jax.tree_util.keystr(path) or '<root>'} has "
                    f"shape {shape}. Stack the per-stage values, e.g. "
                    f"`jax.tree.map(lambda *p: jnp.stack(p), *per_stage_{name})`; every leaf alike."
                )

    def splits(self, pipe, params, specs):
        """``param_specs`` (one pytree prefix for every stage) as per-leaf splits; ``None``
        without them."""
        if specs is None:
            return None
        lead = len(forms.stage_lead(pipe, params))
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[lead:], jnp.result_type(a)), params)
        splits = placement.leaf_splits(specs, one, pipe.mesh, pipe.axis_name, "param_specs")
        pipe.check_data_splits([splits])
        return splits

    def local_form(self, pipe, tree):
        """The engine's form on one device: leaves stacked stage-major, ``(S, ...)``."""
        return forms.stage_major(pipe, tree)

    def mesh_form(self, pipe, tree, splits=None):
        """The engine's form on a mesh: ``(S, ...)``, or ``(v, n, ...)`` on a circular mesh."""
        return forms.mesh_layout(pipe, tree)

    def map_placed(self, fn, params, specs):
        """``fn(leaf, spec)`` over placed ``params`` and their specs."""
        return jax.tree.map(fn, params, specs)

    def pack(self, params, splits):
        """``params`` as ``place`` puts them on the devices (stacked already)."""
        return params

    def stage_params(self, pipe, params, s: int):
        at = forms.stage_at(pipe, params, s)
        # (an index across an Explicit stage axis is refused: the stage, replicated)
        return jax.tree.map(lambda a: compat.replicate(a)[at], params)

    def tie_view(self, pipe, params):
        return forms._Stacked(pipe, params)

    def stage_state(self, state, stage, s):
        """The state of stage ``s`` (traced): row ``s`` of the stacked state."""
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, s, keepdims=False), state)

    # -- boundaries and the engine's stage objects ------------------------------------------

    def boundaries(self, pipe, params, state, xs, key_struct, cs):
        """``(boundaries, stats layout, xs)``: one activation type, ``x`` cast to it."""
        boundaries, stats = bnd.homogeneous(pipe, params, state, xs, key_struct, cs)
        return boundaries, stats, boundaries[0].cast(xs)

    def forward_stages(self, pipe, cfg, params, state, boundaries, stats, local):
        """``(engine stage object, params, state)`` of a forward call."""
        devices = pipe.num_stages if local else pipe.num_devices
        return engine.Homogeneous(cfg, boundaries, stats, devices, local), params, state

    def mesh_training(self, pipe, cfg, boundaries, stats_layouts, runner, variant):
        """``(stages, variants, index, parameter rows)`` of a training step on a mesh: one stage
        function, so one branch per role, the (first, last) pairs that occur."""
        S, fn = pipe.num_stages, pipe.stages[0]
        roles = sorted({(t == 0, t == S - 1) for t in range(S)}, reverse=True)
        variants = [
            variant(fn, first, last, lambda p: p, boundaries[0], boundaries[0]) for first, last in roles
        ]
        index = np.array([roles.index((t == 0, t == S - 1)) for t in range(S)])
        stages = engine.Homogeneous(cfg, boundaries, stats_layouts, pipe.num_devices, local=False)
        return stages, variants, index, runner

    def grads_like(self, runner, grads):
        return grads

    # -- one device -------------------------------------------------------------------------

    def local_table(self, num_stages, num_micro):
        return sched.one_device(num_stages, num_micro)

    def local_rows(self, runner):
        return runner  # stacked (S, ...)

    def row(self, params, s: int):
        """Stage ``s``'s parameters at a static index."""
        return jax.tree.map(lambda a: a[s], params)

    def add_row(self, acc, s: int, delta):
        return jax.tree.map(lambda a, t: a.at[s].add(t.astype(a.dtype)), acc, delta)

    def stage_layouts(self, stats_layouts, num_stages):
        return [stats_layouts] * num_stages

    def stack_records(self, stats):
        """Per-stage records of the one-device loop, stacked ``(S, m, ...)``."""
        return jax.tree.map(lambda *a: jnp.stack(a), *stats)

    # -- records ----------------------------------------------------------------------------

    def unzip(self, stats):
        """Records of ``(stats, aux)`` pairs -> ``(stats, aux)``."""
        return stats[0], stats[1]

    def record_groups(self, aux):
        """``[(records, over)]``: the stacked records, and how a function of one (stage,
        micro-batch) and its row mask maps over them."""
        over = lambda f: jax.vmap(jax.vmap(f, (0, 0)), (0, None))
        return [(aux, over)]


class HeterogeneousKind:
    """A stage function, parameter pytree and activation type per stage."""

    name = "heterogeneous"
    micro_axis = 0  # the micro-batch axis of a stage's record: (m, ...)

    # -- parameter forms --------------------------------------------------------------------

    def stacks(self, tree) -> bool:
        """Whether ``tree`` carries the stages on leading axes (a packed StageParams)."""
        return isinstance(tree, StageParams)

    def check_params(self, params, pipe, name) -> None:
        """A StageParams of the pipeline's stages, or a list with one pytree per stage."""
        n = pipe.num_stages
        if isinstance(params, StageParams):
            if params.num_stages != n:
                raise ValueError(
                    f"`{name}` packs {params.num_stages} stages, but the pipeline has {n} stages. Pack "
                    f"one entry per stage with this pipeline's `place` (`apply.place(per_stage_{name})`, "
                    f"a list of {n} pytrees), or unpack the StageParams (`{name}.unpack()`) and fix "
                    "its list of stages."
                )
            return
        what = "parameter" if name == "params" else name
        checks.sequence(
            params,
            name,
            f"one {what} pytree per stage ({n} stages)",
            f" Wrap a single stage's {what} in a list.",
        )
        if len(params) != n:
            raise ValueError(
                f"`{name}` has {len(params)} {'entry' if len(params) == 1 else 'entries'} but the "
                f"pipeline has {n} stages; pass exactly one "
                f"{what} pytree per stage (use None or {{}} for a stage without any)."
            )

    def splits(self, pipe, params, specs):
        """``param_specs`` (one pytree prefix per stage) as per-stage, per-leaf splits; a
        StageParams must have been packed with the same. Without ``param_specs`` (on a mesh), the
        splits a placed StageParams was packed with, or ``None``."""
        if specs is None:
            if not isinstance(params, StageParams):
                return None
            given = [lay.leaf_splits() for lay in params.layouts]
            return given if any(any(leaf) for leaf in given) else None
        if (
            isinstance(specs, (str, bytes))
            or not isinstance(specs, Sequence)
            or len(specs) != pipe.num_stages
        ):
            raise ValueError(
                f"Heterogeneous stages take `param_specs` as a list with one entry per stage "
                f"({pipe.num_stages}), each a pytree prefix of that stage's parameters with "
                f"PartitionSpec leaves (or None); got {type(specs).__name__}"
                + (f" of length {len(specs)}" if isinstance(specs, Sequence) else "")
                + "."
            )
        packed = isinstance(params, StageParams)
        per_stage = params.unpacked_structs() if packed else params
        splits = [
            placement.leaf_splits(sp, p, pipe.mesh, pipe.axis_name, f"param_specs[{i}]")
            for i, (sp, p) in enumerate(zip(specs, per_stage, strict=True))
        ]
        pipe.check_data_splits(splits)
        if packed and [tuple(sp) for sp in splits] != [lay.leaf_splits() for lay in params.layouts]:
            raise ValueError(
                "`params` is a StageParams packed with other parameter shardings than this "
                "pipeline's `param_specs`; place the per-stage parameters with this pipeline "
                "(`apply.place(params)`), or unpack them first (`params.unpack()`)."
            )
        return splits

    def local_form(self, pipe, tree):
        """The engine's form on one device: a list of per-stage pytrees (each virtual device
        calls its own stage)."""
        if tree is None:
            return [None] * pipe.num_stages
        return forms.stage_major(pipe, tree).unpack() if isinstance(tree, StageParams) else list(tree)

    def mesh_form(self, pipe, tree, splits=None):
        """The engine's form on a mesh: a StageParams, laid out as stacked stages are."""
        if tree is None:
            tree = [None] * pipe.num_stages
        tree = tree if isinstance(tree, StageParams) else placement.pack(tree, splits)
        return forms.mesh_layout(pipe, tree)

    def map_placed(self, fn, params, specs):
        """``fn(buffer, spec)`` over a placed StageParams' buffers and their specs."""
        buffers = tuple(fn(b, sp) for b, sp in zip(params.buffers, specs, strict=True))
        return StageParams(buffers, params.container, params.layouts)

    def pack(self, params, splits):
        """``params`` packed as ``place`` puts them on the devices."""
        return params if isinstance(params, StageParams) else placement.pack(params, splits)

    def stage_params(self, pipe, params, s: int):
        return params.stage(s) if isinstance(params, StageParams) else params[s]

    def tie_view(self, pipe, params):
        return (
            forms._Packed(pipe, params) if isinstance(params, StageParams) else forms._PerStage(pipe, params)
        )

    def stage_state(self, state, stage, s):
        """The state of stage ``stage`` (static): its own entry."""
        return state[stage]

    # -- boundaries and the engine's stage objects ------------------------------------------

    def boundaries(self, pipe, params, state, xs, key_struct, cs):
        """``(boundaries, stats layouts, xs)``: each stage's input and output types."""
        p_structs, st_structs = self.stage_structs(pipe, params), self.stage_structs(pipe, state)
        boundaries, stats = bnd.heterogeneous(pipe, p_structs, st_structs, xs, key_struct, cs)
        return boundaries, stats, xs

    def stage_structs(self, pipe, tree):
        """Each stage's types of ``params`` or ``state`` (a list or a StageParams; ``None``: no
        state, ``[None] * S``)."""
        if isinstance(tree, StageParams):
            return tree.unpacked_structs()
        if tree is None:
            return [None] * pipe.num_stages
        return [bnd.struct(t) for t in tree]

    def forward_stages(self, pipe, cfg, params, state, boundaries, stats, local):
        """``(engine stage object, params, state)`` of a forward call: on a mesh the packed
        buffers, dispatched by one ``lax.switch``; without one every stage is a column of its own
        (see ``engine.LocalDevices``)."""
        if local:
            stages = engine.Heterogeneous(cfg, boundaries, stats, None, None, pipe.num_stages, False)
            return stages, params, state
        stages = engine.Heterogeneous(
            cfg, boundaries, stats, params.layouts, state.layouts, pipe.num_devices, True
        )
        return stages, params.buffers, state.buffers

    def mesh_training(self, pipe, cfg, boundaries, stats_layouts, runner, variant):
        """``(stages, variants, index, parameter rows)`` of a training step on a mesh: one
        branch per stage, unpacking its parameters from the device's packed row."""
        S = pipe.num_stages
        stages = engine.Heterogeneous(
            cfg, boundaries, stats_layouts, runner.layouts, None, pipe.num_devices, True
        )
        variants = [
            variant(
                pipe.stages[t],
                t == 0,
                t == S - 1,
                lambda prow, t=t: stages.pbox.unpack(prow, runner.layouts[t]),
                boundaries[t],
                boundaries[t + 1],
                t,
            )
            for t in range(S)
        ]
        return stages, variants, np.arange(S), runner.buffers

    def grads_like(self, runner, grads):
        """The packed buffers' cotangents as a StageParams like ``runner``."""
        return type(runner).tree_unflatten(runner.tree_flatten()[1], grads)

    # -- one device -------------------------------------------------------------------------

    def local_table(self, num_stages, num_micro):
        return sched.sequential(num_stages, num_micro)

    def local_rows(self, runner):
        return list(runner)  # one pytree per stage

    def row(self, params, s: int):
        return params[s]

    def add_row(self, acc, s: int, delta):
        return [
            jax.tree.map(lambda a, b: a + b.astype(a.dtype), a, delta) if t == s else a
            for t, a in enumerate(acc)
        ]

    def stage_layouts(self, stats_layouts, num_stages):
        return stats_layouts

    def stack_records(self, stats):
        return stats  # one pytree per stage

    # -- records ----------------------------------------------------------------------------

    def unzip(self, stats):
        return [st for st, _ in stats], [a for _, a in stats]

    def record_groups(self, aux):
        over = lambda f: jax.vmap(f, (0, 0))
        return [(a, over) for a in aux]


HOMOGENEOUS = HomogeneousKind()
HETEROGENEOUS = HeterogeneousKind()
Kind = HomogeneousKind | HeterogeneousKind


def of(homogeneous: bool) -> Kind:
    """The kind of a pipeline's stages, decided once (:func:`pipejax._src.options.check_stages`)."""
    return HOMOGENEOUS if homogeneous else HETEROGENEOUS
