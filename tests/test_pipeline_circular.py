"""The circular (interleaved) schedule: ``schedule="circular", repeats=v``.

``S = v n`` stages run on the ``n`` devices of the stage axis; device ``d`` holds stages ``d, d +
n, ...`` and every micro-batch goes round the devices ``v`` times. Checked here:

* the static table (every (stage, micro-batch) once, on the right device, after its input exists;
  the loop buffer never overwritten before it is read; the bubble ``(n - 1) / (v m + n - 1)``);
* results against the composition of the ``S`` stages (outputs, gradients and a Hessian-vector
  product, homogeneous and heterogeneous, ``n = 2`` and ``n = 4``, ``m`` in {2, 4, 5}, uneven
  batches, every checkpoint mode, with and without a mesh);
* against GPipe over the same ``S`` stages with dropout: forward bitwise, gradients to rounding;
  the circular schedule bitwise across checkpoint modes and with or without a mesh;
* the executed bubble, counted with ``jax.debug.callback`` inside the stage;
* ``place`` giving each device exactly its ``v`` stages; no per-tick parameter copies saved;
* stats of stateful stages; errors.

Tolerances (float64): forward rtol 1e-12, gradients and HVPs rtol 1e-10 / atol 1e-12, as in
``test_pipeline_contract.py`` (micro-batching reorders the sums over the batch).
"""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from pipejax._src import checkpoint as ckpt
from pipejax._src import compat
from tests import models

FWD_TOL = {"rtol": 1e-12, "atol": 1e-14}
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}


# --- models ----------------------------------------------------------------------------------------


def drop_res(p, x, key):
    """Homogeneous ``f64[b, 3] -> f64[b, 3]``: a residual tanh layer with dropout (none without a key)."""
    return x + pj.dropout(jnp.tanh(x @ p["w"] + p["b"][None]), key, 0.25)


def hidden(p, hs, key):
    """``(h: f64[b, WIDE], skip) -> (h', skip)``: a middle stage for the ``tokens`` layout."""
    h, skip = hs
    return pj.dropout(jnp.tanh(h @ p["w"] + p["c"][None]), key, 0.25), skip


def hetero(num_stages):
    """``embed, wide, hidden x (S - 3), head``: every boundary type differs from its neighbours'."""
    stages = (models.embed, models.wide) + (hidden,) * (num_stages - 3) + (models.head,)
    first, second, last = models.token_params()
    r = np.random.default_rng(5)
    wide = models.WIDE
    middle = [
        {"w": jnp.asarray(r.normal(size=(wide, wide)) / 2.5), "c": jnp.asarray(r.normal(size=wide))}
        for _ in range(num_stages - 3)
    ]
    return stages, [first, second, *middle, last]


def setup(layout, n, v, chunks, checkpoint, placement):
    mesh = models.make_mesh(placement, n)
    kw = {"chunks": chunks, "checkpoint": models.CHECKPOINTS[checkpoint], "mesh": mesh}
    S = n * v
    if layout == "homogeneous":
        params = models.stacked_params(S)
        apply = pj.pipeline(drop_res, num_stages=S, schedule="circular", repeats=v, **kw)
        stages, per_stage = (drop_res,) * S, models.unstack(params, S)
        return apply, params, lambda p, x: models.compose(stages, models.unstack(p, S), x), per_stage
    stages, params = hetero(S)
    apply = pj.pipeline(list(stages), schedule="circular", repeats=v, **kw)
    return apply, params, lambda p, x: models.compose(stages, p, x), params


def inputs(layout, batch):
    return models.stacked_inputs(batch) if layout == "homogeneous" else models.token_inputs(batch)


def loss_of(layout):
    return models.STACKED.loss if layout == "homogeneous" else models.TOKENS.loss


# --- the table ---------------------------------------------------------------------------------------


def circular_cases():
    return itertools.product(range(1, 5), range(1, 4), range(1, 7))  # (n, v, m)


def test_circular_tables():
    for n, v, m in circular_cases():
        s = pj.circular_schedule(n, m, v)
        slots = max(m, n) if v > 1 else m
        table, stage = s.table, s.stages()
        assert table.shape == stage.shape == (v * slots + n - 1, n) == (s.num_ticks, s.num_devices)
        assert s.num_stages == v * n and s.repeats == v and s.num_micro == m
        # Every (stage, micro-batch) runs once, on device stage % n; each device only runs its stages.
        ticks = {}
        for t, d in zip(*np.nonzero(table >= 0), strict=True):
            key = (int(stage[t, d]), int(table[t, d]))
            assert key not in ticks and key[0] % n == d
            ticks[key] = int(t)
        assert set(ticks) == set(itertools.product(range(v * n), range(m)))
        assert np.all(stage % n == np.arange(n)[None, :]) and np.all((stage >= 0) & (stage < v * n))
        np.testing.assert_array_equal(s.work_per_stage(), [m] * (v * n))
        np.testing.assert_array_equal(s.work_per_device(), [v * m] * n)
        # A stage runs one tick after its predecessor on the next device, or later across the wrap.
        for (j, i), t in ticks.items():
            if j and j % n:
                assert t == ticks[(j - 1, i)] + 1
            elif j:
                assert t > ticks[(j - 1, i)]
        # Device 0's loop buffer: micro-batch i's activation arrives (one tick after the last
        # device produced it) and is read before the next one for slot i arrives.
        for i in range(m):
            events = sorted(
                [(ticks[(r * n - 1, i)] + 1, "arrive") for r in range(1, v)]
                + [(ticks[(r * n, i)], "read") for r in range(1, v)]
            )
            assert [e for _, e in events] == ["arrive", "read"] * (v - 1), (n, v, m, i, events)
        # A bubble entry names the stage the device last ran (its first before it started).
        for t, d in zip(*np.nonzero(table < 0), strict=True):
            done = [j for (j, _), u in ticks.items() if j % n == d and u < t]
            assert stage[t, d] == (max(done) if done else d)
        # The bubble.
        expected = (n - 1) / (v * m + n - 1) if m >= n or v == 1 else 1 - v * m / (v * n + n - 1)
        assert s.bubble_fraction() == pytest.approx(expected, rel=1e-14)
        assert pj.circular_bubble_fraction(n, m, v) == pytest.approx(expected, rel=1e-14)  # m < n too
        if v == 1:  # GPipe's table
            np.testing.assert_array_equal(table, pj.gpipe_schedule(n, m).table)


@pytest.mark.parametrize("checkpoint", list(models.CHECKPOINTS.values()), ids=list(models.CHECKPOINTS))
def test_phases_are_one_scan_but_except_last_cuts_the_drain(checkpoint):
    """Every mode runs the whole table as one scan; ``"except_last"`` keeps the last ``n`` ticks
    (the drain, ``n`` devices) in a second one."""
    for n, v, m in circular_cases():
        s = pj.circular_schedule(n, m, v)
        cuts = [p.start for p in ckpt.phases(checkpoint, s)] + [s.num_ticks]
        drain = [max(s.num_ticks - n, 0)] if checkpoint == "except_last" else []
        assert cuts == sorted(set([0, *drain, s.num_ticks]))


# --- against the composition -------------------------------------------------------------------------

# (layout, n, v, batch, chunks, checkpoint, placement): m = 2 (B=5), 4 (B=10, 2 padding rows),
# 5 (B=10); m < n with n = 4 runs n slots per round.
CASES = [
    ("homogeneous", 2, 2, 10, 5, "except_last", "explicit"),
    ("homogeneous", 4, 2, 5, 2, "never", "auto"),
    ("homogeneous", 4, 2, 10, 4, "always", "none"),
    ("heterogeneous", 2, 2, 10, 4, "dots_saveable", "explicit"),
    ("heterogeneous", 2, 2, 5, 2, "never", "none"),
    ("heterogeneous", 4, 2, 10, 5, "always", "explicit"),
]


def derivatives(apply, loss):
    """One jitted program: ``(y, grads, HVP)`` of ``loss(y)`` w.r.t. params at ``(params, x)``."""

    def run(p, x, vp):
        grad = jax.grad(lambda p: loss(apply(p, x)))
        hvp = jax.jvp(grad, (p,), (vp,))[1]
        return apply(p, x), grad(p), hvp

    return jax.jit(run)


@pytest.mark.parametrize("layout,n,v,batch,chunks,checkpoint,placement", CASES)
def test_matches_the_composition(layout, n, v, batch, chunks, checkpoint, placement):
    apply, params, reference, _ = setup(layout, n, v, chunks, checkpoint, placement)
    x = inputs(layout, batch)
    r = np.random.default_rng(9)
    vp = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape)), params)
    got = derivatives(apply, loss_of(layout))(params, x, vp)
    want = derivatives(reference, loss_of(layout))(params, x, vp)
    models.assert_trees_close(got[0], want[0], **FWD_TOL)
    models.assert_trees_close(got[1:], want[1:], **GRAD_TOL)


def value_and_grads(apply, key):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(apply(p, x, key))), argnums=(0, 1)))


def test_bitwise_across_modes_and_meshes_and_gpipe_forward_with_dropout():
    """Dropout: the circular schedule on a mesh of 2 and without a mesh, every checkpoint mode,
    gives the same bits (``"except_last"``: its parameter gradients to rounding, see
    ``models.assert_modes_agree``); GPipe over the same 4 stages the same forward bits (the keys depend on
    the stage and micro-batch only), and parameter gradients to rounding (the backward sums the
    ticks' parameter cotangents in another grouping)."""
    params, x, key = models.stacked_params(4), models.stacked_inputs(10), jax.random.key(3)
    mesh = models.make_mesh("explicit", 2)

    def run(**kw):
        apply = pj.pipeline(drop_res, num_stages=4, chunks=4, **kw)
        return value_and_grads(apply, key)(params, x)

    reference = run(schedule="circular", repeats=2, mesh=mesh, checkpoint="always")
    for mode, on in [("never", mesh), ("never", None), ("except_last", None)]:
        got = run(schedule="circular", repeats=2, mesh=on, checkpoint=mode)
        models.assert_modes_agree(got, reference, mode)
    gpipe = run()
    value, (g_params, g_x) = reference
    models.assert_trees_equal((value, g_x), (gpipe[0], gpipe[1][1]))
    models.assert_trees_close(g_params, gpipe[1][0], rtol=1e-13, atol=1e-15)


# --- the executed bubble ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,m", [(2, 4), (4, 4), (4, 2)])
def test_bubble_counted_in_the_stage(n, m):
    """Each stage records (its index, the micro-batch id its rows carry) when it really executes.
    (Heterogeneous stages: their bubbles skip the stage; a homogeneous stage on a mesh computes
    its bubbles on a micro-batch of ``x`` and discards them, see docs/pipeline_guarantees.md.)"""
    v = 2
    log: list[tuple[int, int]] = []

    def stage(p, x, key):
        jax.debug.callback(lambda s, i: log.append((int(s), int(i))), p["idx"], x[0, 0])
        return x * p["w"]

    apply = pj.pipeline(
        [stage] * (v * n),
        chunks=m,
        schedule="circular",
        repeats=v,
        checkpoint="always",
        mesh=models.make_mesh("explicit", n),
    )
    params = apply.place([{"idx": jnp.asarray(s), "w": jnp.asarray(1.0)} for s in range(v * n)])
    x = jnp.repeat(jnp.arange(m, dtype=jnp.float64), 2)[:, None] * jnp.ones((1, 3))  # rows carry ids
    jax.block_until_ready(apply(params, x))
    jax.effects_barrier()
    assert sorted(log) == sorted(itertools.product(range(v * n), range(m)))  # each pair once
    per_device = collections.Counter(s % n for s, _ in log)
    ticks = apply.schedule(x.shape[0]).num_ticks
    idle = 1 - np.mean([per_device[d] for d in range(n)]) / ticks
    expected = (n - 1) / (v * m + n - 1) if m >= n else 1 - v * m / (v * n + n - 1)
    assert [per_device[d] for d in range(n)] == [v * m] * n
    assert idle == pytest.approx(expected, rel=1e-12)
    assert idle < pj.gpipe_bubble_fraction(n, m) or m < n


# --- placement ------------------------------------------------------------------------------------


def test_place_gives_each_device_its_repeats_stages():
    n, v = 2, 2
    mesh = models.make_mesh("explicit", n)
    homo = pj.pipeline(drop_res, num_stages=v * n, chunks=2, schedule="circular", repeats=v, mesh=mesh)
    stacked = models.stacked_params(v * n)
    placed = homo.place(stacked)
    for leaf, logical in zip(jax.tree.leaves(placed), jax.tree.leaves(stacked), strict=True):
        assert leaf.shape == (v, n, *logical.shape[1:])
        assert leaf.sharding.spec == jax.sharding.PartitionSpec(None, "stage")
        for shard in leaf.addressable_shards:
            d = mesh.devices.tolist().index(shard.device)
            np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], np.asarray(logical)[d::n])
    for s in range(v * n):
        models.assert_trees_equal(homo.stage_params(placed, s), jax.tree.map(lambda a, s=s: a[s], stacked))
    x = models.stacked_inputs(6)
    models.assert_trees_equal(homo(placed, x), homo(stacked, x))
    with jax.set_mesh(mesh):  # eager autodiff on an Explicit mesh
        g_placed = jax.grad(lambda p: jnp.sum(homo(p, x)))(placed)
        g_logical = jax.grad(lambda p: jnp.sum(homo(p, x)))(stacked)
    assert jax.tree.map(jnp.shape, g_placed) == jax.tree.map(jnp.shape, placed)
    as_logical = jax.tree.map(lambda a: np.asarray(a).reshape(v * n, *a.shape[2:]), g_placed)
    models.assert_trees_equal(as_logical, g_logical)

    stages, params = hetero(v * n)
    het = pj.pipeline(list(stages), chunks=2, schedule="circular", repeats=v, mesh=mesh)
    packed = het.place(params)
    assert isinstance(packed, pj.StageParams) and packed.buffers[0].shape[:2] == (v, n)
    rows = pj.pipeline(list(stages), chunks=2).place(params).buffers[0]  # (S, size), stage order
    for shard in packed.buffers[0].addressable_shards:
        d = mesh.devices.tolist().index(shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], np.asarray(rows)[d::n])
    models.assert_trees_equal(packed.unpack(), params)
    xt = models.token_inputs(6)
    models.assert_trees_equal(het(packed, xt), het(params, xt))


def test_never_keeps_no_parameter_copy_per_tick():
    """A device picks one of its stages' parameters at every tick; phases that keep residuals
    must not keep that slice (or the weights a stage slices out of it) once per tick."""
    width = 16

    def stage(p, x, key):
        for j in range(2):
            x = jnp.tanh(x @ p["w"][j])
        return x

    apply = pj.pipeline(
        stage,
        num_stages=4,
        chunks=4,
        schedule="circular",
        repeats=2,
        checkpoint="never",
        mesh=models.make_mesh("explicit", 2),
    )
    w = apply.place({"w": jnp.full((4, 2, width, width), 0.01)})
    x = jnp.ones((8, width))
    residuals = compat.saved_residuals(lambda w, x: jnp.sum(apply(w, x)), w, x)
    weight_like = [a.shape for a, _ in residuals if tuple(a.shape[-2:]) == (width, width)]
    assert [np.prod(s) for s in weight_like] == [w["w"].size], weight_like  # each device's own block, once


def test_stateful_stats_equal_gpipe():
    def stage(p, x, key, state, mask):
        h = x + jnp.tanh(x @ p["w"] + state["shift"][None])
        return h, {"sum": jnp.sum(jnp.where(mask[:, None], h, 0.0), axis=0), "rows": jnp.sum(mask)}

    params, x = models.stacked_params(4), models.stacked_inputs(10)
    state = {"shift": jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)))}
    gpipe = pj.pipeline(stage, num_stages=4, chunks=4, stateful=True)(params, x, state=state)
    for mesh in (None, models.make_mesh("explicit", 2)):
        circular = pj.pipeline(
            stage, num_stages=4, chunks=4, stateful=True, schedule="circular", repeats=2, mesh=mesh
        )
        y, stats = circular(params, x, state=circular.place(state))
        models.assert_trees_close((y, stats), gpipe, **FWD_TOL)
        assert stats["rows"].tolist() == [[3, 3, 3, 1]] * 4
    stages, hparams = hetero(4)
    lift = lambda f: lambda p, x, key, state, mask: (f(p, x, key), jnp.sum(mask) if state is None else None)
    het = [lift(f) for f in stages]
    xt = models.token_inputs(10)
    want = pj.pipeline(het, chunks=4, stateful=True)(hparams, xt)
    mesh = models.make_mesh("explicit", 2)
    got = pj.pipeline(het, chunks=4, stateful=True, schedule="circular", repeats=2, mesh=mesh)(hparams, xt)
    models.assert_trees_close(got, want, **FWD_TOL)


# --- errors ---------------------------------------------------------------------------------------


def test_errors():
    stages = [drop_res] * 4
    with pytest.raises(ValueError, match=r"`repeats` must be an int >= 1.*got 0"):
        pj.pipeline(stages, schedule="circular", repeats=0)
    with pytest.raises(TypeError, match=r"`repeats` must be an int >= 1, but got float 2.0"):
        pj.pipeline(stages, schedule="circular", repeats=2.0)
    with pytest.raises(ValueError, match=r"multiple of 3 .*has 4 stages.*Use 3 stages"):
        pj.pipeline(stages, schedule="circular", repeats=3)
    with pytest.raises(ValueError, match=r"'circular', .*'interleaved-1f1b'.*, but got 'interleaved'"):
        pj.pipeline(stages, schedule="interleaved")
    with pytest.raises(TypeError, match=r"`schedule` must be one of"):
        pj.pipeline(stages, schedule=None)
    with pytest.raises(ValueError, match=r"`repeats=2` needs `schedule='circular'`"):
        pj.pipeline(stages, repeats=2)
    with pytest.raises(ValueError, match=r"axis 'stage' has size 4, but the circular pipeline has 4 stages"):
        pj.pipeline(stages, schedule="circular", repeats=2, mesh=models.make_mesh("explicit", 4))
    with pytest.raises(ValueError, match=r"has size 2, but the pipeline has 4 stages.*schedule='circular'"):
        pj.pipeline(stages, mesh=models.make_mesh("explicit", 2))
    homo = pj.pipeline(drop_res, num_stages=4, schedule="circular", repeats=2)
    with pytest.raises(ValueError, match=r"leading stage axis of size 4 \(or 2, 2 as `place`"):
        homo({"w": jnp.ones((3, 3, 3)), "b": jnp.ones((3, 3))}, jnp.ones((2, 3)))
