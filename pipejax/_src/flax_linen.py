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

BatchNorm (``deferred_batch_norm=True``). The module then also owns ``{"batch_stats": {"stages":
StageParams}}``: every layer's ``batch_stats``, laid out per stage like the parameters. The
pipeline runs with stage state (``pj.pipeline(..., stateful=True)``): layer ``j`` runs as
``layer.apply({"params": p_j, "batch_stats": s_j}, h, ...)`` under a Linen method interceptor
(``nn.intercept_methods``) that catches every ``nn.BatchNorm`` call inside the layer, however
deeply nested. In evaluation (``use_running_average=True``) the call runs unchanged. In training
the BatchNorm runs on the micro-batch with its padding rows masked (its own ``mask=`` argument),
as a separate pure ``apply`` whose running-statistics update is dropped, and the micro-batch's
:class:`~pipejax.Moments` are sown into a private collection that the stage returns as its
stats. After the pipeline call, the running statistics are updated once from the moments of all
micro-batches (Chan's merge, :func:`pipejax.batch_norm_update`), when ``batch_stats`` is mutable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import unfreeze
from jax.sharding import Mesh

from pipejax._src import flax_common as common
from pipejax._src.flax_common import SownMoments
from pipejax._src.pipeline import Pipeline, pipeline
from pipejax._src.placement import StageParams

PyTree = Any

_SOWN = "pipejax_deferred_batch_norm"  # the collection a BatchNorm call's moments are sown into
_SOWN_NAME = "moments"


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
    Layers that create collections other than ``"params"`` and ``"batch_stats"`` (caches,
    intermediates) raise ``NotImplementedError``.

    BatchNorm: with ``deferred_batch_norm=True``, ``nn.BatchNorm`` layers (also nested inside a
    layer) work as torchgpipe's deferred batch norm. In training each micro-batch is normalised
    with its own statistics over its real rows (the padding rows of an uneven batch do not
    count), and a call with ``mutable=["batch_stats"]`` updates the running statistics **once**,
    from the statistics of the whole mini-batch: ``new = momentum * old + (1 - momentum) *
    batch``, with the layer's ``momentum`` and the unbiased variance ``M2 / (N - 1)`` (PyTorch's
    convention; ``unbiased_variance=False`` tracks the biased ``M2 / N`` that ``nn.BatchNorm``
    tracks). In evaluation (``use_running_average=True``) the running statistics are used; the
    schedule and checkpointing are the same in both modes. The variables are ``{"params":
    {"stages": ...}, "batch_stats": {"stages": StageParams}}``. Without the flag a layer with
    ``batch_stats`` is a ``ValueError``: a pipeline never updates them once per micro-batch.

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
      deferred_batch_norm: support ``nn.BatchNorm`` (and the ``batch_stats`` collection) with
        deferred batch norm, as described above (torchgpipe's flag).
      unbiased_variance: whether the running variance tracks the unbiased ``M2 / (N - 1)``
        (True, as PyTorch) or the biased ``M2 / N`` (False, as ``nn.BatchNorm``).

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
    deferred_batch_norm: bool = False
    unbiased_variance: bool = True

    def __post_init__(self):
        _check_layers(self.layers)
        sizes = common.stage_sizes(len(self.layers), self.balance, self.num_stages)
        common.check_mesh(self.mesh, self.axis_name, sizes)
        for name in ("deferred_batch_norm", "unbiased_variance"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, but got {getattr(self, name)!r}.")
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
            params, state, y = self._init_stages(rng, engine, stages, flags_per_layer, x)
            created.append((state, y))
            return params

        creating = not self.has_variable("params", "stages")
        params = self.param("stages", init)  # (with existing parameters Flax checks the shapes of `init`)
        if creating:  # the layers just ran in sequence on `x`: no need to compile the pipeline
            state, y = created[0]
            if state is not None:
                self.variable("batch_stats", "stages", lambda: state)
            return y
        key = self.make_rng(self.rng_collection) if self.has_rng(self.rng_collection) else None
        if not self.deferred_batch_norm:
            if self.has_variable("batch_stats", "stages"):
                raise ValueError(
                    _NEEDS_FLAG.format(what="The variables hold 'batch_stats' (BatchNorm running statistics)")
                )
            return engine(params, x, key)
        state = self.get_variable("batch_stats", "stages")
        y, stats = engine(params, x, key, state=state)
        self._update_batch_stats(engine, state, stats)
        return y

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
            ``init`` returns for it; inside a bigger model, its subtree), with ``{"batch_stats":
            {"stages": StageParams}}`` for BatchNorm layers.

        Returns:
          ``{"params": {"layers_<l>": params of layer l}}``, ``l`` counted over all layers (layers
          without parameters have no entry), as ``nn.Sequential(layers).init`` lays them out; and
          ``"batch_stats"`` in the same form if ``variables`` hold them.
        """
        packed = _stage_params_of(variables)
        if packed.num_stages != len(self.stage_sizes()):
            raise ValueError(
                f"`variables` hold {packed.num_stages} stages, but this module has "
                f"{len(self.stage_sizes())} stages (layers per stage: {list(self.stage_sizes())})."
            )
        per_layer = [p for stage in common.unpack(packed) for p in stage]
        out = {"params": {f"layers_{index}": p for index, p in enumerate(per_layer) if jax.tree.leaves(p)}}
        state = _batch_stats_of(variables)
        if state is not None:
            per_layer = [st for stage in common.unpack(state) for st in stage]
            out["batch_stats"] = {
                f"layers_{index}": st for index, st in enumerate(per_layer) if jax.tree.leaves(st)
            }
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
                _NEEDS_FLAG.format(what="`variables` hold 'batch_stats' (BatchNorm running statistics)")
            )
        engine = self._engine(self._stage_layers(), None)
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
            per_layer = [tree.get(name, {}) for name in names]
            out[collection] = {"stages": engine.place(self._group(per_layer))}
        return out

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
        firsts = [sum(self.stage_sizes()[:s]) for s in range(len(stages))]
        fns = [
            _stage_fn(layers, flags, self.rng_collection, first, self.deferred_batch_norm)
            for layers, flags, first in zip(stages, flags_per_layer, firsts, strict=True)
        ]
        return pipeline(
            fns,
            chunks=self.chunks,
            checkpoint=self.checkpoint,
            mesh=self.mesh,
            axis_name=self.axis_name,
            stateful=self.deferred_batch_norm,
        )

    @nn.nowrap
    def _init_stages(self, rng, engine, stages, flags_per_layer, x) -> tuple[StageParams, Any, PyTree]:
        per_stage, per_stage_state, h, index = [], [], x, 0
        for layers, flags in zip(stages, flags_per_layer, strict=True):
            params, state = [], []
            for layer, kw in zip(layers, flags, strict=True):
                k_params, k_rng = jax.random.split(jax.random.fold_in(rng, index))
                h, variables = layer.init_with_output(
                    {"params": k_params, self.rng_collection: k_rng}, h, **kw
                )
                variables = unfreeze(variables)
                _check_collections(index, layer, variables, self.deferred_batch_norm)
                params.append(variables.get("params", {}))
                state.append(variables.get("batch_stats", {}))
                index += 1
            per_stage.append(tuple(params))
            per_stage_state.append(tuple(state))
        placed_state = engine.place(per_stage_state) if jax.tree.leaves(per_stage_state) else None
        return engine.place(per_stage), placed_state, h

    @nn.nowrap
    def _update_batch_stats(self, engine: Pipeline, state: Any, stats: list[Any]) -> None:
        """Updates ``batch_stats`` once from the moments every training BatchNorm call sowed."""
        sown = jax.tree.leaves(stats, is_leaf=lambda t: isinstance(t, SownMoments))
        if not any(isinstance(t, SownMoments) for t in sown):
            return  # every BatchNorm ran with its running statistics (or there is none)
        if not self.is_mutable_collection("batch_stats"):
            raise ValueError(
                "BatchNorm layers of the pipeline ran in training mode, which updates the "
                "running statistics, but the 'batch_stats' collection is not mutable. As for "
                "nn.BatchNorm, call `apply(variables, x, mutable=['batch_stats'])` and keep the "
                "returned batch_stats, or evaluate with `use_running_average=True`."
            )
        old = common.unpack(state)
        new = [
            tuple(_updated(st, sw, self.unbiased_variance) for st, sw in zip(stage_st, stage_sw, strict=True))
            for stage_st, stage_sw in zip(old, stats, strict=True)
        ]
        self.put_variable("batch_stats", "stages", engine.place(new))


def _stage_fn(
    layers: Sequence[nn.Module],
    flags: Sequence[dict[str, Any]],
    rng_collection: str,
    first: int,
    deferred: bool,
):
    """Stage ``stage(params, x, key)``: ``params[j]`` are layer ``j``'s parameters.

    With ``deferred`` (deferred BatchNorm), ``stage(params, x, key, state, mask) -> (y, stats)``:
    ``state[j]`` is layer ``j``'s ``batch_stats`` and ``stats[j]`` what its training BatchNorm
    calls sowed (``None`` if nothing). ``first`` is the index of the stage's first layer.
    """

    def run(j, layer, p, x, key, kw, state, mask):
        k = common.layer_key(key, j)
        rngs = {} if k is None else {rng_collection: k}
        variables = {"params": p}
        if state is not None and jax.tree.leaves(state[j]):
            variables["batch_stats"] = state[j]
        with nn.intercept_methods(_batch_norm_interceptor(mask, deferred, first + j)):
            if not deferred:
                return layer.apply(variables, x, rngs=rngs, **kw), None
            x, sown = layer.apply(variables, x, rngs=rngs, mutable=[_SOWN], **kw)
        return x, sown.get(_SOWN)

    def stage(params, x, key):
        for j, (layer, p, kw) in enumerate(zip(layers, params, flags, strict=True)):
            x, _ = run(j, layer, p, x, key, kw, None, None)
        return x

    def stateful_stage(params, x, key, state, mask):
        stats = []
        for j, (layer, p, kw) in enumerate(zip(layers, params, flags, strict=True)):
            x, sown = run(j, layer, p, x, key, kw, state, mask)
            stats.append(sown)
        return x, tuple(stats)

    return stateful_stage if deferred else stage


def _batch_norm_interceptor(row_mask: jax.Array | None, deferred: bool, index: int):
    """A Linen method interceptor that runs every ``nn.BatchNorm`` call as deferred batch norm.

    Evaluation calls run unchanged. A training call normalises the micro-batch with its own
    statistics over the real rows (``row_mask``), through a separate pure ``apply`` of the layer
    whose update of the running statistics is dropped, and sows the micro-batch's moments.
    """
    busy = []  # set while the interceptor runs the BatchNorm itself, which it must not intercept

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if busy or context.method_name != "__call__" or not isinstance(module, nn.BatchNorm):
            return next_fun(*args, **kwargs)
        where = f"Layer {index}'s {type(module).__name__} (at {'/'.join(module.path) or 'the layer itself'})"
        if not deferred:
            raise ValueError(_NEEDS_FLAG.format(what=f"{where} is an nn.BatchNorm"))
        variables = {k: v for k, v in module.variables.items() if k != _SOWN}
        if "batch_stats" not in variables:
            raise ValueError(
                f"{where} has no 'batch_stats'. Pass the LinenPipeline's batch_stats with its "
                "params, as `init` returns them: apply({'params': ..., 'batch_stats': ...}, x)."
            )
        x = args[0] if args else kwargs["x"]
        use_running_average = args[1] if len(args) > 1 else kwargs.get("use_running_average")
        if nn.merge_param("use_running_average", module.use_running_average, use_running_average):
            return next_fun(*args, **kwargs)
        common.check_user_mask(kwargs.get("mask"), where)
        if module.axis_name is not None:
            raise NotImplementedError(
                f"{where} has axis_name={module.axis_name!r}: statistics synchronised over a "
                "device axis are not supported inside a pipeline; set axis_name=None."
            )
        if module.has_variable(_SOWN, _SOWN_NAME):
            raise NotImplementedError(
                f"{where} was called twice in one call of the layer; deferred batch norm supports "
                "one call per BatchNorm module per layer call."
            )
        clone = module.copy(parent=None, name=None, use_running_average=False)
        busy.append(True)
        try:
            y, _ = clone.apply(variables, x, mask=common.row_mask_for(row_mask, x), mutable=["batch_stats"])
        finally:
            busy.pop()
        module.sow(_SOWN, _SOWN_NAME, common.batch_norm_moments(x, row_mask, module.axis, module.momentum))
        return y

    return intercept


def _updated(batch_stats: Any, sown: Any, unbiased: bool) -> Any:
    """A layer's ``batch_stats`` updated at every BatchNorm that sowed moments into ``sown``."""
    if sown is None:
        return batch_stats
    out = dict(batch_stats)
    for name, sub in sown.items():
        if name == _SOWN_NAME:
            (moments,) = sub  # one call per BatchNorm module (the interceptor checks)
            new = common.update_running(batch_stats["mean"], batch_stats["var"], moments, unbiased)
            out["mean"], out["var"] = new.mean, new.var
        else:
            out[name] = _updated(batch_stats[name], sub, unbiased)
    return out


_NEEDS_FLAG = (
    "{what}, but this LinenPipeline was built without "
    "`deferred_batch_norm=True`. A pipeline normalises each micro-batch separately and must not "
    "update the running statistics once per micro-batch; build it with "
    "`LinenPipeline(..., deferred_batch_norm=True)`, which updates them once per mini-batch."
)


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


def _check_collections(index: int, layer: nn.Module, variables: Mapping[str, Any], deferred: bool) -> None:
    if "batch_stats" in variables and not deferred:
        raise ValueError(
            _NEEDS_FLAG.format(
                what=f"Layer {index} ({type(layer).__name__}) creates 'batch_stats' (BatchNorm statistics)"
            )
        )
    extra = sorted(set(variables) - {"params", "batch_stats"})
    if extra:
        raise NotImplementedError(
            f"Layer {index} ({type(layer).__name__}) creates the variable collection(s) {extra} "
            "besides 'params' and 'batch_stats'. LinenPipeline supports parameters and "
            "BatchNorm statistics only (caches and other mutable state are not supported)."
        )


def _batch_stats_of(variables: Any) -> StageParams | None:
    try:
        state = variables["batch_stats"]["stages"]
    except (KeyError, TypeError, IndexError):
        return None
    return state if isinstance(state, StageParams) else None


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
