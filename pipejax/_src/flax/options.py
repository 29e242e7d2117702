"""The Flax adapters' options: how layers are cut into stages, and the :func:`pipejax.pipeline`
options they forward.

An adapter takes every option of ``pj.pipeline`` (read from its signature, so an option added
there reaches the adapters without being declared again) except those it sets itself; they are
kept as an :class:`Options` mapping that compares by value (NNX graph definitions hold it).
``tied=`` is given in layers' terms and translated to the pipeline's stages (:func:`layer_tied`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from pipejax._src import checks
from pipejax._src.balance import partition
from pipejax._src.pipeline import pipeline

# Arguments of pj.pipeline that the adapters set themselves (not pipeline options of theirs).
_OWN = {
    "stages": "the adapters build the stage functions from `layers`",
    "num_stages": "give the adapter's own `num_stages=` (an even split of the layers) or `balance=`",
    "stateful": "the adapters run with stage state exactly when `deferred_batch_norm=True`",
}


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
        return partition([no_layer] * num_layers, balance).balance
    if checks.integer(num_stages) is None:
        raise TypeError(f"`num_stages` must be an int, but got {type(num_stages).__name__} {num_stages!r}.")
    num_stages = checks.integer(num_stages)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"`num_stages` must be between 1 and the number of layers ({num_layers}), since "
            f"every stage needs at least one layer, but got {num_stages}."
        )
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def no_layer(params, x, key):  # a placeholder layer: partition() checks `balance` against the count
    raise AssertionError("placeholder layer called")  # internal: never part of a pipeline


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
