"""The core both Flax adapters share: layers cut into stages, one pipeline over them, BatchNorm.

An adapter (Linen or NNX) supplies two things only:

* **layer ``l`` as a pure function**, ``run_layer(index, variables, x, key, mask, kwargs) -> (y,
  records)``: ``variables`` is ``{"params": p}`` (and ``"batch_stats"`` with deferred BatchNorm),
  ``key`` the layer's key (or ``None``), ``mask`` the micro-batch's row mask (``None`` without
  deferred BatchNorm), ``kwargs`` the keyword arguments of the layer's call, and ``records`` the
  :class:`SownMoments` of its training BatchNorm calls, keyed by the BatchNorm's path in the
  layer's ``batch_stats`` tree;
* **how updated variables are written back**: :meth:`Stack.updated_state` returns the new
  stage-laid-out statistics and the adapter stores them (a Linen variable, NNX ``BatchStat``s).

Everything else is here, once: the layers are grouped into stages by :func:`pipejax.partition`
(its balance checks), the stage functions are built from ``partition``'s stages (layer ``j`` of a
stage draws from ``pj.layer_key(stage_key, j)``), and :func:`pipejax.pipeline` runs them with
every pipeline option the adapter was given (``chunks``, ``checkpoint``, ``mesh``, ``schedule``,
``repeats``, ``data_axis_name``, ``per_example_keys``, ...) forwarded unchanged, so the
pipeline's own validation checks them and an option added to ``pj.pipeline`` reaches the adapters
without being declared again.

The pipelines (and their ``jax.jit``, and ``value_and_grad`` steps) are built once per
configuration and cached, for both adapters, by :func:`program`: so an eager call compiles on its
first call only, and :class:`Stack` (with its :class:`Options`) compares by value, so identically
built modules have equal NNX graph definitions and share the compiled programs.

A layer's keyword arguments (``kwargs``) come from two places: the Python flags of the call
(``deterministic=True``), fixed per layer (:meth:`Stack.pipeline`'s ``kwargs_per_layer``), and the
side inputs (``context={"decoder_mask": mask}``), batch-shaped arrays that :func:`pipejax.pipeline`
cuts into micro-batches with ``x`` and hands every stage as ``context=``. Each stage threads the
dict through its layers; layer ``l`` receives the entries named in ``context_per_layer[l]`` (those
its ``__call__`` accepts, :func:`route_context`) as keyword arguments, merged with its flags.

Randomness: stage ``s`` on micro-batch ``i`` receives ``pj.stage_key(key, i, s)`` from the
pipeline; layer ``j`` of that stage (``j`` counts from 0 inside the stage) draws from
``jax.random.fold_in(stage_key, j)``. With ``per_example_keys=True`` the stage receives one key per
row, and each layer runs row by row (``jax.vmap``) with its row's key, so random draws depend on the
example, not on ``chunks``.

Training (:meth:`Stack.value_and_grad`, the adapters' ``value_and_grad(loss_fn)``): the same
pipeline's :meth:`pipejax.Pipeline.value_and_grad`, so the schedules that own the backward pass
("1f1b", "zb-h1", "interleaved-1f1b") run the layers with the keys, flags and side inputs of the
forward call; an adapter converts only its parameters in and its gradients out.

Deferred BatchNorm (``deferred_batch_norm=True``): the pipeline runs with stage state. A stage
holds its layers' running statistics as ``state``; a BatchNorm layer in training normalises its
micro-batch with that micro-batch's own statistics over its real rows (the ``mask`` the stage
receives) and records the micro-batch's :class:`~pipejax.Moments` as a :class:`SownMoments`;
after the call :meth:`Stack.updated_state` updates the running statistics once, from the moments
of all micro-batches merged (:func:`pipejax.batch_norm_update`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipejax._src import checks
from pipejax._src.balance import partition
from pipejax._src.batchnorm import BatchStats, Moments, batch_norm_update
from pipejax._src.batchnorm import moments as moments_of
from pipejax._src.pipeline import Pipeline, pipeline
from pipejax._src.placement import StageParams

PyTree = Any

# Arguments of pj.pipeline that the adapters set themselves (not pipeline options of theirs).
_OWN = {
    "stages": "the adapters build the stage functions from `layers`",
    "num_stages": "give the adapter's own `num_stages=` (an even split of the layers) or `balance=`",
    "stateful": "the adapters run with stage state exactly when `deferred_batch_norm=True`",
}


class RunLayer(Protocol):
    """Layer ``index`` as a pure function: ``(y, records, sown)`` from its variables, input, key and
    kwargs; ``sown``: the values the layer sowed (NNX ``nnx.Intermediate``, Linen's
    ``'intermediates'`` collection) as a dict, ``{}`` when none.

    It compares and hashes by value (a frozen dataclass of static configuration, no arrays): it is
    part of the key under which :func:`program` caches the pipeline that runs it.
    """

    def __call__(
        self,
        index: int,
        variables: dict[str, PyTree],
        x: PyTree,
        key: jax.Array | None,
        mask: jax.Array | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[PyTree, dict[tuple[str, ...], SownMoments], PyTree]: ...


def pipeline_option_names() -> tuple[str, ...]:
    """The options of :func:`pipejax.pipeline` an adapter forwards (all but ``stages``, ...)."""
    return tuple(name for name in inspect.signature(pipeline).parameters if name not in _OWN)


def check_options(options: Mapping[str, Any], owner: str) -> Options:
    """``options`` as :class:`Options`, after checking that each names an option of :func:`pipejax.pipeline`.

    Raises:
      TypeError: for an argument that is not an option of ``pj.pipeline``, or one the adapter sets.
    """
    for name in options:
        if name in _OWN:
            raise TypeError(f"{owner} does not take `{name}`: {_OWN[name]}.")
        if name not in pipeline_option_names():
            raise TypeError(
                f"{owner} got the unknown argument `{name}`. Besides its own arguments it takes the "
                f"options of pj.pipeline: {', '.join(pipeline_option_names())}."
            )
    return Options(options)


class Options(Mapping[str, Any]):
    """An adapter's options of :func:`pipejax.pipeline`: a read-only mapping equal by value.

    NNX keeps it in the module's graph definition, and ``nnx.jit`` keys its cache on that, so two
    identically built modules must give equal options with equal hashes (a ``dict`` has no hash).
    The value is the options' pytree structure and leaves: meshes and ``PartitionSpec`` objects
    compare by value, a checkpoint policy (a callable) by identity. Hashing raises ``TypeError``
    for an unhashable leaf, as for a tuple holding one.
    """

    def __init__(self, options: Mapping[str, Any]):
        self._options = dict(options)

    def __getitem__(self, name: str) -> Any:
        return self._options[name]

    def __iter__(self):
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def __repr__(self) -> str:
        return repr(self._options)

    def _value(self) -> tuple[Any, ...]:
        leaves, treedef = jax.tree.flatten(self._options, is_leaf=_is_spec)
        return treedef, tuple(leaves)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Options):
            return self._value() == other._value()
        return super().__eq__(other)  # against a plain dict: the same items

    def __hash__(self) -> int:
        return hash(self._value())


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def stage_sizes(num_layers: int, balance: Sequence[int] | None, num_stages: int | None) -> tuple[int, ...]:
    """The number of layers of each stage, from ``balance`` or ``num_stages`` (exactly one of them).

    ``balance`` is checked by :func:`pipejax.partition`; ``num_stages`` splits as evenly as
    possible, the first ``num_layers mod num_stages`` stages taking one layer more.

    Raises:
      TypeError: if neither or both of ``balance`` and ``num_stages`` are given, or either has the
        wrong type.
      ValueError: for a ``balance`` that :func:`pipejax.partition` rejects, or a ``num_stages``
        outside ``[1, num_layers]``.
    """
    if (balance is None) == (num_stages is None):
        given = "both" if balance is not None else "neither"
        raise TypeError(
            f"Pass exactly one of `balance` (layers per stage, e.g. balance=[2, 2]) and "
            f"`num_stages` (an even split), but {given} was given."
        )
    if balance is not None:
        return partition([_no_layer] * num_layers, balance).balance
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"`num_stages` must be an int, but got {type(num_stages).__name__} {num_stages!r}.")
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"`num_stages` must be between 1 and the number of layers ({num_layers}), since "
            f"every stage needs at least one layer, but got {num_stages}."
        )
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def _no_layer(params, x, key):  # a placeholder layer: partition() checks `balance` against the count
    raise AssertionError("placeholder layer called")  # internal: never part of a pipeline


class Stack:
    """Layers cut into stages, and the pipelines that run them (see the module docstring).

    Equal (and of equal hash) when built from equal arguments, so identically built adapters have
    equal NNX graph definitions and share :func:`program`'s cached pipelines.

    Args:
      num_layers: the number of layers.
      balance, num_stages: how to cut them (exactly one; see :func:`stage_sizes`).
      deferred_batch_norm: run with stage state (BatchNorm statistics).
      unbiased_variance: the variance the running statistics track (``M2 / (N - 1)`` or ``M2 / N``).
      options: options of :func:`pipejax.pipeline`, forwarded unchanged (checked by it).
      owner: the adapter's name, for messages.
      carry: which part of each layer's output is the activation passed on (:func:`check_carry`,
        :func:`select_carry`); ``None``: the whole output.
    """

    def __init__(
        self,
        num_layers: int,
        balance: Sequence[int] | None,
        num_stages: int | None,
        *,
        deferred_batch_norm: bool,
        unbiased_variance: bool,
        options: Mapping[str, Any],
        owner: str,
        carry: Carry = None,
        leaf_keys: tuple[str, ...] = (),
    ):
        for name, value in (
            ("deferred_batch_norm", deferred_batch_norm),
            ("unbiased_variance", unbiased_variance),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, but got {value!r}.")
        self.sizes = stage_sizes(num_layers, balance, num_stages)
        self.options = check_options(options, owner)
        if self.options.get("tied") is not None:  # layers' terms -> the pipeline's stages' terms
            tied = layer_tied(self.options["tied"], self.sizes, owner, leaf_keys)
            self.options = Options({**self.options, "tied": tied})
        self.deferred = deferred_batch_norm
        self.unbiased = unbiased_variance
        self.owner = owner
        self.carry = check_carry(carry, owner)
        # The pipeline's own validation of every option (mesh, schedule, repeats, data axis, ...).
        self.placer = pipeline([_no_stage] * len(self.sizes), stateful=self.deferred, **self.options)
        self.aux = self.placer.aux  # collect layers' auxiliary outputs and sown values
        if self.aux is not None and self.placer.per_example_keys:
            raise NotImplementedError(
                f"{owner} with `aux={self.aux!r}` does not support `per_example_keys=True`: "
                "per-example keys run each layer row by row, and aux outputs are values of the "
                "whole micro-batch. Drop one of the two."
            )
        if self.deferred and self.placer.per_example_keys:
            raise NotImplementedError(
                f"{owner} with `deferred_batch_norm=True` does not support `per_example_keys=True`: "
                "per-example keys run each layer row by row, and BatchNorm needs the whole "
                "micro-batch. Drop one of the two."
            )

    def _value(self) -> tuple[Any, ...]:
        return self.sizes, self.options, self.deferred, self.unbiased, self.owner, self.carry

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stack) and self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())

    def __repr__(self) -> str:
        return f"Stack(sizes={self.sizes}, options={self.options!r}, deferred_batch_norm={self.deferred})"

    @property
    def num_layers(self) -> int:
        return sum(self.sizes)

    @property
    def firsts(self) -> tuple[int, ...]:
        """The index of each stage's first layer."""
        return tuple(sum(self.sizes[:s]) for s in range(len(self.sizes)))

    def group(self, items: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Per-layer items -> per-stage tuples."""
        return [tuple(g) for g in partition([_no_layer] * self.num_layers, self.sizes).group(list(items))]

    def place(self, per_layer: Sequence[PyTree], specs: Sequence[PyTree] | None = None) -> StageParams:
        """Per-layer pytrees laid out for the pipeline (device ``s`` stores stage ``s``'s).

        ``specs``: per layer, a ``PartitionSpec`` per parameter leaf over the mesh's other axes
        (the layers' own sharding metadata, see :func:`layer_specs`), or ``None``: the pipeline's
        ``param_specs`` option, if any.
        """
        if specs is None:
            return self.placer.place(self.group(per_layer))
        options = dict(self.options, param_specs=self.group(specs))
        return pipeline([_no_stage] * len(self.sizes), stateful=self.deferred, **options).place(
            self.group(per_layer)
        )

    def unpack(self, packed: StageParams) -> list[PyTree]:
        """The per-layer pytrees of ``packed`` (what :meth:`place` took), in layer order."""
        return [p for stage in _unpack(packed) for p in stage]

    def replicated(self, tree: PyTree) -> PyTree:
        """``tree`` replicated over the pipeline's mesh (unchanged without a mesh).

        What an adapter creates besides the stage-sharded parameters (rng streams, counters) is
        placed so, because a jitted train step returns it replicated over the mesh: created on
        one device, it would make the second step compile again.
        """
        mesh = self.placer.mesh
        if mesh is None:
            return tree
        return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))

    def spec(self, ndim: int = 2) -> PartitionSpec:
        """The partition spec of a placed buffer: ``P(stage, None)`` (``P(None, stage, None)`` circular)."""
        pipe = self.placer
        if pipe.mesh is None:
            return PartitionSpec()
        if pipe.repeats > 1 and ndim == 3:
            return PartitionSpec(None, pipe.axis_name, None)
        return PartitionSpec(pipe.axis_name, *([None] * (ndim - 1)))

    def pipeline(
        self,
        run_layer: RunLayer,
        kwargs_per_layer: Sequence[Mapping[str, Any]] | None = None,
        context_per_layer: Sequence[Sequence[str]] | None = None,
    ) -> Pipeline:
        """The pipeline whose stage ``s`` runs layers ``firsts[s]...`` with :func:`pipejax.partition`.

        Built once per configuration and shared (:func:`program`), so its ``jax.jit`` compiles
        once, not at every call of the adapter.

        Args:
          run_layer: layer ``l`` as a pure function (see :class:`RunLayer`).
          kwargs_per_layer: the keyword arguments of each layer's call (``None``: none).
          context_per_layer: the names of the side inputs each layer receives as keyword arguments
            (``None``: none). Call the pipeline with ``context=`` a dict holding them all.
        """
        return program(self, run_layer, kwargs_per_layer, context_per_layer)

    def build(
        self,
        run_layer: RunLayer,
        kwargs_per_layer: Sequence[Mapping[str, Any]] | None,
        context_per_layer: Sequence[Sequence[str]] | None,
    ) -> Pipeline:
        """A new pipeline (and a new ``jax.jit``) as :meth:`pipeline` describes it; see :func:`program`."""
        if kwargs_per_layer is None:
            kwargs_per_layer = [{}] * self.num_layers
        if context_per_layer is None:
            context_per_layer = [()] * self.num_layers
        collect = self.aux is not None
        steps = [
            _layer_step(run_layer, i, kwargs_per_layer[i], tuple(context_per_layer[i]), self.carry, collect)
            for i in range(self.num_layers)
        ]
        part = partition(steps, self.sizes)
        wrap = _stateful if self.deferred else _stateless
        stages = [wrap(st, collect) for st in part.stages]
        return pipeline(stages, stateful=self.deferred, **self.options)

    def layer_aux(self, aux_per_stage: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The pipeline's aux (per stage, a tuple over its layers) as a list over all layers."""
        return [a for stage in aux_per_stage for a in stage]

    def check_aux_loss(self, aux_loss: Any) -> Any:
        """``aux_loss`` (per layer) checked, as the stage-level function the pipeline applies: the
        sum of ``aux_loss(a)`` over the stage's layers whose aux ``a`` holds arrays (a ``None``
        result adds nothing)."""
        if aux_loss is None:
            return None
        if not callable(aux_loss):
            raise TypeError(
                f"`aux_loss` of {self.owner}.value_and_grad must be a callable `aux_loss(aux) -> "
                "scalar`, applied to the aux outputs of each layer and micro-batch, but got "
                f"{type(aux_loss).__name__} {aux_loss!r}."
            )
        if self.aux is None:
            raise ValueError(
                f"`aux_loss` was given, but {self.owner} was built without `aux=`, so it collects no "
                "auxiliary outputs of its layers. Build it with `aux='mean'` (or 'sum', 'stack'), "
                "or drop `aux_loss`."
            )
        return _StageAuxLoss(aux_loss)

    def check_trainable(self, loss_fn: Any) -> None:
        """Raises for what the adapters' ``value_and_grad`` does not support (see :meth:`value_and_grad`).

        Raises:
          TypeError: if ``loss_fn`` is not callable.
          ValueError: with ``deferred_batch_norm=True`` (the step returns no statistics).
        """
        owner = self.owner
        signature = "loss_fn(outputs, targets) -> losses"
        checks.check_callable(loss_fn, "loss_fn", signature, f"{owner}.value_and_grad")
        if self.deferred:
            raise ValueError(
                f"{owner}.value_and_grad does not support `deferred_batch_norm=True`: it returns the "
                "loss and the gradients only, and a BatchNorm in training must also update its running "
                "statistics. Train this model with `jax.value_and_grad` of the module's call and "
                "schedule='gpipe' or 'circular' (Linen: `apply(..., mutable=['batch_stats'])`; NNX: "
                "`nnx.value_and_grad`), or use a normalisation without state (LayerNorm, RMSNorm), "
                "which `value_and_grad` trains with every schedule (1f1b, zb-h1, interleaved-1f1b)."
            )

    def value_and_grad(
        self,
        run_layer: RunLayer,
        loss_fn: Callable[[PyTree, PyTree], jax.Array],
        kwargs_per_layer: Sequence[Mapping[str, Any]],
        context_per_layer: Sequence[Sequence[str]] | None,
        aux_loss: Any = None,
    ) -> Callable[..., tuple[jax.Array, StageParams]]:
        """``f(params, x, targets, key, context=None) -> (loss, grads)``: a training step of the
        layers, run by the pipeline's schedule (the core of both adapters' ``value_and_grad``).

        ``params`` is the adapter's :class:`~pipejax.StageParams` and ``grads`` has its form;
        ``loss_fn(outputs, targets)`` gives one loss per example and the loss is their mean over
        the batch (padding rows of an uneven batch excluded). It is
        :meth:`pipejax.Pipeline.value_and_grad` of the pipeline :meth:`pipeline` builds, the one
        the adapter's forward call runs: with ``schedule="gpipe"`` or ``"circular"``,
        ``jax.value_and_grad`` of that call; with a training schedule (``"1f1b"``, ``"zb-h1"``,
        ``"interleaved-1f1b"``) one program that runs the schedule's forward and backward slots.
        Both give each layer the keys and side inputs of the forward call.

        The adapters run :meth:`check_trainable` once, when ``value_and_grad(loss_fn)`` is called,
        before building any step. The step is built once per configuration and ``loss_fn`` (by
        identity) and shared (:func:`program`).

        Args:
          run_layer, kwargs_per_layer, context_per_layer: as for :meth:`pipeline`.
          loss_fn: ``loss_fn(outputs, targets) -> losses``, shape ``(batch,)``.
          aux_loss: what :meth:`check_aux_loss` returned, or ``None``. With ``aux=``, ``f``
            returns ``((loss, aux per layer), grads)``.
        """
        step = program(self, run_layer, kwargs_per_layer, context_per_layer, loss_fn, aux_loss)

        def f(params, x, targets, key, context=None):
            side = {} if context_per_layer is None else {"context": dict(context)}
            out, grads = step(params, x, targets, key, **side)
            if self.aux is None:
                return out, grads
            return (out[0], self.layer_aux(out[1])), grads

        return f

    def updated_state(self, state: StageParams, stats: Sequence[Any]) -> StageParams | None:
        """The running statistics updated once from the moments all micro-batches recorded.

        ``stats`` is what the stateful pipeline returned: per stage, per layer, the records of
        its BatchNorm calls stacked over the micro-batches. Returns ``None`` when no BatchNorm
        ran in training (nothing to update).
        """
        if not any(isinstance(t, SownMoments) for t in jax.tree.leaves(stats, is_leaf=_is_sown)):
            return None
        old = self.unpack(state)
        records = [r for stage in stats for r in stage]
        new = [_updated(st, rec, self.unbiased) for st, rec in zip(old, records, strict=True)]
        return self.place(new)


# --- the programs both adapters run, built once ------------------------------------------------

PROGRAM_CACHE_SIZE = 64  # configurations kept; the least recently used is dropped beyond this


def program(
    stack: Stack,
    run_layer: RunLayer,
    kwargs_per_layer: Sequence[Mapping[str, Any]] | None,
    context_per_layer: Sequence[Sequence[str]] | None,
    loss_fn: Callable[[PyTree, PyTree], jax.Array] | None = None,
    aux_loss: Any = None,
) -> Any:
    """The pipeline :meth:`Stack.build` makes (with ``loss_fn``: its ``value_and_grad`` step),
    built once per configuration and shared by every call of both adapters.

    A new :class:`~pipejax.Pipeline` has a new ``jax.jit``, which traces and compiles again; an
    adapter that built one per call would compile at every eager call (an evaluation loop: a
    compile per batch) and after every rebuild of the model. So the programs are cached here, the
    one cache of the Flax adapters, keyed on everything that changes the program: the ``stack``
    (stage sizes, every pipeline option, the mesh among them, the BatchNorm flags), the layers as
    pure functions (``run_layer``, which compares by value: Linen's unbound layer modules, NNX's
    graph definitions and call defaults), each layer's keyword arguments, the side inputs' names
    and ``loss_fn`` (by identity). Shapes, dtypes and shardings of the arguments are ``jax.jit``'s
    own cache's business.

    It is a ``functools.lru_cache`` of ``PROGRAM_CACHE_SIZE`` entries, not a weak dictionary: no
    adapter keeps what it was given (a Linen module is rebuilt at every ``apply``), so weak entries
    would die after each call. An entry holds configuration and compiled executables, no arrays of
    the model: the mesh, unbound Linen layers, NNX graph definitions, ``loss_fn`` (and whatever it
    closes over). A configuration with an unhashable part (a flag that is a list, a Linen layer
    with an unhashable attribute) is built for its call only, as it was before there was a cache.
    """
    kwargs = None
    if kwargs_per_layer is not None:
        kwargs = tuple(tuple(sorted(kw.items())) for kw in kwargs_per_layer)
    context = None if context_per_layer is None else tuple(tuple(names) for names in context_per_layer)
    return _lookup(stack, run_layer, kwargs, context, loss_fn, aux_loss)


def _lookup(*key: Any) -> Any:
    try:
        hash(key)
    except TypeError:  # an unhashable configuration: built for this call only
        return _build(*key)
    return _cached(*key)


def _build(stack: Stack, run_layer: RunLayer, kwargs: Any, context: Any, loss_fn: Any, aux_loss: Any) -> Any:
    if loss_fn is not None:
        forward = _lookup(stack, run_layer, kwargs, context, None, None)
        return forward.value_and_grad(loss_fn, aux_loss=aux_loss)
    return stack.build(run_layer, None if kwargs is None else [dict(kw) for kw in kwargs], context)


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _cached(*key: Any) -> Any:
    return _build(*key)


def on_mesh(tree: PyTree, mesh: Mesh) -> PyTree:
    """``tree`` with every array that is not on ``mesh`` moved onto it, replicated.

    A jitted train step returns the arrays it does not shard replicated over the mesh. Arrays
    that start on one device (parameters loaded from elsewhere, the embedding and head of a model
    built outside ``jax.set_mesh``, ``optimizer.init`` run outside it) therefore come back with
    another sharding, and the second step compiles again. Put the train state through this once
    before the first step: arrays already on the mesh (the stage-sharded pipeline parameters)
    are left as they are, so the first step's shardings are the steady-state ones.

    Args:
      tree: a pytree of arrays (an ``nnx.State`` too; Python scalars and numpy arrays are left
        alone, they are not committed to a device).
      mesh: the pipeline's mesh.

    Returns:
      ``tree`` with the same structure.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh`` (e.g. an axis name).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from pipejax.flax import on_mesh
      >>> mesh = jax.make_mesh((2,), ("stage",))
      >>> on_mesh({"w": jnp.ones(3)}, mesh)["w"].sharding.spec
      P()
    """
    if not isinstance(mesh, Mesh):
        named = isinstance(mesh, str)
        hint = " An axis name is not a mesh: pass the Mesh that axis belongs to." if named else ""
        raise TypeError(
            f"`mesh` of on_mesh must be a jax.sharding.Mesh (the pipeline's mesh, e.g. "
            f"`jax.make_mesh((2,), ('stage',))`), but got {type(mesh).__name__} {mesh!r}.{hint}"
        )
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())

    def put(a):
        if (
            isinstance(a, jax.Array)
            and not isinstance(a, jax.core.Tracer)
            and a.sharding.device_set != devices
        ):
            return jax.device_put(a, replicated)
        return a

    return jax.tree.map(put, tree)


def layer_tied(tied: Any, sizes: Sequence[int], owner: str, leaf_keys: tuple[str, ...]) -> tuple:
    """An adapter's ``tied=`` (groups of ``(layer, path)``: a layer's index and the copy's path in
    that layer's parameters) as :func:`pipejax.pipeline`'s (groups of ``(stage, path)``, a path
    in the stage's parameters: the layer's place in its stage, then the path, then
    ``leaf_keys``, e.g. NNX's ``value`` of a ``Param``).

    Raises:
      TypeError, ValueError, IndexError: the pipeline's own checks of the groups (:func:`options.check_tied`),
        in layers' terms, with a note; and for two copies in layers of one stage.
    """
    from pipejax._src import options as opts

    num_layers = sum(sizes)
    try:
        groups = opts.check_tied(tied, num_layers)
    except (TypeError, ValueError, IndexError) as err:
        err.add_note(
            f"{owner}'s `tied` names layers, not stages: each pair is `(layer, path)`, the layer's "
            f"index among the {num_layers} layers and the copy's path in that layer's parameters, "
            'e.g. `tied=[[(0, "embedding"), (5, "table")]]`.'
        )
        raise
    firsts = [sum(sizes[:s]) for s in range(len(sizes))]
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    out = []
    for g, group in enumerate(groups):
        stages = [stage_of[layer] for layer, _ in group]
        if len(set(stages)) < len(stages):
            raise ValueError(
                f"`tied[{g}]` of {owner} ties layers {[layer for layer, _ in group]}, but two of them "
                f"are in one stage (the stages hold layers {_ranges(sizes)}): a stage holds one copy "
                "of a tied weight. Let those layers share one module, or cut the stages between them "
                "(`balance=`)."
            )
        out.append(
            tuple(
                (stage_of[layer], (str(layer - firsts[stage_of[layer]]), *path, *leaf_keys))
                for layer, path in group
            )
        )
    return tuple(out)


def _ranges(sizes: Sequence[int]) -> str:
    firsts = [sum(sizes[:s]) for s in range(len(sizes))]
    return ", ".join(f"{a}-{a + n - 1}" if n > 1 else f"{a}" for a, n in zip(firsts, sizes, strict=True))


def restore_target(tree: PyTree, mesh: Mesh) -> PyTree:
    """An orbax restore target on ``mesh`` for a train state's shapes: every leaf a
    ``jax.ShapeDtypeStruct`` with a ``NamedSharding`` of ``mesh``.

    The shapes of a model built for a mesh come from ``nnx.eval_shape`` (or ``jax.eval_shape``)
    without materialising it, but their shardings name an ``AbstractMesh``, which orbax cannot
    restore to (``_device_assignment is not implemented``), and leaves created outside any
    sharding rule (the optimizer's step count, rng counters) have none. This gives each leaf its
    own ``PartitionSpec`` on the concrete ``mesh`` (the stage-sharded pipeline parameters stay
    split over the stage axis), and replicates the leaves that have none. Each process then
    reads only the shards it holds. Concrete arrays are accepted too (their specs are kept).

    Args:
      tree: a pytree of ``jax.ShapeDtypeStruct`` or arrays: e.g. ``nnx.state((model,
        optimizer))`` of ``nnx.eval_shape(build)``, or ``jax.eval_shape`` of a Linen ``init``.
      mesh: the mesh to restore onto: the one the model is built for.

    Returns:
      ``tree`` with the same structure, each leaf a ``jax.ShapeDtypeStruct`` on ``mesh``.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: a leaf's ``PartitionSpec`` names an axis that ``mesh`` lacks (the state was
        built for another mesh).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from pipejax.flax import restore_target
      >>> mesh = jax.make_mesh((2,), ("stage",))
      >>> split = NamedSharding(mesh.abstract_mesh, P("stage"))  # as eval_shape gives it
      >>> shapes = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=split),
      ...           "step": jax.ShapeDtypeStruct((), jnp.int32)}
      >>> target = restore_target(shapes, mesh)
      >>> target["w"].sharding.spec, target["step"].sharding.spec
      (P('stage',), P())
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "`mesh` of restore_target must be a jax.sharding.Mesh (the mesh to restore onto, e.g. "
            f"`jax.make_mesh((4,), ('stage',))`), but got {type(mesh).__name__} {mesh!r}."
        )

    def one(path, a):
        sharding = getattr(a, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        named = {n for p in spec if p is not None for n in ((p,) if isinstance(p, str) else p)}
        missing = sorted(named - set(mesh.axis_names))
        if missing:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path) or '<root>'} of restore_target's `tree` is "
                f"sharded as {spec}, but `mesh` has no axis {', '.join(map(repr, missing))} (its "
                f"axes: {mesh.axis_names}). Build the abstract state for the mesh you restore onto "
                "(the same `mesh=`), or restore on the saved mesh and re-cut the stages "
                "(`to_sequential` / `from_sequential`)."
            )
        return jax.ShapeDtypeStruct(jnp.shape(a), a.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, tree)


def _no_stage(params, x, key, *rest):  # a placeholder: the placement pipeline never runs
    raise AssertionError("placeholder stage called")


def _layer_step(
    run_layer: RunLayer,
    index: int,
    kwargs: Mapping[str, Any],
    names: tuple[str, ...],
    carry: Carry,
    collect: bool = False,
):
    """Layer ``index`` as a :func:`pipejax.partition` layer over the carry ``(h, mask, context,
    records, auxes)``: it reads the side inputs ``names`` of the micro-batch's ``context`` as
    keyword arguments, passes on the part of its output that ``carry`` selects
    (:func:`select_carry`), and passes the context on unchanged to the stage's next layer. With
    ``collect`` (the ``aux=`` option) it adds its aux outputs to ``auxes`` (:func:`layer_aux`)."""

    def step(variables, state, key):
        h, mask, context, records, auxes = state
        side = {name: context[name] for name in names}
        if key is not None and _batched(key):  # per-example keys: the layer row by row

            def one(row, k, side_row):
                kw = {**kwargs, **_lead(side_row)}
                y = run_layer(index, variables, _lead(row), k, None, kw)[0]
                return _first(select_carry(carry, index, y))

            return jax.vmap(one)(h, key, side), mask, context, (*records, {}), auxes
        try:
            y, rec, sown = run_layer(index, variables, h, key, mask, {**kwargs, **side})
        except (TypeError, ValueError) as err:
            hint = _carry_hint(carry, index, h, err)
            if hint is None:
                raise
            if type(err) in (TypeError, ValueError):  # (JAX's own, or the user's plain ones)
                raise type(err)(hint) from err
            err.add_note(hint)
            raise
        if not collect:
            return select_carry(carry, index, y), mask, context, (*records, rec or {}), auxes
        h, rest = split_carry(carry, index, y, collect=True)
        return h, mask, context, (*records, rec or {}), (*auxes, layer_aux(rest, sown))

    return step


def layer_aux(rest: Any, sown: Mapping[str, Any]) -> dict[str, Any]:
    """A layer's aux outputs: ``{"outputs": the rest of its output (what ``carry=`` did not pass
    on), "intermediates": what it sowed}``, each key present only when it holds arrays."""
    aux = {}
    if any(_is_array(a) for a in jax.tree.leaves(rest)):
        aux["outputs"] = rest
    if jax.tree.leaves(sown):
        aux["intermediates"] = sown
    return aux


class _StageAuxLoss:
    """A per-layer ``aux_loss`` as the pipeline's per-stage one: the sum over the stage's layers
    with aux outputs (``None`` results add nothing; ``None`` when nothing does). Equal by the
    wrapped function, so the cached training step is found again."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, stage_aux):
        values = [self.fn(a) for a in stage_aux if jax.tree.leaves(a)]
        values = [v for v in values if v is not None]
        return sum(values[1:], values[0]) if values else None

    def __eq__(self, other):
        return isinstance(other, _StageAuxLoss) and other.fn is self.fn

    def __hash__(self):
        return hash(("stage-aux-loss", id(self.fn)))


def _stateless(stage, collect=False):
    def run(params, x, key, context=None):
        y, _, _, _, auxes = stage([{"params": p} for p in params], (x, None, context, (), ()), key)
        return (y, auxes) if collect else y

    return run


def _stateful(stage, collect=False):
    def run(params, x, key, state, mask, context=None):
        state = (None,) * len(params) if state is None else state  # (no layer has statistics)
        variables = [{"params": p, "batch_stats": st} for p, st in zip(params, state, strict=True)]
        y, _, _, records, auxes = stage(variables, (x, mask, context, (), ()), key)
        stats = tuple(r or None for r in records)
        return (y, stats, auxes) if collect else (y, stats)

    return run


def _batched(key: jax.Array) -> bool:
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    return key.ndim > (0 if typed else 1)


def _lead(tree):
    return jax.tree.map(lambda a: a[None], tree)


def _first(tree):
    return jax.tree.map(lambda a: a[0], tree)


@jax.jit
def _unpack(packed: StageParams) -> list[Any]:
    """``packed.unpack()`` as one compiled program (eagerly it would dispatch a slice per leaf)."""
    return packed.unpack()


def keyword_names(call: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments a layer's ``__call__(self, x, ...)`` accepts; ``None`` for any (``**kw``).

    ``self`` and the input (the first parameter after it) are not keyword arguments of a layer:
    the pipeline passes the input positionally.
    """
    params = list(inspect.signature(call).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    skip = {p.name for p in positional[:2]}  # self and the input
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in skip
    )


def _accepts(names: frozenset[str] | None, name: str) -> bool:
    return names is None or name in names


def route_kwargs(calls: Sequence[Callable[..., Any]], kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For each layer's call, the keyword arguments it accepts, after checking ``kwargs``.

    Raises:
      TypeError: if a keyword argument is an array (per-example inputs belong in ``context=`` or
        ``x``, where they are cut into micro-batches) or is accepted by none of the layers (a typo
        would otherwise be ignored silently).
    """
    for name, value in kwargs.items():
        if isinstance(value, jax.Array) or hasattr(value, "__jax_array__"):
            raise TypeError(
                f"Keyword argument `{name}` is an array. Keyword arguments reach every layer "
                "unchanged (whole, not cut into micro-batches), so they are for Python flags such "
                f"as `deterministic=True`. Pass a batch-shaped array as a side input, "
                f"`context={{{name!r}: ...}}`: it is cut into micro-batches with `x` and each layer "
                f"whose `__call__` takes `{name}` receives its micro-batch's rows."
            )
    accepted = [keyword_names(call) for call in calls]
    routed = [{k: v for k, v in kwargs.items() if _accepts(names, k)} for names in accepted]
    unused = sorted(set(kwargs) - {k for r in routed for k in r})
    if unused:
        raise TypeError(
            f"Keyword argument(s) {unused} are accepted by none of the layers' `__call__` "
            f"({_signatures(calls, accepted)}). Each keyword argument is passed to the layers whose "
            "`__call__` takes it; check the spelling, or remove it."
        )
    return routed


def route_context(
    calls: Sequence[Callable[..., Any]], context: Any, flags: Mapping[str, Any]
) -> list[tuple[str, ...]] | None:
    """For each layer's call, the names of the side inputs in ``context`` it receives.

    ``context`` maps keyword-argument names to batch-shaped arrays (or pytrees of them); layer
    ``l`` receives the entries its ``__call__`` accepts (all of them with ``**kwargs``), the same
    rule as for flags. Returns ``None`` for ``context=None`` or an empty dict (no side inputs).

    Raises:
      TypeError: if ``context`` is not a dict with string keys, an entry is also given as a flag,
        or an entry is accepted by none of the layers.
    """
    if context is None:
        return None
    if not isinstance(context, Mapping):
        raise TypeError(
            "`context` must be a dict from keyword-argument names to batch-shaped arrays, e.g. "
            "`context={'decoder_mask': mask}`: each entry is cut into micro-batches with `x` and "
            "passed to every layer whose `__call__` takes that keyword argument, but got "
            f"{type(context).__name__}. Wrap a single array in a dict named after the layers' argument."
        )
    if not context:
        return None
    for name in context:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(
                f"The keys of `context` name the layers' keyword arguments, so they must be "
                f"identifiers (strings), but got the key {name!r}."
            )
        if name in flags:
            raise TypeError(
                f"`{name}` is given both as a keyword argument of the call and as an entry of "
                f"`context`; pass it once (as a side input, `context={{{name!r}: ...}}`, if it is "
                "batch-shaped)."
            )
    accepted = [keyword_names(call) for call in calls]
    routed = [tuple(k for k in context if _accepts(names, k)) for names in accepted]
    unused = [k for k in context if not any(k in r for r in routed)]
    if unused:
        raise TypeError(
            f"`context` entr{'y' if len(unused) == 1 else 'ies'} {unused} "
            f"{'is' if len(unused) == 1 else 'are'} a keyword argument that none of the layers' "
            f"`__call__` takes ({_signatures(calls, accepted)}). Each entry of `context` is passed "
            "to the layers whose `__call__` takes a keyword argument of that name: rename the "
            "entry to the layers' argument (e.g. context={'decoder_mask': mask} for "
            "`__call__(self, x, decoder_mask=None)`), or add the argument to the layers' `__call__`."
        )
    return routed


def with_context(
    kwargs: Sequence[Mapping[str, Any]], names: Sequence[Sequence[str]] | None, context: Any
) -> list[dict[str, Any]]:
    """Each layer's keyword arguments with its side inputs (``names``, from :func:`route_context`)
    added, for a call outside the pipeline (on the whole batch)."""
    if names is None:
        return [dict(kw) for kw in kwargs]
    return [{**kw, **{k: context[k] for k in n}} for kw, n in zip(kwargs, names, strict=True)]


# --- layer outputs: the activation passed on ---------------------------------------------------

Carry = int | str | Callable[[Any], Any] | None  # what `carry=` takes (see select_carry)


def check_carry(carry: Any, owner: str) -> Carry:
    """``carry`` after checking that it is ``None``, an int, a str or a callable.

    Raises:
      TypeError: for anything else (a bool, a float, a list of indices, ...).
    """
    ok = carry is None or isinstance(carry, str) or callable(carry)
    ok = ok or (isinstance(carry, int) and not isinstance(carry, bool))
    if not ok:
        raise TypeError(
            f"`carry` of {owner} says which part of each layer's output is the activation passed to "
            "the next layer: None (the whole output), an int (the index in a tuple output: carry=1 "
            "for a layer that returns `(cache, x)`), a str (the key in a dict output), or a function "
            f"`out -> activation`; but got {type(carry).__name__} {carry!r}."
        )
    return carry


def select_carry(carry: Carry, index: int, out: Any) -> Any:
    """The activation layer ``index`` passes on, from its output ``out`` and ``carry`` (the rest
    must hold no arrays; see :func:`split_carry`)."""
    return split_carry(carry, index, out)[0]


def split_carry(carry: Carry, index: int, out: Any, collect: bool = False) -> tuple[Any, Any]:
    """``(activation, rest)``: the part of layer ``index``'s output ``out`` that ``carry`` selects,
    and the rest (``None`` when nothing is dropped).

    * ``None``: ``out`` itself;
    * an int ``k``: ``out[k]`` if ``out`` is a tuple or a list; any other output (an array, a
      dict) is passed on whole;
    * a str ``k``: ``out[k]`` if ``out`` is a dict (a ``Mapping``); any other output whole;
    * a callable: ``carry(out)``, for every output (the function decides what is dropped).

    With an int or a str, the rest of ``out`` (a tuple of the other items; a dict of the other
    entries) is returned (``collect``: the ``aux=`` option collects it as the layer's aux
    outputs); without ``collect`` it must hold no arrays (``None``, Python values): an
    auxiliary output that is an array (an aux loss, a cache) would be lost silently.

    Raises:
      ValueError: an index or key that ``out`` does not have, or (without ``collect``) dropped
        parts holding arrays.
    """
    if carry is None:
        return out, None
    if callable(carry):
        return carry(out), None
    if isinstance(carry, int):
        if not isinstance(out, (tuple, list)):
            return out, None
        if not -len(out) <= carry < len(out):
            raise ValueError(
                f"`carry={carry}` selects item {carry} of each layer's tuple output, but layer {index} "
                f"returned a {type(out).__name__} of {len(out)} item(s): {_describe(out)}. Give the "
                f"index of the activation in that tuple (0 to {len(out) - 1}), or a function "
                "`carry=lambda out: ...`."
            )
        kept = carry % len(out)
        dropped = {f"item {k}": v for k, v in enumerate(out) if k != kept}
        chosen, rest = out[kept], tuple(v for k, v in enumerate(out) if k != kept)
    else:
        if not isinstance(out, Mapping):
            return out, None
        if carry not in out:
            raise ValueError(
                f"`carry={carry!r}` selects the entry {carry!r} of each layer's dict output, but layer "
                f"{index} returned a dict with the keys {sorted(map(str, out))}: {_describe(out)}. Give "
                "the key of the activation, or a function `carry=lambda out: ...`."
            )
        dropped = {f"entry {k!r}": v for k, v in out.items() if k != carry}
        chosen, rest = out[carry], {k: v for k, v in out.items() if k != carry}
    arrays = [name for name, v in dropped.items() if any(_is_array(a) for a in jax.tree.leaves(v))]
    if arrays and not collect:
        raise ValueError(
            f"Layer {index} returned {_describe(out)}: with `carry={carry!r}` its "
            f"{', '.join(arrays)} would be dropped, but {'it holds' if len(arrays) == 1 else 'they hold'} "
            "arrays. A pipeline passes on only the activation; the rest of a layer's output is "
            "collected only with the `aux=` option ('stack', 'sum' or 'mean'), which returns it "
            "beside the output (`y, aux = pipe(x)`), so without it the drop is allowed only for "
            "parts without arrays (a cache of None). Build the pipeline with `aux='mean'` to "
            "collect them, return only the activation (or None beside it), or, if these outputs "
            "are not needed, drop them explicitly with a function: `carry=lambda out: out[...]`."
        )
    return chosen, rest


def _carry_hint(carry: Carry, index: int, h: Any, err: Exception) -> str | None:
    """The message to raise (same type) when layer ``index`` failed on a tuple holding ``None`` from
    the layer before it (``return cache, x`` without ``carry=``); ``None`` when that is not the case."""
    items = h.values() if isinstance(h, Mapping) else h if isinstance(h, (tuple, list)) else ()
    if carry is not None or index == 0 or not any(item is None for item in items):
        return None
    return (
        f"Layer {index} could not be applied to the output of layer {index - 1}, {_describe(h)}: "
        f"{type(err).__name__}: {err}\nA layer's whole output is passed on as the next layer's "
        f"input. If layer {index - 1} returns the activation beside other outputs (`return cache, x`, "
        "as Gemma's blocks do), say which one is the activation with `carry=`: `carry=1` for "
        "`(cache, x)`, a key for a dict output, or a function `carry=lambda out: out.x`. The "
        "other outputs are dropped (only if they hold no arrays, such as a cache of None)."
    )


def _is_array(a: Any) -> bool:
    return isinstance(a, (jax.Array, np.ndarray)) or hasattr(a, "__jax_array__")


def _describe(out: Any) -> str:
    """A layer's output for messages: ``(None, 'float32[3, 16, 32]')``."""
    shapes = jax.tree.map(lambda a: f"{jnp.result_type(a)}{list(jnp.shape(a))}" if _is_array(a) else a, out)
    return repr(shapes)


def _signatures(calls: Sequence[Callable[..., Any]], accepted: Sequence[frozenset[str] | None]) -> str:
    """``"layers 0-3 (Block) take decoder_mask, deterministic; layer 4 (Dense) takes none"``."""
    groups: list[tuple[list[int], str, str]] = []
    for index, (call, names) in enumerate(zip(calls, accepted, strict=True)):
        owner = getattr(call, "__qualname__", "?").rsplit(".", 1)[0]
        takes = "any (**kwargs)" if names is None else (", ".join(sorted(names)) or "none")
        if groups and groups[-1][1:] == (owner, takes) and groups[-1][0][-1] == index - 1:
            groups[-1][0].append(index)
        else:
            groups.append(([index], owner, takes))
    parts = []
    for indices, owner, takes in groups:
        which = f"layer {indices[0]}" if len(indices) == 1 else f"layers {indices[0]}-{indices[-1]}"
        verb = "takes" if len(indices) == 1 else "take"
        parts.append(f"{which} ({owner}) {verb} {takes}")
    return "; ".join(parts)


def check_layers(layers: Any, base: type, kind: str, adapter: str, other: tuple[str, str]) -> None:
    """Raises unless ``layers`` is a non-empty sequence of ``base`` instances.

    Args:
      layers: what the user passed.
      base: the module class of the adapter's API.
      kind: how messages name an instance of ``base``, with its article ("an nnx.Module").
      adapter: the adapter's name.
      other: ``(module prefix, adapter)`` of the other Flax API, named when its modules are passed.

    Raises:
      TypeError, ValueError: naming the first bad entry.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):  # (nnx.List is one)
        raise TypeError(
            f"`layers` must be a sequence of {kind.split(' ', 1)[1]}, but got {type(layers).__name__}. "
            "For a stack of layers built with nn.scan or nnx.vmap, see `LinenPipeline.from_stacked` and "
            "`pipejax.flax.unstack`."
        )
    if len(layers) == 0:
        raise ValueError(f"`layers` is empty; {adapter} needs at least one layer ({kind}).")
    for index, layer in enumerate(layers):
        if isinstance(layer, base):
            continue
        hint = ""
        if type(layer).__module__.startswith(other[0]):
            hint = f" For {other[0]} modules use `pipejax.flax.{other[1]}`."
        elif callable(layer):
            hint = " Wrap a function in a module whose `__call__(self, x)` applies it."
        raise TypeError(f"`layers[{index}]` must be {kind}, but got {type(layer).__name__}.{hint}")


# --- deferred BatchNorm ------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class SownMoments:
    """One BatchNorm call's :class:`~pipejax.Moments`, with the layer's momentum (static).

    The momentum travels in the pytree structure, not as an array, so the stats a pipeline stacks
    over the micro-batches still say how to update the layer they came from.
    """

    def __init__(self, moments: Moments, momentum: float):
        self.moments = moments
        self.momentum = momentum

    def tree_flatten(self):
        return (self.moments,), self.momentum

    @classmethod
    def tree_unflatten(cls, momentum, children):
        return cls(children[0], momentum)

    def __repr__(self) -> str:
        return f"SownMoments({self.moments!r}, momentum={self.momentum!r})"


def _is_sown(t) -> bool:
    return isinstance(t, SownMoments)


def batch_norm_moments(x: jax.Array, row_mask: jax.Array, axis: Any, momentum: float) -> SownMoments:
    """The moments of a BatchNorm input ``x`` over the real rows of a micro-batch."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return SownMoments(moments_of(x, row_mask, axis=axes), momentum)


def row_mask_for(row_mask: jax.Array, x: jax.Array) -> jax.Array:
    """``bool[b]`` reshaped to broadcast against ``x`` (``(b, 1, ..., 1)``), as Flax's ``mask=``."""
    return jnp.reshape(row_mask, (x.shape[0],) + (1,) * (x.ndim - 1))


def check_training_call(
    where: str, mask: Any, axis_name: Any, path: tuple[str, ...], records: Mapping
) -> None:
    """Raises for what deferred BatchNorm does not support in a training call.

    Raises:
      NotImplementedError: for a ``mask=`` of the user's, a BatchNorm ``axis_name``, or a second
        call of the same BatchNorm module in one call of the layer.
    """
    if mask is not None:
        raise NotImplementedError(
            f"{where} was called with `mask=` in training inside a pipeline. Deferred BatchNorm "
            "masks the padding rows of each micro-batch itself and supports no other mask; drop "
            "`mask=`, or evaluate with `use_running_average=True`."
        )
    if axis_name is not None:
        raise NotImplementedError(
            f"{where} has axis_name={axis_name!r}: statistics synchronised over a device axis are "
            "not supported inside a pipeline; set axis_name=None."
        )
    if path in records:
        raise NotImplementedError(
            f"{where} was called twice in one call of the layer; deferred batch norm supports one "
            "call per BatchNorm module per layer call."
        )


def needs_flag(what: str, adapter: str) -> str:
    """The message for BatchNorm statistics in an adapter built without ``deferred_batch_norm``."""
    return (
        f"{what}, but this {adapter} was built without `deferred_batch_norm=True`. A pipeline "
        "normalises each micro-batch separately and must not update the running statistics once "
        f"per micro-batch; build it with `{adapter}(..., deferred_batch_norm=True)`, which updates "
        "them once per mini-batch."
    )


def _dict_path(path) -> tuple[str, ...]:
    """The mapping keys of a pytree key path (NNX Variables add a ``.value`` attribute key)."""
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _updated(batch_stats: PyTree, records: Mapping[tuple[str, ...], SownMoments] | None, unbiased: bool):
    """A layer's statistics with ``mean``/``var`` of every BatchNorm that recorded moments updated.

    ``batch_stats`` is the layer's statistics tree (a Linen dict or an ``nnx.State``): a BatchNorm
    at path ``p`` keeps its running statistics at ``p + ("mean",)`` and ``p + ("var",)``.
    """
    if not records:
        return batch_stats
    leaves = {_dict_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(batch_stats)[0]}
    new = {}
    for path, sown in records.items():
        running = BatchStats(leaves[(*path, "mean")], leaves[(*path, "var")])
        stats = batch_norm_update(running, sown.moments, momentum=sown.momentum, unbiased=unbiased)
        new[(*path, "mean")], new[(*path, "var")] = stats.mean, stats.var
    return jax.tree_util.tree_map_with_path(lambda p, a: new.get(_dict_path(p), a), batch_stats)


def layer_specs(boxed: Sequence[PyTree], mesh: Mesh | None, axis_name: str) -> list[PyTree] | None:
    """Per layer, the ``PartitionSpec`` of each parameter leaf over the mesh's non-stage axes,
    from Linen's sharding metadata: ``nn.with_partitioning`` boxes name mesh axes,
    ``nn.with_logical_partitioning`` boxes logical axes that the rules in effect
    (``nn.logical_axis_rules(...)``, or the box's own ``rules``) map to mesh axes. ``None`` when
    no leaf is sharded over an axis of ``mesh`` other than ``axis_name`` (or without a mesh)."""
    if mesh is None:
        return None
    from flax import linen as nn

    def spec_of(box):
        if isinstance(box, nn.LogicallyPartitioned):
            return nn.logical_to_mesh_axes(box.names, box.rules)
        if isinstance(box, nn.Partitioned):
            return PartitionSpec(*box.names)
        return None

    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    return split_specs([jax.tree.map(spec_of, layer, is_leaf=is_box) for layer in boxed], mesh, axis_name)


def split_specs(specs: Sequence[PyTree], mesh: Mesh, axis_name: str) -> list[PyTree] | None:
    """``specs`` (per layer, a ``PartitionSpec`` or ``None`` per parameter leaf) restricted to the
    axes of ``mesh`` other than the stage axis ``axis_name``, or ``None`` when nothing is left to
    split. Names that are not mesh axes (logical axes no rule mapped) split nothing."""
    keep = set(mesh.axis_names) - {axis_name}

    def restrict(spec):
        if not isinstance(spec, PartitionSpec):
            return None
        entries = []
        for p in spec:
            names = tuple(a for a in (() if p is None else (p,) if isinstance(p, str) else p) if a in keep)
            entries.append(None if not names else names[0] if len(names) == 1 else names)
        return PartitionSpec(*entries) if any(e is not None for e in entries) else None

    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)
    restricted = [jax.tree.map(restrict, layer, is_leaf=is_spec) for layer in specs]
    split = any(
        isinstance(p, PartitionSpec) for layer in restricted for p in jax.tree.leaves(layer, is_leaf=is_spec)
    )
    return restricted if split else None
