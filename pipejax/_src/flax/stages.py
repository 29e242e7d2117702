"""The layers as the pipeline's stages: what runs inside a stage of either Flax adapter.

An adapter supplies layer ``l`` as a pure function (:class:`RunLayer`). Here each layer becomes a
:func:`pipejax.partition` layer over the carry ``(h, mask, context, records, auxes)`` (its key, the
side inputs it takes, the part of its output ``carry=`` passes on, and with ``aux=`` its aux
outputs, :func:`layer_aux`), and a stage of them the function :func:`pipejax.pipeline` runs, with
stage state (deferred BatchNorm) or without. :meth:`~pipejax._src.flax.common.Stack.build` puts
them together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax
from flax import errors as flax_errors

from pipejax._src.flax.batchnorm import SownMoments
from pipejax._src.flax.calls import Carry, carry_hint, is_array, linen_rng_note, select_carry, split_carry

PyTree = Any


class RunLayer(Protocol):
    """Layer ``index`` as a pure function: ``(y, records, sown)`` from its variables, input, key and
    kwargs; ``sown``: the values the layer sowed (NNX ``nnx.Intermediate``, Linen's
    ``'intermediates'`` collection) as a dict, ``{}`` when none.

    It compares and hashes by value (a frozen dataclass of static configuration, no arrays): it is
    part of the key under which :func:`~pipejax._src.flax.common.program` caches the pipeline that
    runs it.
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


def _layer_step(
    run_layer: RunLayer,
    index: int,
    kwargs: Mapping[str, Any],
    names: tuple[str, ...],
    carry: Carry,
    collect: bool = False,
    where: str | None = None,
):
    """Layer ``index`` as a :func:`pipejax.partition` layer over the carry ``(h, mask, context,
    records, auxes)``: it reads the side inputs ``names`` of the micro-batch's ``context`` as
    keyword arguments, passes on the part of its output that ``carry`` selects
    (:func:`select_carry`), and passes the context on unchanged to the stage's next layer. With
    ``collect`` (the ``aux=`` option) it adds its aux outputs to ``auxes`` (:func:`layer_aux`).

    ``where`` names the layer in notes (``"layer 2 (stage 1, Block)"``): a Linen layer that draws
    from an rng the pipeline did not give it (Flax's ``InvalidRngError``) gains a note saying which
    layer it is and how to pass the rng (:func:`~pipejax._src.flax.calls.linen_rng_note`)."""
    if where is None:
        where = f"layer {index}"

    def step(variables, state, key):
        try:
            return run(variables, state, key)
        except flax_errors.InvalidRngError as err:
            rng_collection = getattr(run_layer, "rng_collection", None)
            note = None if rng_collection is None else linen_rng_note(where, err, rng_collection)
            if note is not None:
                err.add_note(note)
            raise

    def run(variables, state, key):
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
        except (TypeError, ValueError, AttributeError) as err:
            hint = carry_hint(carry, index, h, err)
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


def _layer_name(run_layer: RunLayer, index: int) -> str | None:
    """The class name of layer ``index``, for messages, where ``run_layer`` holds the layers (Linen's
    unbound layers, ``layers``; NNX's, ``names``); ``None`` otherwise."""
    names = getattr(run_layer, "names", None)
    if names is not None:
        return names[index]
    layers = getattr(run_layer, "layers", None)
    return None if layers is None else type(layers[index]).__name__


def layer_aux(rest: Any, sown: Mapping[str, Any]) -> dict[str, Any]:
    """A layer's aux outputs: ``{"outputs": the rest of its output (what ``carry=`` did not pass
    on), "intermediates": what it sowed}``, each key present only when it holds arrays."""
    aux = {}
    if any(is_array(a) for a in jax.tree.leaves(rest)):
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
