"""A Flax Linen module that runs a sequence of Linen layers as a micro-batch pipeline.

``LinenPipeline(layers, balance=[...])`` cuts ``layers`` into stages of consecutive layers and
runs them with :func:`pipejax.pipeline`. It is an ordinary Linen module: it can sit inside a
bigger model (an embedding before it, a head after it), and ``init``/``apply``/``jax.jit``/
``jax.grad``/optax work on it as on any module.

Parameters. The module owns one parameter, ``"stages"``: the layers' parameters in the
stage-sharded layout of :meth:`pipejax.Pipeline.place` (a :class:`pipejax.StageParams`; with a
mesh, device ``s`` stores only stage ``s``'s parameters). :meth:`LinenPipeline.to_sequential`
and :meth:`LinenPipeline.from_sequential` convert to and from the variables of
``nn.Sequential(layers)``: ``{"params": {"layers_0": ..., "layers_1": ...}}``.

This module supplies only what is Linen about it: layer ``l`` as a pure function,
``layer.apply({"params": p_l}, h, rngs={rng_collection: layer_key}, **flags)``, and where the
updated BatchNorm statistics go (a Linen variable). Grouping into stages, the pipeline and the
BatchNorm update are the core the NNX adapter shares (:mod:`pipejax._src.flax.common`), and every
keyword argument that is not a field of the module is an option of :func:`pipejax.pipeline`
(``chunks``, ``mesh``, ``schedule``, ``data_axis_name``, ...), forwarded unchanged. Layer ``l`` as
a pure function (and the BatchNorm interceptor below) is :mod:`pipejax._src.flax.linen_layers`;
the ``"stages"`` variables' box (:class:`~pipejax.flax.StagePartitioned`), their checks and the
conversions of the layers' own variables are :mod:`pipejax._src.flax.linen_variables`.

BatchNorm (``deferred_batch_norm=True``). The module then also owns ``{"batch_stats": {"stages":
StageParams}}``: every layer's ``batch_stats``, laid out per stage like the parameters. The
pipeline runs with stage state (``pj.pipeline(..., stateful=True)``): layer ``j`` runs as
``layer.apply({"params": p_j, "batch_stats": s_j}, h, ...)`` under a Linen method interceptor
(``nn.intercept_methods``) that catches every ``nn.BatchNorm`` call inside the layer, however
deeply nested. In evaluation (``use_running_average=True``) the call runs unchanged. In training
the BatchNorm runs on the micro-batch with its padding rows masked (its own ``mask=`` argument),
as a separate pure ``apply`` whose running-statistics update is dropped, and the micro-batch's
:class:`~pipejax.Moments` are recorded under the BatchNorm's path and returned as the stage's
stats. After the pipeline call, the running statistics are updated once from the moments of all
micro-batches (Chan's merge, :func:`pipejax.batch_norm_update`), when ``batch_stats`` is mutable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.errors
import flax.linen as nn
import jax
from flax.core import unfreeze

from pipejax._src.flax import batchnorm as flax_batchnorm
from pipejax._src.flax import calls as flax_calls
from pipejax._src.flax import common
from pipejax._src.flax import sharding as flax_sharding
from pipejax._src.flax.linen_layers import _LinenLayers
from pipejax._src.flax.linen_variables import (
    _NAME,
    _batch_stats_of,
    _check_alike,
    _check_collections,
    _check_packed,
    _check_present,
    _named,
    _stack_trees,
    _stage_params_of,
    _unstack_tree,
    stack_box,
)
from pipejax._src.params.placement import StageParams

PyTree = Any


class LinenPipeline(nn.Module):
    """Runs a sequence of Linen layers as a micro-batch pipeline, inside any Linen model.

    The layers are cut into stages of consecutive layers (``balance`` layers per stage, or
    ``num_stages`` even stages), and :func:`pipejax.pipeline` streams ``chunks`` micro-batches
    through them; with a ``mesh``, device ``s`` along ``axis_name`` runs stage ``s`` and stores
    only its parameters. Layers within a stage run in sequence; stages may differ in every way
    (heterogeneous stages). The result equals running the layers in sequence on the whole batch.

    Calling: ``module.apply(variables, x, context=None, rngs={"dropout": key}, **flags)``.

    * ``x`` is what the first layer takes (an array or a pytree of arrays with a leading batch axis).
    * ``context`` (side inputs: attention masks, positions, segment ids): a dict from keyword
      names to arrays (or pytrees of arrays) with ``x``'s leading batch axis. They are cut into
      micro-batches with ``x`` (padding rows included), and every layer whose ``__call__`` takes
      a keyword argument of an entry's name receives its micro-batch's rows under that name:
      ``context={"decoder_mask": mask}`` runs ``layer(h, decoder_mask=rows_of_mask)``. Layers
      that do not take it do not receive it; an entry no layer takes is a ``TypeError``. Nothing
      of it travels between stages.
    * ``flags`` (keyword arguments such as ``deterministic=True`` or ``train=False``) are passed to
      every layer whose ``__call__`` accepts them, on every micro-batch. They must be Python
      values; a flag that no layer accepts is a ``TypeError``.
    * Randomness: when the module has a ``rng_collection`` rng (``rngs={"dropout": ...}``), it
      draws one key per call, ``key = self.make_rng(rng_collection)``. Layer ``j`` (counted from 0
      inside its stage) of stage ``s`` on micro-batch ``i`` then receives
      ``rngs={rng_collection: jax.random.fold_in(pj.stage_key(key, i, s), j)}``. The keys do not
      depend on the mesh or the checkpoint mode, so all of them give bitwise the same result.
      Without that rng, layers get no rngs (so dropout layers must be deterministic).

    Initialisation: ``init`` runs the layers in sequence on the whole batch (and the whole
    ``context``) to create their parameters (layer ``l``, counted over all layers, with rngs
    ``{"params": k_l, rng_collection: k'_l}``, where
    ``k_l, k'_l = jax.random.split(jax.random.fold_in(rng, l))`` and ``rng`` is the module's
    ``"params"`` rng) and lays them out with
    :meth:`pipejax.Pipeline.place`. The output of ``init`` is that sequential run's (equal to the
    pipeline's up to rounding when deterministic), so ``init`` never compiles the pipeline.
    Layers that create collections other than ``"params"``, ``"batch_stats"`` and
    ``"intermediates"`` (sown values, which ``aux=`` collects per call; ``init`` drops them), such
    as caches, raise ``NotImplementedError``.

    BatchNorm: with ``deferred_batch_norm=True``, ``nn.BatchNorm`` layers (also nested inside a
    layer) work as torchgpipe's deferred batch norm. In training each micro-batch is normalised
    with its own statistics over its real rows (the padding rows of an uneven batch do not
    count), and a call with ``mutable=["batch_stats"]`` updates the running statistics **once**,
    from the statistics of the whole mini-batch: ``new = momentum * old + (1 - momentum) *
    batch``, with the layer's ``momentum`` and, by default, the biased variance ``M2 / N``: the
    statistics ``nn.BatchNorm`` tracks on the whole batch (``unbiased_variance=True`` tracks
    PyTorch's unbiased ``M2 / (N - 1)`` instead). In evaluation (``use_running_average=True``)
    the running statistics are used; the schedule and checkpointing are the same in both modes.
    The variables are ``{"params": {"stages": ...}, "batch_stats": {"stages": StageParams}}``.
    Without the flag a layer with ``batch_stats`` is a ``ValueError``: a pipeline never updates
    them once per micro-batch.

    Attributes:
      layers: the Linen modules, applied in order.
      balance: the number of layers of each stage (``sum(balance) == len(layers)``), as in
        torchgpipe. Give this or ``num_stages``.
      num_stages: an even split into this many stages (the first ``len(layers) % num_stages``
        stages take one layer more).
      rng_collection: the name of the rng stream the module draws its key from and hands to the
        layers.
      deferred_batch_norm: support ``nn.BatchNorm`` (and the ``batch_stats`` collection) with
        deferred batch norm, as described above (torchgpipe's flag).
      unbiased_variance: whether the running variance tracks the unbiased ``M2 / (N - 1)``
        (True, as PyTorch) or the biased ``M2 / N`` (False, the default, as ``nn.BatchNorm``).
      carry: which part of each layer's output is the activation passed to the next layer (and
        returned by the last), in ``apply`` and ``init`` alike: ``None``, the whole output; an
        int, the item of a tuple output, negative ones counting from the end as in Python
        (``carry=1`` for layers that return ``(cache, x)``; other outputs pass whole); a str,
        the entry of a dict output; or a function ``out -> activation``. With an int or a str
        the other items are not passed on: without ``aux=`` they must hold no arrays
        (``ValueError``); with it they are collected.
      pipeline_options: options of :func:`pipejax.pipeline`, forwarded unchanged and checked by
        it: ``chunks``, ``checkpoint``, ``mesh``, ``axis_name``, ``schedule``, ``repeats``,
        ``data_axis_name``, ``per_example_keys``, ``aux``. With ``aux="stack"``, ``"sum"`` or
        ``"mean"`` ``apply`` returns ``(y, aux)``, ``aux`` a list with one dict per layer:
        ``"outputs"`` (what ``carry=`` did not pass on) and ``"intermediates"`` (what it sowed
        with ``self.sow("intermediates", ...)``), per micro-batch reduced as ``aux`` says.
        Pass them as keyword arguments, ``LinenPipeline(layers, balance=[2, 2], chunks=4,
        mesh=mesh)``; they are collected here.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from pipejax.flax import LinenPipeline
      >>> layers = [nn.Dense(8, param_dtype=jnp.float64) for _ in range(3)]
      >>> pipe = LinenPipeline(layers, balance=[2, 1], chunks=2)
      >>> x = jnp.ones((4, 5))
      >>> variables = pipe.init(jax.random.key(0), x)
      >>> nn.unbox(variables)["params"]["stages"]
      StageParams(num_stages=2, buffers=(float64[2, 120]))
      >>> seq = pipe.to_sequential(variables)
      >>> sorted(seq["params"])
      ['layers_0', 'layers_1', 'layers_2']
      >>> y = pipe.apply(variables, x)
      >>> bool(jnp.allclose(y, nn.Sequential(layers).apply(seq, x)))
      True
    """

    layers: Sequence[nn.Module]
    balance: Sequence[int] | None = None
    num_stages: int | None = None
    rng_collection: str = "dropout"
    deferred_batch_norm: bool = False
    unbiased_variance: bool = False
    carry: flax_calls.Carry = None
    pipeline_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        common.check_layers(self.layers, nn.Module, "a flax.linen.Module", _NAME, ("flax.nnx", "NNXPipeline"))
        common.check_rng_collection(self.rng_collection, _NAME)
        self._stack()  # checks balance, num_stages, the flags and every pipeline option now
        super().__post_init__()

    @nn.compact
    def __call__(self, x: PyTree, *, context: Mapping[str, PyTree] | None = None, **flags: Any) -> PyTree:
        stack = self._stack()
        calls = [type(layer).__call__ for layer in self.layers]
        call = flax_calls.prepare(calls, context, flags)
        if not self.has_variable("params", "stages"):  # init: the layers run in sequence on `x`
            created = []
            whole = call.whole()  # the whole batch's side inputs

            def init(rng):
                params, state, y = self._init_layers(rng, stack, whole, x)
                created.append((state, y))
                return stack_box(stack, params)

            try:
                self.param("stages", init)
            except (flax.errors.ScopeCollectionNotFound, flax.errors.ScopeParamNotFoundError) as err:
                if self.is_initializing():  # (raised by a layer's own initialisation)
                    raise
                err.add_note(
                    f"pipejax.flax.{_NAME}: `variables` hold no pipeline parameters "
                    "({'params': {'stages': ...}}). Make them with `variables = pipe.init(key, x)`, "
                    "or convert those of nn.Sequential(layers) with `pipe.from_sequential(...)` "
                    "(or of an nn.scan stack with `pipe.from_stacked(...)`)."
                )
                raise
            state, y = created[0]
            if state is not None:
                self.variable("batch_stats", "stages", lambda: stack_box(stack, state))
            return y  # (the output of that sequential run: init never compiles the pipeline)
        # Read, not `self.param`: that would trace the layers' initialisation at every call to
        # compare shapes; the pipeline checks the parameters against its stages itself.
        params = _check_packed(self.get_variable("params", "stages"), "params")
        key = self.make_rng(self.rng_collection) if self.has_rng(self.rng_collection) else None
        run = _LinenLayers(tuple(self._layers()), self.rng_collection, stack.deferred)
        engine = stack.pipeline(run, call.kwargs, call.names)  # built once per configuration
        if not stack.deferred:
            if self.has_variable("batch_stats", "stages"):
                raise ValueError(
                    flax_batchnorm.needs_flag(
                        "The variables hold 'batch_stats' (BatchNorm running statistics)", _NAME
                    )
                )
            out = engine(params, x, key, **call.side)
            return out if stack.aux is None else (out[0], stack.layer_aux(out[1]))
        state = self.get_variable("batch_stats", "stages")
        state = None if state is None else _check_packed(state, "batch_stats")
        out = engine(params, x, key, state=state, **call.side)
        y, stats = out[:2]
        new = None if state is None else stack.updated_state(state, stats)
        if new is not None:  # some BatchNorm ran in training: update its statistics once
            if not self.is_mutable_collection("batch_stats"):
                raise ValueError(
                    "BatchNorm layers of the pipeline ran in training mode, which updates the "
                    "running statistics, but the 'batch_stats' collection is not mutable. As for "
                    "nn.BatchNorm, call `apply(variables, x, mutable=['batch_stats'])` and keep the "
                    "returned batch_stats, or evaluate with `use_running_average=True`."
                )
            self.put_variable("batch_stats", "stages", stack_box(stack, new))
        return y if stack.aux is None else (y, stack.layer_aux(out[2]))

    @nn.nowrap
    def value_and_grad(self, loss_fn: Any, *, aux_loss: Any = None) -> Any:
        """A training step of this module that returns the loss and its gradient, run by its schedule.

        Returns ``step(variables, x, targets, *, rngs=None, context=None, **flags) -> (loss,
        grads)``. ``loss_fn(outputs, targets)`` gives one loss per example (``outputs`` is what
        ``apply(variables, x, ...)`` returns); the loss is their mean over the batch (padding
        rows of an uneven batch excluded) and ``grads`` has the form of ``variables["params"]``
        (``{"stages": StagePartitioned(StageParams)}``, what ``jax.grad`` of a loss of ``apply``
        gives; unboxed if ``variables`` are), ready for optax. ``rngs``, ``context`` and
        ``flags`` mean what they mean for ``apply``: the module draws its key from ``rngs`` as
        ``apply`` does, so the layers see the same dropout masks and the loss equals the mean of
        ``loss_fn(apply(variables, x, rngs=rngs, **flags), targets)``.

        * ``schedule="gpipe"`` or ``"circular"``: ``jax.value_and_grad`` of that loss;
        * ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``: :meth:`pipejax.Pipeline.value_and_grad`
          of the module's pipeline, one program that runs the schedule's forward and backward
          slots, keeping what the backward needs of a bounded number of micro-batches per device.

        The module must be the whole model trained this way (an embedding and a head are its
        first and last layers; stages may differ): the step differentiates with respect to the
        module's parameters only. Call ``step`` under ``jax.jit`` (as a train step), or eagerly.

        With ``aux=`` (the layers' auxiliary outputs), ``step`` returns ``((loss, aux),
        grads)``, ``aux`` a list with one entry per layer, and ``aux_loss`` adds their losses
        exactly as :meth:`pipejax.flax.NNXPipeline.value_and_grad` describes.

        Args:
          loss_fn: ``loss_fn(outputs, targets) -> losses`` of shape ``(batch,)``.
          aux_loss: ``aux_loss(aux_of_one_layer) -> scalar or None``, or ``None`` (needs ``aux=``).

        Returns:
          ``step`` as described above.

        Raises:
          TypeError: if ``loss_fn`` or ``aux_loss`` is not callable.
          ValueError: with ``deferred_batch_norm=True`` (no statistics are returned); an
            ``aux_loss`` without ``aux=``.

        Examples:
          >>> import jax, jax.numpy as jnp, flax.linen as nn
          >>> from pipejax.flax import LinenPipeline
          >>> layers = [nn.Dense(8, param_dtype=jnp.float64) for _ in range(3)]
          >>> x, t = jnp.ones((5, 4)), jnp.zeros((5, 8))
          >>> sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)  # one loss per example
          >>> pipe = LinenPipeline(layers, balance=[2, 1], chunks=3, schedule="1f1b")
          >>> variables = pipe.init(jax.random.key(0), x)
          >>> loss, grads = jax.jit(pipe.value_and_grad(sq))(variables, x, t)
          >>> gpipe = pipe.clone(pipeline_options={**pipe.pipeline_options, "schedule": "gpipe"})
          >>> direct = lambda p: sq(gpipe.apply({"params": p}, x), t).mean()
          >>> loss_ref, grads_ref = jax.value_and_grad(direct)(variables["params"])
          >>> bool(jnp.allclose(loss, loss_ref))
          True
          >>> jax.tree.structure(grads) == jax.tree.structure(grads_ref)
          True
        """
        stack = self._stack()
        stack.check_trainable(loss_fn)
        stage_aux_loss = stack.check_aux_loss(aux_loss)
        calls = [type(layer).__call__ for layer in self.layers]
        run = _LinenLayers(tuple(self._layers()), self.rng_collection, stack.deferred)

        def step(variables, x, targets, *, rngs=None, context=None, **flags):
            call = flax_calls.prepare(calls, context, flags)
            if _batch_stats_of(variables) is not None:
                raise ValueError(
                    flax_batchnorm.needs_flag(
                        "The variables hold 'batch_stats' (BatchNorm running statistics)", _NAME
                    )
                )
            packed = _stage_params_of(variables)
            f = stack.value_and_grad(run, loss_fn, call.kwargs, call.names, stage_aux_loss)  # built once
            loss, grads = f(packed, x, targets, self._call_key(variables, rngs), context)
            box = variables["params"]["stages"]
            if isinstance(box, nn.meta.AxisMetadata):
                grads = box.replace_boxed(grads)
            return loss, {"stages": grads}

        return step

    @nn.nowrap
    def _call_key(self, variables: Mapping[str, Any], rngs: Any) -> jax.Array | None:
        """The key ``apply(variables, ..., rngs=rngs)`` draws (``self.make_rng(rng_collection)``)."""
        if rngs is None:
            return None
        coll = self.rng_collection

        def draw(module):
            return module.make_rng(coll) if module.has_rng(coll) else None

        return nn.apply(draw, self)(variables, rngs=rngs)

    @nn.nowrap
    def stage_sizes(self) -> tuple[int, ...]:
        """The number of layers of each stage (``balance``, or the even split of ``num_stages``)."""
        return self._stack().sizes

    # -- the mapping to and from nn.Sequential(layers) ---------------------------------------

    @nn.nowrap
    def to_sequential(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The variables of ``nn.Sequential(layers)`` with this module's parameters.

        Args:
          variables: this module's variables, ``{"params": {"stages": StageParams}}`` (what
            ``init`` returns for it; inside a bigger model, its subtree), with ``{"batch_stats":
            {"stages": StageParams}}`` for BatchNorm layers.

        Returns:
          ``{"params": {"layers_<l>": params of layer l}}``, ``l`` counted over all layers (layers
          without parameters have no entry), as ``nn.Sequential(layers).init`` lays them out; and
          ``"batch_stats"`` in the same form if ``variables`` hold them.
        """
        stack = self._stack()
        packed = _stage_params_of(variables)
        if packed.num_stages != len(stack.sizes):
            raise ValueError(
                f"`variables` hold {packed.num_stages} stages, but this module has "
                f"{len(stack.sizes)} stages (layers per stage: {list(stack.sizes)})."
            )
        out = {"params": _named(stack.unpack(packed))}
        state = _batch_stats_of(variables)
        if state is not None:
            out["batch_stats"] = _named(stack.unpack(state))
        return out

    @nn.nowrap
    def from_sequential(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """This module's variables from those of ``nn.Sequential(layers)`` (see :meth:`to_sequential`).

        The parameters are laid out with :meth:`pipejax.Pipeline.place`: with a mesh, each device
        stores only its stage's parameters.

        Args:
          variables: ``{"params": {"layers_<l>": ...}}``, and ``"batch_stats"`` in the same form
            for BatchNorm layers (``deferred_batch_norm=True`` only); layers without parameters
            (or statistics) may be absent.

        Returns:
          ``{"params": {"stages": StageParams}}`` (and ``"batch_stats"`` likewise), ready for
          ``apply``.
        """
        if (
            not isinstance(variables, Mapping)
            or "params" not in variables
            or not set(variables) <= {"params", "batch_stats"}
        ):
            got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
            raise ValueError(
                "`variables` must be the variables of nn.Sequential(layers), a mapping with the "
                "collection 'params' ({'params': {'layers_0': ...}}) and, for BatchNorm layers, "
                f"'batch_stats', but got {got}."
            )
        if "batch_stats" in variables and not self.deferred_batch_norm:
            raise ValueError(
                flax_batchnorm.needs_flag(
                    "`variables` hold 'batch_stats' (BatchNorm running statistics)", _NAME
                )
            )
        stack = self._stack()
        out = {}
        for collection in variables:
            tree = unfreeze(variables[collection])
            names = [f"layers_{index}" for index in range(len(self.layers))]
            unknown = sorted(set(tree) - set(names))
            if unknown:
                raise ValueError(
                    f"`variables[{collection!r}]` has entries {unknown} that match no layer; expected "
                    f"names among layers_0 ... layers_{len(self.layers) - 1}."
                )
            if collection == "params":
                _check_present(self.layers, tree, names)
            _check_alike(self.layers, tree, names, collection)
            out[collection] = {
                "stages": stack_box(stack, stack.place([tree.get(name, {}) for name in names]))
            }
        return out

    @nn.nowrap
    def from_stacked(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """This module's variables from those of a layer stack built with ``nn.scan``.

        ``nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
        length=L)`` keeps one parameter tree of ``Layer`` whose leaves have a leading axis of
        size ``L``; layer ``l``'s parameters are the slices ``[l]``. This is
        :meth:`from_sequential` of those slices: pass the stack's variables (``{"params": ...}``,
        and ``"batch_stats"`` likewise), with the same layers (``L`` of them) in this module.

        Raises:
          ValueError: if a leaf's leading axis is not the number of layers.
        """
        return self.from_sequential(
            {col: _named(_unstack_tree(tree, len(self.layers), col)) for col, tree in variables.items()}
        )

    @nn.nowrap
    def to_stacked(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The variables of the ``nn.scan`` stack of these layers (the inverse of :meth:`from_stacked`).

        Every layer must have the same parameter structure. Returns ``{"params": tree}`` (and
        ``"batch_stats"``) with leaves stacked on a leading axis of size ``len(layers)``.
        """
        seq = self.to_sequential(variables)
        return {
            col: _stack_trees([tree[f"layers_{i}"] for i in range(len(self.layers))], col)
            for col, tree in seq.items()
        }

    # -- internals --------------------------------------------------------------------------

    @nn.nowrap
    def _stack(self) -> common.Stack:
        return common.Stack(
            len(self.layers),
            self.balance,
            self.num_stages,
            deferred_batch_norm=self.deferred_batch_norm,
            unbiased_variance=self.unbiased_variance,
            options=self.pipeline_options,
            owner=_NAME,
            carry=self.carry,
        )

    @nn.nowrap
    def _layers(self) -> list[nn.Module]:
        """Unbound copies of the layers: pure functions via ``init``/``apply``."""
        return [layer.copy(parent=None, name=None) for layer in self.layers]

    @nn.nowrap
    def _init_layers(self, rng, stack, kwargs, x) -> tuple[StageParams, Any, PyTree]:
        params, state, h = [], [], x
        for index, (layer, kw) in enumerate(zip(self._layers(), kwargs, strict=True)):
            k_params, k_rng = jax.random.split(jax.random.fold_in(rng, index))
            try:
                out, variables = layer.init_with_output(
                    {"params": k_params, self.rng_collection: k_rng}, h, **kw
                )
            except (TypeError, ValueError, AttributeError) as err:
                hint = flax_calls.carry_hint(stack.carry, index, h, err)
                if hint is None:
                    raise
                if type(err) in (TypeError, ValueError):  # (JAX's or numpy's own, or the user's plain ones)
                    raise type(err)(hint) from err
                err.add_note(hint)
                raise
            h = flax_calls.split_carry(stack.carry, index, out, collect=stack.aux is not None)[0]
            variables = unfreeze(variables)
            variables.pop("intermediates", None)  # sown values: collected per call with `aux=`
            _check_collections(index, layer, variables, self.deferred_batch_norm)
            params.append(variables.get("params", {}))
            state.append(variables.get("batch_stats", {}))
        placed_state = stack.place(state) if jax.tree.leaves(state) else None
        # the layers' own sharding metadata (nn.with_partitioning / with_logical_partitioning and
        # the logical axis rules in effect) says how each parameter is split inside its stage
        specs = flax_sharding.layer_specs(params, stack.placer.plan)
        return stack.place(params, specs), placed_state, h


_FIELDS = (
    "layers",
    "balance",
    "num_stages",
    "rng_collection",
    "deferred_batch_norm",
    "unbiased_variance",
    "carry",
)
_dataclass_init = LinenPipeline.__init__


def _init(self, *args: Any, pipeline_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
    """``LinenPipeline(layers, *, balance, num_stages, ..., **pipeline_options)``.

    Keyword arguments that are not fields of the module are options of :func:`pipejax.pipeline`;
    they are collected into ``pipeline_options`` (the pipeline checks them).
    """
    own = {k: v for k, v in kwargs.items() if k in (*_FIELDS, "parent", "name")}
    options = {**(pipeline_options or {}), **{k: v for k, v in kwargs.items() if k not in own}}
    _dataclass_init(self, *args, pipeline_options=options, **own)


_init.__wrapped__ = _dataclass_init  # type: ignore[attr-defined]
LinenPipeline.__init__ = _init  # type: ignore[method-assign]
