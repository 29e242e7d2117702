"""A Flax NNX module that runs a sequence of NNX modules as a GPipe pipeline.

``NNXPipeline(layers, balance=[...])`` takes NNX modules that already hold their parameters,
cuts them into stages of consecutive layers, and keeps:

* ``packed``: the layers' ``nnx.Param`` values in the stage-sharded layout of
  :meth:`pipejax.Pipeline.place` (one ``nnx.Param`` per dtype, of shape ``(num_stages, size)``;
  with a mesh, device ``s`` stores only row ``s``, its stage's parameters);
* ``layer_state``: the rest of each layer's state (for now, only rng streams are allowed);
* the layers' graph definitions (static), from ``nnx.split``.

A call rebuilds each layer inside its stage with ``nnx.merge`` from its graph definition and its
parameters, so every stage is a pure function ``stage(params, x, key)`` as
:func:`pipejax.pipeline` requires, and nothing of the pipeline's tracing leaks into the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from pipejax._src import flax_common as common
from pipejax._src.pipeline import Pipeline, pipeline
from pipejax._src.placement import StageParams

PyTree = Any


class NNXPipeline(nnx.Module):
    """Runs a sequence of NNX modules as a GPipe pipeline, as one NNX module.

    The layers are cut into stages of consecutive layers (``balance`` layers per stage, or
    ``num_stages`` even stages) and :func:`pipejax.pipeline` streams ``chunks`` micro-batches
    through them; with a ``mesh``, device ``s`` along ``axis_name`` runs stage ``s`` and stores
    only its parameters. The constructor copies the layers' parameters into the pipeline (later
    changes to the layer objects do not reach it); :meth:`to_sequential` gives them back as
    modules. The result equals running the layers in sequence on the whole batch.

    Calling: ``pipe(x, deterministic=None, rngs=None, **flags)``.

    * ``flags`` (e.g. ``train=True``) are passed to every layer whose ``__call__`` accepts them.
    * ``deterministic`` (the call's, else the module's attribute, which ``pipe.eval()`` and
      ``pipe.train()`` set) is set on every layer that has a ``deterministic`` attribute
      (``nnx.Dropout``) before it runs; ``None`` leaves the layers' own settings.
    * Randomness: if any layer holds an rng stream (``nnx.Dropout(rate, rngs=rngs)``), every call
      draws one key: from the call's ``rngs`` (an ``nnx.Rngs``, whose ``rng_collection`` stream is
      used, an ``nnx.RngStream``, or a key), else from the stream the pipeline was given at
      construction. Layer ``j`` (counted from 0 inside its stage) of stage ``s`` on micro-batch
      ``i`` is then reseeded before it runs, every stream in it:
      ``nnx.reseed(layer, **{name: jax.random.fold_in(pj.stage_key(key, i, s), j)})``. The keys do
      not depend on the mesh or the checkpoint mode, so all of them give bitwise the same result.

    Args:
      layers: the NNX modules, applied in order; non-parameter state other than rng streams
        (``nnx.BatchNorm``'s batch statistics) raises ``NotImplementedError`` for now.
      balance: the number of layers of each stage (``sum(balance) == len(layers)``), as in
        torchgpipe. Give this or ``num_stages``.
      num_stages: an even split into this many stages (the first ``len(layers) % num_stages``
        stages take one layer more).
      chunks: micro-batches per mini-batch (see :func:`pipejax.pipeline`).
      checkpoint: ``"always"``, ``"except_last"``, ``"never"`` or a ``jax.checkpoint`` policy.
      mesh: a mesh with an axis ``axis_name`` of one device per stage, or ``None``.
      axis_name: the stage axis of ``mesh``.
      deterministic: the default for calls: ``True`` turns dropout off in every layer, ``False``
        on, ``None`` keeps each layer's own setting.
      rng_collection: the stream taken from an ``nnx.Rngs`` given as ``rngs``.
      rngs: an ``nnx.Rngs`` or ``nnx.RngStream`` the pipeline forks its own key stream from; needed
        when layers hold rng streams, unless every call passes ``rngs``.

    Raises:
      TypeError, ValueError: for bad layers, balance, mesh or flags (see ``docs/flax.md``).
      NotImplementedError: for layers with state other than parameters and rng streams.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from pipejax.flax import NNXPipeline
      >>> rngs = nnx.Rngs(0)
      >>> layers = [nnx.Linear(5, 8, param_dtype=jnp.float64, rngs=rngs) for _ in range(1)]
      >>> layers += [nnx.Linear(8, 8, param_dtype=jnp.float64, rngs=rngs) for _ in range(2)]
      >>> pipe = NNXPipeline(layers, balance=[2, 1], chunks=2)
      >>> pipe.stage_params()
      StageParams(num_stages=2, buffers=(float64[2, 120]))
      >>> x = jnp.ones((4, 5))
      >>> y = pipe(x)
      >>> h = x
      >>> for layer in pipe.to_sequential():
      ...     h = layer(h)
      >>> bool(jnp.allclose(y, h))
      True
    """

    def __init__(
        self,
        layers: Sequence[nnx.Module],
        *,
        balance: Sequence[int] | None = None,
        num_stages: int | None = None,
        chunks: int = 1,
        checkpoint: str | Callable[..., Any] = "except_last",
        mesh: Mesh | None = None,
        axis_name: str = "stage",
        deterministic: bool | None = None,
        rng_collection: str = "dropout",
        rngs: nnx.Rngs | nnx.RngStream | None = None,
    ):
        _check_layers(layers)
        layers = list(layers)
        self._sizes = common.stage_sizes(len(layers), balance, num_stages)
        common.check_mesh(mesh, axis_name, self._sizes)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.mesh = mesh
        self.axis_name = axis_name
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        graphdefs, params, rest = [], [], []
        for index, layer in enumerate(layers):
            graphdef, p, r = nnx.split(layer, nnx.Param, ...)
            _check_state(index, layer, r)
            graphdefs.append(graphdef)
            params.append(p)
            rest.append(r)
        self.graphdefs = tuple(graphdefs)
        self.calls = tuple(type(layer).__call__ for layer in layers)
        # The rng stream names of each layer, all reseeded from the pipeline's key at every call.
        self.stream_names = tuple(
            tuple(sorted({v.tag for v in jax.tree.leaves(r, is_leaf=_is_var) if isinstance(v, nnx.RngKey)}))
            for r in rest
        )
        self.layer_state = nnx.data(rest)
        placed = self._engine().place(common.group(params, self._sizes))
        self.packed = nnx.List([nnx.Param(b) for b in placed.buffers])
        self.container, self.layouts = placed.container, placed.layouts
        if isinstance(rngs, nnx.Rngs):
            self.rngs = rngs[rng_collection].fork()
        elif isinstance(rngs, nnx.RngStream):
            self.rngs = rngs.fork()
        elif rngs is None:
            self.rngs = nnx.data(None)
        else:
            raise TypeError(
                f"`rngs` must be an nnx.Rngs, an nnx.RngStream or None, but got {type(rngs).__name__}."
            )

    def __call__(
        self,
        x: PyTree,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        **flags: Any,
    ) -> PyTree:
        flags_per_layer = common.route_kwargs(self.calls, flags)
        det = self.deterministic if deterministic is None else deterministic
        engine = self._engine(self._stage_fns(det, flags_per_layer))
        return engine(self.stage_params(), x, self._key(rngs))

    def set_view(self, deterministic: bool | None = None):
        """Used by ``nnx.view(model, deterministic=...)``: sets the default of calls.

        Args:
          deterministic: if not None, the new default of :attr:`deterministic`.
        """
        if deterministic is not None:
            self.deterministic = deterministic

    def stage_sizes(self) -> tuple[int, ...]:
        """The number of layers of each stage (``balance``, or the even split of ``num_stages``)."""
        return self._sizes

    def stage_params(self) -> StageParams:
        """The parameters as the pipeline takes them: a :class:`pipejax.StageParams`."""
        return StageParams(tuple(p[...] for p in self.packed), self.container, self.layouts)

    def layer_params(self, state: Any = None) -> list[nnx.State]:
        """Each layer's ``nnx.Param`` state, read out of the packed parameters.

        Args:
          state: ``None`` for the module's own parameters, or a state of the same form as
            ``nnx.state(pipe, nnx.Param)``, such as the gradient ``nnx.grad(loss)(pipe)``.

        Returns:
          One ``nnx.State`` per layer, in order, as ``nnx.state(layer, nnx.Param)`` lays it out.
        """
        if state is None:
            packed = self.stage_params()
        else:
            try:
                buffers = tuple(jax.tree.leaves(state["packed"]))
            except (KeyError, TypeError):
                buffers = ()
            if len(buffers) != len(self.container.dtypes):
                raise ValueError(
                    "`state` must have the form of `nnx.state(pipe, nnx.Param)` (a 'packed' entry "
                    f"with {len(self.container.dtypes)} array(s)), but got {type(state).__name__}."
                )
            packed = StageParams(buffers, self.container, self.layouts)
        return [p for stage in common.unpack(packed) for p in stage]

    def to_sequential(self) -> list[nnx.Module]:
        """The layers as separate modules, with the pipeline's current parameters.

        Returns:
          New modules (sharing nothing with the pipeline), in order; running them in sequence
          computes what the pipeline computes. Their rng streams are those the layers had when
          the pipeline was built.
        """
        return [
            nnx.merge(g, p, jax.tree.map(lambda a: a, r))
            for g, p, r in zip(self.graphdefs, self.layer_params(), self.layer_state, strict=True)
        ]

    # -- internals --------------------------------------------------------------------------

    def _key(self, rngs) -> jax.Array | None:
        if not any(self.stream_names):
            return None  # no layer can draw random numbers from a stream
        if isinstance(rngs, nnx.Rngs):
            return rngs[self.rng_collection]()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if isinstance(rngs, jax.Array):
            return rngs
        if rngs is not None:
            raise TypeError(
                "`rngs` must be an nnx.Rngs, an nnx.RngStream, a PRNG key or None, but got "
                f"{type(rngs).__name__}."
            )
        if self.rngs is None:
            holders = [index for index, names in enumerate(self.stream_names) if names]
            raise ValueError(
                f"Layers {holders} hold rng streams, which the pipeline reseeds at every call from "
                "a key of its own, but it has none: pass `rngs=nnx.Rngs(dropout=...)` to "
                "NNXPipeline(...) or to the call."
            )
        return self.rngs()

    def _stage_fns(self, det, flags_per_layer):
        layers = list(zip(self.graphdefs, self.layer_state, self.stream_names, flags_per_layer, strict=True))
        return [_stage_fn(stage, det) for stage in common.group(layers, self._sizes)]

    def _engine(self, fns=None) -> Pipeline:
        """The pipeline over ``fns``; without them, one for :meth:`Pipeline.place` only."""
        if fns is None:
            fns = [_stage_fn((), None)] * len(self._sizes)
        return pipeline(
            fns, chunks=self.chunks, checkpoint=self.checkpoint, mesh=self.mesh, axis_name=self.axis_name
        )


def _stage_fn(layers, det):
    """Stage ``stage(params, x, key)``; ``params[j]`` is layer ``j``'s ``nnx.Param`` state."""

    def stage(params, x, key):
        for j, ((graphdef, rest, names, kw), p) in enumerate(zip(layers, params, strict=True)):
            # Fresh Variables for the rest: the stored ones belong to the module, outside this trace.
            layer = nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest))
            if det is not None:
                layer.set_attributes(deterministic=det, raise_if_not_found=False)
            k = common.layer_key(key, j)
            if names and k is not None:
                nnx.reseed(layer, **{name: k for name in names})
            x = layer(x, **kw)
        return x

    return stage


def _is_var(v) -> bool:
    return isinstance(v, nnx.Variable)


def _check_layers(layers) -> None:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):  # nnx.List is one
        raise TypeError(
            "`layers` must be a sequence of nnx.Module (e.g. [nnx.Linear(4, 4, rngs=rngs), ...]), "
            f"but got {type(layers).__name__}."
        )
    if len(layers) == 0:
        raise ValueError("`layers` is empty; a pipeline needs at least one nnx.Module.")
    for index, layer in enumerate(layers):
        if not isinstance(layer, nnx.Module):
            hint = ""
            if type(layer).__module__.startswith("flax.linen"):
                hint = " For Flax Linen modules use `pipejax.flax.LinenPipeline`."
            elif callable(layer):
                hint = " Wrap a function in an nnx.Module whose `__call__(self, x)` applies it."
            raise TypeError(f"`layers[{index}]` must be an nnx.Module, but got {type(layer).__name__}.{hint}")


def _check_state(index: int, layer: nnx.Module, rest: Any) -> None:
    other = sorted(
        {
            type(v).__name__
            for v in jax.tree.leaves(rest, is_leaf=_is_var)
            if _is_var(v) and not isinstance(v, nnx.RngState)
        }
    )
    if other:
        raise NotImplementedError(
            f"Layer {index} ({type(layer).__name__}) holds state of type(s) {other} besides its "
            "nnx.Param parameters and rng streams. Mutable layer state (such as BatchNorm's "
            "batch statistics) is not supported by NNXPipeline yet; use layers with parameters "
            "only (e.g. nnx.LayerNorm instead of nnx.BatchNorm)."
        )
