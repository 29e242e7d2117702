"""A Flax adapter's call, prepared once for both adapters: flags and side inputs routed to the
layers that take them, and the activation chosen among a layer's outputs (``carry=``).

A layer's keyword arguments come from two places: the Python flags of the call
(``deterministic=True``), fixed per layer, and the side inputs (``context={"decoder_mask": mask}``),
batch-shaped arrays that :func:`pipejax.pipeline` cuts into micro-batches with ``x``. Layer ``l``
receives the flags and the entries its ``__call__`` accepts (all of them with ``**kwargs``);
a flag or entry no layer takes is an error, not ignored. :func:`prepare` does this for every
call of both adapters (the forward call and the training step).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def keyword_names(call: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments a layer's ``__call__(self, x, ...)`` accepts; ``None`` for any (``**kw``).

    ``self`` and the input (the first parameter after it) are not keyword arguments of a layer:
    the pipeline passes the input positionally.
    """
    params = list(inspect.signature(call).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    skip = {p.name for p in positional[:2]}  # self and the input
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in skip
    )


def _accepts(names: frozenset[str] | None, name: str) -> bool:
    return names is None or name in names


def route_kwargs(calls: Sequence[Callable[..., Any]], kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For each layer's call, the keyword arguments it accepts, after checking ``kwargs``.

    Raises:
      TypeError: if a keyword argument is an array (per-example inputs belong in ``context=`` or
        ``x``, where they are cut into micro-batches) or is accepted by none of the layers (a typo
        would otherwise be ignored silently).
    """
    for name, value in kwargs.items():
        if isinstance(value, jax.Array) or hasattr(value, "__jax_array__"):
            raise TypeError(
                f"Keyword argument `{name}` is an array. Keyword arguments reach every layer "
                "unchanged (whole, not cut into micro-batches), so they are for Python flags such "
                f"as `deterministic=True`. Pass a batch-shaped array as a side input, "
                f"`context={{{name!r}: ...}}`: it is cut into micro-batches with `x` and each layer "
                f"whose `__call__` takes `{name}` receives its micro-batch's rows."
            )
    accepted = [keyword_names(call) for call in calls]
    routed = [{k: v for k, v in kwargs.items() if _accepts(names, k)} for names in accepted]
    unused = sorted(set(kwargs) - {k for r in routed for k in r})
    if unused:
        raise TypeError(
            f"Keyword argument(s) {unused} are accepted by none of the layers' `__call__` "
            f"({_signatures(calls, accepted)}). Each keyword argument is passed to the layers whose "
            "`__call__` takes it; check the spelling, or remove it."
        )
    return routed


def route_context(
    calls: Sequence[Callable[..., Any]], context: Any, flags: Mapping[str, Any]
) -> list[tuple[str, ...]] | None:
    """For each layer's call, the names of the side inputs in ``context`` it receives.

    ``context`` maps keyword-argument names to batch-shaped arrays (or pytrees of them); layer
    ``l`` receives the entries its ``__call__`` accepts (all of them with ``**kwargs``), the same
    rule as for flags. Returns ``None`` for ``context=None`` or an empty dict (no side inputs).

    Raises:
      TypeError: if ``context`` is not a dict with string keys, an entry is also given as a flag,
        or an entry is accepted by none of the layers.
    """
    if context is None:
        return None
    if not isinstance(context, Mapping):
        raise TypeError(
            "`context` must be a dict from keyword-argument names to batch-shaped arrays, e.g. "
            "`context={'decoder_mask': mask}`: each entry is cut into micro-batches with `x` and "
            "passed to every layer whose `__call__` takes that keyword argument, but got "
            f"{type(context).__name__}. Wrap a single array in a dict named after the layers' argument."
        )
    if not context:
        return None
    for name in context:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(
                f"The keys of `context` name the layers' keyword arguments, so they must be "
                f"identifiers (strings), but got the key {name!r}."
            )
        if name in flags:
            raise TypeError(
                f"`{name}` is given both as a keyword argument of the call and as an entry of "
                f"`context`; pass it once (as a side input, `context={{{name!r}: ...}}`, if it is "
                "batch-shaped)."
            )
    accepted = [keyword_names(call) for call in calls]
    routed = [tuple(k for k in context if _accepts(names, k)) for names in accepted]
    unused = [k for k in context if not any(k in r for r in routed)]
    if unused:
        raise TypeError(
            f"`context` entr{'y' if len(unused) == 1 else 'ies'} {unused} "
            f"{'is' if len(unused) == 1 else 'are'} a keyword argument that none of the layers' "
            f"`__call__` takes ({_signatures(calls, accepted)}). Each entry of `context` is passed "
            "to the layers whose `__call__` takes a keyword argument of that name: rename the "
            "entry to the layers' argument (e.g. context={'decoder_mask': mask} for "
            "`__call__(self, x, decoder_mask=None)`), or add the argument to the layers' `__call__`."
        )
    return routed


def with_context(
    kwargs: Sequence[Mapping[str, Any]], names: Sequence[Sequence[str]] | None, context: Any
) -> list[dict[str, Any]]:
    """Each layer's keyword arguments with its side inputs (``names``, from :func:`route_context`)
    added, for a call outside the pipeline (on the whole batch)."""
    if names is None:
        return [dict(kw) for kw in kwargs]
    return [{**kw, **{k: context[k] for k in n}} for kw, n in zip(kwargs, names, strict=True)]


class Call(NamedTuple):
    """One call of an adapter (its forward call or a training step), routed to the layers."""

    kwargs: list[dict[str, Any]]  # per layer: the flags its `__call__` accepts
    names: list[tuple[str, ...]] | None  # per layer: the side inputs it receives; None: no context
    context: Any  # the side inputs (a dict of batch-shaped arrays), or None

    @property
    def side(self) -> dict[str, Any]:
        """The pipeline call's ``context=`` keyword: ``{}`` without side inputs."""
        return {} if self.names is None else {"context": dict(self.context)}

    def whole(self) -> list[dict[str, Any]]:
        """Each layer's keyword arguments with its side inputs, for a call on the whole batch
        (outside the pipeline: a Linen ``init``)."""
        return with_context(self.kwargs, self.names, self.context)


def prepare(calls: Sequence[Callable[..., Any]], context: Any, flags: Mapping[str, Any]) -> Call:
    """A call of the layers ``calls`` (their ``__call__`` methods) with ``context`` and ``flags``,
    checked and routed (:func:`route_kwargs`, :func:`route_context`): the one preparation both
    adapters' forward calls and training steps go through.

    Raises:
      TypeError: as :func:`route_kwargs` and :func:`route_context` do.
    """
    return Call(route_kwargs(calls, flags), route_context(calls, context, flags), context)


Carry = int | str | Callable[[Any], Any] | None  # what `carry=` takes (see select_carry)


def check_carry(carry: Any, owner: str) -> Carry:
    """``carry`` after checking that it is ``None``, an int, a str or a callable.

    Raises:
      TypeError: for anything else (a bool, a float, a list of indices, ...).
    """
    ok = carry is None or isinstance(carry, str) or callable(carry)
    ok = ok or (isinstance(carry, int) and not isinstance(carry, bool))
    if not ok:
        raise TypeError(
            f"`carry` of {owner} says which part of each layer's output is the activation passed to "
            "the next layer: None (the whole output), an int (the index in a tuple output: carry=1 "
            "for a layer that returns `(cache, x)`), a str (the key in a dict output), or a function "
            f"`out -> activation`; but got {type(carry).__name__} {carry!r}."
        )
    return carry


def select_carry(carry: Carry, index: int, out: Any) -> Any:
    """The activation layer ``index`` passes on, from its output ``out`` and ``carry`` (the rest
    must hold no arrays; see :func:`split_carry`)."""
    return split_carry(carry, index, out)[0]


def split_carry(carry: Carry, index: int, out: Any, collect: bool = False) -> tuple[Any, Any]:
    """``(activation, rest)``: the part of layer ``index``'s output ``out`` that ``carry`` selects,
    and the rest (``None`` when nothing is dropped).

    * ``None``: ``out`` itself;
    * an int ``k``: ``out[k]`` if ``out`` is a tuple or a list; any other output (an array, a
      dict) is passed on whole;
    * a str ``k``: ``out[k]`` if ``out`` is a dict (a ``Mapping``); any other output whole;
    * a callable: ``carry(out)``, for every output (the function decides what is dropped).

    With an int or a str, the rest of ``out`` (a tuple of the other items; a dict of the other
    entries) is returned (``collect``: the ``aux=`` option collects it as the layer's aux
    outputs); without ``collect`` it must hold no arrays (``None``, Python values): an
    auxiliary output that is an array (an aux loss, a cache) would be lost silently.

    Raises:
      ValueError: an index or key that ``out`` does not have, or (without ``collect``) dropped
        parts holding arrays.
    """
    if carry is None:
        return out, None
    if callable(carry):
        return carry(out), None
    if isinstance(carry, int):
        if not isinstance(out, (tuple, list)):
            return out, None
        if not -len(out) <= carry < len(out):
            raise ValueError(
                f"`carry={carry}` selects item {carry} of each layer's tuple output, but layer {index} "
                f"returned a {type(out).__name__} of {len(out)} item(s): {_describe(out)}. Give the "
                f"index of the activation in that tuple (0 to {len(out) - 1}), or a function "
                "`carry=lambda out: ...`."
            )
        kept = carry % len(out)
        dropped = {f"item {k}": v for k, v in enumerate(out) if k != kept}
        chosen, rest = out[kept], tuple(v for k, v in enumerate(out) if k != kept)
    else:
        if not isinstance(out, Mapping):
            return out, None
        if carry not in out:
            raise ValueError(
                f"`carry={carry!r}` selects the entry {carry!r} of each layer's dict output, but layer "
                f"{index} returned a dict with the keys {sorted(map(str, out))}: {_describe(out)}. Give "
                "the key of the activation, or a function `carry=lambda out: ...`."
            )
        dropped = {f"entry {k!r}": v for k, v in out.items() if k != carry}
        chosen, rest = out[carry], {k: v for k, v in out.items() if k != carry}
    arrays = [name for name, v in dropped.items() if any(is_array(a) for a in jax.tree.leaves(v))]
    if arrays and not collect:
        raise ValueError(
            f"Layer {index} returned {_describe(out)}: with `carry={carry!r}` its "
            f"{', '.join(arrays)} would be dropped, but {'it holds' if len(arrays) == 1 else 'they hold'} "
            "arrays. A pipeline passes on only the activation; the rest of a layer's output is "
            "collected only with the `aux=` option ('stack', 'sum' or 'mean'), which returns it "
            "beside the output (`y, aux = pipe(x)`), so without it the drop is allowed only for "
            "parts without arrays (a cache of None). Build the pipeline with `aux='mean'` to "
            "collect them, return only the activation (or None beside it), or, if these outputs "
            "are not needed, drop them explicitly with a function: `carry=lambda out: out[...]`."
        )
    return chosen, rest


def carry_hint(carry: Carry, index: int, h: Any, err: Exception) -> str | None:
    """The message to raise (same type) when layer ``index`` failed on a tuple holding ``None`` from
    the layer before it, passed on whole (``return cache, x`` without ``carry=``, or with a
    ``carry=`` for another kind of output); ``None`` when that is not the case."""
    items = h.values() if isinstance(h, Mapping) else h if isinstance(h, (tuple, list)) else ()
    if index == 0 or not any(item is None for item in items):
        return None
    if carry is None:
        passed = "A layer's whole output is passed on as the next layer's input."
    elif isinstance(carry, str) and not isinstance(h, Mapping):
        passed = (
            f"`carry={carry!r}` selects an entry of a dict output; any other output, such as this "
            f"{type(h).__name__}, is passed on whole."
        )
    elif isinstance(carry, int) and not isinstance(carry, bool) and not isinstance(h, (tuple, list)):
        passed = (
            f"`carry={carry}` selects an item of a tuple output; any other output, such as this "
            f"{type(h).__name__}, is passed on whole."
        )
    else:  # carry selected `h` (a function's choice, or a nested tuple): not a carry= mistake
        return None
    return (
        f"Layer {index} could not be applied to the output of layer {index - 1}, {_describe(h)}: "
        f"{type(err).__name__}: {err}\n{passed} If layer {index - 1} returns the activation beside "
        "other outputs (`return cache, x`, as Gemma's blocks do), say which one is the activation "
        "with `carry=`: `carry=1` for `(cache, x)`, a key for a dict output, or a function "
        "`carry=lambda out: out.x`. The other outputs are dropped (only if they hold no arrays, "
        "such as a cache of None)."
    )


def is_array(a: Any) -> bool:
    return isinstance(a, (jax.Array, np.ndarray)) or hasattr(a, "__jax_array__")


def _describe(out: Any) -> str:
    """A layer's output for messages: ``(None, 'float32[3, 16, 32]')``."""
    shapes = jax.tree.map(lambda a: f"{jnp.result_type(a)}{list(jnp.shape(a))}" if is_array(a) else a, out)
    return repr(shapes)


def _signatures(calls: Sequence[Callable[..., Any]], accepted: Sequence[frozenset[str] | None]) -> str:
    """``"layers 0-3 (Block) take decoder_mask, deterministic; layer 4 (Dense) takes none"``."""
    groups: list[tuple[list[int], str, str]] = []
    for index, (call, names) in enumerate(zip(calls, accepted, strict=True)):
        owner = getattr(call, "__qualname__", "?").rsplit(".", 1)[0]
        takes = "any (**kwargs)" if names is None else (", ".join(sorted(names)) or "none")
        if groups and groups[-1][1:] == (owner, takes) and groups[-1][0][-1] == index - 1:
            groups[-1][0].append(index)
        else:
            groups.append(([index], owner, takes))
    parts = []
    for indices, owner, takes in groups:
        which = f"layer {indices[0]}" if len(indices) == 1 else f"layers {indices[0]}-{indices[-1]}"
        verb = "takes" if len(indices) == 1 else "take"
        parts.append(f"{which} ({owner}) {verb} {takes}")
    return "; ".join(parts)


# --- naming layers and rng streams in messages ---------------------------------------------------


def stage_of(index: int, sizes: Sequence[int]) -> int:
    """The stage of layer ``index`` (``sizes``: the number of layers of each stage)."""
    return int(np.searchsorted(np.cumsum(sizes), index, side="right"))


def layer_where(index: int, sizes: Sequence[int], name: str | None = None) -> str:
    """``"layer 2 (stage 1, Block)"``: layer ``index`` for messages, with its stage and, if known,
    its class name."""
    return f"layer {index} (stage {stage_of(index, sizes)}{'' if name is None else f', {name}'})"


def layers_where(indices: Sequence[int], sizes: Sequence[int], names: Sequence[str]) -> str:
    """``"layers 0-3 (stages 0-1, Block) and layer 5 (stage 2, Dense)"``: the layers ``indices``
    for messages, runs of consecutive layers of one class grouped (``names``: every layer's class)."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1 and names[runs[-1][-1]] == names[index]:
            runs[-1].append(index)
        else:
            runs.append([index])
    parts = []
    for run in runs:
        first, last = stage_of(run[0], sizes), stage_of(run[-1], sizes)
        if len(run) == 1:
            parts.append(layer_where(run[0], sizes, names[run[0]]))
            continue
        stages = f"stage {first}" if first == last else f"stages {first}-{last}"
        parts.append(f"layers {run[0]}-{run[-1]} ({stages}, {names[run[0]]})")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def missing_stream(err: BaseException) -> str | None:
    """The rng stream a Flax error says is missing, or ``None`` for another error: NNX's
    ``KeyError``/``AttributeError`` "No RngStream named 'dropout' found in Rngs.", Linen's
    ``InvalidRngError`` 'Dropout_0 needs PRNG for "dropout"'."""
    text = str(err.args[0]) if err.args else ""
    match = re.search(r"No RngStream named '([^']+)'", text) or re.search(r'needs PRNG for "([^"]+)"', text)
    return None if match is None else match[1]


def linen_rng_note(where: str, err: BaseException, rng_collection: str) -> str | None:
    """The note for Linen's ``InvalidRngError`` raised by layer ``where`` in a ``LinenPipeline``
    (``None`` when the error names no rng): the module hands each layer one rng only, its
    ``rng_collection``, and only when ``apply`` was given that rng."""
    name = missing_stream(err)
    if name is None:
        return None
    head = f"pipejax.flax.LinenPipeline: {where} draws from the rng {name!r} (`self.make_rng({name!r})`)"
    if name != rng_collection:
        return (
            f"{head}, but the pipeline hands each layer one rng only: a key of its "
            f"`rng_collection` rng, {rng_collection!r}. If {name!r} is the layers' only random "
            f"stream, build the pipeline with `rng_collection={name!r}` and pass "
            f"`rngs={{{name!r}: key}}` to `apply`; layers that draw from two streams are not supported."
        )
    return (
        f"{head}, and the call had no {name!r} rng to give it: the module draws one key per call "
        f"from its {name!r} rng (`rng_collection`) and gives each layer a key of its own. Pass it "
        f"to `apply`, `module.apply(variables, x, rngs={{{name!r}: key}})` (or `rngs=` of a "
        f"`value_and_grad` step, the same dict; a bare key is Linen's 'params' rng, not {name!r}), "
        "or turn the layers' dropout off (e.g. `deterministic=True`)."
    )
