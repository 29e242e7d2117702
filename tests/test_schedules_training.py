"""Schedules that own the backward pass ("1f1b", "zb-h1") and ``Pipeline.value_and_grad``.

* The tables: every (stage, micro-batch) has its F, B (and W) exactly once, in an order the
  program can run (an activation or cotangent is consumed the tick after it is sent), with at
  most ``2 n - 1`` micro-batches in flight per device whatever ``m``, and the lockstep bubble
  of the theory.
* The program: loss and gradients equal ``jax.value_and_grad`` of the GPipe pipeline on
  heterogeneous stages with dropout and an uneven batch, with and without a mesh, and on
  homogeneous stages; ``jax.jvp`` of it gives the Hessian-vector products of ``jax.hessian`` of
  the composed model; the F/B/W slots counted inside the program equal the table's.

Tolerances (float64, eps 2.2e-16): the schedules sum the loss and the parameter cotangents per
micro-batch in another order than GPipe's autodiff (and recompute the forward in B), so results
agree to rounding: rtol 1e-10 and atol 1e-12 leave a margin of about 100x over <= 16 reordered
O(1) terms, as in test_pipeline_contract.py.
"""

from __future__ import annotations

import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import pipejax as pj
import pipejax.hessian
from pipejax._src.schedules import tables as sched
from pipejax._src.training import step as train
from tests import models

TOL = {"rtol": 1e-10, "atol": 1e-12}
SCHEDULES = ("1f1b", "zb-h1")


# --- the tables -------------------------------------------------------------------------------


def _ticks(table, stages=None):
    """{(stage, micro): tick} of a slot table (each entry at most once); the stage of a slot is
    its device unless a stage table is given."""
    out = {}
    for t, d in itertools.product(range(table.shape[0]), range(table.shape[1])):
        i = int(table[t, d])
        if i >= 0:
            s = d if stages is None else int(stages[t, d])
            assert s % table.shape[1] == d, f"stage {s} on device {d}"
            assert (s, i) not in out, f"slot ({s}, {i}) twice"
            out[(s, i)] = t
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("n", "m"), [(1, 3), (2, 1), (2, 5), (3, 2), (3, 7), (4, 4), (4, 9)])
def test_table_is_valid(name, n, m):
    s = sched.training(name, n, m)
    every = {(d, i) for d in range(n) for i in range(m)}
    F, B = _ticks(s.forward), _ticks(s.backward)
    W = _ticks(s.weight) if s.weight is not None else B
    assert set(F) == set(B) == set(W) == every  # each slot exactly once
    for d, i in every:
        if d + 1 < n:  # the activation is consumed the tick after it was sent
            assert F[(d + 1, i)] == F[(d, i)] + 1
            assert B[(d, i)] == B[(d + 1, i)] + 1  # and so is the cotangent
        assert B[(d, i)] >= F[(d, i)]  # the last stage: F then B in the same tick
        assert W[(d, i)] >= B[(d, i)]
    flight = s.in_flight()
    assert s.stash_slots() == flight.max() == min(m, 2 * n - 1)
    per_device = flight.max(axis=0)
    expect = [min(m, 2 * (n - d) - 1 if name == "1f1b" else 2 * n - 1 - d) for d in range(n)]
    assert per_device.tolist() == expect


@pytest.mark.parametrize(("n", "m", "v"), [(1, 3, 2), (2, 2, 2), (2, 6, 3), (3, 9, 2), (4, 8, 2), (4, 16, 2)])
def test_interleaved_table_is_valid(n, m, v):
    s = pj.interleaved_one_f_one_b_schedule(n, m, v)
    S = n * v
    fs, bs = s.stages("F"), s.stages("B")
    F, B = _ticks(s.forward, fs), _ticks(s.backward, bs)
    every = {(j, i) for j in range(S) for i in range(m)}
    assert set(F) == set(B) == every
    for j, i in every:
        if j + 1 < S:  # over the ring: device n - 1 hands stage j + 1 to device 0
            assert F[(j + 1, i)] == F[(j, i)] + 1 and B[(j, i)] == B[(j + 1, i)] + 1
    assert all(B[(S - 1, i)] == F[(S - 1, i)] for i in range(m))
    # per device at most one F and one B per tick (the tables hold one entry per cell), every
    # device does v m of each, and the lockstep bubble is the circular schedule's
    assert s.slots()["F"].tolist() == s.slots()["B"].tolist() == [v * m] * n
    np.testing.assert_allclose(s.bubble_fraction(1 / v, 2 / v), pj.circular_bubble_fraction(n, m, v))
    assert s.stash_slots() == min(m, 2 * n)  # per stage held, flat in m
    with pytest.raises(ValueError, match=r"`num_micro` must be a multiple of `num_devices="):
        pj.interleaved_one_f_one_b_schedule(n + 1, n + 2, v)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 4), (4, 16), (8, 32)])
def test_bubble_matches_theory(n, m):
    f, b, w = 1.0, 1.3, 0.7
    one = sched.one_f_one_b(n, m)
    zb = sched.zb_h1(n, m)
    # 1F1B in lockstep costs GPipe's (m + n - 1)(f + b): the same bubble, memory flat in m
    np.testing.assert_allclose(one.bubble_fraction(f, b + w), sched.gpipe_bubble_fraction(n, m))
    np.testing.assert_allclose(zb.bubble_fraction(f, b, w), sched.zb_h1_bubble_fraction(n, m, f, b, w))
    assert zb.step_time(f, b, w) == pytest.approx(one.step_time(f, b + w) - (n - 1) * w)
    assert one.stash_slots() == zb.stash_slots() == min(m, 2 * n - 1)


def test_stash_is_flat_in_m():
    assert {sched.one_f_one_b(4, m).stash_slots() for m in (7, 8, 64, 512)} == {7}


@pytest.mark.parametrize(("n", "m"), [(1, 3), (2, 1), (2, 2), (2, 5), (3, 7), (4, 3), (4, 8), (4, 32)])
def test_v_half_table_is_valid(n, m):
    """The V: device d holds stages d and 2 n - 1 - d; every activation (and cotangent) is read
    the tick after it was made, the turn (stage n - 1 to n) on device n - 1 itself; the last
    stage, on device 0, runs B right after F; the bubble and step are 1F1B's with stages of half
    the cost; a device holds at most 2 n stage inputs (half a 1F1B stage each), flat in m."""
    s = sched.v_half(n, m)
    S = 2 * n
    assert (s.placement, s.repeats, s.num_stages) == ("v", 2, S)
    fs, bs = s.stages("F"), s.stages("B")
    F, B = {}, {}
    for ticks, table, stages in ((F, s.forward, fs), (B, s.backward, bs)):
        for t, d in itertools.product(range(s.num_ticks), range(n)):
            if table[t, d] >= 0:
                j = int(stages[t, d])
                assert d == (j if j < n else S - 1 - j), f"stage {j} on device {d}"
                assert (j, int(table[t, d])) not in ticks
                ticks[(j, int(table[t, d]))] = t
    every = {(j, i) for j in range(S) for i in range(m)}
    assert set(F) == set(B) == every
    for j, i in every:
        if j + 1 < S:
            assert F[(j + 1, i)] == F[(j, i)] + 1 and B[(j, i)] == B[(j + 1, i)] + 1
    assert all(B[(S - 1, i)] == F[(S - 1, i)] for i in range(m))
    assert s.slots()["F"].tolist() == s.slots()["B"].tolist() == [2 * m] * n
    np.testing.assert_allclose(s.bubble_fraction(1.0, 2.0), pj.v_half_bubble_fraction(n, m))
    np.testing.assert_allclose(s.bubble_fraction(1.0, 2.0), sched.gpipe_bubble_fraction(n, m))
    one = sched.one_f_one_b(n, m)
    assert s.step_time(0.5, 1.0) == pytest.approx(one.step_time(1.0, 2.0))
    size, slot = s.stash_pool()
    assert size == s.in_flight().max() <= 2 * n
    if m >= n:
        assert size == 2 * n
    for kind, table in (("F", s.forward), ("B", s.backward)):  # every slot has its pool slot
        assert ((slot[kind] >= 0) == (table >= 0)).all() and slot[kind].max() < size


@pytest.mark.parametrize(("n", "m"), [(1, 2), (2, 3), (3, 5), (4, 8), (4, 32)])
def test_zb_v_table_is_valid(n, m):
    """ZB-V: V-Half's F slots; B the input cotangent only, at V-Half's ticks; W of micro-batch i
    on every device at 2 i + 4 n - 2 (way down) and 2 i + 4 n - 3 (way up), at or after its B;
    the step and bubble of ZB-H1 with stages of half the cost; both pools flat in m."""
    s, v = sched.zb_v(n, m), sched.v_half(n, m)
    assert s.kinds == ("F", "B", "W") and s.placement == "v"
    for k in ("F", "B"):
        np.testing.assert_array_equal(s.micro[k], v.micro[k])
        np.testing.assert_array_equal(s.stage[k], v.stage[k])
    for t, d in itertools.product(range(s.num_ticks), range(n)):
        i, j = int(s.weight[t, d]), int(s.stages("W")[t, d])
        if i >= 0:
            assert t == 2 * i + 4 * n - 2 - (j >= n) and d == (j if j < n else 2 * n - 1 - j)
    assert s.slots()["W"].tolist() == [2 * m] * n
    f, b, w = 1.0, 1.3, 0.7
    zb = sched.zb_h1(n, m)
    assert s.step_time(f / 2, b / 2, w / 2) == pytest.approx(zb.step_time(f, b, w))
    np.testing.assert_allclose(s.bubble_fraction(0.5, 0.5, 0.5), sched.zb_h1_bubble_fraction(n, m, 1, 1, 1))
    size, _ = s.stash_pool()
    assert size == s.in_flight().max()
    if m >= n:
        assert size == 3 * n - 1 and s.cotangent_pool()[0] == n


@pytest.mark.parametrize(("n", "m"), [(1, 3), (2, 5), (3, 4), (4, 8)])
def test_v_tables_with_two_tick_hops(n, m):
    """Sends that overlap compute on a V: a message between devices is read two ticks after it
    was made, the turn's one tick after; way-down slots on even ticks and way-up slots on odd
    ones, so each tick's activations (and cotangents) all go one way; the step of the one-tick
    table, and pools flat in m."""
    S = 2 * n
    for s in (sched.v_half(n, m, hop=2), sched.zb_v(n, m, hop=2)):
        assert s.hop == 2 and s.num_ticks == 2 * m + 8 * n - 7
        F, B = _v_ticks(s, "F"), _v_ticks(s, "B")
        for i in range(m):
            for j in range(S - 1):
                gap = 1 if j == n - 1 else 2
                assert F[j + 1, i] - F[j, i] == gap and B[j, i] - B[j + 1, i] == gap
            assert B[S - 1, i] == F[S - 1, i]
            for kind, t in (("F", F), ("B", B)):  # down on even ticks, up on odd ones
                assert all(t[j, i] % 2 == (j >= n) for j in range(S)), kind
        if s.weight is not None:
            W = _v_ticks(s, "W")
            assert (W >= B).all()
    # the ticks the hops add hold no slot: with stages of equal cost the step is the one-tick
    # table's (an idle tick of a training table costs nothing), under 1F1B's with the same hops
    v, zb = sched.v_half(n, m, hop=2), sched.zb_v(n, m, hop=2)
    assert v.step_time(0.5, 1.0) == sched.v_half(n, m).step_time(0.5, 1.0)
    assert zb.step_time(0.5, 0.7, 0.3) == pytest.approx(sched.zb_v(n, m).step_time(0.5, 0.7, 0.3))
    assert v.step_time(0.5, 1.0) <= sched.one_f_one_b(n, m, hop=2).step_time(1.0, 2.0)
    big = 8 * n
    assert sched.v_half(n, big, hop=2).stash_pool()[0] == sched.v_half(n, 4 * big, hop=2).stash_pool()[0]
    assert sched.zb_v(n, big, hop=2).stash_pool()[0] == sched.zb_v(n, 4 * big, hop=2).stash_pool()[0]


def _v_ticks(s, kind):
    """int[S, m]: the tick of each (stage, micro-batch)'s ``kind`` slot, read off the table."""
    out = np.full((s.num_stages, s.num_micro), -1)
    for t, d in zip(*np.nonzero(s.micro[kind] >= 0), strict=True):
        out[s.stages(kind)[t, d], s.micro[kind][t, d]] = t
    assert (out >= 0).all()
    return out


def test_v_half_stash_is_flat_in_m():
    assert {sched.v_half(4, m).stash_pool()[0] for m in (8, 16, 32, 256)} == {8}


def test_last_stage_slots():
    """The last stage's own ring (``slots._MeshSlots``): none where its F and its last use (B,
    or W) share a tick, F handing what it keeps straight to B; ``n`` where ZB defers its W."""
    for n, m in ((2, 4), (4, 8), (3, 7)):
        assert sched.one_f_one_b(n, m).last_stage_slots() == 0
        assert sched.v_half(n, m).last_stage_slots() == 0
        assert sched.zb_h1(n, m).last_stage_slots() == n
        assert sched.zb_v(n, m).last_stage_slots() == n
    assert sched.interleaved_one_f_one_b(4, 8, 2).last_stage_slots() == 0
    assert sched.one_f_one_b(1, 4).last_stage_slots() == 0  # one device: every stage is the last
    # a user table whose last stage runs B a tick after F: one slot holds it
    late = pj.schedule_from_actions(
        [(0, 0, "F", 0), (1, 1, "F", 0), (1, 2, "B", 0), (0, 3, "B", 0)], num_devices=2, num_micro=1
    )
    assert late.last_stage_slots() == 1
    for s in _random_training_tables():  # the ring holds every last-stage input apart
        size = s.last_stage_slots()
        stage, micro, first, last = s._held()
        mine = (stage == s.num_stages - 1) & (first < last)
        if size == 0:
            assert not mine.any()
            continue
        assert size >= s.in_flight(per_stage=True)[:, -1].max() or size == s.num_micro
        for i in np.flatnonzero(mine):
            for j in np.flatnonzero(mine):
                if i != j and micro[i] % size == micro[j] % size:
                    assert last[i] < first[j] or last[j] < first[i], (s.name, size)


def _naive_in_flight(s, per_stage=False):
    last = s.backward if s.weight is None else s.weight
    fs, bs = s.stages("F"), s.stages("B")
    n, t = s.num_devices, np.arange(s.num_ticks)
    count = np.zeros((s.num_ticks, n * s.repeats), np.int64)
    first, done = {}, {}
    for tick, d in np.ndindex(s.forward.shape):
        if s.forward[tick, d] >= 0:
            first[(int(fs[tick, d]), int(s.forward[tick, d]))] = tick
        if last[tick, d] >= 0:
            done[(int(bs[tick, d]), int(last[tick, d]))] = tick
    for (j, i), tick in first.items():
        count[:, j] += (t >= tick) & (t <= done[(j, i)])
    if per_stage:
        return count
    return count.reshape(s.num_ticks, s.repeats, n).sum(axis=1)


def _naive_interleaved(n, m, v):
    S = n * v
    base = (np.arange(m) // n) * n * v + np.arange(m) % n
    ticks = int(base[-1]) + 2 * (S - 1) + 1
    forward, backward = (np.full((ticks, n), -1, np.int32) for _ in range(2))
    fstage = np.broadcast_to(np.arange(n, dtype=np.int32), (ticks, n)).copy()
    bstage = fstage.copy()
    for j in range(S):
        for k, b0 in enumerate(base):
            tf, tb = b0 + j, b0 + 2 * (S - 1) - j
            assert forward[tf, j % n] < 0 and backward[tb, j % n] < 0
            forward[tf, j % n], fstage[tf, j % n] = k, j
            backward[tb, j % n], bstage[tb, j % n] = k, j
    return forward, backward, fstage, bstage


def _random_training_tables(seed=0, count=12):
    """Random small tables of every training kind (fixed seed; n, m, v drawn)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n, m, v = (int(a) for a in (rng.integers(1, 6), rng.integers(1, 12), rng.integers(2, 4)))
        out += [sched.one_f_one_b(n, m), sched.zb_h1(n, m), sched.sequential_training(n, m)]
        out.append(sched.interleaved_one_f_one_b(n, n * (1 + m // n), v))
    return out


def test_table_helpers_equal_the_naive_references():
    for s in _random_training_tables():
        for per_stage in (False, True):
            got, want = s.in_flight(per_stage=per_stage), _naive_in_flight(s, per_stage)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=f"{s.name} {s.forward.shape}")
        assert s.stash_slots() == max(1, int(_naive_in_flight(s, True).max())), s.name


@pytest.mark.parametrize(("n", "m", "v"), [(1, 3, 2), (2, 2, 2), (2, 6, 3), (3, 9, 2), (5, 10, 3)])
def test_interleaved_table_equals_the_loop_that_defines_it(n, m, v):
    s = sched.interleaved_one_f_one_b(n, m, v)
    tables = (s.forward, s.backward, s.forward_stage, s.backward_stage)
    for got, want in zip(tables, _naive_interleaved(n, m, v), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_table_helpers_scale_to_long_tables():
    """m = 200,000: the naive helpers need minutes (quadratic in m); these about 0.1 s of CPU."""
    one = sched.one_f_one_b(4, 200_000)
    assert one.stash_slots() == 7
    assert one.in_flight().max(axis=0).tolist() == [7, 5, 3, 1]
    interleaved = sched.interleaved_one_f_one_b(4, 20_000, 2)  # 160,000 (stage, micro) pairs
    assert interleaved.stash_slots() == 8  # min(m, 2 n), flat in m
    assert interleaved.slots()["F"].tolist() == [2 * 20_000] * 4


# --- the program: against GPipe's jax.value_and_grad -------------------------------------------------

RATE = 0.25


def _dropout(key, h):
    if key is None:
        return h
    keep = jax.random.bernoulli(key, 1.0 - RATE, h.shape)
    return jnp.where(keep, h / (1.0 - RATE), jnp.zeros_like(h))


def embed(p, x, key):
    return _dropout(key, models.embed(p, x, key))


def wide(p, e, key):
    h, skip = models.wide(p, e, key)
    return _dropout(key, h), skip


STAGES = (embed, wide, models.head)


def xent(logits, labels):
    """Per-example cross-entropy."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]


def _labels(batch):
    return jnp.asarray(np.arange(batch) % models.CLASSES, jnp.int32)


@functools.cache
def _reference(batch, chunks, seed):
    """GPipe's ``jax.value_and_grad`` on the token stages (computed once per arguments)."""
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    key = None if seed is None else jax.random.key(seed)
    return pj.pipeline(list(STAGES), chunks=chunks).value_and_grad(xent)(params, x, labels, key)


# checkpoint: "never" keeps the residuals of F for B and W; "always" recomputes the stage from
# its input; a policy keeps what it saves and recomputes the rest
CASES = [("1f1b", "none", "always"), ("1f1b", "explicit", "never"), ("zb-h1", "none", "never")]
CASES += [("zb-h1", "auto", jax.checkpoint_policies.dots_saveable)]


def extra(p, y, key):
    """A fourth stage for the interleaved schedule (4 stages on 2 devices)."""
    return jnp.tanh(y) @ p["w"]


STAGES4 = (*STAGES, extra)


def _params4():
    return [*models.token_params(), {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)) / 2)}]


@functools.cache
def _reference4(batch, chunks, seed):
    params, x, labels = _params4(), models.token_inputs(batch), _labels(batch)
    return pj.pipeline(list(STAGES4), chunks=chunks).value_and_grad(xent)(
        params, x, labels, jax.random.key(seed)
    )


@pytest.mark.parametrize(("placement", "checkpoint"), [("explicit", "always"), ("none", "never")])
def test_interleaved_heterogeneous_with_dropout_uneven_batch(placement, checkpoint):
    """4 stages on 2 devices (stages 0, 2 on device 0; 1, 3 on device 1); without a mesh the
    micro-batches' gradients are accumulated one after the other."""
    batch, chunks = 11, 4  # micro-batches of 3, the last with one padding row
    x, labels = models.token_inputs(batch), _labels(batch)
    mesh = None if placement == "none" else models.make_mesh(placement, 2)
    pipe = pj.pipeline(
        list(STAGES4), chunks=chunks, schedule="interleaved-1f1b", repeats=2, mesh=mesh, checkpoint=checkpoint
    )
    got = pipe.value_and_grad(xent)(_params4(), x, labels, jax.random.key(3))
    models.assert_trees_close(got, _reference4(batch, chunks, 3), **TOL)
    if mesh is not None:  # every device runs v m = 8 F and 8 B slots
        counts = train.slot_counts(pipe, xent, _params4(), x, labels, jax.random.key(3))
        np.testing.assert_array_equal(counts, [[8, 8, 0], [8, 8, 0]])


def test_interleaved_homogeneous_placed():
    n, batch, chunks = 4, 8, 4
    params, x = models.stacked_params(n), models.stacked_inputs(batch)
    t = jnp.asarray(np.random.default_rng(0).normal(size=(batch, models.WIDTH)))
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    mesh = models.make_mesh("explicit", 2)
    pipe = pj.pipeline(
        models.residual, num_stages=n, chunks=chunks, schedule="interleaved-1f1b", repeats=2, mesh=mesh
    )
    ref = pj.pipeline(models.residual, num_stages=n, chunks=chunks).value_and_grad(sq)(params, x, t)
    models.assert_trees_close(pipe.value_and_grad(sq)(params, x, t), ref, **TOL)
    loss, grads = pipe.value_and_grad(sq)(pipe.place(params), x, t)  # (v, n, ...) in and out
    assert grads["w"].shape == (2, 2, models.WIDTH, models.WIDTH)
    stage_major = jax.tree.map(lambda a: np.asarray(a).reshape(n, *a.shape[2:]), grads)
    models.assert_trees_close((loss, stage_major), ref, **TOL)


def test_interleaved_needs_a_multiple_of_n_micro_batches():
    pipe = pj.pipeline(
        list(STAGES4), chunks=3, schedule="interleaved-1f1b", repeats=2, mesh=models.make_mesh("auto", 2)
    )
    with pytest.raises(ValueError, match=r"multiple of 2, but a batch of 9 with `chunks=3`.*`chunks=2`"):
        pipe.value_and_grad(xent)(_params4(), models.token_inputs(9), _labels(9))


@pytest.mark.parametrize(("name", "placement", "checkpoint"), CASES)
def test_heterogeneous_with_dropout_uneven_batch(name, placement, checkpoint):
    batch, chunks = 10, 4  # micro-batches of 3, the last with 2 padding rows
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    key = jax.random.key(7)
    mesh = models.make_mesh(placement, 3)
    pipe = pj.pipeline(list(STAGES), chunks=chunks, schedule=name, mesh=mesh, checkpoint=checkpoint)
    loss, grads = jax.jit(pipe.value_and_grad(xent))(params, x, labels, key)
    ref = _reference(batch, chunks, 7)
    models.assert_trees_close((loss, grads), ref, **TOL)


def test_gpipe_value_and_grad_is_autodiff_of_the_mean_loss():
    batch, chunks = 5, 2
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    key = jax.random.key(3)
    gpipe = pj.pipeline(list(STAGES), chunks=chunks)
    plain = jax.jit(jax.value_and_grad(lambda p: jnp.mean(xent(gpipe(p, x, key), labels))))
    models.assert_trees_close(gpipe.value_and_grad(xent)(params, x, labels, key), plain(params), **TOL)


@pytest.mark.parametrize(
    ("name", "placement", "checkpoint"), [("1f1b", "explicit", "never"), ("zb-h1", "none", "always")]
)
def test_homogeneous_stages(name, placement, checkpoint):
    n, batch, chunks = 4, 9, 5  # micro-batches of 2, the last with one padding row
    params, x = models.stacked_params(n), models.stacked_inputs(batch)
    targets = jnp.asarray(np.random.default_rng(0).normal(size=(batch, models.WIDTH)))
    sq = lambda y, t: jnp.sum((y - t) ** 2, axis=-1)
    mesh = models.make_mesh(placement, n)
    pipe = pj.pipeline(
        models.residual, num_stages=n, chunks=chunks, schedule=name, mesh=mesh, checkpoint=checkpoint
    )
    got = pipe.value_and_grad(sq)(params, x, targets)
    ref = pj.pipeline(models.residual, num_stages=n, chunks=chunks).value_and_grad(sq)(params, x, targets)
    models.assert_trees_close(got, ref, **TOL)


@pytest.mark.parametrize(("name", "placement"), [("1f1b", "explicit")])
def test_placed_params_give_placed_grads(name, placement):
    batch, chunks = 10, 4
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    pipe = pj.pipeline(list(STAGES), chunks=chunks, schedule=name, mesh=models.make_mesh(placement, 3))
    placed = pipe.place(params)
    loss, grads = pipe.value_and_grad(xent)(placed, x, labels, jax.random.key(7))
    assert isinstance(grads, pj.StageParams)
    ref = _reference(batch, chunks, 7)
    models.assert_trees_close((loss, grads.unpack()), ref, **TOL)


# --- second order -------------------------------------------------------------------------------


@functools.cache
def _composed_hessian(repeats, batch):
    """``jax.hessian`` of the composed model's mean loss (``STAGES``, or ``STAGES4`` for
    ``repeats=2``) at the flat parameters, jitted (one compile instead of op-by-op autodiff) and
    computed once per (stages, batch) for the tests that share it."""
    stages, params = (STAGES4, _params4()) if repeats == 2 else (STAGES, models.token_params())
    flat, unravel = ravel_pytree(params)
    x, labels = models.token_inputs(batch), _labels(batch)
    composed = lambda v: jnp.mean(xent(models.compose(stages, unravel(v), x), labels))
    return np.asarray(jax.jit(jax.hessian(composed))(flat))


@pytest.mark.parametrize(
    ("name", "placement", "checkpoint"),
    [
        ("1f1b", "explicit", "always"),
        ("zb-h1", "none", "never"),
        ("interleaved-1f1b", "explicit", "never"),
        ("v-half", "explicit", "always"),
        ("zb-v", "explicit", "never"),
    ],
)
def test_hvp_equals_hessian_of_composition(name, placement, checkpoint):
    """``jax.jvp`` of the (loss, grads) function: forward-over-reverse through the schedule."""
    stages, params, v = STAGES, models.token_params(), 1
    if name in ("interleaved-1f1b", "v-half", "zb-v"):  # 4 stages on 2 devices
        stages, params, v = STAGES4, _params4(), 2
    batch, chunks = (8, 4) if v == 2 else (5, 3)  # interleaved: 4 micro-batches, a multiple of 2
    x, labels = models.token_inputs(batch), _labels(batch)
    mesh = models.make_mesh(placement, len(stages) // v)
    pipe = pj.pipeline(
        list(stages), chunks=chunks, schedule=name, mesh=mesh, checkpoint=checkpoint, repeats=v
    )
    flat, unravel = ravel_pytree(params)
    step = pipe.value_and_grad(xent)

    def grad_flat(v):
        return ravel_pytree(step(unravel(v), x, labels)[1])[0]

    hessian = _composed_hessian(v, batch)
    direction = jnp.asarray(np.random.default_rng(1).normal(size=flat.shape))
    _, hvp = jax.jit(lambda v, u: jax.jvp(grad_flat, (v,), (u,)))(flat, direction)
    np.testing.assert_allclose(np.asarray(hvp), np.asarray(hessian @ direction), **TOL)


# --- the slots the program runs ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "placement"), [("zb-h1", "explicit")])
def test_counted_slots_equal_the_table(name, placement):
    batch, chunks = 10, 4
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    pipe = pj.pipeline(list(STAGES), chunks=chunks, schedule=name, mesh=models.make_mesh(placement, 3))
    counts = train.slot_counts(pipe, xent, params, x, labels)
    table = sched.training(name, 3, 4)
    slots = table.slots()
    expect = np.stack([slots["F"], slots["B"], slots.get("W", np.zeros(3, int))], axis=1)
    np.testing.assert_array_equal(counts, expect)


@pytest.mark.parametrize("placement", ["none", "explicit"])
def test_every_schedule_runs_its_ticks_in_the_engine_loop(monkeypatch, placement):
    """One tick loop (issue 22): the forward schedules and the training schedules alike trace
    their ticks through ``engine.device_tick`` -- a training table's F slot is its stage
    computation, B and W run after it -- with and without a mesh; the training program has no
    ``lax.scan`` of its own (``train``, ``slots``, ``stage_grad``). Counted while tracing
    ``value_and_grad``."""
    from pipejax._src import engine
    from pipejax._src.training import slots, stage_grad

    calls = []
    real = engine.tick.device_tick
    monkeypatch.setattr(engine.tick, "device_tick", lambda *a, **k: calls.append(1) or real(*a, **k))
    scans, real_scan = [], jax.lax.scan
    training = {train.__name__, slots.__name__, stage_grad.__name__}

    def scan(*a, **k):  # a scan started by code of the training program
        scans.append(sys._getframe(1).f_globals["__name__"] in training)
        return real_scan(*a, **k)

    monkeypatch.setattr(jax.lax, "scan", scan)
    batch, chunks = 10, 4
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    mesh = models.make_mesh(placement, 3)
    for name in ("gpipe", *SCHEDULES):
        calls.clear()
        pipe = pj.pipeline(list(STAGES), chunks=chunks, schedule=name, mesh=mesh)
        jax.make_jaxpr(pipe.value_and_grad(xent))(params, x, labels)
        assert calls, name
    assert scans and not any(scans)  # the engine's scans ran; none of the training program's own


# --- bad input ---------------------------------------------------------------------------------------


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'gpipe', 'circular', '1f1b', 'zb-h1'.*'2f2b'"):
        pj.pipeline(list(STAGES), schedule="2f2b")


def test_repeats_with_1f1b_names_the_fix():
    with pytest.raises(
        ValueError, match=r"`repeats=2` needs `schedule='circular'` or `'interleaved-1f1b'`.*'1f1b'"
    ):
        pj.pipeline(models.residual, num_stages=4, schedule="1f1b", repeats=2)


def test_loss_fn_must_give_per_example_losses():
    pipe = pj.pipeline(list(STAGES), chunks=2, schedule="1f1b")
    mean = lambda y, t: jnp.mean(xent(y, t))
    with pytest.raises(ValueError, match=r"one per example of the batch of 4: shape \(2,\) per call"):
        pipe.value_and_grad(mean)(models.token_params(), models.token_inputs(4), _labels(4))


def test_data_axis_needs_whole_micro_batches_per_shard():
    mesh = jax.make_mesh((2, 2), ("data", "stage"))
    pipe = pj.pipeline(list(PAIR), chunks=3, schedule="zb-h1", mesh=mesh, data_axis_name="data")
    x = models.pair_inputs(6)
    with pytest.raises(ValueError, match=r"data axis 'data' of size 2 does not divide"):
        pipe.value_and_grad(sq)(models.pair_params(), x, jnp.zeros((6, 1)))


# --- data x pipeline ------------------------------------------------------------------------------


def dense_in(p, x, key):
    return _dropout(key, models.dense_in(p, x, key))


PAIR = (dense_in, models.dense_out)  # the second stage has a float32 parameter among float64 ones


def sq(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


@pytest.mark.parametrize(("name", "checkpoint"), [("1f1b", "always"), ("zb-h1", "never")])
def test_data_axis(name, checkpoint):
    """Data shard q runs micro-batches q m/p, ...: keys, loss and grads as without the data axis."""
    batch, chunks = 11, 4  # micro-batches of 3 (the last with one padding row), 2 per data shard
    params, x = models.pair_params(), models.pair_inputs(batch)
    t = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 1)))
    key = jax.random.key(5)
    mesh = jax.make_mesh((2, 2), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    pipe = pj.pipeline(
        list(PAIR), chunks=chunks, schedule=name, mesh=mesh, data_axis_name="data", checkpoint=checkpoint
    )
    got = pipe.value_and_grad(sq)(params, x, t, key)
    ref = pj.pipeline(list(PAIR), chunks=chunks).value_and_grad(sq)(params, x, t, key)
    models.assert_trees_close(got, ref, **TOL)
    counts = train.slot_counts(pipe, sq, params, x, t, key)
    assert counts.shape == (2, 2, 3) and (counts[..., 0] == 2).all() and (counts[..., 1] == 2).all()


def _scaled(stage):
    """``stage`` whose output rows are scaled by the side input ``context["scale"]``."""

    def run(p, x, key, context):
        y = stage(p, x, key)
        return y * context["scale"].reshape((-1,) + (1,) * (y.ndim - 1)).astype(y.dtype)

    return run


def test_side_inputs_with_a_data_axis():
    """``context=``: every slot's stage gets its micro-batch's rows, also on a data shard."""
    batch, chunks = 11, 4
    params, x = models.pair_params(), models.pair_inputs(batch)
    t = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 1)))
    context = {"scale": jnp.linspace(0.5, 1.5, batch)}  # distinct rows: a shifted row would show
    key = jax.random.key(5)
    stages = [_scaled(s) for s in PAIR]
    mesh = jax.make_mesh((2, 2), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    pipe = pj.pipeline(stages, chunks=chunks, schedule="1f1b", mesh=mesh, data_axis_name="data")
    got = pipe.value_and_grad(sq)(params, x, t, key, context=context)
    ref = pj.pipeline(stages, chunks=chunks).value_and_grad(sq)(params, x, t, key, context=context)
    models.assert_trees_close(got, ref, **TOL)
    plain = pj.pipeline(list(PAIR), chunks=chunks).value_and_grad(sq)(params, x, t, key)
    assert abs(float(plain[0]) - float(ref[0])) > 1e-3  # the side input matters
    with pytest.raises(ValueError, match=r"`context` has a batch of 5 examples but `x` has 11"):
        pipe.value_and_grad(sq)(params, x, t, key, context={"scale": jnp.ones(5)})


# --- pipejax.hessian through a schedule -----------------------------------------------------------


def test_hessian_tools_take_the_schedule_gradient():
    """``pj.hessian.from_value_and_grad``: HVPs through the 1F1B program, forward-over-reverse and
    reverse-over-reverse (autodiff of the program in both modes)."""
    batch, chunks = 6, 3
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    pipe = pj.pipeline(list(STAGES), chunks=chunks, schedule="1f1b", mesh=models.make_mesh("auto", 3))
    loss = pj.hessian.from_value_and_grad(pipe.value_and_grad(xent))
    flat, unravel = ravel_pytree(params)
    hessian = _composed_hessian(1, batch)
    u = jnp.asarray(np.random.default_rng(2).normal(size=flat.shape))
    got = ravel_pytree(pj.hessian.hvp(loss, params, unravel(u), x, labels))[0]
    np.testing.assert_allclose(np.asarray(got), hessian @ np.asarray(u), **TOL)
    rev = ravel_pytree(pj.hessian.hvp(loss, params, unravel(u), x, labels, mode="rev_rev"))[0]
    np.testing.assert_allclose(np.asarray(rev), hessian @ np.asarray(u), **TOL)


def test_per_example_keys():
    """``per_example_keys=True``: every example draws its own dropout mask, as in GPipe."""
    batch, chunks = 10, 4
    params, x, labels = models.token_params(), models.token_inputs(batch), _labels(batch)
    kw = dict(chunks=chunks, per_example_keys=True)
    stages = (lambda p, x, k: pj.dropout(models.embed(p, x, k), k, 0.3), models.wide, models.head)
    ref = pj.pipeline(list(stages), **kw).value_and_grad(xent)(params, x, labels, jax.random.key(1))
    pipe = pj.pipeline(list(stages), schedule="zb-h1", checkpoint="never", **kw)
    models.assert_trees_close(pipe.value_and_grad(xent)(params, x, labels, jax.random.key(1)), ref, **TOL)


def test_pipeline_schedule_is_the_table_the_schedule_runs():
    """`Pipeline.schedule(batch)` gives a training schedule's own table (what value_and_grad
    runs), and the forward call's table with `training=False`; GPipe has no training table."""
    f = lambda p, x: x * p
    kinds = (("1f1b", 1), ("zb-h1", 1), ("zb-floor", 1), ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2))
    for name, repeats in kinds:
        apply = pj.pipeline([f] * 4, chunks=4, schedule=name, repeats=repeats)
        table = apply.schedule(8)
        assert table.trains and table.name == name
        assert table == sched.training(name, 4, 4, repeats)
        forward = apply.schedule(8, training=False)
        assert not forward.trains
        assert forward == sched.circular(4 // repeats, 4, repeats) != table
    gpipe = pj.pipeline([f] * 4, chunks=4)
    assert gpipe.schedule(8) == sched.gpipe(4, 4)
    assert gpipe.schedule(8, training=False) == sched.gpipe(4, 4)
    with pytest.raises(ValueError, match=r"`training=True` asks for the training table"):
        gpipe.schedule(8, training=True)
    with pytest.raises(TypeError, match=r"`training` must be None, True or False"):
        gpipe.schedule(8, training="yes")
