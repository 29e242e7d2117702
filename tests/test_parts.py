"""Unit tests of the pipeline's parts: micro-batching, the schedule, containers, stage parameters,
keys and checkpoint phases. Everything here is exact, so comparisons are bitwise."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from pipejax._src import checkpoint as ckpt
from pipejax._src import checks, keys
from pipejax._src.containers import Container, Layout
from pipejax._src.params.placement import pack as pack_params
from tests import models

# --- micro-batching -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", range(1, 18))
def test_plan_counts(batch):
    for chunks in range(1, 10):
        p = pj.microbatch_plan(batch, chunks)
        assert p.batch == batch
        assert p.micro_size == math.ceil(batch / chunks)
        assert p.num_micro == math.ceil(batch / p.micro_size) <= chunks
        assert p.padding == p.num_micro * p.micro_size - batch
        assert 0 <= p.padding < p.micro_size
        # The micro-batch sizes torch.chunk would give: all full but the last.
        assert (p.num_micro - 1) * p.micro_size < batch <= p.num_micro * p.micro_size


@pytest.mark.parametrize("batch,chunks", [(12, 3), (10, 4), (3, 5), (1, 1), (7, 7), (17, 9)])
def test_split_merge_round_trip(batch, chunks):
    r = np.random.default_rng(batch)
    x = {
        "f": jnp.asarray(r.normal(size=(batch, 2, 3)), jnp.float32),
        "ids": jnp.asarray(r.integers(0, 100, size=(batch,)), jnp.int32),
        "pair": (jnp.asarray(r.normal(size=(batch, 1))), jnp.arange(batch) % 2 == 0),
    }
    xs, mask, p = pj.split_microbatches(x, chunks)
    assert p == pj.microbatch_plan(batch, chunks)
    for leaf, split in zip(jax.tree.leaves(x), jax.tree.leaves(xs), strict=True):
        assert split.shape == (p.num_micro, p.micro_size, *leaf.shape[1:])
        assert split.dtype == leaf.dtype
        flat = np.asarray(split).reshape((-1, *leaf.shape[1:]))
        np.testing.assert_array_equal(flat[:batch], np.asarray(leaf))
        # Padding rows copy the last example.
        for row in flat[batch:]:
            np.testing.assert_array_equal(row, np.asarray(leaf)[-1])
    assert mask.shape == (p.num_micro, p.micro_size) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(mask).reshape(-1), np.arange(p.num_micro * p.micro_size) < batch)
    models.assert_trees_equal(pj.merge_microbatches(xs, p), x)


def test_split_under_jit():
    x = jnp.arange(10.0).reshape(5, 2)
    xs, mask = jax.jit(lambda x: pj.split_microbatches(x, 2)[:2])(x)
    assert xs.shape == (2, 3, 2)
    np.testing.assert_array_equal(np.asarray(xs[1, 2]), np.asarray(x[4]))
    np.testing.assert_array_equal(np.asarray(mask), [[True] * 3, [True, True, False]])


def test_merge_drops_padding_and_has_zero_cotangents_there():
    """Padding rows are dropped by merge, so they receive exactly zero cotangent."""
    x = jnp.arange(5.0)
    p = pj.microbatch_plan(5, 2)

    def f(xs):
        return jnp.sum(pj.merge_microbatches(xs, p) ** 2)

    xs, _, _ = pj.split_microbatches(x, 2)
    g = jax.grad(f)(xs)
    np.testing.assert_array_equal(np.asarray(g).reshape(-1), [0.0, 2.0, 4.0, 6.0, 8.0, 0.0])


# --- the GPipe schedule ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", range(1, 6))
def test_gpipe_schedule(num_stages):
    for num_micro in range(1, 9):
        s = pj.gpipe_schedule(num_stages, num_micro)
        table = np.asarray(s.table)
        assert table.shape == (num_micro + num_stages - 1, num_stages) == (s.num_ticks, s.num_stages)
        assert s.num_micro == num_micro and s.fill_ticks == num_micro - 1
        # Each stage works exactly m ticks, on every micro-batch once, in order.
        np.testing.assert_array_equal(s.work_per_stage(), [num_micro] * num_stages)
        for stage in range(num_stages):
            worked = table[:, stage][table[:, stage] >= 0]
            np.testing.assert_array_equal(worked, np.arange(num_micro))
        # Stage s runs micro-batch i at tick i + s: each stage gets its input one tick after
        # the previous stage produced it.
        for t, stage in np.argwhere(table >= 0):
            assert table[t, stage] == t - stage
        assert np.all(table >= -1)
        # The bubble fraction is (n - 1) / (m + n - 1).
        expected = (num_stages - 1) / (num_micro + num_stages - 1)
        assert s.bubble_fraction() == pytest.approx(expected, rel=1e-15)
        assert pj.gpipe_bubble_fraction(num_stages, num_micro) == pytest.approx(expected, rel=1e-15)


def test_pipeline_schedule_uses_the_micro_batch_count():
    apply = pj.pipeline([lambda p, x, k: x] * 3, chunks=4)
    s = apply.schedule(10)  # 4 micro-batches of 3
    assert s.num_micro == 4 and s.num_stages == 3 and s.num_ticks == 6
    assert apply.schedule(2).num_micro == 2  # batch smaller than chunks


# --- checkpoint phases ------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", list(models.CHECKPOINTS.values()), ids=list(models.CHECKPOINTS))
def test_phases_cover_every_tick_once(checkpoint):
    for num_stages in range(1, 5):
        for num_micro in range(1, 6):
            schedule = pj.gpipe_schedule(num_stages, num_micro)
            phases = ckpt.phases(checkpoint, schedule)
            assert phases, (num_stages, num_micro)
            assert phases[0][0] == 0 and phases[-1][1] == schedule.num_ticks
            for a, b in itertools.pairwise(phases):
                assert a[1] == b[0]
            assert all(p[1] > p[0] for p in phases)


# --- containers ------------------------------------------------------------------------------------


def _mixed(seed, scale=1):
    r = np.random.default_rng(seed)
    return {
        "f32": jnp.asarray(r.normal(size=(2 * scale, 3)), jnp.float32),
        "f64": (jnp.asarray(r.normal(size=(scale,))), jnp.asarray(r.normal(size=(2, 2)))),
        "i32": jnp.asarray(r.integers(-5, 5, size=(3 * scale,)), jnp.int32),
        "u8": jnp.asarray(r.integers(0, 255, size=(2,)), jnp.uint8),
        "bool": jnp.asarray(r.integers(0, 2, size=(scale, 2)) == 1),
    }


def test_container_pack_unpack_round_trip_mixed_dtypes():
    trees = [_mixed(0), _mixed(1, scale=3), {"only": jnp.ones((4,), jnp.int32)}]
    layouts = [Layout.of(t) for t in trees]
    box = Container.for_layouts(layouts)
    # One buffer per dtype, as long as the largest demand on it.
    need = {}
    for layout in layouts:
        for (dtype, split), n in layout.demand().items():
            assert split == ()  # no leaf is split over mesh axes
            need[dtype] = max(need.get(dtype, 0), n)
    assert dict(zip(box.dtypes, box.sizes, strict=True)) == need
    assert box.nbytes() == sum(d.itemsize * n for d, n in need.items())
    for tree, layout in zip(trees, layouts, strict=True):
        buffers = box.pack(tree)
        assert [b.shape for b in buffers] == [(n,) for n in box.sizes]
        assert [b.dtype for b in buffers] == list(box.dtypes)
        models.assert_trees_equal(box.unpack(buffers, layout), tree)
        # Unused space is zero.
        for buf, dtype in zip(buffers, box.dtypes, strict=True):
            used = layout.demand().get((dtype, ()), 0)
            assert not np.any(np.asarray(buf)[used:])
    assert layouts[0].structs()["f32"] == jax.ShapeDtypeStruct((2, 3), jnp.float32)
    assert "float32[2, 3]" in layouts[0].describe()


def test_container_is_differentiable_and_linear():
    tree = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2), jnp.float32)}
    layout = Layout.of(tree)
    box = Container.for_layouts([layout, Layout.of({"c": jnp.ones((9,))})])
    round_trip = lambda t: box.unpack(box.pack(t), layout)
    tangent = {"a": jnp.asarray([1.0, -2.0, 0.5]), "b": jnp.full((2, 2), 3.0, jnp.float32)}
    _, out_tangent = jax.jvp(round_trip, (tree,), (tangent,))
    models.assert_trees_equal(out_tangent, tangent)
    _, vjp = jax.vjp(round_trip, tree)
    models.assert_trees_equal(vjp(tangent)[0], tangent)


# --- stage parameters ---------------------------------------------------------------------------------


def test_stage_params_pack_round_trip():
    params = [_mixed(2), {"w": jnp.ones((5,))}, {}, _mixed(3, scale=2)]
    packed = pack_params(params)
    assert isinstance(packed, pj.StageParams)
    assert packed.num_stages == 4
    assert all(b.shape[0] == 4 for b in packed.buffers)
    assert packed.bytes_per_stage() == sum(b.shape[1] * b.dtype.itemsize for b in packed.buffers)
    models.assert_trees_equal(packed.unpack(), params)
    models.assert_trees_equal(packed.stage(1), params[1])
    # A pytree: tree.map keeps the type and the layout.
    doubled = jax.tree.map(lambda b: b, packed)
    assert isinstance(doubled, pj.StageParams)
    models.assert_trees_equal(doubled.unpack(), params)
    assert "StageParams(num_stages=4" in repr(packed)


def test_stage_params_repr_with_non_array_leaves():
    """Printing e.g. ``jax.tree.map(jnp.shape, params)`` must not fail."""
    packed = pack_params([{"w": jnp.ones((2,))}, {"w": jnp.ones((3,))}])
    shapes = jax.tree.map(jnp.shape, packed)
    assert "StageParams" in repr(shapes)


def test_pipeline_stage_params_accessor():
    apply = pj.pipeline(list(models.PAIR_STAGES))
    params = models.pair_params()
    placed = apply.place(params)
    for s in range(2):
        models.assert_trees_equal(apply.stage_params(placed, s), params[s])
        models.assert_trees_equal(apply.stage_params(params, s), params[s])
    # Without a mesh, StageParams are accepted in place of the list, with the same result.
    x = models.pair_inputs(5)
    np.testing.assert_array_equal(np.asarray(apply(placed, x)), np.asarray(apply(params, x)))
    stacked = models.stacked_params(2)
    homo = pj.pipeline(models.residual, num_stages=2)
    models.assert_trees_equal(homo.stage_params(stacked, 1), models.unstack(stacked, 2)[1])


# --- keys -------------------------------------------------------------------------------------------


def test_key_for_is_two_fold_ins_for_raw_and_typed_keys():
    for key in (jax.random.key(5), jax.random.PRNGKey(5)):
        got = keys.key_for(key, jnp.int32(2), jnp.int32(1))
        expected = jax.random.fold_in(jax.random.fold_in(key, 2), 1)
        data = lambda k: jax.random.key_data(k) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) else k
        np.testing.assert_array_equal(np.asarray(data(got)), np.asarray(data(expected)))


@pytest.mark.parametrize("key", [None, jax.random.key(0), jax.random.PRNGKey(0)])
def test_check_key_accepts(key):
    checks.check_key(key)


def test_repr_names_the_configuration():
    text = repr(pj.pipeline(models.residual, num_stages=2, chunks=3, checkpoint="always"))
    assert "2 homogeneous stages" in text and "chunks=3" in text and "'always'" in text
