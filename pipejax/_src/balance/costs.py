"""Per-layer costs under a cost model: :func:`layer_costs`, what :func:`pipejax.balance` balances.

The cost models (``COST_MODELS``): XLA's flop count of the compiled layer, its wall time, or the
memory its parameters and saved activations take.
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from pipejax._src import checks
from pipejax._src.balance.partitioning import Layer, PyTree, _check_layers

COST_MODELS = ("flops", "time", "memory")


def layer_costs(
    layers: Sequence[Layer],
    layer_params: Sequence[PyTree],
    sample_x: PyTree,
    *,
    by: str = "flops",
    key: jax.Array | None = None,
    backward: bool = True,
    param_scale: float = 2.0,
    activation_scale: float = 1.0,
    warmup: int = 1,
    repeats: int = 5,
) -> tuple[float, ...]:
    """The cost of every layer under a cost model; what :func:`balance` balances.

    ``sample_x`` is propagated through the layers with ``jax.eval_shape`` (``"time"`` runs them),
    so each layer is measured on the input type it will see. Layers with equal functions,
    parameter types and input types are compiled once.

    * ``by="flops"``: XLA's operation count of the compiled layer,
      ``jax.jit(f).lower(...).compile().cost_analysis()``, ``flops + transcendentals``. With
      ``backward=True`` (default) ``f`` is the layer's forward *and* backward (a ``jax.vjp``
      with a cotangent argument): what a training step executes. The backward is not a fixed
      multiple of the forward (twice it for a matmul, a scatter-add for an embedding's
      gather, nothing for a layer without inputs to differentiate), so forward flops alone would
      misrank layers. Deterministic, and needs no data: parameters may be ``ShapeDtypeStruct``.
      It counts arithmetic, not memory traffic, so it underrates memory-bound layers
      (elementwise ops, gathers).
    * ``by="time"``: wall-clock seconds of the same jitted program, the median of ``repeats``
      runs after ``warmup`` runs, each ended by ``block_until_ready``. It sees what flops miss,
      but it is **noisy** (other processes, frequency scaling, tiny layers near the launch
      overhead): two calls may return different balances. Abstract leaves run as zeros.
    * ``by="memory"``: bytes, ``param_scale * parameter bytes + activation_scale * activation
      bytes``. ``param_scale`` follows torchgpipe's ``balance_by_size``: how many
      parameter-sized buffers training allocates per parameter: 2 for parameters and their
      gradients (plain SGD), 3 for SGD with momentum, 4 for Adam (two moment estimates).
      Activation bytes are what reverse-mode autodiff saves for the layer's backward on one
      ``sample_x`` micro-batch (its saved residuals, the layer's input included when the backward
      needs it, the parameters excluded since they are counted above): the deterministic,
      compile-free counterpart of torchgpipe's measured CUDA allocation. A pipeline device keeps
      those of one micro-batch at a time under ``checkpoint="always"`` (``activation_scale=1``)
      and of up to ``chunks`` micro-batches under ``"never"``.

    Args:
      layers, layer_params, sample_x, by, key, backward, param_scale: as for :func:`balance`.
      activation_scale, warmup, repeats: as for :func:`balance`.

    Raises:
      TypeError, ValueError: as for :func:`balance`.

    Returns:
      One non-negative float per layer: flops, seconds or bytes.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> def dense(p, x, key):
      ...     return x @ p
      >>> w = jax.ShapeDtypeStruct((4, 2), jnp.float32)  # no data needed for flops
      >>> pj.layer_costs([dense], [w], jnp.ones((8, 4), jnp.float32), backward=False)
      (128.0,)
      >>> pj.layer_costs([dense], [w], jnp.ones((8, 4), jnp.float32), by="memory")  # 2 * 32 + 128
      (192.0,)
    """
    layers = _check_layers(layers)
    if isinstance(layer_params, (str, bytes)) or not isinstance(layer_params, Sequence):
        raise TypeError(
            f"`layer_params` must be a sequence with one parameter pytree per layer ({len(layers)}), "
            f"but got {type(layer_params).__name__}."
        )
    if len(layer_params) != len(layers):
        raise ValueError(
            f"`layer_params` has {len(layer_params)} entries but there are {len(layers)} layers; pass "
            "one parameter pytree per layer (None for a layer without parameters)."
        )
    if by not in COST_MODELS:
        raise ValueError(
            f"`by` must be one of {', '.join(repr(m) for m in COST_MODELS)}, but got {by!r}. For your "
            "own per-layer costs, call `pj.balance_costs(costs, num_stages)`."
        )
    _check_scale(param_scale, "param_scale")
    _check_scale(activation_scale, "activation_scale")
    _check_count(warmup, "warmup", 0)
    _check_count(repeats, "repeats", 1)
    if not isinstance(backward, bool):
        raise TypeError(f"`backward` must be a bool, but got {backward!r}.")
    checks.check_key(key)

    cache: dict[Any, Any] = {}
    costs = []
    x = sample_x if by == "time" else _structs(sample_x)
    if by == "time":
        x = _materialise(x)
    for idx, (layer, p) in enumerate(zip(layers, layer_params, strict=True)):
        k = None if key is None else jax.random.fold_in(key, idx)
        if by == "time":
            p = _materialise(p)
        else:
            p = _structs(p)
        y = _output_type(layer, p, x, k, idx)
        if by == "memory":
            cost = param_scale * _nbytes(p) + activation_scale * _activation_bytes(layer, p, x, k)
        else:
            program = _program(cache, layer, p, x, k, y, backward)
            if by == "flops":
                cost = _flops(program, idx)
            else:
                cost, y = _time(program, p, x, k, y, backward, warmup, repeats)
        costs.append(float(cost))
        x = y
    return tuple(costs)


def _check_scale(value, name) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < math.inf):
        raise ValueError(f"`{name}` must be a finite number >= 0, but got {value!r}.")


def _check_count(value, name, least) -> None:
    checks.count(value, name, least=least)


def _struct(a) -> jax.ShapeDtypeStruct:
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(jax.typeof(a), "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), weak_type=True)  # Python scalars


def _structs(tree: PyTree) -> PyTree:
    return jax.tree.map(_struct, tree)


def _materialise(tree: PyTree) -> PyTree:
    """Concrete arrays for timing: abstract leaves become zeros."""

    def zeros(a):
        return jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a

    return jax.tree.map(zeros, tree)


def output_bytes(
    layers: Sequence[Layer], layer_params: Sequence[PyTree], sample_x: PyTree
) -> tuple[int, ...]:
    """The bytes of each layer's output on ``sample_x`` propagated through the layers (shapes
    only: nothing runs); what crosses a stage boundary cut after that layer."""
    x, sizes = _structs(sample_x), []
    for idx, (layer, p) in enumerate(zip(layers, layer_params, strict=True)):
        x = _output_type(layer, _structs(p), x, None, idx)
        sizes.append(_nbytes(x))
    return tuple(sizes)


def _output_type(layer, p, x, k, idx) -> PyTree:
    """The layer's output type, or: JAX's own shape/dtype error as a ``ValueError`` naming the
    layer; any other exception (the user's own) with its type kept and the layer added as a note."""
    try:
        return jax.eval_shape(layer, p, x, k)
    except Exception as err:
        where = "`sample_x`" if idx == 0 else f"the output of layer {idx - 1}"
        fix = f"Make layer {idx} accept what {where} is (with its batch axis first), or check `layer_params`."
        types = checks.types_text(_structs(x))
        if type(err) in (TypeError, ValueError) and checks.raised_in_jax(err):
            raise ValueError(
                f"Layer {idx} could not be applied to {where}, whose type is {types}:\n"
                f"{type(err).__name__}: {err}\n{fix}"
            ) from err
        err.add_note(
            f"Layer {idx} failed on {where}, whose type is {types}, while pipejax measured its cost. {fix}"
        )
        raise


def _nbytes(tree: PyTree) -> int:
    return sum(math.prod(a.shape) * getattr(a.dtype, "itemsize", 0) for a in jax.tree.leaves(_structs(tree)))


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _step(layer, backward):
    """The program whose cost is measured: the forward, or a forward + backward (a vjp)."""

    def forward(p, x, k, ct):
        return layer(p, x, k)

    def train(p, x, k, ct):
        y, vjp = jax.vjp(lambda p, x: layer(p, x, k), p, x)
        leaves, tree = jax.tree.flatten(y)
        given = iter(ct)  # cotangents of the float outputs; integer outputs take float0 zeros
        cts = [next(given) if _inexact(a) else np.zeros(a.shape, jax.dtypes.float0) for a in leaves]
        return y, vjp(jax.tree.unflatten(tree, cts))

    return train if backward else forward


def _signature(tree) -> Any:
    leaves, tree = jax.tree.flatten(_structs(tree))
    return tree, tuple((a.shape, a.dtype, a.weak_type) for a in leaves)


def _program(cache, layer, p, x, k, y, backward):
    """The compiled program of a layer, shared by layers with equal functions and types."""
    ct = [a for a in jax.tree.leaves(y) if _inexact(a)] if backward else []
    sig = (layer, backward, _signature(p), _signature(x), _signature(k), _signature(ct))
    if sig not in cache:
        cache[sig] = jax.jit(_step(layer, backward)).lower(p, x, k, _structs(ct)).compile()
    return cache[sig]


def _flops(program, idx) -> float:
    analysis = program.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis:
        raise ValueError(
            f"XLA reported no cost analysis for layer {idx} on this backend; use `by='time'` or "
            "`by='memory'`, or bring your own costs to `pj.balance_costs`."
        )
    # XLA leaves the "flops" key out of a program that does none (a reshape, an identity)
    flops = float(analysis.get("flops", 0.0))
    return max(0.0, flops) + max(0.0, float(analysis.get("transcendentals", 0.0)))


def _time(program, p, x, k, y, backward, warmup, repeats):
    ct = [jnp.ones(a.shape, a.dtype) for a in jax.tree.leaves(y) if _inexact(a)] if backward else []
    for _ in range(warmup):
        jax.block_until_ready(program(p, x, k, ct))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(program(p, x, k, ct))
        times.append(time.perf_counter() - start)
    y = out[0] if backward else out
    return statistics.median(times), y


def _activation_bytes(layer, p, x, k) -> int:
    """Bytes reverse-mode autodiff saves for the layer's backward, its parameters excluded.

    The residuals are the leaves of the function ``jax.vjp`` returns; in the jaxpr of
    ``(p, x) -> vjp_fn`` they are the outputs. Outputs that are parameter inputs, closed-over
    constants or literals are not activations; the layer's own input ``x`` is, when it is saved.
    """

    def residuals(p, x):
        return jax.vjp(lambda p, x: layer(p, x, k), p, x)[1]

    closed = jax.make_jaxpr(residuals)(p, x)
    jaxpr = closed.jaxpr
    num_params = len(jax.tree.leaves(p))
    not_activations = {id(v) for v in jaxpr.invars[:num_params]} | {id(v) for v in jaxpr.constvars}
    seen: set[int] = set()
    total = 0
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Literal) or id(v) in not_activations or id(v) in seen:
            continue
        seen.add(id(v))
        aval = v.aval
        total += math.prod(aval.shape) * getattr(aval.dtype, "itemsize", 0)
    return total
