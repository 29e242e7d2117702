"""A Flax Linen module that runs a sequence of Linen layers as a GPipe pipeline.

``LinenPipeline(layers, balance=[...])`` cuts ``layers`` into stages of consecutive layers and
runs them with :func:`pipejax.pipeline`. It is an ordinary Linen module: it can sit inside a
bigger model (an embedding before it, a head after it), and ``init``/``apply``/``jax.jit``/
``jax.grad``/optax work on it as on any module.

Parameters. The module owns one parameter, ``"stages"``: the layers' parameters in the
stage-sharded layout of :meth:`pipejax.Pipeline.place` (a :class:`pipejax.StageParams`; with a
mesh, device ``s`` stores only stage ``s``'s parameters). :meth:`LinenPipeline.to_sequential`
and :meth:`LinenPipeline.from_sequential` convert to and from the variables of
``nn.Sequential(layers)``: ``{"params": {"layers_0": ..., "layers_1": ...}}``.

Each stage is a pure function of its parameters: layer ``j`` of the stage runs as
``layer.apply({"params": p_j}, h, rngs={rng_collection: layer_key}, **flags)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import unfreeze
from jax.sharding import Mesh

from pipejax._src import flax_common as common
from pipejax._src.pipeline import Pipeline, pipeline
from pipejax._src.placement import StageParams

PyTree = Any


class LinenPipeline(nn.Module):
    """Runs a sequence of Linen layers as a GPipe pipeline, inside any Linen model.

    The layers are cut into stages of consecutive layers (``balance`` layers per stage, or
    ``num_stages`` even stages), and :func:`pipejax.pipeline` streams ``chunks`` micro-batches
    through them; with a ``mesh``, device ``s`` along ``axis_name`` runs stage ``s`` and stores
    only its parameters. Layers within a stage run in sequence; stages may differ in every way
    (heterogeneous stages). The result equals running the layers in sequence on the whole batch.

    Calling: ``module.apply(variables, x, rngs={"dropout": key}, **flags)``.

    * ``x`` is what the first layer takes (an array or a pytree of arrays with a leading batch axis).
    * ``flags`` (keyword arguments such as ``deterministic=True`` or ``train=False``) are passed to
      every layer whose ``__call__`` accepts them, on every micro-batch. They must be Python
      values; a flag that no layer accepts is a ``TypeError``.
    * Randomness: when the module has a ``rng_collection`` rng (``rngs={"dropout": ...}``), it
      draws one key per call, ``key = self.make_rng(rng_collection)``. Layer ``j`` (counted from 0
      inside its stage) of stage ``s`` on micro-batch ``i`` then receives
      ``rngs={rng_collection: jax.random.fold_in(pj.stage_key(key, i, s), j)}``. The keys do not
      depend on the mesh or the checkpoint mode, so all of them give bitwise the same result.
      Without that rng, layers get no rngs (so dropout layers must be deterministic).

    Initialisation: ``init`` runs the layers in sequence on the whole batch to create their
    parameters (layer ``l``, counted over all layers, with rngs ``{"params": k_l,
    rng_collection: k'_l}``, where ``k_l, k'_l = jax.random.split(jax.random.fold_in(rng, l))``
    and ``rng`` is the module's ``"params"`` rng) and lays them out with
    :meth:`pipejax.Pipeline.place`. The output of ``init`` is that sequential run's (equal to the
    pipeline's up to rounding when deterministic), so ``init`` never compiles the pipeline.
    Layers that create collections other than ``"params"`` (``batch_stats``, caches) raise
    ``NotImplementedError`` for now.

    Attributes:
      layers: the Linen modules, applied in order.
      balance: the number of layers of each stage (``sum(balance) == len(layers)``), as in
        torchgpipe. Give this or ``num_stages``.
      num_stages: an even split into this many stages (the first ``len(layers) % num_stages``
        stages take one layer more).
      chunks: micro-batches per mini-batch (see :func:`pipejax.pipeline`).
      checkpoint: ``"always"``, ``"except_last"``, ``"never"`` or a ``jax.checkpoint`` policy.
      mesh: a mesh with an axis ``axis_name`` of one device per stage, or ``None``.
      axis_name: the stage axis of ``mesh``.
      rng_collection: the name of the rng stream the module draws its key from and hands to the
        layers.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from pipejax.flax import LinenPipeline
      >>> layers = [nn.Dense(8, param_dtype=jnp.float64) for _ in range(3)]
      >>> pipe = LinenPipeline(layers, balance=[2, 1], chunks=2)
      >>> x = jnp.ones((4, 5))
      >>> variables = pipe.init(jax.random.key(0), x)
      >>> variables["params"]["stages"]
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
    chunks: int = 1
    checkpoint: str | Callable[..., Any] = "except_last"
    mesh: Mesh | None = None
    axis_name: str = "stage"
    rng_collection: str = "dropout"

    def __post_init__(self):
        _check_layers(self.layers)
        sizes = common.stage_sizes(len(self.layers), self.balance, self.num_stages)
        common.check_mesh(self.mesh, self.axis_name, sizes)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: PyTree, **flags: Any) -> PyTree:
        stages = self._stage_layers()
        flags_per_layer = common.group(
            common.route_kwargs([type(layer).__call__ for layer in self.layers], flags), self.stage_sizes()
        )
        engine = self._engine(stages, flags_per_layer)
        created = []  # the layers' output on `x`, when this call creates the parameters

        def init(rng):
            params, y = self._init_stages(rng, engine, stages, flags_per_layer, x)
            created.append(y)
            return params

        creating = not self.has_variable("params", "stages")
        params = self.param("stages", init)  # (with existing parameters Flax checks the shapes of `init`)
        if creating:  # the layers just ran in sequence on `x`: no need to compile the pipeline
            return created[0]
        key = self.make_rng(self.rng_collection) if self.has_rng(self.rng_collection) else None
        return engine(params, x, key)

    @nn.nowrap
    def stage_sizes(self) -> tuple[int, ...]:
        """The number of layers of each stage (``balance``, or the even split of ``num_stages``)."""
        return common.stage_sizes(len(self.layers), self.balance, self.num_stages)

    # -- the mapping to and from nn.Sequential(layers) ---------------------------------------

    @nn.nowrap
    def to_sequential(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """The variables of ``nn.Sequential(layers)`` with this module's parameters.

        Args:
          variables: this module's variables, ``{"params": {"stages": StageParams}}`` (what
            ``init`` returns for it; inside a bigger model, its subtree).

        Returns:
          ``{"params": {"layers_<l>": params of layer l}}``, ``l`` counted over all layers (layers
          without parameters have no entry), as ``nn.Sequential(layers).init`` lays them out.
        """
        packed = _stage_params_of(variables)
        if packed.num_stages != len(self.stage_sizes()):
            raise ValueError(
                f"`variables` hold {packed.num_stages} stages, but this module has "
                f"{len(self.stage_sizes())} stages (layers per stage: {list(self.stage_sizes())})."
            )
        per_layer = [p for stage in common.unpack(packed) for p in stage]
        return {"params": {f"layers_{index}": p for index, p in enumerate(per_layer) if jax.tree.leaves(p)}}

    @nn.nowrap
    def from_sequential(self, variables: Mapping[str, Any]) -> dict[str, Any]:
        """This module's variables from those of ``nn.Sequential(layers)`` (see :meth:`to_sequential`).

        The parameters are laid out with :meth:`pipejax.Pipeline.place`: with a mesh, each device
        stores only its stage's parameters.

        Args:
          variables: ``{"params": {"layers_<l>": ...}}``; layers without parameters may be absent.

        Returns:
          ``{"params": {"stages": StageParams}}``, ready for ``apply``.
        """
        if not isinstance(variables, Mapping) or set(variables) != {"params"}:
            got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
            raise ValueError(
                "`variables` must be the variables of nn.Sequential(layers), a mapping with the "
                f"single collection 'params' ({{'params': {{'layers_0': ...}}}}), but got {got}."
            )
        params = unfreeze(variables["params"])
        names = [f"layers_{index}" for index in range(len(self.layers))]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ValueError(
                f"`variables['params']` has entries {unknown} that match no layer; expected names "
                f"among layers_0 ... layers_{len(self.layers) - 1}."
            )
        per_layer = [params.get(name, {}) for name in names]
        return {"params": {"stages": self._engine(self._stage_layers(), None).place(self._group(per_layer))}}

    # -- internals --------------------------------------------------------------------------

    @nn.nowrap
    def _group(self, items: Sequence[Any]) -> list[tuple[Any, ...]]:
        return common.group(items, self.stage_sizes())

    @nn.nowrap
    def _stage_layers(self) -> list[tuple[nn.Module, ...]]:
        """Unbound copies of the layers, grouped by stage: pure functions via ``init``/``apply``."""
        return self._group([layer.copy(parent=None, name=None) for layer in self.layers])

    @nn.nowrap
    def _engine(self, stages, flags_per_layer) -> Pipeline:
        if flags_per_layer is None:
            flags_per_layer = [({},) * len(stage) for stage in stages]
        fns = [
            _stage_fn(layers, flags, self.rng_collection)
            for layers, flags in zip(stages, flags_per_layer, strict=True)
        ]
        return pipeline(
            fns, chunks=self.chunks, checkpoint=self.checkpoint, mesh=self.mesh, axis_name=self.axis_name
        )

    @nn.nowrap
    def _init_stages(self, rng, engine, stages, flags_per_layer, x) -> tuple[StageParams, PyTree]:
        per_stage, h, index = [], x, 0
        for layers, flags in zip(stages, flags_per_layer, strict=True):
            params = []
            for layer, kw in zip(layers, flags, strict=True):
                k_params, k_rng = jax.random.split(jax.random.fold_in(rng, index))
                h, variables = layer.init_with_output(
                    {"params": k_params, self.rng_collection: k_rng}, h, **kw
                )
                variables = unfreeze(variables)
                _check_collections(index, layer, variables)
                params.append(variables.get("params", {}))
                index += 1
            per_stage.append(tuple(params))
        return engine.place(per_stage), h


def _stage_fn(layers: Sequence[nn.Module], flags: Sequence[dict[str, Any]], rng_collection: str):
    """Stage ``stage(params, x, key)``: ``params[j]`` are layer ``j``'s parameters."""

    def stage(params, x, key):
        for j, (layer, p, kw) in enumerate(zip(layers, params, flags, strict=True)):
            k = common.layer_key(key, j)
            x = layer.apply({"params": p}, x, rngs={} if k is None else {rng_collection: k}, **kw)
        return x

    return stage


def _check_layers(layers) -> None:
    if isinstance(layers, (str, bytes, nn.Module)) or not isinstance(layers, Sequence):
        raise TypeError(
            f"`layers` must be a sequence of Linen modules (e.g. [nn.Dense(64), nn.Dense(10)]), "
            f"but got {type(layers).__name__}."
        )
    if len(layers) == 0:
        raise ValueError("`layers` is empty; a pipeline needs at least one Linen module.")
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            hint = ""
            if callable(layer):
                hint = (
                    " Wrap a function in a module, e.g. `class Relu(nn.Module)` whose "
                    "`__call__(self, x)` returns `nn.relu(x)`."
                )
            if type(layer).__module__.startswith("flax.nnx"):
                hint = " For Flax NNX modules use `pipejax.flax.NNXPipeline`."
            raise TypeError(
                f"`layers[{index}]` must be a flax.linen.Module, but got {type(layer).__name__}.{hint}"
            )


def _check_collections(index: int, layer: nn.Module, variables: Mapping[str, Any]) -> None:
    extra = sorted(set(variables) - {"params"})
    if extra:
        raise NotImplementedError(
            f"Layer {index} ({type(layer).__name__}) creates the variable collection(s) {extra} "
            "besides 'params'. Mutable layer state (such as BatchNorm's 'batch_stats') is not "
            "supported by LinenPipeline yet; use layers with parameters only (e.g. LayerNorm "
            "instead of BatchNorm)."
        )


def _stage_params_of(variables: Any) -> StageParams:
    try:
        packed = variables["params"]["stages"]
    except (KeyError, TypeError, IndexError):
        packed = None
    if not isinstance(packed, StageParams):
        raise ValueError(
            "`variables` must be this LinenPipeline's own variables, {'params': {'stages': "
            "StageParams}} (inside a bigger model, pass its subtree, e.g. "
            "{'params': variables['params']['LinenPipeline_0']}), but got "
            f"{jax.tree.map(lambda a: getattr(a, 'shape', a), variables)!r}."
        )
    return packed
