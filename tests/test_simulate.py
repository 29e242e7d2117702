"""The schedule simulator of ``benchmarks/simulate.py`` against closed forms it must reproduce.

Exact arithmetic (``Fraction`` times) makes every comparison an equality: GPipe's bubble
``(n - 1) / (m + n - 1)``, the circular schedule's ``(n - 1) / (v m + n - 1)``, the flow-shop
makespan of unequal stages, and the latency each pipeline hop adds.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from benchmarks import _simulate as sim


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("lockstep", [False, True])
def test_gpipe_bubble_is_exact_with_equal_stages_and_free_links(checkpoint, lockstep):
    f = Fraction(3, 7)  # any positive time; backward 2 f, recomputation 1 f more
    for n, m in itertools.product([1, 2, 3, 4, 8], [1, 2, 5, 8, 32]):
        r = sim.simulate([f] * n, num_micro=m, checkpoint=checkpoint, lockstep=lockstep)
        assert r.bubble == Fraction(n - 1, m + n - 1) == sim.gpipe_bubble(n, m), (n, m)
        per_tick = 3 * f + (f if checkpoint == "always" else 0)
        assert r.makespan == (m + n - 1) * per_tick
        assert r.ticks == m + n - 1
        assert r.busy == (m * per_tick,) * n


@pytest.mark.parametrize("lockstep", [False, True])
def test_circular_bubble_is_exact(lockstep):
    for n, v, groups in itertools.product([2, 3, 4], [1, 2, 3], [1, 2, 4]):
        m = groups * n  # micro-batches fill the ring
        f = Fraction(1, v)  # a device's work per micro-batch stays 1 forward + 2 backward
        r = sim.simulate([f] * (n * v), num_devices=n, num_micro=m, lockstep=lockstep)
        assert r.bubble == Fraction(n - 1, v * m + n - 1) == sim.gpipe_bubble(n, m, v), (n, v, m)
        assert r.makespan == (v * m + n - 1) * 3 * f
        assert r.ticks == v * m + n - 1


def test_circular_beats_gpipe_by_its_shorter_fill():
    gpipe = sim.simulate([Fraction(1)] * 4, num_micro=8)
    circular = sim.simulate([Fraction(1, 4)] * 16, num_devices=4, num_micro=8)
    assert circular.makespan < gpipe.makespan
    assert gpipe.serial == circular.serial == 8 * 3 * 4


def test_unequal_stages_follow_the_flow_shop_makespan():
    """Identical jobs through a flow shop: sum of stage times + (m - 1) * the slowest stage, once
    for the forwards and once for the backwards (which start as the last forward ends)."""
    rng = random.Random(0)
    for _ in range(20):
        n, m = rng.randint(1, 6), rng.randint(1, 10)
        f = [Fraction(rng.randint(1, 9)) for _ in range(n)]
        b = [Fraction(rng.randint(1, 9)) for _ in range(n)]
        r = sim.simulate(f, num_micro=m, backward=b)
        assert r.makespan == sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
        # Lockstep ticks last as long as their slowest stage: never faster.
        assert sim.simulate(f, num_micro=m, backward=b, lockstep=True).makespan >= r.makespan


def test_links_add_one_transfer_per_hop():
    f, lat, size, bw = Fraction(2), Fraction(1, 3), 6, Fraction(12)  # transfer: 1/3 + 1/2
    hop = lat + Fraction(size) / bw
    for n, m in [(2, 1), (3, 4), (4, 8)]:
        r = sim.simulate([f] * n, num_micro=m, activation_bytes=size, bandwidth=bw, latency=lat)
        assert r.makespan == (m + n - 1) * 3 * f + 2 * (n - 1) * hop  # forward and backward
        blocking = sim.simulate(
            [f] * n, num_micro=m, activation_bytes=size, bandwidth=bw, latency=lat, overlap=False
        )
        assert blocking.makespan > r.makespan or m == 1  # one micro-batch: nothing waits


def test_except_last_recomputes_all_but_the_last_micro_batch():
    f, n, m = Fraction(1), 2, 5
    r = sim.simulate([f] * n, num_micro=m, checkpoint="except_last")
    assert r.busy == (m * 3 * f + (m - 1) * f,) * n


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="multiple of `num_devices`"):
        sim.simulate([1, 1, 1], num_devices=2, num_micro=4)
    with pytest.raises(ValueError, match="`checkpoint` must be one of"):
        sim.simulate([1, 1], num_micro=4, checkpoint="sometimes")
    with pytest.raises(ValueError, match="`activation_bytes` has 3 entries"):
        sim.simulate([1, 1], num_micro=4, activation_bytes=[1, 2, 3])
    with pytest.raises(ValueError, match="`num_micro` must be an int >= 1"):
        sim.simulate([1, 1], num_micro=0)


def test_plan_layout_adds_tensor_and_data_parallel_terms_to_the_pipeline():
    common = dict(
        forward=Fraction(8),
        backward=Fraction(16),
        batch=32,
        activation_bytes=Fraction(4),
        param_bytes=Fraction(96),
    )
    # One tensor rank, one replica: exactly the lockstep pipeline of the model cut into n stages.
    plain = sim.plan_layout(stages=4, tensor=1, data=1, chunks=8, bandwidth=Fraction(2), **common)
    micro = 32 // 8
    ref = sim.simulate(
        [Fraction(8 * micro, 4)] * 4,
        backward=[Fraction(16 * micro, 4)] * 4,
        num_micro=8,
        activation_bytes=4 * micro,
        bandwidth=Fraction(2),
        lockstep=True,
    )
    assert plain.step == plain.pipeline == ref.makespan and plain.gradient_sync == 0
    # Ring all-reduce: 2 (k - 1) steps of bytes / k each.
    assert sim.ring_all_reduce(Fraction(12), 3, Fraction(2), Fraction(1)) == 4 * (2 + 1)
    assert sim.ring_all_reduce(Fraction(12), 1) == 0
    # Free links: splitting a stage over t devices divides its compute by t; slow links add the
    # tensor all-reduces, and replicas add the gradient all-reduce of a device's shard.
    free = sim.plan_layout(stages=2, tensor=2, data=1, chunks=4, **common)
    half = sim.plan_layout(stages=2, tensor=1, data=1, chunks=4, **common)
    assert free.pipeline * 2 == half.pipeline
    slow = sim.plan_layout(
        stages=2, tensor=2, data=2, chunks=4, bandwidth=Fraction(1), allreduces_per_forward=4, **common
    )
    micro = 32 // (2 * 4)
    tp = Fraction(4, 2) * sim.ring_all_reduce(micro * 4, 2, Fraction(1))
    f, b = Fraction(8 * micro, 4) + tp, Fraction(16 * micro, 4) + tp
    ref = sim.simulate(
        [f] * 2,
        backward=[b] * 2,
        num_micro=4,
        activation_bytes=micro * 4 / 2,
        bandwidth=Fraction(1),
        lockstep=True,
    )
    assert slow.pipeline == ref.makespan
    assert slow.gradient_sync == sim.ring_all_reduce(Fraction(96, 4), 2, Fraction(1))
    with pytest.raises(ValueError, match="must be a multiple of `data` x `chunks`"):
        sim.plan_layout(stages=2, tensor=2, data=3, chunks=4, **common)
