"""NNX layer stacks (``nnx.vmap`` over a constructor) to separate layers and back.

:func:`unstack` gives the layers of a stack as separate modules for
:class:`~pipejax.flax.NNXPipeline` (refusing a module that was not built as a stack), and
:func:`restack` stacks them again, as ``nnx.scan`` takes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pipejax._src import checks
from pipejax._src.flax.nnx_checks import _path_key


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
      ``L`` new modules sharing nothing with ``stack``: pass them to :class:`~pipejax.flax.NNXPipeline`.

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
