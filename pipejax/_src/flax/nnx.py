"""A Flax NNX module that runs a sequence of NNX modules as a micro-batch pipeline.

``NNXPipeline(layers, balance=[...])`` takes NNX modules that already hold their parameters,
cuts them into stages of consecutive layers, and keeps:

* ``packed``: the layers' ``nnx.Param`` values in the stage-sharded layout of
  :meth:`pipejax.Pipeline.place` (one ``nnx.Param`` per dtype, of shape ``(num_stages, size)``;
  with a mesh, device ``s`` stores only row ``s``, its stage's parameters);
* ``packed_batch_stats``: with ``deferred_batch_norm=True``, the layers' ``nnx.BatchStat``
  values (BatchNorm running statistics) in the same layout (one ``nnx.BatchStat`` per dtype);
* ``layer_state``: the rest of each layer's state (only rng streams are allowed);
* the layers' graph definitions (static), from ``nnx.split``.

A call rebuilds each layer inside its stage with ``nnx.merge`` from its graph definition and its
parameters, so every stage is a pure function ``stage(params, x, key)`` as
:func:`pipejax.pipeline` requires, and nothing of the pipeline's tracing leaks into the module.

Deferred BatchNorm: the pipeline then runs with stage state, ``stage(params, x, key, state, mask)
-> (y, stats)``, where ``state`` holds the stage's batch statistics. Inside the stage every
``nnx.BatchNorm`` of the rebuilt layers (a fresh object, private to the stage's trace) has its
class switched to a subclass whose training call passes the micro-batch's row mask as
``mask=`` (so padding rows do not count) and records the micro-batch's :class:`~pipejax.Moments`;
its own update of the (fresh, discarded) ``BatchStat`` is dropped. After the call the pipeline
updates ``packed_batch_stats`` once from the moments of all micro-batches.

This module holds :class:`NNXPipeline`; the rebuilt layer as a pure function and the BatchNorm
class switch are :mod:`pipejax._src.flax.nnx_layers`, the checks of its arguments and layers and
its rng-stream helpers :mod:`pipejax._src.flax.nnx_checks`, and :func:`~pipejax.flax.unstack` /
:func:`~pipejax.flax.restack` (``nnx.vmap`` layer stacks) :mod:`pipejax._src.flax.nnx_stacking`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pipejax._src import checks
from pipejax._src.flax import calls as flax_calls
from pipejax._src.flax import common
from pipejax._src.flax import sharding as flax_sharding
from pipejax._src.flax.nnx_checks import (
    _NAME,
    _check_deterministic,
    _check_state,
    _check_use_running_average,
    _describe_rngs,
    _is_var,
    _rngs_fix,
    _sharding,
    _stream,
    _takes_rngs,
)
from pipejax._src.flax.nnx_layers import _NNXLayers
from pipejax._src.params.placement import StageParams

PyTree = Any


class NNXPipeline(nnx.Module):
    """Runs a sequence of NNX modules as a micro-batch pipeline, as one NNX module.

    The layers are cut into stages of consecutive layers (``balance`` layers per stage, or
    ``num_stages`` even stages) and :func:`pipejax.pipeline` streams ``chunks`` micro-batches
    through them; with a ``mesh``, device ``s`` along ``axis_name`` runs stage ``s`` and stores
    only its parameters. The constructor copies the layers' parameters into the pipeline (later
    changes to the layer objects do not reach it); :meth:`to_sequential` gives them back as
    modules. The result equals running the layers in sequence on the whole batch.

    Calling: ``pipe(x, deterministic=None, rngs=None, context=None, **flags)``.

    * ``context`` (side inputs: attention masks, positions, segment ids): a dict from keyword
      names to arrays (or pytrees of arrays) with ``x``'s leading batch axis. They are cut into
      micro-batches with ``x`` (padding rows included), and every layer whose ``__call__`` takes
      a keyword argument of an entry's name receives its micro-batch's rows under that name:
      ``context={"decoder_mask": mask}`` runs ``layer(h, decoder_mask=rows_of_mask)``. Layers
      that do not take it do not receive it; an entry no layer takes is a ``TypeError``.
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
    * Call-time rngs: a layer whose ``__call__`` names an ``rngs`` parameter (current NNX style:
      ``nnx.Dropout(rate)`` holds no stream and is called as ``self.drop(h, rngs=rngs)``)
      receives its own ``rngs=nnx.Rngs(...)``, with the same per-(micro-batch, stage, layer) key
      ``k = jax.random.fold_in(pj.stage_key(key, i, s), j)``, reseeded as a held stream is:
      ``rngs = nnx.Rngs(dropout=k); nnx.reseed(rngs, dropout=k)`` (one stream per name in
      ``rng_collection`` and the streams of a call's ``nnx.Rngs``). So a layer that draws once
      gets the mask it would get holding the stream. The key is drawn as above (from the call's
      ``rngs``, else the pipeline's own stream); with neither, such layers are called without
      ``rngs``, as they would be outside the pipeline.

    BatchNorm: with ``deferred_batch_norm=True``, ``nnx.BatchNorm`` layers (also nested inside a
    layer) work as torchgpipe's deferred batch norm. In training (``use_running_average=False``)
    each micro-batch is normalised with its own statistics over its real rows (the padding rows
    of an uneven batch do not count), and the call updates the running statistics (the
    pipeline's ``nnx.BatchStat`` variables) **once**, from the statistics of the whole
    mini-batch: ``new = momentum * old + (1 - momentum) * batch``, with the layer's momentum
    and, by default, the biased variance ``M2 / N``: the statistics ``nnx.BatchNorm`` tracks on
    the whole batch (``unbiased_variance=True`` tracks PyTorch's unbiased ``M2 / (N - 1)``). In
    evaluation (``pipe.eval()``, or
    ``use_running_average=True``) the running statistics are used; the schedule and
    checkpointing are the same in both modes. Without the flag, layers with ``nnx.BatchStat``
    raise ``ValueError``: a pipeline never updates them once per micro-batch.

    Args:
      layers: the NNX modules, applied in order; non-parameter state other than rng streams and
        ``nnx.BatchNorm`` statistics raises ``NotImplementedError``.
      balance: the number of layers of each stage (``sum(balance) == len(layers)``), as in
        torchgpipe. Give this or ``num_stages``.
      num_stages: an even split into this many stages (the first ``len(layers) % num_stages``
        stages take one layer more).
      deterministic: the default for calls: ``True`` turns dropout off in every layer, ``False``
        on, ``None`` keeps each layer's own setting.
      rng_collection: the stream taken from an ``nnx.Rngs`` given as ``rngs``.
      rngs: an ``nnx.Rngs`` or ``nnx.RngStream`` the pipeline forks its own key stream from; needed
        when layers hold rng streams, unless every call passes ``rngs``.
      deferred_batch_norm: support ``nnx.BatchNorm`` layers with deferred batch norm, as
        described above (torchgpipe's flag).
      use_running_average: the default for calls: ``True`` makes every BatchNorm use its running
        statistics, ``False`` the micro-batch's, ``None`` keeps each layer's own setting.
        ``pipe.eval()`` and ``pipe.train()`` set it.
      unbiased_variance: whether the running variance tracks the unbiased ``M2 / (N - 1)``
        (True, as PyTorch) or the biased ``M2 / N`` (False, the default, as ``nnx.BatchNorm``).
      carry: which part of each layer's output is the activation passed to the next layer (and
        returned by the last): ``None``, the whole output; an int, the item of a tuple output,
        negative ones counting from the end as in Python (``carry=1`` for layers that return
        ``(cache, x)``; other outputs pass whole); a str, the entry of a dict output; or a
        function ``out -> activation``. With an int or a str the other items are not passed
        on: without ``aux=`` they must hold no arrays (``ValueError``); with it they are
        collected.
      **pipeline_options: options of :func:`pipejax.pipeline`, forwarded unchanged and checked
        by it: ``chunks``, ``checkpoint``, ``mesh``, ``axis_name``, ``schedule``, ``repeats``,
        ``data_axis_name``, ``per_example_keys``, ``aux``. With ``aux="stack"``, ``"sum"`` or
        ``"mean"`` a call returns ``(y, aux)``, ``aux`` a list with one dict per layer of what
        the layer produced beside its activation, per micro-batch reduced as ``aux`` says:
        ``"outputs"`` (what ``carry=`` did not pass on) and ``"intermediates"`` (what it sowed
        with ``self.sow(nnx.Intermediate, ...)``); see :meth:`value_and_grad`'s ``aux_loss``.
        Kept as the attribute ``pipeline_options``.

    Raises:
      TypeError, ValueError: for bad layers, balance, mesh or flags (see ``docs/flax_batchnorm.md``), and
        for BatchNorm layers without ``deferred_batch_norm=True``.
      NotImplementedError: for layers with state other than parameters, rng streams and
        ``nnx.BatchNorm`` statistics.

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
        deterministic: bool | None = None,
        rng_collection: str = "dropout",
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        deferred_batch_norm: bool = False,
        use_running_average: bool | None = None,
        unbiased_variance: bool = False,
        carry: flax_calls.Carry = None,
        **pipeline_options: Any,
    ):
        common.check_layers(layers, nnx.Module, "an nnx.Module", _NAME, ("flax.linen", "LinenPipeline"))
        layers = list(layers)
        stack = common.Stack(
            len(layers),
            balance,
            num_stages,
            deferred_batch_norm=deferred_batch_norm,
            unbiased_variance=unbiased_variance,
            options=pipeline_options,
            owner=_NAME,
            carry=carry,
            leaf_keys=("value",),  # a parameter leaf is a Param's value
        )
        self._stack = nnx.static(stack)
        self.pipeline_options = nnx.static(stack.options)
        self.deterministic = _check_deterministic(deterministic, f"{_NAME}(...)")
        self.rng_collection = common.check_rng_collection(rng_collection, _NAME)
        self.deferred_batch_norm = deferred_batch_norm
        self.use_running_average = _check_use_running_average(use_running_average, f"{_NAME}(...)")
        self.unbiased_variance = unbiased_variance
        graphdefs, params, batch_stats, rest = [], [], [], []
        for index, layer in enumerate(layers):
            graphdef, p, bs, r = nnx.split(layer, nnx.Param, nnx.BatchStat, ...)
            _check_state(index, layer, bs, r, deferred_batch_norm)
            graphdefs.append(graphdef)
            params.append(p)
            batch_stats.append(bs)
            rest.append(r)
        self.graphdefs = tuple(graphdefs)
        self.calls = tuple(type(layer).__call__ for layer in layers)
        self.layer_types = tuple(type(layer).__name__ for layer in layers)  # for messages
        # Which layers take `rngs=` at call time (current NNX style: `nnx.Dropout(rate)` holding no
        # stream, called as `dropout(x, rngs=rngs)`): they receive an nnx.Rngs of their own key.
        self.takes_rngs = tuple(_takes_rngs(call) for call in self.calls)
        # The rng stream names of each layer, all reseeded from the pipeline's key at every call.
        self.stream_names = tuple(
            tuple(sorted({v.tag for v in jax.tree.leaves(r, is_leaf=_is_var) if isinstance(v, nnx.RngKey)}))
            for r in rest
        )
        # Placed replicated over the mesh, as a jitted step returns them: arrays made on one device
        # (the layers' rng streams, the pipeline's own) would make the second step compile again.
        self.layer_state = nnx.data(stack.replicated(rest))
        # the layers' own sharding metadata (nnx.with_partitioning, resolved by nnx's rules) says
        # how each parameter is split inside its stage
        specs = flax_sharding.split_specs([nnx.get_partition_spec(p) for p in params], stack.placer.plan)
        placed = stack.place(params, specs)
        self.packed = nnx.List([nnx.Param(b, **_sharding(stack, b)) for b in placed.buffers])
        self.container, self.layouts = placed.container, placed.layouts
        self.stats_container = self.stats_layouts = None
        self.packed_batch_stats = nnx.List([])
        if jax.tree.leaves(batch_stats):
            placed = stack.place(batch_stats)
            self.packed_batch_stats = nnx.List(
                [nnx.BatchStat(b, **_sharding(stack, b)) for b in placed.buffers]
            )
            self.stats_container, self.stats_layouts = placed.container, placed.layouts
        if isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
            stream = (
                _stream(rngs, rng_collection, "built with") if isinstance(rngs, nnx.Rngs) else rngs
            ).fork()
            nnx.update(stream, stack.replicated(nnx.state(stream)))
            self.rngs = stream
        elif rngs is None:
            self.rngs = nnx.data(None)
        else:
            raise TypeError(
                f"`rngs` of NNXPipeline(...) is what the pipeline forks its own key stream from: an "
                f"nnx.Rngs (its `rng_collection` stream, {rng_collection!r}), an nnx.RngStream, or "
                f"None, but got {_describe_rngs(rngs)}. {_rngs_fix(rngs, rng_collection)}"
            )

    def __call__(
        self,
        x: PyTree,
        *,
        deterministic: bool | None = None,
        use_running_average: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        context: Mapping[str, PyTree] | None = None,
        **flags: Any,
    ) -> PyTree:
        stack = self._stack
        call = flax_calls.prepare(self.calls, context, flags)
        det = _check_deterministic(deterministic, "an NNXPipeline call")
        det = self.deterministic if det is None else det
        ura = _check_use_running_average(use_running_average, "an NNXPipeline call")
        ura = self.use_running_average if ura is None else ura
        run = self._run_layer(det, ura, self._call_streams(rngs))
        engine = stack.pipeline(run, call.kwargs, call.names)  # built once per configuration
        if not stack.deferred:
            out = engine(self.stage_params(), x, self._key(rngs), **call.side)
            return out if stack.aux is None else (out[0], stack.layer_aux(out[1]))
        state = self.stage_batch_stats()
        out = engine(self.stage_params(), x, self._key(rngs), state=state, **call.side)
        y, stats = out[:2]
        new = stack.updated_state(state, stats)
        if new is not None:  # some BatchNorm ran in training: its statistics change once
            for var, buffer in zip(self.packed_batch_stats, new.buffers, strict=True):
                var[...] = buffer
        return y if stack.aux is None else (y, stack.layer_aux(out[2]))

    def value_and_grad(self, loss_fn: Any, *, aux_loss: Any = None) -> Any:
        """A training step of this module that returns the loss and its gradient, run by its schedule.

        Returns ``step(x, targets, *, deterministic=None, rngs=None, context=None, **flags) ->
        (loss, grads)``, which reads the module's current parameters when called.
        ``loss_fn(outputs, targets)`` gives one loss per example (``outputs`` is what the call
        ``pipe(x, ...)`` returns); the loss is their mean over the batch (padding rows of an
        uneven batch excluded) and ``grads`` is an ``nnx.State`` of the form of
        ``nnx.state(pipe, nnx.Param)``, what ``nnx.grad`` of a loss of ``pipe`` gives, so
        ``optimizer.update(pipe, grads)`` takes it. ``deterministic``, ``rngs``, ``context`` and
        ``flags`` mean what they mean for the call: the step draws one key as a call does
        (from ``rngs``, else from the pipeline's own stream, which advances), so with the same
        key the layers see the same dropout masks and the loss equals the mean of
        ``loss_fn(pipe(x, rngs=key, ...), targets)``.

        * ``schedule="gpipe"`` or ``"circular"``: ``jax.value_and_grad`` of that loss;
        * ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``: :meth:`pipejax.Pipeline.value_and_grad`
          of the module's pipeline, one program that runs the schedule's forward and backward
          slots, keeping what the backward needs of a bounded number of micro-batches per device.

        The module must be the whole model trained this way (an embedding and a head are its
        first and last layers; stages may differ): the step differentiates with respect to the
        module's parameters only. Inside ``nnx.jit``, call ``model.value_and_grad(loss_fn)`` on
        the model the jitted function receives (not on one captured from outside).

        With ``aux=`` (the layers' auxiliary outputs, see the class docstring), ``step`` returns
        ``((loss, aux), grads)``, ``aux`` a list with one entry per layer, and ``aux_loss``
        adds their losses: ``aux_loss(a)`` is called on the aux ``a`` of each layer and
        micro-batch (a dict with ``"outputs"`` and/or ``"intermediates"``; return ``None``
        for a layer without a loss), and the loss gains ``sum_l sum_i w_i aux_loss(a_li)``,
        ``w_i`` micro-batch ``i``'s share of the batch's real examples, under every schedule
        (:meth:`pipejax.Pipeline.value_and_grad`).

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
          >>> import jax, jax.numpy as jnp
          >>> from flax import nnx
          >>> from pipejax.flax import NNXPipeline
          >>> rngs = nnx.Rngs(0)
          >>> layers = [nnx.Linear(4, 8, param_dtype=jnp.float64, rngs=rngs) for _ in range(1)]
          >>> layers += [nnx.Linear(8, 8, param_dtype=jnp.float64, rngs=rngs) for _ in range(2)]
          >>> pipe = NNXPipeline(layers, balance=[2, 1], chunks=3, schedule="zb-h1")
          >>> x, t = jnp.ones((5, 4)), jnp.zeros((5, 8))
          >>> sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)  # one loss per example
          >>> loss, grads = pipe.value_and_grad(sq)(x, t)
          >>> gpipe = NNXPipeline(layers, balance=[2, 1], chunks=3)  # its forward call differentiates
          >>> loss_ref, grads_ref = nnx.value_and_grad(lambda m: sq(m(x), t).mean())(gpipe)
          >>> bool(jnp.allclose(loss, loss_ref))
          True
          >>> jax.tree.structure(grads) == jax.tree.structure(grads_ref)
          True
        """
        stack = self._stack
        stack.check_trainable(loss_fn)
        stage_aux_loss = stack.check_aux_loss(aux_loss)

        def step(x, targets, *, deterministic=None, rngs=None, context=None, **flags):
            call = flax_calls.prepare(self.calls, context, flags)
            det = _check_deterministic(deterministic, "NNXPipeline.value_and_grad's step")
            det = self.deterministic if det is None else det
            run = self._run_layer(det, self.use_running_average, self._call_streams(rngs))
            f = stack.value_and_grad(run, loss_fn, call.kwargs, call.names, stage_aux_loss)  # built once
            loss, grads = f(self.stage_params(), x, targets, self._key(rngs), context)
            like = nnx.state(self, nnx.Param)
            return loss, jax.tree.unflatten(jax.tree.structure(like), list(grads.buffers))

        return step

    def set_view(self, deterministic: bool | None = None, use_running_average: bool | None = None):
        """Used by ``nnx.view(model, deterministic=..., use_running_average=...)``: sets call defaults.

        Args:
          deterministic: if not None, the new default of :attr:`deterministic`.
          use_running_average: if not None, the new default of :attr:`use_running_average`.
        """
        deterministic = _check_deterministic(deterministic, "NNXPipeline.set_view")
        use_running_average = _check_use_running_average(use_running_average, "NNXPipeline.set_view")
        if deterministic is not None:
            self.deterministic = deterministic
        if use_running_average is not None:
            self.use_running_average = use_running_average

    def stage_sizes(self) -> tuple[int, ...]:
        """The number of layers of each stage (``balance``, or the even split of ``num_stages``)."""
        return self._stack.sizes

    def stage_params(self) -> StageParams:
        """The parameters as the pipeline takes them: a :class:`pipejax.StageParams`."""
        return StageParams(tuple(p[...] for p in self.packed), self.container, self.layouts)

    def stage_batch_stats(self) -> StageParams | None:
        """The BatchNorm statistics as the pipeline takes them (``None`` without BatchNorm)."""
        if self.stats_container is None:
            return None
        return StageParams(
            tuple(b[...] for b in self.packed_batch_stats), self.stats_container, self.stats_layouts
        )

    def layer_batch_stats(self) -> list[nnx.State]:
        """Each layer's ``nnx.BatchStat`` state (empty for layers without BatchNorm), in order."""
        state = self.stage_batch_stats()
        if state is None:
            return [nnx.State({}) for _ in self.graphdefs]
        return self._stack.unpack(state)

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
        return self._stack.unpack(packed)

    def to_sequential(self) -> list[nnx.Module]:
        """The layers as separate modules, with the pipeline's current parameters.

        Returns:
          New modules (sharing nothing with the pipeline), in order, with the current BatchNorm
          statistics; running them in sequence computes what the pipeline computes (in training,
          BatchNorm on the whole batch instead of per micro-batch). Their rng streams are those
          the layers had when the pipeline was built.
        """
        return [
            nnx.merge(g, p, bs, jax.tree.map(lambda a: a, r))
            for g, p, bs, r in zip(
                self.graphdefs, self.layer_params(), self.layer_batch_stats(), self.layer_state, strict=True
            )
        ]

    # -- internals --------------------------------------------------------------------------

    def _key(self, rngs) -> jax.Array | None:
        holders = any(self.stream_names)
        if not holders and not any(self.takes_rngs):
            return None  # no layer can draw random numbers
        if isinstance(rngs, nnx.Rngs):
            return _stream(rngs, self.rng_collection, "called with", self._drawing)()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if isinstance(rngs, jax.Array):
            return checks.check_key(
                rngs,
                name="rngs",
                where="an NNXPipeline call",
                purpose=(
                    f"It may also be an nnx.Rngs (e.g. `nnx.Rngs({self.rng_collection}=0)`) or an "
                    "nnx.RngStream."
                ),
                batch_fix=(
                    "Pass one key: the pipeline derives each layer's keys from it "
                    "(`per_example_keys=True` for one key per example)."
                ),
            )
        if rngs is not None:
            raise TypeError(
                "`rngs` of an NNXPipeline call gives the call's one key: an nnx.Rngs (its "
                f"`rng_collection` stream, {self.rng_collection!r}), an nnx.RngStream, a PRNG key "
                f"(`jax.random.key(0)`) or None, but got {_describe_rngs(rngs)}. "
                f"{_rngs_fix(rngs, self.rng_collection, key=True)}"
            )
        if self.rngs is None:
            if not holders:  # layers that take `rngs` at call time get none, as unpipelined
                return None
            holders = [index for index, names in enumerate(self.stream_names) if names]
            raise ValueError(
                f"Layers {holders} hold rng streams, which the pipeline reseeds at every call from "
                f"a key of its own, but it has none: pass `rngs=nnx.Rngs({self.rng_collection}=...)` "
                "to NNXPipeline(...) or to the call."
            )
        return self.rngs()

    def _drawing(self) -> str:
        """The layers that draw from the call's key, for messages: ``"layers 0-3 (stages 0-1,
        Block), which hold rng streams"``."""
        parts = []
        for flags, one, many in (
            ([bool(n) for n in self.stream_names], "holds rng streams", "hold rng streams"),
            (self.takes_rngs, "takes `rngs` at call time", "take `rngs` at call time"),
        ):
            indices = [index for index, flag in enumerate(flags) if flag]
            if indices:
                where = flax_calls.layers_where(indices, self._stack.sizes, self.layer_types)
                parts.append(f"{where}, which {one if len(indices) == 1 else many}")
        return "; ".join(parts)

    def _call_streams(self, rngs) -> tuple[str, ...]:
        """The streams of the ``nnx.Rngs`` a layer that takes ``rngs`` receives: ``rng_collection``
        and, when the call's ``rngs`` is an ``nnx.Rngs``, every stream it has."""
        names = {self.rng_collection}
        if isinstance(rngs, nnx.Rngs):
            names.update(rngs)
        return tuple(sorted(names))

    def _run_layer(
        self, det: bool | None, ura: bool | None, call_streams: tuple[str, ...] | None = None
    ) -> _NNXLayers:
        """Layer ``index`` as a pure function: rebuilt with ``nnx.merge``, reseeded from its key.

        ``call_streams``: the streams of the rngs given to layers that take ``rngs`` (``None``: those
        of a call without an ``nnx.Rngs``, :meth:`_call_streams`)."""
        if call_streams is None:
            call_streams = self._call_streams(None)
        rest = []
        for state in self.layer_state:
            leaves, treedef = jax.tree.flatten(state)
            rest.append((treedef, tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves)))
        streams = tuple(call_streams if takes else () for takes in self.takes_rngs)
        return _NNXLayers(
            self.graphdefs,
            tuple(rest),
            self.stream_names,
            streams,
            det,
            ura,
            self._stack.deferred,
            self.layer_types,
            self._stack.sizes,
            self.rng_collection,
        )
