"""The core both Flax adapters share: layers cut into stages, and the one pipeline over them.

An adapter (Linen or NNX) supplies two things only:

* **layer ``l`` as a pure function**, ``run_layer(index, variables, x, key, mask, kwargs) -> (y,
  records, sown)`` (:class:`~pipejax._src.flax.stages.RunLayer`): ``variables`` is ``{"params":
  p}`` (and ``"batch_stats"`` with deferred BatchNorm), ``key`` the layer's key (or ``None``),
  ``mask`` the micro-batch's row mask (``None`` without deferred BatchNorm), ``kwargs`` the
  keyword arguments of the layer's call;
* **how updated variables are written back**: :meth:`Stack.updated_state` returns the new
  stage-laid-out statistics and the adapter stores them (a Linen variable, NNX ``BatchStat``s).

Everything else is here, once: the layers are grouped into stages by :func:`pipejax.partition`
(its balance checks), the stage functions are built from ``partition``'s stages (layer ``j`` of a
stage draws from ``pj.layer_key(stage_key, j)``), and :func:`pipejax.pipeline` runs them with
every pipeline option the adapter was given, forwarded unchanged. The pipelines (and their
``jax.jit``, and ``value_and_grad`` steps) are built once per configuration and cached, for both
adapters, by :func:`program`; :class:`Stack` compares by value, so identically built modules have
equal NNX graph definitions and share the compiled programs.

The Flax side's other jobs each have a module of their own:

* :mod:`~pipejax._src.flax.stages`: what runs inside a stage, each layer as a step of
  :func:`pipejax.partition` (its key, side inputs, ``carry=`` and aux outputs) and the stage
  functions :meth:`Stack.build` makes of them;
* :mod:`~pipejax._src.flax.options`: the stage sizes (``balance=`` / ``num_stages=``), the
  pipeline options an adapter forwards (read from :func:`pipejax.pipeline`'s signature), and
  ``tied=`` in layers' terms;
* :mod:`~pipejax._src.flax.calls`: one call's preparation (:func:`~pipejax._src.flax.calls.prepare`:
  flags and ``context=`` side inputs routed to the layers that take them) and ``carry=``, the
  activation among a layer's outputs; the rest is the layer's aux outputs with ``aux=``;
* :mod:`~pipejax._src.flax.batchnorm`: deferred BatchNorm (``deferred_batch_norm=True``);
* :mod:`~pipejax._src.flax.sharding`: the layers' sharding metadata as ``param_specs``,
  :func:`~pipejax.flax.on_mesh` and :func:`~pipejax.flax.restore_target`.

Randomness: stage ``s`` on micro-batch ``i`` receives ``pj.stage_key(key, i, s)`` from the
pipeline; layer ``j`` of that stage (``j`` counts from 0 inside the stage) draws from
``jax.random.fold_in(stage_key, j)``. With ``per_example_keys=True`` the stage receives one key per
row, and each layer runs row by row (``jax.vmap``) with its row's key, so random draws depend on the
example, not on ``chunks``.

Training (:meth:`Stack.value_and_grad`, the adapters' ``value_and_grad(loss_fn)``): the same
pipeline's :meth:`pipejax.Pipeline.value_and_grad`, so the schedules that own the backward pass
("1f1b", "zb-h1", "interleaved-1f1b") run the layers with the keys, flags and side inputs of the
forward call; an adapter converts only its parameters in and its gradients out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pipejax._src import checks
from pipejax._src.balance import partition
from pipejax._src.flax.batchnorm import SownMoments, is_sown, updated
from pipejax._src.flax.calls import Carry, check_carry, layer_where
from pipejax._src.flax.options import Options, check_options, layer_tied, no_layer, stage_sizes
from pipejax._src.flax.stages import RunLayer, _layer_name, _layer_step, _StageAuxLoss, _stateful, _stateless
from pipejax._src.params.placement import StageParams
from pipejax._src.pipeline import Pipeline, pipeline

PyTree = Any


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
                raise TypeError(
                    f"`{name}` must be a bool (True or False), but got {type(value).__name__} "
                    f"{value!r}. Pass `{name}=True` or `{name}=False` to {owner}."
                )
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
        return [tuple(g) for g in partition([no_layer] * self.num_layers, self.sizes).group(list(items))]

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
        return self.placer.plan.put(tree)

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
            _layer_step(
                run_layer,
                i,
                kwargs_per_layer[i],
                tuple(context_per_layer[i]),
                self.carry,
                collect,
                layer_where(i, self.sizes, _layer_name(run_layer, i)),
            )
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
        if not any(isinstance(t, SownMoments) for t in jax.tree.leaves(stats, is_leaf=is_sown)):
            return None
        old = self.unpack(state)
        records = [r for stage in stats for r in stage]
        new = [updated(st, rec, self.unbiased) for st, rec in zip(old, records, strict=True)]
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


def _no_stage(params, x, key, *rest):  # a placeholder: the placement pipeline never runs
    raise AssertionError("placeholder stage called")


@jax.jit
def _unpack(packed: StageParams) -> list[Any]:
    """``packed.unpack()`` as one compiled program (eagerly it would dispatch a slice per leaf)."""
    return packed.unpack()


def check_flag(value: Any, name: str, where: str, meaning: str) -> bool | None:
    """``value`` (a bool, numpy's included, or ``None``) as a Python bool or ``None``; raises otherwise.

    ``name`` is the flag (``deterministic``), ``where`` what takes it (``"NNXPipeline(...)"``) and
    ``meaning`` what ``True`` does, for the message: a string such as ``'no'`` is refused rather
    than read by its truth (``bool('no')`` is ``True``).

    Raises:
      TypeError: for anything else.
    """
    if value is None or isinstance(value, bool | np.bool_):
        return None if value is None else bool(value)
    raise TypeError(
        f"{checks.label(name, where)} must be True, False or None (None: the module's default), "
        f"but got {type(value).__name__} {value!r}. `{name}=True` {meaning}; pass a Python bool, "
        f"e.g. `{name}=False`."
    )


def check_rng_collection(value: Any, owner: str) -> str:
    """``value``, the name of the rng stream an adapter draws its key from: a non-empty str.

    Raises:
      TypeError: ``value`` is not a str.
      ValueError: ``value`` is the empty string.
    """
    if isinstance(value, str) and value:
        return value
    kind = TypeError if not isinstance(value, str) else ValueError
    raise kind(
        f"`rng_collection` of {owner} names the rng stream the pipeline draws its key from, a "
        f"non-empty str, but got {type(value).__name__} {value!r}. Pass the stream's name, e.g. "
        "`rng_collection='dropout'` (the default), the name dropout layers draw from."
    )


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
