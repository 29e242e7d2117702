"""The checks and helpers of :class:`~pipejax.flax.NNXPipeline`'s arguments and layers.

The layers' state (only parameters, rng streams and BatchNorm statistics), the flags
``deterministic`` and ``use_running_average``, the ``rngs`` given to the module or a call (the
stream it draws from, and messages for a wrong one), which layers take ``rngs`` at call time, and
the sharding metadata of the packed stages' variables.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from pipejax._src.flax import batchnorm as flax_batchnorm
from pipejax._src.flax import common


def _path_key(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


_NAME = "NNXPipeline"


def _sharding(stack: common.Stack, buffer: jax.Array) -> dict[str, Any]:
    """The sharding metadata of a placed buffer's Variable (none without a mesh).

    With it ``nnx.get_partition_spec(nnx.state(model))`` reports ``P("stage", None)`` for the
    packed stages instead of ``P()`` (replicated).
    """
    mesh = stack.placer.mesh
    if mesh is None:
        return {}
    spec = tuple(stack.placer.plan.buffer_spec(buffer.ndim))
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
