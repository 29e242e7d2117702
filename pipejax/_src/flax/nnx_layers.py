"""Each layer of an :class:`~pipejax.flax.NNXPipeline` as a pure function, with deferred BatchNorm.

``_NNXLayers`` is the NNX adapter's :class:`~pipejax._src.flax.stages.RunLayer`: layer ``l``
rebuilt with ``nnx.merge`` and reseeded from its key, returning what it sowed. Inside it every
``nnx.BatchNorm`` has its class switched (``_deferred_class``) to one whose training call is
deferred batch norm (see :mod:`pipejax._src.flax.nnx`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pipejax._src.flax import batchnorm as flax_batchnorm
from pipejax._src.flax import calls as flax_calls
from pipejax._src.flax.nnx_checks import _NAME


@dataclasses.dataclass(frozen=True)
class _NNXLayers:
    """Layer ``index`` as a pure function: rebuilt with ``nnx.merge``, reseeded from its key.

    A :class:`~pipejax._src.flax.stages.RunLayer` equal by value (graph definitions, call defaults,
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
