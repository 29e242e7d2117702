"""A Flax NNX module that runs a sequence of NNX modules as a GPipe pipeline.

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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from pipejax._src import checks
from pipejax._src.flax import batchnorm as flax_batchnorm
from pipejax._src.flax import calls as flax_calls
from pipejax._src.flax import common
from pipejax._src.flax import sharding as flax_sharding
from pipejax._src.params.placement import StageParams

PyTree = Any


class NNXPipeline(nnx.Module):
    """Runs a sequence of NNX modules as a GPipe pipeline, as one NNX module.

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
      TypeError, ValueError: for bad layers, balance, mesh or flags (see ``docs/flax.md``), and
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
        specs = None
        if stack.placer.mesh is not None:
            specs = flax_sharding.split_specs(
                [nnx.get_partition_spec(p) for p in params], stack.placer.mesh, stack.placer.axis_name
            )
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


@dataclasses.dataclass(frozen=True)
class _NNXLayers:
    """Layer ``index`` as a pure function: rebuilt with ``nnx.merge``, reseeded from its key.

    A :class:`~pipejax._src.flax.common.RunLayer` equal by value (graph definitions, call defaults,
    and the structure, shapes and dtypes of the layers' rng state), so identically built
    pipelines share one cached pipeline. It holds no arrays: a layer's rng state (its streams'
    keys and counts) is rebuilt as zeros of its shapes, since ``nnx.reseed`` overwrites all of it
    (keys and counts) before the layer runs (a layer with rng streams always receives a key: the
    pipeline draws one at every call, ``NNXPipeline._key``). A layer that takes ``rngs`` at call
    time receives a new ``nnx.Rngs`` of the streams ``call_streams[index]``, reseeded from its
    key the same way, when there is a key.
    """

    graphdefs: tuple[Any, ...]
    rest: tuple[tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]], ...]  # (treedef, shapes) per layer
    stream_names: tuple[tuple[str, ...], ...]
    call_streams: tuple[tuple[str, ...], ...]  # per layer: the streams of its call-time rngs (or ())
    det: bool | None
    ura: bool | None
    deferred: bool
    # for messages only (not part of the cache key: the graph definitions and the stack decide them)
    names: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # per layer: its class
    sizes: tuple[int, ...] = dataclasses.field(default=(), compare=False)  # layers of each stage
    rng_collection: str = dataclasses.field(default="dropout", compare=False)  # the call key's stream

    def __call__(self, index, variables, x, key, mask, kwargs):
        states = [variables["params"]]
        if "batch_stats" in variables:
            states.append(variables["batch_stats"])
        treedef, shapes = self.rest[index]
        rest = jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype) for shape, dtype in shapes])
        layer = nnx.merge(self.graphdefs[index], *states, rest)
        if self.det is not None:
            layer.set_attributes(deterministic=self.det, raise_if_not_found=False)
        if self.ura is not None:
            layer.set_attributes(use_running_average=self.ura, raise_if_not_found=False)
        if self.stream_names[index]:
            assert key is not None, "a layer with rng streams runs without a key"  # NNXPipeline._key
            nnx.reseed(layer, **{name: key for name in self.stream_names[index]})
        if self.call_streams[index] and key is not None:  # `__call__(..., rngs=None)`: reseeded alike
            streams = {name: key for name in self.call_streams[index]}
            rngs = nnx.Rngs(**streams)
            nnx.reseed(rngs, **streams)
            kwargs = {**kwargs, "rngs": rngs}
        records: dict[tuple[str, ...], flax_batchnorm.SownMoments] = {}
        for path, module in nnx.iter_graph(layer):
            if isinstance(module, nnx.BatchNorm):
                path = tuple(str(p) for p in path)
                where = f"Layer {index}'s {type(module).__name__} (at {'/'.join(path) or 'the layer itself'})"
                if not self.deferred:
                    raise ValueError(flax_batchnorm.needs_flag(f"{where} is an nnx.BatchNorm", _NAME))
                object.__setattr__(module, "__class__", _deferred_class(type(module)))
                object.__setattr__(module, _CTX, _Deferred(mask, path, records, where))
        try:
            if hasattr(nnx, "capture"):  # sown values (`self.sow(nnx.Intermediate, ...)`): the layer's aux
                y, sown = nnx.capture(layer, nnx.Intermediate)(x, **kwargs)
            else:  # flax before nnx.capture: sow stores into the layer
                y, sown = layer(x, **kwargs), nnx.pop(layer, nnx.Intermediate)
            return y, records, nnx.to_pure_dict(sown)
        except ValueError as err:
            if self.call_streams[index] and key is None and "rngs" in str(err):
                err.add_note(
                    f"pipejax.flax.NNXPipeline: {self._where(index, layer)} takes `rngs` at "
                    "call time, and the pipeline had no key to give it: pass `rngs=` to the call (a "
                    f"key, an nnx.Rngs or an nnx.RngStream), or `rngs=nnx.Rngs({self.rng_collection}=...)` "
                    "to NNXPipeline(...), or turn dropout off (`deterministic=True`, `pipe.eval()`)."
                )
            raise
        except (KeyError, AttributeError) as err:
            name = flax_calls.missing_stream(err)
            if self.call_streams[index] and key is not None and name is not None:
                err.add_note(self._missing_stream_note(index, layer, name))
            raise

    def _where(self, index: int, layer: nnx.Module) -> str:
        return (
            flax_calls.layer_where(index, self.sizes, type(layer).__name__)
            if self.sizes
            else f"layer {index}"
        )

    def _missing_stream_note(self, index: int, layer: nnx.Module, name: str) -> str:
        """Layer ``index`` drew from the stream ``name``, which the call-time rngs it received lack."""
        given = list(self.call_streams[index])
        wanted = sorted({*given, name} - {self.rng_collection})
        streams = ", ".join(f"{n}=..." for n in wanted)
        return (
            f"pipejax.flax.NNXPipeline: {self._where(index, layer)} draws from the stream {name!r} of "
            f"the `rngs` it is called with, but the nnx.Rngs the pipeline gave it has the streams "
            f"{given} only: the pipeline's `rng_collection` ({self.rng_collection!r}) and the streams "
            f"of the call's nnx.Rngs (none when the call passes a key or an nnx.RngStream), all "
            f"seeded from the call's one key. Call with an nnx.Rngs that has the stream: "
            f"`rngs=nnx.Rngs({self.rng_collection}=..., {streams})` (the other streams' seeds do not "
            f"matter: the pipeline draws one key from {self.rng_collection!r} and seeds them all from it)."
        )


_CTX = "_pipejax_deferred_batch_norm"  # the attribute a switched BatchNorm reads its context from


class _Deferred:
    """What a switched BatchNorm needs: the row mask, its path, and where to record its moments."""

    def __init__(self, mask, path: tuple[str, ...], records: dict, where: str):
        self.mask, self.path, self.records, self.where = mask, path, records, where


@functools.cache
def _deferred_class(base: type) -> type:
    """A subclass of the BatchNorm class ``base`` whose training call is deferred batch norm."""

    def __call__(self, x, use_running_average=None, *, mask=None):
        ctx = getattr(self, _CTX)
        train = use_running_average is False or (
            use_running_average is None and self.use_running_average is False
        )
        if not train:  # evaluation (or no setting, which BatchNorm reports itself): unchanged
            return base.__call__(self, x, use_running_average, mask=mask)
        flax_batchnorm.check_training_call(ctx.where, mask, self.axis_name, ctx.path, ctx.records)
        y = base.__call__(self, x, use_running_average, mask=flax_batchnorm.row_mask_for(ctx.mask, x))
        ctx.records[ctx.path] = flax_batchnorm.batch_norm_moments(x, ctx.mask, self.axis, self.momentum)
        return y

    def body(ns):
        ns["__call__"] = __call__
        ns["__module__"] = __name__

    return types.new_class(f"Deferred{base.__name__}", (base,), exec_body=body)


def _path_key(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


def unstack(stack: nnx.Module, *, num_layers: int | None = None) -> list[nnx.Module]:
    """The layers of an NNX layer stack, as separate modules.

    Flax builds deep models as one module whose variables have a leading layer axis
    (``nnx.vmap`` over a constructor, with ``nnx.split_rngs``), run with ``nnx.scan``. Layer
    ``l`` is the same module with the slices ``[l]`` of every variable (rng streams included).

    A module that was not built as a stack is refused, since slicing it would give "layers" of
    the wrong shapes (an ``nnx.Linear(4, 4)`` would give 4 layers with kernels of shape
    ``(4,)``). The rule, checked on the first layer:

    * every variable has a leading axis, of one size ``L`` for all of them;
    * every Flax layer inside (``nnx.Linear``, ``nnx.Conv``, ``nnx.LayerNorm``, ...) has the
      parameter shapes its own configuration makes (it is rebuilt abstractly with
      ``nnx.eval_shape`` to compare);
    * no parameter of another module becomes a scalar: a stacked per-layer scalar is rare, a
      vector mistaken for a stack is common. If your layers do hold scalar parameters, confirm
      the stack by passing ``num_layers=L``.

    Args:
      stack: the stacked module.
      num_layers: the number of layers ``L``, if known: checked against the leading axis, and it
        allows scalar parameters in the layers.

    Returns:
      ``L`` new modules sharing nothing with ``stack``: pass them to :class:`NNXPipeline`.

    Raises:
      TypeError: ``stack`` is not an ``nnx.Module``.
      ValueError: ``stack`` is not a layer stack (the rule above), or ``num_layers`` differs
        from its leading axis.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from pipejax.flax import restack, unstack
      >>> @nnx.split_rngs(splits=3)
      ... @nnx.vmap(in_axes=(0,), out_axes=0)
      ... def create(rngs):
      ...     return nnx.Linear(2, 2, rngs=rngs)
      >>> layers = unstack(create(nnx.Rngs(0)))
      >>> len(layers), layers[0].kernel.shape, restack(layers).kernel.shape
      (3, (2, 2), (3, 2, 2))
    """
    if not isinstance(stack, nnx.Module):
        raise TypeError(
            f"`stack` of unstack must be an nnx.Module built as a layer stack (nnx.vmap over a "
            f"constructor), but got {type(stack).__name__}. For a list of layers, pass it to "
            "NNXPipeline directly."
        )
    graphdef, state = nnx.split(stack)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if not leaves:
        raise ValueError(
            f"`stack` ({type(stack).__name__}) has no variables, so it has no layer axis to unstack; "
            "build the stack with nnx.vmap over a constructor."
        )
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for _, a in leaves}
    if len(sizes) != 1 or None in sizes:
        listing = ", ".join(f"{jax.tree_util.keystr(p)}: {jnp.shape(a)}" for p, a in leaves)
        raise ValueError(
            f"`stack` must be a layer stack (every variable stacked on one leading layer axis, as "
            f"nnx.vmap makes it), but its variables have leading sizes {sorted(sizes, key=str)} "
            f"(None: a scalar); shapes {listing}. A single layer needs no unstacking: pass [module]."
        )
    (size,) = sizes
    if num_layers is not None:
        num_layers = checks.check_int(num_layers, "num_layers", 1, "unstack")
        if num_layers != size:
            raise ValueError(
                f"`num_layers` of unstack is {num_layers}, but the variables of `stack` have a leading "
                f"axis of size {size}."
            )
    layers = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(size)]
    _check_unstacked(stack, layers[0], size, confirmed=num_layers is not None)
    return layers


def _check_unstacked(stack: nnx.Module, layer: nnx.Module, size: int, confirmed: bool) -> None:
    """Raises if ``layer``, the first slice of ``stack``, does not look like one layer (:func:`unstack`)."""
    nodes = dict(nnx.iter_graph(layer))
    where = (
        f"`stack` ({type(stack).__name__}) is not a layer stack: sliced on its leading axis (size {size}) "
        "it gives layers whose"
    )
    fix = (
        "unstack takes a module built by nnx.vmap over a constructor (see the example in its "
        "docstring); a single layer needs no unstacking: pass [module] to NNXPipeline."
    )
    for path, module in nodes.items():
        if not (isinstance(module, nnx.Module) and type(module).__module__.startswith("flax.")):
            continue
        expected = _rebuilt_param_shapes(module)
        if expected is None:
            continue
        for sub, shape in _param_shapes(module).items():
            if sub in expected and expected[sub] != shape:
                name = _path_key(path + sub) or "<root>"
                raise ValueError(
                    f"{where} parameter {name} has shape {shape}, but {type(module).__name__} as configured "
                    f"makes it of shape {expected[sub]}. {fix}"
                )
    if confirmed:
        return
    for sub, shape in _param_shapes(layer).items():
        owner = nodes.get(sub[:-1])
        builtin = owner is not None and type(owner).__module__.startswith("flax.")
        if shape == () and not builtin:
            raise ValueError(
                f"{where} parameter {_path_key(sub)} is a scalar. {fix} If your layers do hold "
                f"scalar parameters, confirm the stack with `unstack(stack, num_layers={size})`."
            )


def _param_shapes(module: nnx.Module) -> dict[tuple[Any, ...], tuple[int, ...]]:
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {path: tuple(jnp.shape(v.get_value())) for path, v in flat}


def _rebuilt_param_shapes(module: nnx.Module) -> dict[tuple[Any, ...], tuple[int, ...]] | None:
    """The parameter shapes of a Flax layer rebuilt (abstractly) from the configuration it stores.

    Flax's own layers keep their constructor arguments as attributes of the same names. ``None``
    when the layer cannot be rebuilt that way.
    """
    cls = type(module)
    try:
        params = inspect.signature(cls.__init__).parameters
        kwargs = {n: getattr(module, n) for n in params if n not in ("self", "rngs") and hasattr(module, n)}
        rngs = (lambda: {"rngs": nnx.Rngs(0)}) if "rngs" in params else dict
        return _param_shapes(nnx.eval_shape(lambda: cls(**kwargs, **rngs())))
    except Exception:  # a layer that stores its configuration otherwise: no reference to compare
        return None


def restack(layers: Sequence[nnx.Module]) -> nnx.Module:
    """One stacked module from layers of one kind: the inverse of :func:`unstack`.

    ``restack(pipe.to_sequential())`` gives the trained layers back as the stack an
    ``nnx.scan`` forward pass takes.

    Raises:
      TypeError: ``layers`` is not a sequence of ``nnx.Module``.
      ValueError: ``layers`` is empty, or the layers differ in structure or shapes.
    """
    if isinstance(layers, nnx.Module) or not isinstance(layers, Sequence):
        raise TypeError(
            f"`layers` of restack must be a list of nnx.Module layers of one kind, but got "
            f"{type(layers).__name__}."
        )
    if len(layers) == 0:
        raise ValueError(
            "`layers` of restack is empty: there is no layer to stack. Pass the list of layers, e.g. "
            "`restack(pipe.to_sequential())`."
        )
    for index, layer in enumerate(layers):
        if not isinstance(layer, nnx.Module):
            raise TypeError(
                f"`layers[{index}]` of restack must be an nnx.Module, but got {type(layer).__name__}."
            )
    splits = [nnx.split(layer) for layer in layers]
    first = splits[0]
    shapes = lambda st: jax.tree.map(jnp.shape, st)
    for index, (g, st) in enumerate(splits[1:], start=1):
        if g != first[0] or shapes(st) != shapes(first[1]):
            raise ValueError(
                f"The layers differ in structure, so they do not form a stack: layers[{index}] "
                f"({type(layers[index]).__name__}) differs from layers[0] ({type(layers[0]).__name__}) "
                "in its module structure, configuration or variable shapes; restack needs layers of one kind."
            )
    return nnx.merge(first[0], jax.tree.map(lambda *a: jnp.stack(a), *[st for _, st in splits]))


_NAME = "NNXPipeline"


def _sharding(stack: common.Stack, buffer: jax.Array) -> dict[str, Any]:
    """The sharding metadata of a placed buffer's Variable (none without a mesh).

    With it ``nnx.get_partition_spec(nnx.state(model))`` reports ``P("stage", None)`` for the
    packed stages instead of ``P()`` (replicated).
    """
    mesh = stack.placer.mesh
    if mesh is None:
        return {}
    spec = tuple(stack.spec(buffer.ndim))
    placed = getattr(buffer, "sharding", None)  # as `place` laid it out (split inside its stage too)
    if isinstance(placed, NamedSharding) and placed.mesh == mesh:
        spec = tuple(placed.spec) + (None,) * (buffer.ndim - len(placed.spec))
    return {"out_sharding": spec, "mesh": mesh}


def _stream(rngs: nnx.Rngs, name: str, how: str, drawing: Callable[[], str] | None = None) -> nnx.RngStream:
    """The stream ``name`` of ``rngs`` (as ``rngs[name]``: its ``default`` stream if it has no
    ``name``); Flax's ``KeyError`` for neither gains a note saying what the pipeline draws and how to
    add the stream (``how``: "built with" or "called with"; ``drawing()``: the layers that need it,
    computed only for the note)."""
    try:
        return rngs[name]
    except KeyError as err:
        others = sorted(rngs)
        seeds = ", ".join(f"{n}=..." for n in [*others, name])
        if how == "built with":
            what, fixes = "forks its own key stream", []
        else:
            what = "draws the call's one key, even with dropout off,"
            fixes = ["pass a key, `rngs=jax.random.key(0)`"]
        fixes = [
            f"add the stream: `rngs=nnx.Rngs({seeds})`",
            "give it a default stream: `nnx.Rngs(0)`",
            *fixes,
            f"build the pipeline with `rng_collection=` one of {others}",
        ]
        err.add_note(
            f"pipejax.flax.NNXPipeline: the pipeline was {how} `rngs=` an nnx.Rngs with the streams "
            f"{others} only, but it {what} from the stream {name!r} (its `rng_collection`) of that "
            f"nnx.Rngs, or from its 'default' stream, which it lacks too."
            + (f" That key seeds {drawing()}." if drawing is not None else "")
            + " Either "
            + "; or ".join(fixes)
            + "."
        )
        raise


def _describe_rngs(rngs: Any) -> str:
    """A wrong ``rngs`` for messages: ``"dict with the keys ['dropout']"``, ``"int 0"``."""
    if isinstance(rngs, Mapping):
        return f"{type(rngs).__name__} with the keys {sorted(map(str, rngs))}"
    if isinstance(rngs, (int, float, str)):
        return f"{type(rngs).__name__} {rngs!r}"
    return type(rngs).__name__


def _rngs_fix(rngs: Any, rng_collection: str, key: bool = False) -> str:
    """How to turn a wrong ``rngs`` into one an NNXPipeline takes."""
    c = rng_collection
    if isinstance(rngs, Mapping):
        return (
            "A dict of keys is Linen's form (`apply(..., rngs={'dropout': key})`); in NNX wrap it in "
            f"an nnx.Rngs: `rngs=nnx.Rngs(**rngs)`, e.g. `nnx.Rngs({c}=key)`."
        )
    if isinstance(rngs, int) and not isinstance(rngs, bool):
        alt = f" or a key, `rngs=jax.random.key({rngs})`" if key else ""
        return f"For a seed, pass `rngs=nnx.Rngs({c}={rngs})`{alt}."
    if not key and isinstance(rngs, jax.Array):
        return f"For a key, pass `rngs=nnx.Rngs({c}=key)`, or pass it to each call: `pipe(x, rngs=key)`."
    return f"Build one with `nnx.Rngs({c}=seed_or_key)`."


def _takes_rngs(call: Any) -> bool:
    """Whether a layer's ``__call__(self, x, ...)`` names an ``rngs`` parameter (not ``**kwargs``)."""
    params = list(inspect.signature(call).parameters.values())
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY][:2]
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.name == "rngs" and p.kind in keyword and p.name not in positional for p in params)


def _is_var(v) -> bool:
    return isinstance(v, nnx.Variable)


def _check_state(index: int, layer: nnx.Module, batch_stats: nnx.State, rest: Any, deferred: bool) -> None:
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
            "nnx.Param parameters, rng streams and BatchNorm statistics. NNXPipeline supports "
            "no other mutable layer state."
        )
    paths = [path for path, _ in nnx.to_flat_state(batch_stats)]
    if not paths:
        return
    norms = {path for path, module in nnx.iter_graph(layer) if isinstance(module, nnx.BatchNorm)}
    outside = [_path_key(p) for p in paths if p[:-1] not in norms or p[-1] not in ("mean", "var")]
    if outside:
        raise NotImplementedError(
            f"Layer {index} ({type(layer).__name__}) holds nnx.BatchStat variables {outside} that "
            "are not the mean/var of an nnx.BatchNorm. NNXPipeline updates BatchNorm statistics "
            "only (deferred batch norm); other mutable state is not supported."
        )
    if not deferred:
        raise ValueError(
            flax_batchnorm.needs_flag(
                f"Layer {index} ({type(layer).__name__}) holds nnx.BatchNorm statistics", _NAME
            )
        )


def _check_deterministic(value: Any, where: str) -> bool | None:
    return common.check_flag(value, "deterministic", where, "turns dropout off in every layer")


def _check_use_running_average(value: Any, where: str) -> bool | None:
    meaning = "makes every BatchNorm normalise with its running statistics (evaluation)"
    return common.check_flag(value, "use_running_average", where, meaning)
