"""What the tick loop is given: the stages and options (:class:`Config`), the inputs of a call
(:class:`Inputs`), and the reads and writes of micro-batches and accumulators a tick does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from pipejax._src import aux_outputs, compat, keys
from pipejax._src import checkpoint as ckpt
from pipejax._src.containers import Layout

PyTree = Any


class Config(NamedTuple):
    """What the loop needs to know of the pipeline (all static)."""

    stages: tuple[Callable[..., Any], ...]  # one function per stage (homogeneous: the same one)
    stateful: bool
    per_example_keys: bool
    checkpoint: Any
    axis_name: str
    data_axis_name: str | None
    # the shard_map is manual over the stage (and data) axes only (``param_specs``): the mesh's
    # other axes are XLA's to place, and micro-batches of the inputs are read pinned replicated
    # over them (see :func:`read`)
    inner_axes: bool = False
    aux: bool = False  # stages also return aux outputs, carried as stats (see `aux_outputs`)


class Inputs(NamedTuple):
    """What a run reads. ``params``/``state`` in the stage object's form; ``xs`` leaves
    ``(m, b, ...)``; ``mask`` the micro-batched side inputs ``(rows, context)``: ``bool[m, b]``
    real rows (``None`` when stateless) and the user's ``context`` (``None`` without one)."""

    params: Any
    state: Any
    xs: Any
    mask: Any
    key: Any


def take(xs, i):
    """Micro-batch ``i`` (a traced index) of the split batch."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)


def read(cfg: Config, xs, i):
    """Micro-batch ``i`` of a batch input (``x``, targets, row masks, ``context=``).

    With axes left to XLA inside the stages (``cfg.inner_axes``) the micro-batch is pinned
    replicated over them. Without the pin, sharding propagation shards the whole ``(m, b, ...)``
    batch the way a stage's first matmul reads it (e.g. its features over a "model" axis) and
    keeps that copy as a temporary: one micro-batch of memory per micro-batch, which is what a
    1F1B device must not grow with. Pinned, a micro-batch is resharded when it is read.
    """
    return _pinned_whole(cfg, take(xs, i))


def _pinned_whole(cfg: Config, tree):
    """``tree`` constrained replicated over the mesh's axes inside a stage (``cfg.inner_axes``);
    unchanged without them, or without a mesh context (a shape analysis outside the
    ``shard_map``, e.g. of what a training schedule's F slot saves, where nothing is placed)."""
    if not cfg.inner_axes or not compat.mesh_context_set():
        return tree
    return jax.tree.map(lambda a: lax.with_sharding_constraint(a, PartitionSpec()), tree)


def whole(cfg: Config, tree):
    """``tree`` replicated over the mesh axes inside a stage (``cfg.inner_axes``): what a stage
    sends on, records or stashes (the one rule of every container on a mesh). On Explicit axes
    a reshard; on Auto axes a sharding constraint, so that XLA gathers the value within each
    stage's group of devices. (Left to XLA, the resharding of an Auto-typed stats record landed
    inside the stage's switch branch, the stages' devices waited at different collectives, and
    the program deadlocked: ``tests/test_pipeline_sharded_stages.py``.)"""
    return _pinned_whole(cfg, compat.replicate(tree))


def clip(i, num_micro):
    return jnp.clip(i, 0, num_micro - 1)


def write(acc, y, r, i, enabled):
    """``acc[r, i] = y`` where ``enabled`` (``acc`` has two leading axes); unchanged otherwise."""

    def one(a, v):
        start = tuple(jnp.asarray(j, jnp.int32) for j in (r, i, *(0,) * v.ndim))
        old = lax.dynamic_slice(a, start, (1, 1, *v.shape))[0, 0]
        return lax.dynamic_update_slice(a, jnp.where(enabled, v, old)[None, None], start)

    return jax.tree.map(one, acc, y)


def zeros(layout: Layout, leading=()):
    return layout.retype(jax.tree.map(lambda s: jnp.zeros(leading + s.shape, s.dtype), layout.structs()))


def named(tree):
    """Marks a per-tick slice of stage parameters: saved by no phase (see ``checkpoint.phases``)."""
    return jax.tree.map(lambda a: checkpoint_name(a, ckpt.STAGE_PARAMS), tree)


def stage_call(cfg: Config, s: int):
    """Stage ``s`` as ``f(params, x, key, state, side) -> (y, stats)``, ``side = (mask, context)``
    of the micro-batch; stats ``None`` when stateless (with ``aux``: the aux outputs, or
    ``(stats, aux)``); ``context=`` passed only when given."""
    stage = cfg.stages[s]

    def call(p, x, key, state, side):
        mask, context = side
        kwargs = {} if context is None else {"context": context}
        return aux_outputs.call(stage, cfg.stateful, cfg.aux, p, x, key, state, mask, kwargs)

    return call


def stage_keys(cfg: Config, key, i, s, micro_size):
    """The key(s) stage ``s`` receives for (mini-batch-wide) micro-batch ``i`` (:mod:`keys`)."""
    if cfg.per_example_keys:
        return keys.example_keys_for(key, i, micro_size, s)
    return keys.key_for(key, i, s)
