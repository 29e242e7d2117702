"""Predicted pipeline throughput and bubble on n devices, from per-stage costs (a simulator).

Run from the repository root::

    .venv/bin/python benchmarks/simulate.py            # all sections (a few minutes on 2 cores)
    .venv/bin/python benchmarks/simulate.py --quick    # smoke run (seconds)
    .venv/bin/python benchmarks/simulate.py --section bandwidth

Two simulators (``benchmarks/_simulate.py``). ``simulate`` replays GPipe's fill-drain schedule,
or the circular (interleaved) one, as an event simulation: per-stage forward and backward times,
recomputation when checkpointing, and ``bytes / bandwidth + latency`` for every message between
devices, asynchronous (as torchgpipe) or in lockstep. ``ticks`` runs any of pipejax's tables
(GPipe, circular, 1F1B, ZB-H1, interleaved 1F1B, read through ``slot_fields()``) in lockstep ticks
as pipejax's SPMD loop does: every tick lasts as long as its busiest device (F, B and W slots one
after another) plus its ``ppermute`` s, or, with overlap of sends, the longer of the two on a table
re-timed so that every hop takes two ticks. Fake CPU devices do not run in parallel, so pipejax
cannot *measure* a pipeline speed-up on this machine; this script *predicts* one from costs.

Sections (each prints markdown tables):

1. ``theory``: the simulated bubble against GPipe's ``(n - 1) / (m + n - 1)`` and the circular
   schedule's ``(n - 1) / (v m + n - 1)``, with equal stages and free links (exact fractions).
2. ``measured``: a 16-layer MLP measured layer by layer on this CPU with ``pj.layer_costs``
   (``by="time"``, forward and forward + backward), cut into ``n`` stages with
   ``pj.balance_costs``, and simulated on ``n`` devices, GPipe and circular, asynchronous (as
   torchgpipe) and in lockstep ticks (as pipejax's ``shard_map`` loop).
3. ``torchgpipe``: predictions for torchgpipe's published speed benchmarks (AmoebaNet-D (18, 256),
   ResNet-101, U-Net (5, 64) on 8 Tesla P40s) from a stated cost model of each network, against
   the measured speed-ups.
4. ``layouts``: a (stage, tensor, data) layout of 64 devices for a 1.3B-parameter transformer.
5. ``lockstep``: every schedule's table in lockstep ticks with free links, against the table's
   own ``step_time`` (equal), with its bubble, and the ticks and step re-timed for overlap.
6. ``bandwidth``: the predicted step of every schedule, with and without overlap of sends, over
   NVLink-, InfiniBand- and Ethernet-like links, for a 32-layer transformer (width 2048,
   sequence 2048, micro-batches of 4 sequences, bfloat16 messages) on 8 devices from analytic
   FLOPs at 400 TFLOP/s; and the link speeds at which overlap gives the shorter step.
7. ``one-device``: the per-stage costs of a small MLP measured on this CPU (F, F + B + W, F + B,
   F + W of one stage), summed over each schedule's table as the simulator does, against the
   training step measured with ``mesh=None`` (one device runs every stage) and a ``lax.scan``.
8. ``floor``: the floor of one synchronous step with one stage per device and F = B = W,
   ``3m + n - 1`` slot times, against lockstep ZB-H1 and 1F1B, and against ZB-H1's F and B
   ticks with the W slots placed by an exact integer program (one W per device and tick, at or
   after its B, at most ``ring`` cotangents held) or greedily without a bound
   (``docs/decisions/0034-no-zb-h2.md``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from benchmarks import _simulate as sim
from benchmarks._common import section, table

# --- 1. theory -------------------------------------------------------------------------------------


def theory(quick: bool) -> None:
    section("Bubble: simulation against theory (equal stages, free links)")
    rows = []
    for n in (2, 4) if quick else (2, 4, 8):
        for m in (1, 4, 8, 32):
            for v in (1, 2, 4):
                if v > 1 and m % n:
                    continue  # the circular formula needs the micro-batches to fill the ring
                r = sim.simulate([Fraction(1, v)] * (n * v), num_devices=n, num_micro=m)
                theory_ = sim.gpipe_bubble(n, m, v)
                rows.append([n, m, v, f"{float(r.bubble):.4f}", f"{float(theory_):.4f}", r.bubble == theory_])
    print(table(["n", "m", "v", "simulated bubble", "(n-1)/(v m+n-1)", "exact"], rows))


# --- 2. measured costs -------------------------------------------------------------------------------


def measured(quick: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pipejax as pj

    section("Predictions from per-layer times measured on this CPU")
    widths = [512] * (8 if quick else 16)  # equal layers: measured times differ only by noise
    micro = 64
    rng = np.random.default_rng(0)
    dims = [128, *widths]
    params = [
        {"w": jnp.asarray(rng.standard_normal((a, b), dtype=np.float32) / np.sqrt(a))}
        for a, b in itertools.pairwise(dims)
    ]
    layers = [lambda p, x, key: jnp.tanh(x @ p["w"])] * len(params)
    x = jnp.ones((micro, dims[0]), jnp.float32)
    repeats = 3 if quick else 15
    fwd = pj.layer_costs(layers, params, x, by="time", backward=False, repeats=repeats)
    both = pj.layer_costs(layers, params, x, by="time", backward=True, repeats=repeats)
    bwd = [max(b - f, 0.0) for f, b in zip(fwd, both, strict=True)]
    out_bytes = [micro * w * 4 for w in widths]  # float32 activations leaving each layer
    print(
        f"{len(layers)} tanh dense layers ({dims[0]} -> {widths[0]}, then {widths[0]} wide), micro-batches "
        f"of {micro} rows, float32, jax {jax.__version__} on {jax.devices()[0].platform}. Layer forward "
        f"{sum(fwd) * 1e3:.2f} ms, forward + backward {sum(both) * 1e3:.2f} ms in total (medians of "
        f"{repeats}). Links: free, or 10 GB/s + 10 us per message (PCIe 3.0 x16 class)."
    )

    def stages(k):
        cut = pj.balance_costs(both, k)
        o = np.cumsum([0, *cut])
        f = [math.fsum(fwd[o[s] : o[s + 1]]) for s in range(k)]
        b = [math.fsum(bwd[o[s] : o[s + 1]]) for s in range(k)]
        return f, b, [out_bytes[o[s + 1] - 1] for s in range(k - 1)], tuple(cut)

    rows = []
    for n in (2, 4) if quick else (2, 4, 8):
        for v in (1, 2):
            f, b, sizes, cut = stages(n * v)
            for m in (n, 4 * n) if quick else (n, 4 * n, 8 * n):
                for links, bw, lat in (("free", math.inf, 0.0), ("10 GB/s", 10e9, 10e-6)):
                    common = dict(num_devices=n, num_micro=m, backward=b, activation_bytes=sizes)
                    common.update(bandwidth=bw, latency=lat, checkpoint="always")
                    r = sim.simulate(f, **common)
                    lock = sim.simulate(f, lockstep=True, **common)
                    rows.append(
                        [
                            n,
                            "GPipe" if v == 1 else f"circular v={v}",
                            m,
                            links,
                            f"{r.makespan * 1e3:.2f}",
                            f"{m * micro / r.makespan:,.0f}",
                            f"{r.speedup:.2f}x",
                            f"{r.bubble:.3f}",
                            f"{lock.speedup:.2f}x",
                            f"{float(sim.gpipe_bubble(n, m, v)):.3f}",
                        ]
                    )
            print(f"\nn={n}, v={v}: balance {cut} (by measured forward + backward time)")
    print()
    headers = ["n", "schedule", "m", "links", "step ms", "samples/s", "speed-up", "bubble"]
    print(table([*headers, "lockstep speed-up", "theory bubble"], rows, align="rlrlrrrrrr"))
    recompute = (sum(fwd) + sum(bwd)) / (2 * sum(fwd) + sum(bwd))
    print(
        "\nspeed-up: against one device running the layers without a pipeline and without "
        "recomputation. The pipelines recompute every forward (checkpoint='always'), so n devices "
        f"give at most n * (1 - bubble) * (F + B) / (2F + B) = n * (1 - bubble) * {recompute:.2f}. "
        "theory bubble: (n-1)/(v m+n-1), for equal stages; the simulated one adds the measured "
        "imbalance and the links."
    )


# --- 3. torchgpipe's benchmarks -------------------------------------------------------------------------
# Each network is a list of torchgpipe's sequential layers with an analytic per-sample cost:
# conv flops and the bytes of the tensors every layer reads and writes (float32). Forward time
# = flops / F + bytes / W with P40-class rates; backward = 2 x forward. The absolute scale is
# then fitted so that the simulated baseline matches the published baseline throughput.

P40_FLOPS = 0.5 * 11.76e12  # half of the P40's fp32 peak
P40_BYTES = 0.7 * 346e9  # 70% of its memory bandwidth
LINK_BW, LINK_LATENCY = 10e9, 10e-6  # PCIe 3.0 x16 class, device to device


class Layer(NamedTuple):
    flops: float  # forward flops per sample
    traffic: float  # forward bytes read + written per sample
    out: float  # bytes of the output per sample (what crosses a cut after this layer)
    stash: float = 0.0  # bytes this layer stashes for a later layer (a skip connection)
    pops: int = 0  # how many stashes this layer consumes (the most recent first)


class _Net:
    """Accumulates layers; ``res`` and ``ch`` track the current tensor."""

    def __init__(self, ch, res):
        self.layers: list[Layer] = []
        self.ch, self.res = ch, res

    def size(self, ch=None, res=None):
        return 4.0 * (self.ch if ch is None else ch) * (self.res if res is None else res) ** 2

    def add(self, flops=0.0, ch=None, res=None, extra_in=0.0, stash=0.0, pops=0):
        before = self.size()
        self.ch = self.ch if ch is None else ch
        self.res = self.res if res is None else res
        after = self.size()
        self.layers.append(Layer(flops, before + extra_in + after, after, stash, pops))

    def conv(self, cout, k=1, stride=1, kw=None):
        res = self.res // stride
        self.add(2.0 * self.ch * cout * k * (kw or k) * res * res, ch=cout, res=res)

    def elementwise(self, res=None, ch=None):  # bn, relu, pool, dropout, norm, upsample
        self.add(ch=ch, res=res)


def resnet101() -> list[Layer]:
    """torchgpipe's flattened ResNet-101 on 224 x 224 images: 370 layers."""
    net = _Net(3, 224)
    net.conv(64, k=7, stride=2)
    net.elementwise()
    net.elementwise()
    net.elementwise(res=56)  # max pool
    inplanes = 64
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 23, 2), (512, 3, 2)):
        for i in range(blocks):
            s = stride if i == 0 else 1
            identity_bytes = net.size()
            net.add(stash=identity_bytes)  # identity: stash the block's input
            net.conv(planes)
            net.elementwise()
            net.elementwise()
            net.conv(planes, k=3, stride=s)
            net.elementwise()
            net.elementwise()
            net.conv(4 * planes)
            net.elementwise()
            down_flops, down_bytes = 0.0, 0.0
            if i == 0:  # the projection shortcut: a strided 1x1 conv and a batch norm on the identity
                down_flops, down_bytes = 2.0 * inplanes * 4 * planes * net.res**2, 3 * net.size()
            net.add(flops=down_flops, extra_in=identity_bytes + down_bytes, pops=1)  # residual
            net.elementwise()
            inplanes = 4 * planes
    net.elementwise(res=1)  # average pool
    net.add()  # flatten
    net.add(flops=2.0 * 2048 * 1000, ch=1000)
    assert len(net.layers) == 370, len(net.layers)
    return net.layers


def unet(depth=5, convs=5, base=64, size=192) -> list[Layer]:
    """torchgpipe's simplified U-Net (5, 64) on 192 x 192 images: 241 layers."""
    net = _Net(3, size)

    def unit(cout):  # conv 3x3, dropout, instance norm, leaky relu
        net.conv(cout, k=3)
        net.elementwise()
        net.elementwise()
        net.elementwise()

    def cell(mid, out):
        unit(mid)
        for _ in range(convs - 2):
            unit(mid)
        unit(out)

    for i in range(depth):
        cell(base * 2**i, base * 2**i)
        net.add(stash=net.size())  # stash the skip
        net.elementwise(res=net.res // 2)  # max pool
    cell(base * 2**depth, base * 2 ** (depth - 1))
    for i in reversed(range(depth)):
        net.elementwise(res=net.res * 2)  # upsample
        skip = 4.0 * base * 2**i * net.res**2
        net.add(ch=net.ch + base * 2**i, extra_in=skip, pops=1)  # concatenate the skip
        cell(int(base * 2 ** (i - 1)), int(base * 2 ** (i - 1)))
    net.conv(1)
    assert len(net.layers) == 241, len(net.layers)
    return net.layers


NORMAL = [(1, "c1"), (1, "pool"), (1, "none"), (0, "c17"), (0, "c1"), (0, "c17"), (2, "pool"), (2, "none")]
NORMAL += [(1, "pool"), (5, "c1")]
REDUCTION = [(0, "pool"), (0, "pool"), (2, "none"), (1, "c3"), (2, "c17"), (2, "pool"), (3, "none")]
REDUCTION += [(1, "pool"), (2, "pool"), (3, "c1")]


def amoebanet_d(num_layers=18, filters=256, size=224) -> list[Layer]:
    """torchgpipe's AmoebaNet-D (L, F): stem, reduction and normal cells, classifier (24 layers).

    A cell's cost sums its operations: 1x1 / 1x7+7x1 / 3x3 conv branches (with their bottleneck
    1x1 convs), pools and factorized reductions, each read and written once (plus a relu and a
    batch norm around every conv). Its output is ``(concat, skip)``: both cross a cut.
    """
    layers = []
    c = filters // 4
    stem_res = size // 2
    stem_bytes = 4.0 * (3 * size**2 + 3 * c * stem_res**2)  # relu, conv 3x3 stride 2, batch norm
    layers.append(Layer(2.0 * 3 * c * 9 * stem_res**2, stem_bytes, 4.0 * c * stem_res**2))
    state = {"pp": (c, stem_res), "p": (c, stem_res), "red_prev": False}

    def conv_cost(cin, cout, k, res_out):
        flops = 2.0 * cin * cout * k * res_out**2
        return flops, 4.0 * (cin + 3 * cout) * res_out**2  # conv in + out, bn and relu around it

    def cell(ch, reduction):
        (cpp, _), (cp, rp) = state["pp"], state["p"]
        flops = traffic = 0.0
        f, t = conv_cost(cp, ch, 1, rp)  # reduce1
        flops, traffic = flops + f, traffic + t
        if state["red_prev"]:  # factorized reduce of s2 to the current resolution
            f, t = conv_cost(cpp, ch, 1, rp)
            flops, traffic = flops + f / 2, traffic + t
        elif cpp != ch:
            f, t = conv_cost(cpp, ch, 1, rp)
            flops, traffic = flops + f, traffic + t
        rout = rp // 2 if reduction else rp
        for index, (src, op) in enumerate(REDUCTION if reduction else NORMAL):
            stride = 2 if reduction and src < 2 else 1
            rin = rp if src < 2 else rout
            if op == "c1":
                f, t = conv_cost(ch, ch, 1, rin // stride)
            elif op == "c3":
                f1, t1 = conv_cost(ch, ch // 4, 1, rin)
                f2, t2 = conv_cost(ch // 4, ch // 4, 9, rin // stride)
                f3, t3 = conv_cost(ch // 4, ch, 1, rin // stride)
                f, t = f1 + f2 + f3, t1 + t2 + t3
            elif op == "c17":
                f1, t1 = conv_cost(ch, ch // 4, 1, rin)
                f2, t2 = conv_cost(ch // 4, ch // 4, 7, rin // stride)  # 1x7 then 7x1
                f3, t3 = conv_cost(ch // 4, ch // 4, 7, rin // stride)
                f4, t4 = conv_cost(ch // 4, ch, 1, rin // stride)
                f, t = f1 + f2 + f3 + f4, t1 + t2 + t3 + t4
            elif op == "none" and stride == 2:
                f, t = conv_cost(ch, ch, 1, rin // 2)
                f = f / 2  # two 1x1 convs to ch / 2 channels each
            else:  # pools; identity costs nothing
                f, t = 0.0, (0.0 if op == "none" else 4.0 * ch * (rin**2 + (rin // stride) ** 2))
            flops, traffic = flops + f, traffic + t
            if index % 2:
                traffic += 3 * 4.0 * ch * rout**2  # the sum of the pair
        concat = 3 if reduction else 4
        traffic += 2 * 4.0 * concat * ch * rout**2  # the concatenation
        out = 4.0 * (concat * ch * rout**2 + cp * rp**2)  # (concat, skip)
        state["pp"], state["p"], state["red_prev"] = (cp, rp), (concat * ch, rout), reduction
        layers.append(Layer(flops, traffic, out))

    cell(2 * c, True)  # stem2
    cell(4 * c, True)  # stem3
    ch = 4 * c
    for stack in range(3):
        if stack:
            ch *= 2
            cell(ch, True)
        for _ in range(num_layers // 3):
            cell(ch, False)
    cp, rp = state["p"]
    layers.append(Layer(2.0 * cp * 1000, 4.0 * cp * rp**2, 4.0 * 1000))
    assert len(layers) == 24, len(layers)
    return layers


def layer_time(layer: Layer) -> float:
    return layer.flops / P40_FLOPS + layer.traffic / P40_BYTES


def stage_plan(layers, balance):
    """Per-sample forward time of each stage and the bytes per sample crossing each cut."""
    times, cuts, start, live = [], [], 0, []
    for s, count in enumerate(balance):
        block = layers[start : start + count]
        times.append(math.fsum(layer_time(layer) for layer in block))
        for layer in block:  # the skip stashes still waiting for their pop cross the cut too
            for _ in range(layer.pops):
                live.pop()
            if layer.stash:
                live.append(layer.stash)
        start += count
        if s < len(balance) - 1:
            cuts.append(block[-1].out + sum(live))
    assert start == len(layers), (start, len(layers))
    return times, cuts


class Experiment(NamedTuple):
    name: str
    layers: list
    balance: tuple
    batch: int
    chunks: int
    checkpoint: str
    baseline: tuple  # (balance or None for one plain device, batch, chunks, checkpoint)
    baseline_throughput: float  # samples/s, published
    measured: float  # published speed-up


EXPERIMENTS = [
    Experiment("AmoebaNet-D (18, 256)", amoebanet_d(), (2, 2, 2, 3, 3, 4, 4, 4), 1280, 32, "except_last",
               ((7, 17), 96, 1, "always"), 26.733, 4.953),
    Experiment("ResNet-101", resnet101(), (26, 22, 33, 44, 44, 66, 66, 69), 5400, 150, "except_last",
               (None, 118, 1, "never"), 95.862, 4.294),
    Experiment("U-Net (5, 64)", unet(), (16, 27, 31, 44, 22, 57, 27, 17), 640, 40, "except_last",
               (None, 40, 1, "never"), 28.500, 3.105),
]  # fmt: skip


def step_time(stage_times, cuts, batch, chunks, checkpoint, scale, *, links=True, lockstep=False):
    micro = math.ceil(batch / chunks)
    m = math.ceil(batch / micro)
    f = [scale * t * micro for t in stage_times]
    sizes = [c * micro for c in cuts]
    bw, lat = (LINK_BW, LINK_LATENCY) if links else (math.inf, 0.0)
    links = dict(activation_bytes=sizes, bandwidth=bw, latency=lat)
    return sim.simulate(f, num_micro=m, checkpoint=checkpoint, lockstep=lockstep, **links)


def throughput(exp, stage_times, cuts, scale, **kw):
    r = step_time(stage_times, cuts, exp.batch, exp.chunks, exp.checkpoint, scale, **kw)
    return exp.batch / r.makespan


def baseline_time(exp, scale):
    balance, batch, chunks, checkpoint = exp.baseline
    if balance is None:  # one device, no pipeline, no checkpointing
        return scale * batch * 3 * math.fsum(layer_time(layer) for layer in exp.layers)
    times, cuts = stage_plan(exp.layers, balance)
    return step_time(times, cuts, batch, chunks, checkpoint, scale).makespan


def torchgpipe(quick: bool) -> None:
    section("torchgpipe's published speed-ups on 8 Tesla P40s, against the simulator")
    print(
        "Cost model: per layer, forward time = conv flops / (0.5 x 11.76 TFLOP/s) + bytes read and written / "
        "(0.7 x 346 GB/s), float32, per sample; backward = 2 x forward; per-sample cost independent of "
        "the micro-batch size. Links: 10 GB/s + 10 us per message, overlapped with compute "
        "(torchgpipe's copy streams); skip tensors count on every cut they cross. Baselines and "
        "settings as in torchgpipe's benchmark scripts; the time scale is fitted so the simulated "
        "baseline equals the published baseline throughput.\n"
    )
    rows, notes = [], []
    for exp in EXPERIMENTS:
        times, cuts = stage_plan(exp.layers, exp.balance)
        scale = (exp.baseline[1] / exp.baseline_throughput) / baseline_time(exp, 1.0)
        base = exp.baseline[1] / baseline_time(exp, scale)  # == the published baseline
        total = math.fsum(times)
        n = len(exp.balance)
        balanced = [total / n] * n
        ideal = throughput(exp, balanced, [0.0] * (n - 1), scale, links=False) / base
        ours = throughput(exp, times, cuts, scale) / base
        free = throughput(exp, times, cuts, scale, links=False) / base
        lock = throughput(exp, times, cuts, scale, lockstep=True) / base
        imbalance = max(times) / (total / n)

        lo, hi = 0.0, float(n - 1)
        for _ in range(60):  # bisection: the imbalance that reproduces the measured speed-up
            mid = (lo + hi) / 2
            slow = [total / n * (1 + mid)] + [total / n * (1 - mid / (n - 1))] * (n - 1)
            lo, hi = (mid, hi) if throughput(exp, slow, cuts, scale) / base > exp.measured else (lo, mid)
        micro = math.ceil(exp.batch / exp.chunks)
        rows.append(
            [
                exp.name,
                f"n=8, m={math.ceil(exp.batch / micro)} (b={micro})",
                f"{exp.measured:.3f}x",
                f"{ideal:.2f}x",
                f"{free:.2f}x",
                f"{ours:.2f}x",
                f"{lock:.2f}x",
                f"{imbalance:.2f}",
                f"{1 + lo:.2f}",
            ]
        )
        unfitted = exp.baseline[1] / baseline_time(exp, 1.0)
        largest = max(cuts) * micro
        notes.append(
            f"{exp.name}: cost-model baseline {unfitted:.1f} samples/s before fitting (published "
            f"{exp.baseline_throughput}); stage times (share of the model) "
            f"{', '.join(f'{t / total:.0%}' for t in times)}; largest cut {largest / 1e6:.0f} MB per "
            f"micro-batch, {largest / LINK_BW * 1e3:.1f} ms on the link against "
            f"{scale * max(times) * micro * 1e3:.0f} ms of forward compute on the slowest stage."
        )
    headers = ["model", "pipeline", "measured", "balanced, free links", "simulated, free links"]
    headers += ["simulated", "lockstep", "max/mean stage", "implied max/mean"]
    print(table(headers, rows, align="llrrrrrrr"))
    print()
    for note in notes:
        print(f"- {note}")
    print(
        "\nbalanced, free links: the same schedule, recomputation and baseline with equal stages and "
        "instant links (the GPipe bound for this setting). simulated: torchgpipe's balance under the "
        "cost model, without and with links. lockstep: the same with every tick ending in a barrier "
        "(pipejax's SPMD loop). implied max/mean: the slowest stage's time over the mean that, with "
        "the other stages equal and the same links, reproduces the measured speed-up."
    )
    amoebanet_grid()


# torchgpipe's AmoebaNet-D (18, 256) runs: (n, m) -> (balance, batch, published speed-up over n=2, m=1).
AMOEBANET_RUNS = {
    (2, 4): ((9, 15), 256, 1.539),
    (2, 32): ((9, 15), 1280, 1.773),
    (4, 1): ((3, 4, 5, 12), 160, 1.004),
    (4, 4): ((3, 6, 7, 8), 360, 1.666),
    (4, 32): ((3, 6, 7, 8), 1152, 2.709),
    (8, 1): ((2, 2, 2, 2, 2, 3, 4, 7), 196, 0.932),
    (8, 4): ((2, 2, 2, 3, 3, 4, 4, 4), 480, 2.621),
    (8, 32): ((2, 2, 2, 3, 3, 4, 4, 4), 1280, 4.953),
}


def amoebanet_grid() -> None:
    """Every AmoebaNet-D run of torchgpipe's table, against the simulator (same fitted scale)."""
    ref = EXPERIMENTS[0]
    scale = (ref.baseline[1] / ref.baseline_throughput) / baseline_time(ref, 1.0)
    base = ref.baseline[1] / baseline_time(ref, scale)
    rows = []
    for (n, m), (balance, batch, measured) in AMOEBANET_RUNS.items():
        checkpoint = "always" if m == 1 else "except_last"  # as torchgpipe's script
        exp = ref._replace(balance=balance, batch=batch, chunks=m, checkpoint=checkpoint, measured=measured)
        times, cuts = stage_plan(exp.layers, balance)
        sim_speedup = throughput(exp, times, cuts, scale) / base
        total = math.fsum(times)
        bound = throughput(exp, [total / n] * n, [0.0] * (n - 1), scale, links=False) / base
        rows.append(
            [n, m, str(balance), f"{measured:.3f}x", f"{bound:.2f}x", f"{sim_speedup:.2f}x",
             f"{sim_speedup / measured - 1:+.0%}"]
        )  # fmt: skip
    print("\nAmoebaNet-D (18, 256), every run of torchgpipe's table (speed-ups over n=2, m=1):\n")
    headers = ["n", "m", "balance", "measured", "balanced, free links", "simulated", "simulated/measured"]
    print(table(headers, rows, align="rrlrrrr"))


def layouts(quick: bool) -> None:
    section("Planning a (stage, tensor, data) layout: 64 devices, a 1.3B-parameter Transformer")
    # GPT-style, 24 layers, hidden 2048, sequence 2048, bf16: per example 2 * 1.3e9 * 2048 FLOPs
    # forward at 300 TFLOP/s; boundary activation 2048 x 2048 x 2 bytes; 8 GPUs per host joined by
    # 300 GB/s links (tensor groups stay inside a host), hosts by 25 GB/s, 10 us per message.
    forward = 2 * 1.3e9 * 2048 / 300e12
    common = dict(
        forward=forward,
        backward=2 * forward,
        activation_bytes=2048 * 2048 * 2,
        param_bytes=2.6e9,
        allreduces_per_forward=48,
        bandwidth=25e9,
        latency=1e-5,
        tensor_bandwidth=300e9,
        batch=512,
    )
    rows = []
    for n in (1, 2, 4, 8):
        for t in (1, 2, 4, 8):
            d = 64 // (n * t)
            if n * t * d != 64 or 512 % (d * 4 * n):
                continue
            r = sim.plan_layout(stages=n, tensor=t, data=d, chunks=4 * n, **common)
            rows.append(
                [
                    n,
                    t,
                    d,
                    4 * n,
                    f"{r.step:.3f}",
                    f"{r.pipeline:.3f}",
                    f"{r.gradient_sync:.3f}",
                    f"{float(r.bubble):.3f}",
                ]
            )
    rows.sort(key=lambda row: float(row[4]))
    print(
        "`_simulate.plan_layout`: per layout, chunks = 4 n; the pipeline simulated in lockstep with\n"
        "tensor-parallel all-reduces inside each stage's forward and backward, then the data-parallel\n"
        "gradient all-reduce of each device's parameter shard. Seconds per step of 512 sequences.\n"
        "Time only: memory per device (parameters and optimizer state / (n t), activations of the\n"
        "micro-batches in flight) decides which layouts fit at all.\n"
    )
    print(
        table(
            ["stages n", "tensor t", "data d", "chunks", "step s", "pipeline s", "grad sync s", "bubble"],
            rows,
        )
    )


# --- 4. every schedule in lockstep ticks ----------------------------------------------------------


def schedule_tables(n: int, m: int, v: int = 2, hop: int = 1) -> dict[str, object]:
    """pipejax's tables of every schedule for ``n`` devices and ``m`` micro-batches (``v`` chunks
    per device for the circular and interleaved ones), built by its public constructors;
    ``hop=2``: the tables of ``overlap=True`` (interleaved 1F1B needs ``m`` a multiple of ``2 n``)."""
    import pipejax as pj

    tables = {
        "gpipe": pj.gpipe_schedule(n, m, hop=hop),
        f"circular v={v}": pj.circular_schedule(n, m, v, hop=hop),
        "1f1b": pj.one_f_one_b_schedule(n, m, hop=hop),
        "zb-h1": pj.zb_h1_schedule(n, m, hop=hop),
        f"interleaved-1f1b v={v}": pj.interleaved_one_f_one_b_schedule(n, m, v, hop=hop),
        "v-half": pj.v_half_schedule(n, m, hop=hop),
        "zb-v": pj.zb_v_schedule(n, m, hop=hop),
    }
    return tables


def trains(table) -> bool:
    """Whether a table holds its backward pass (B slots) rather than leaving it to autodiff."""
    return "B" in table.slot_fields()


def table_step(table, f: float, b: float, w: float) -> float:
    """The lockstep step the table itself predicts with free links: a training table's
    ``step_time`` (B the whole backward when it has no W), a forward table's ticks times one
    stage's ``f + b + w`` (equal stages; its forward ticks, then autodiff's reversed ones)."""
    if not trains(table):
        return table.num_ticks * (f + b + w)
    return table.step_time(f, b if "W" in table.slot_fields() else b + w, w)


def lockstep(quick: bool) -> None:
    section("Every schedule in lockstep ticks: the simulator against the table (free links)")
    rows = []
    for n in (2, 4) if quick else (2, 4, 8):
        for m in (n, 4 * n) if quick else (n, 4 * n, 8 * n):
            built = schedule_tables(n, 2 * m, hop=2)  # pipejax's overlap=True tables (m: 2n, 8n, 16n)
            for name, sched in schedule_tables(n, m).items():
                v = sched.repeats
                c = 1.0 / v  # f = b = w = 1 for a device's share of the model: 1/v per stage
                plain, expect = sim.ticks(sched, c, c, c), table_step(sched, c, c, c)
                over = sim.ticks(sched, c, c, c, overlap=True)
                # the re-timed table against pipejax's own hop-2 table (at 2 m, both for m and 2 m)
                again = sim.ticks(schedule_tables(n, 2 * m)[name], c, c, c, overlap=True)
                own = sim.ticks(built[name], c, c, c, overlap=True)
                rows.append(
                    [
                        n,
                        m,
                        name,
                        len(plain.compute),
                        f"{plain.step():g}",
                        f"{expect:g}",
                        plain.step() == expect,
                        f"{1 - plain.work / (n * plain.step()):.3f}",
                        len(over.compute),
                        f"{over.step():g}",
                        f"{len(again.compute)} / {len(own.compute)}",
                    ]
                )
    headers = ["n", "m", "schedule", "ticks", "simulated step", "table's step", "equal", "bubble"]
    headers += ["ticks, overlap", "step, overlap", "ticks at 2m: re-timed / pipejax hop=2"]
    print(table(headers, rows, align="rrlrrrlrrrr"))
    print(
        "\nCosts: a device's share of the model costs f = b = w = 1 per micro-batch (1/v per stage "
        "of the circular and interleaved tables); 1F1B and interleaved 1F1B run b + w in their B "
        "slot, GPipe and circular train by autodiff (their ticks, then reversed with B = b + w). "
        "ticks: of the whole step (forward tables: both passes). table's step: "
        "`schedule.step_time(f, b, w)` of the training tables, ticks x (f + b + w) of the forward "
        "ones. bubble: 1 - work / (n step). overlap: the table re-timed so that every hop takes "
        "two ticks (`_simulate._retime`), step with free links. The last column compares that "
        "re-timing with pipejax's own `overlap=True` tables (`hop=2`) at 2m micro-batches (the "
        "interleaved table needs a multiple of 2n): equal for GPipe, 1F1B and ZB-H1; the circular "
        "table spaces its rounds by max(m, 2n) slots and the interleaved one groups 2n "
        "micro-batches, where the re-timing keeps the hop-1 table's order; the V tables (v-half, "
        "zb-v) put their way-down slots on even ticks and the way-up ones on odd ticks, so that "
        "each tick's messages go one way, where the re-timing keeps the hop-1 table's ticks."
    )


# --- 5. step time against link bandwidth ----------------------------------------------------------

# The transformer of `benchmarks/gpu.py --model transformer` at full width: pre-RMSNorm decoder
# blocks, causal attention, SwiGLU; 32 layers on n = 8 devices, m = 32 micro-batches of 4
# sequences, bfloat16 activations crossing every cut.
WIDTH, HIDDEN, SEQ, MICRO, LAYERS = 2048, 5632, 2048, 4, 32
DEVICES, CHUNKS = 8, 32
ACHIEVED = 400e12  # FLOP/s a device sustains on these matmuls (about 40% of an H100's bf16 peak)
MESSAGE_BYTES = MICRO * SEQ * WIDTH * 2  # one micro-batch's activation (or cotangent), bfloat16
LINKS = [  # (name, bytes/s per direction, latency s)
    ("NVLink, 450 GB/s, 5 us", 450e9, 5e-6),
    ("InfiniBand, 50 GB/s, 10 us", 50e9, 10e-6),
    ("InfiniBand, 25 GB/s, 15 us", 25e9, 15e-6),
    ("Ethernet, 10 GB/s, 20 us", 10e9, 20e-6),
    ("Ethernet, 1 GB/s, 30 us", 1e9, 30e-6),
]
CROSSOVER_LATENCY = 10e-6  # the latency at which the crossover bandwidths are stated


def layer_costs_transformer() -> tuple[float, float, float]:
    """Forward, input-cotangent and weight-cotangent seconds of one decoder layer on one micro-batch.

    Analytic FLOPs at ``ACHIEVED`` FLOP/s: the matmuls (QKV, output, gate, up, down: ``2 tokens
    (4 w^2 + 3 w h)``) cost as much again in B (input cotangent) and in W (weight cotangent);
    causal attention (``QK^T`` and ``AV`` halved: ``2 b s^2 w``) has no weights and costs twice
    its forward in B.
    """
    tokens = MICRO * SEQ
    matmul = 2 * tokens * (4 * WIDTH**2 + 3 * WIDTH * HIDDEN) / ACHIEVED
    attention = 2 * MICRO * SEQ**2 * WIDTH / ACHIEVED
    return matmul + attention, matmul + 2 * attention, matmul


def bandwidth(quick: bool) -> None:
    section("Step time against link bandwidth, with and without overlap of sends (a prediction)")
    f1, b1, w1 = layer_costs_transformer()
    print(
        f"Model: {LAYERS} decoder layers (width {WIDTH}, SwiGLU hidden {HIDDEN}, sequence {SEQ}), "
        f"n = {DEVICES} devices, m = {CHUNKS} micro-batches of {MICRO} sequences; gpipe, 1f1b and "
        f"zb-h1 run {LAYERS // DEVICES} layers per stage, circular, interleaved 1F1B (v = 2), "
        f"v-half and zb-v {LAYERS // (2 * DEVICES)}. Per layer and micro-batch at "
        f"{ACHIEVED / 1e12:.0f} TFLOP/s achieved: F {f1 * 1e3:.2f} ms, B {b1 * 1e3:.2f} ms, "
        f"W {w1 * 1e3:.2f} ms (analytic FLOPs; 1F1B, interleaved 1F1B, V-Half and autodiff run "
        "B + W in one slot); no recomputation. "
        f"Message: one micro-batch's bfloat16 activation, {MESSAGE_BYTES / 1e6:.1f} MB, "
        "bytes / bandwidth + latency.\n"
    )
    print(
        "Without overlap (pipejax today) a tick computes, then runs its ppermutes (a forward "
        "table's tick one, a training table's two, one after the other), and lasts the busiest "
        "device's compute plus the messages. With overlap (`overlap=True`, pipejax's tables with "
        "`hop=2`) a message is read a tick later: a tick lasts max(compute, messages), and every "
        "hop takes two ticks (more ticks of fill and drain). ideal: all the slots' work / n.\n"
    )
    plans = {}
    built = schedule_tables(DEVICES, CHUNKS, hop=2)  # pipejax's overlap=True tables
    for name, t in schedule_tables(DEVICES, CHUNKS).items():
        layers = LAYERS // t.num_stages
        costs = (layers * f1, layers * b1, layers * w1)
        plans[name] = (sim.ticks(t, *costs), sim.ticks(built[name], *costs, overlap=True))
    rows = []
    for name, (plain, over) in plans.items():
        for link, bw, lat in LINKS:
            msg = sim.message_time(MESSAGE_BYTES, bw, lat)
            a, o = plain.step(msg), over.step(msg)
            rows.append(
                [
                    name,
                    link,
                    f"{msg * 1e3:.3f}",
                    f"{a * 1e3:,.0f}",
                    f"{a / plain.ideal:.3f}",
                    f"{o * 1e3:,.0f}",
                    f"{o / over.ideal:.3f}",
                    "overlap" if o < a else "no overlap",
                ]
            )
    ideal = next(iter(plans.values()))[0].ideal
    print(f"Ideal step (work / n, the same for every schedule): {ideal * 1e3:,.0f} ms.\n")
    headers = ["schedule", "link", "message ms", "step ms", "/ ideal", "step ms, overlap", "/ ideal, overlap"]
    print(table([*headers, "shorter"], rows, align="llrrrrrl"))

    print("\nWhere overlap wins:\n")
    rows = []
    for name, (plain, over) in plans.items():
        window = sim.overlap_wins(plain, over)
        if window is None:
            span, bws = "never", "never"
        else:
            lo, hi = window
            span = f"{lo * 1e3:.2f} .. {hi * 1e3:.2f}" if math.isfinite(hi) else f"> {lo * 1e3:.2f}"
            top = MESSAGE_BYTES / (lo - CROSSOVER_LATENCY) if lo > CROSSOVER_LATENCY else math.inf
            low = MESSAGE_BYTES / (hi - CROSSOVER_LATENCY) if math.isfinite(hi) else 0.0
            bws = f"{low / 1e9:.2f} .. {top / 1e9:.2f}"
        rows.append([name, len(plain.compute), len(over.compute), plain.messages.max(), span, bws])
    headers = ["schedule", "ticks", "ticks, overlap", "messages per tick", "message ms where overlap wins"]
    print(
        table([*headers, f"GB/s where overlap wins ({CROSSOVER_LATENCY * 1e6:.0f} us)"], rows, align="lrrrrr")
    )
    print(
        "\nThe difference overlap - no overlap is convex and piecewise linear in the message time, so "
        "overlap wins on one interval: from where the sends it hides outweigh its extra ticks to "
        "where the extra ticks, each now as long as its messages, outweigh the compute it hides "
        "(`_simulate.overlap_wins`, exact). Bandwidths at the stated latency."
    )


# --- 6. the simulator against a measured one-device step ------------------------------------------


def one_device(quick: bool) -> None:
    import jax
    import numpy as np

    import pipejax as pj
    from benchmarks._common import interleaved_times
    from benchmarks.gpu import mlp, scan_step

    section("The simulator's stage times against a measured one-device step (mesh=None)")
    S, L, width, hidden, m, micro = (4, 1, 128, 512, 4, 32) if quick else (4, 2, 256, 1024, 8, 64)
    rounds = 5 if quick else 10
    model = mlp(S, L, width, hidden, m * micro)
    piece_args = (jax.tree.map(lambda a: a[0], model.params), model.args[1][:micro])
    piece_args += (jax.numpy.ones_like(piece_args[1]),)  # the output cotangent

    def stage(p, x):
        return model.stage(p, x, None)

    pieces = {  # one stage on one micro-batch: F, and F + each backward (XLA drops what is unused)
        "F": lambda p, x, ct: stage(p, x),
        "F + B + W": lambda p, x, ct: jax.vjp(stage, p, x)[1](ct),
        "F + B": lambda p, x, ct: jax.vjp(lambda x: stage(p, x), x)[1](ct),
        "F + W": lambda p, x, ct: jax.vjp(lambda p: stage(p, x), p)[1](ct),
    }

    def repeated(fn):  # as many stage calls as a step makes, so both see the same machine
        def call():
            for _ in range(m * S):
                out = fn(*piece_args)
            return out

        return call

    calls = {k: repeated(jax.jit(fn)) for k, fn in pieces.items()}
    tables = {}
    for name, v in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        pipe = pj.pipeline(model.stage, num_stages=S, chunks=m, schedule=name, repeats=v, checkpoint="never")
        compiled = jax.jit(pipe.value_and_grad(model.loss))
        calls[name] = lambda c=compiled: c(*model.args)
        tables[name] = schedule_tables(S // v, m, v)[name if v == 1 else f"{name} v={v}"]
    scan = jax.jit(scan_step(model, S, m, remat=False))
    calls["scan (no remat)"] = lambda: scan(*model.args)
    tables["scan (no remat)"] = None  # the same work as the 1f1b table, on one device
    times = interleaved_times(calls, (), rounds=rounds)
    per = {k: times[k] / (m * S) for k in pieces}  # seconds per stage call, each round
    f = per["F"]
    costs = {  # (f, b, w) per round: zb-h1 splits the backward into B and W, the others run it in B
        "split": (f, np.maximum(per["F + B"] - f, 0), np.maximum(per["F + W"] - f, 0)),  # >= 0: noise
        "whole": (f, np.maximum(per["F + B + W"] - f, 0), 0 * f),
    }
    med = {k: float(np.median(v)) for k, v in per.items()}
    print(
        f"{model.text}, m = {m} micro-batches of {micro}, checkpoint='never'. One stage on one "
        f"micro-batch (median of {rounds} rounds of {m * S} calls): F {med['F'] * 1e3:.3f} ms, F + B + W "
        f"{med['F + B + W'] * 1e3:.3f} ms, F + B (input cotangent) {med['F + B'] * 1e3:.3f} ms, F + W "
        f"(weight cotangent) {med['F + W'] * 1e3:.3f} ms. jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}.\n"
    )
    rows = []
    for name, sched in tables.items():
        sched = sched or tables["1f1b"]
        kind = "split" if "W" in sched.slot_fields() else "whole"
        by_round = [sim.ticks(sched, *(c[r] for c in costs[kind])) for r in range(rounds)]
        work = np.array([t.work for t in by_round])
        ratio = times[name] / work
        rows.append(
            [
                name,
                f"{np.median(work) * 1e3:.2f}",
                f"{np.median(times[name]) * 1e3:.2f}",
                f"{np.median(ratio):.2f} ({np.min(ratio):.2f}-{np.max(ratio):.2f})",
                "-" if tables[name] is None else sched.num_devices,
                "-" if tables[name] is None else f"{np.median([t.step() for t in by_round]) * 1e3:.2f}",
            ]
        )
    headers = ["program", "sum of stage times the simulator assumes, ms", "step measured, ms"]
    headers += ["measured / assumed (min-max)", "n", "predicted step on n devices, free links, ms"]
    print(table(headers, rows, align="lrrrrr"))
    print(
        "\nassumed: the work of the schedule's table, every slot's cost summed (F and the whole "
        "backward per stage and micro-batch; zb-h1: F, B and W timed apart), which one device runs "
        "in turn: with mesh=None every schedule runs as gradient accumulation over the micro-batches. "
        "measured: the jitted value_and_grad step. Pieces and steps run in the same interleaved "
        "rounds; ratios are medians of per-round ratios. The ratio is what the stage times miss: "
        "the loss, the engine's per-tick bookkeeping, XLA's fusion across stages; the scan row does "
        "the same work without the pipeline."
    )


# --- 8. the floor of one step ----------------------------------------------------------------------


def _zb_ticks(n: int, m: int) -> tuple[dict, dict]:
    """ZB-H1's F and B ticks per (device, micro-batch), read from the library's table."""
    import numpy as np

    import pipejax as pj

    table = pj.zb_h1_schedule(n, m)
    return tuple(
        {(d, int(i)): t for (t, d), i in np.ndenumerate(table.micro[kind]) if i >= 0} for kind in "FB"
    )


def _step_of(n, ticks_f, ticks_b, ticks_w) -> tuple[int, int, int]:
    """The lockstep step of F, B and W ticks (each slot 1), and the most stage inputs (F to W)
    and output cotangents (B to W) a device holds at once."""
    last = max(ticks_w.values()) + 1
    load = [[0] * n for _ in range(last)]
    for ticks in (ticks_f, ticks_b, ticks_w):
        for (d, _), t in ticks.items():
            load[t][d] += 1

    def held(start):
        return max(
            sum(start[d, i] <= t <= ticks_w[d, i] for (dd, i) in ticks_w if dd == d)
            for d in range(n)
            for t in range(last)
        )

    return sum(max(row) for row in load), held(ticks_f), held(ticks_b)


def _greedy_w(n, m) -> dict:
    """Each W in the first tick where its device is below the tick's busiest device (after every
    F and B: one W a tick), in order: no bound on the cotangents held."""
    f, b = _zb_ticks(n, m)
    last = max(b.values())
    load = {}
    for ticks in (f, b):
        for (d, _), t in ticks.items():
            load[t, d] = load.get((t, d), 0) + 1
    w, pending = {}, [[] for _ in range(n)]
    for t in itertools.count():
        for d in range(n):
            pending[d] += [i for i in range(m) if b[d, i] == t]
        busiest = max(1, max(load.get((t, d), 0) for d in range(n))) if t <= last else 1
        for d in range(n):
            if pending[d] and load.get((t, d), 0) < busiest:
                w[d, pending[d].pop(0)] = t
                load[t, d] = load.get((t, d), 0) + 1
        if t >= last and not any(pending):
            return w


def _best_w(n, m, ring, extra=4) -> dict | None:
    """The W ticks that minimise the lockstep step over ZB-H1's F and B ticks (an integer program,
    scipy's HiGHS): one W per device and tick, each at or after its B, W of micro-batch ``i``
    before B of ``i + ring`` (a ring of ``ring`` cotangents)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    f, b = _zb_ticks(n, m)
    T = max(b.values()) + 1 + extra
    fixed = np.zeros((T, n))
    for ticks in (f, b):
        for (d, _), t in ticks.items():
            fixed[t, d] += 1
    var = {(d, i, t): k for k, (d, i, t) in enumerate((d, i, t) for (d, i) in b for t in range(b[d, i], T))}
    nw = len(var)
    rows, lo, hi = lil_matrix((2 * len(b) + 2 * n * T, nw + T)), [], []

    def row(entries, low, high):
        for col, value in entries:
            rows[len(lo), col] = value
        lo.append(low)
        hi.append(high)

    for d, i in b:  # each W once; before B of i + ring
        row([(var[d, i, t], 1) for t in range(b[d, i], T)], 1, 1)
        if i + ring < m:
            row([(var[d, i, t], t) for t in range(b[d, i], T)], -np.inf, b[d, i + ring] - 1)
    for d in range(n):
        for t in range(T):  # one W a tick; the tick lasts its busiest device
            ws = [(var[d, i, t], 1) for i in range(m) if (d, i, t) in var]
            row(ws, 0, 1)
            row([(nw + t, 1)] + [(k, -1) for k, _ in ws], fixed[t, d], np.inf)
    A = rows[: len(lo)].tocsr()
    cost = np.r_[np.zeros(nw), np.ones(T)]
    res = milp(
        cost, constraints=LinearConstraint(A, lo, hi), integrality=np.r_[np.ones(nw), np.zeros(T)],
        bounds=Bounds(0, np.r_[np.ones(nw), np.full(T, 3)]), options={"time_limit": 120},
    )  # fmt: skip
    if res.x is None:
        return None
    return {(d, i): t for (d, i, t), k in var.items() if res.x[k] > 0.5}


def floor(quick: bool) -> None:
    import pipejax as pj

    section("The floor of one step: ZB-H1's ticks against 3m + n - 1 (F = B = W = 1)")
    rows = []
    for n, m in ((4, 8),) if quick else ((4, 8), (4, 16), (8, 8), (8, 16)):
        zb, one, low = pj.zb_h1_schedule(n, m), pj.one_f_one_b_schedule(n, m), pj.zb_floor_schedule(n, m)
        row = [n, m, 3 * m + n - 1, f"{zb.step_time(1, 1, 1):g}", f"{one.step_time(1, 2, 0):g}"]
        row.append(f"{low.step_time(1, 1, 1):g}, {low.stash_slots()} / {low.cotangent_slots()}")
        f, b = _zb_ticks(n, m)
        for ring in (n, 2 * n):
            w = _best_w(n, m, ring)
            row.append("-" if w is None else "{}, {} / {}".format(*_step_of(n, f, b, w)))
        row.append("{}, {} / {}".format(*_step_of(n, f, b, _greedy_w(n, m))))
        rows.append(row)
    print(
        "Lockstep step times in slot times, F = B = W = 1 (1F1B: B = 2, its whole backward). "
        "'zb-floor' is pj.zb_floor_schedule (ZB-H1 with its last 2(n - 1) W slots in the drain); "
        "the last three columns keep ZB-H1's F and B ticks and place the W slots: exactly, with a "
        "ring of n cotangents or one of 2n, and greedily without a bound. Each gives the step, then "
        "the most stage inputs / output cotangents a device holds (ZB-H1: 2n - 1 / n)."
    )
    print()
    heads = ["n", "m", "floor 3m + n - 1", "zb-h1", "1f1b", "zb-floor", "best W, ring n", "best W, ring 2n"]
    heads.append("greedy W")
    print(table(heads, rows))


SECTIONS = {
    "theory": theory,
    "measured": measured,
    "torchgpipe": torchgpipe,
    "layouts": layouts,
    "lockstep": lockstep,
    "bandwidth": bandwidth,
    "one-device": one_device,
    "floor": floor,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer sizes, fewer repeats")
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only these")
    args = parser.parse_args(argv)
    print("# Pipeline schedule simulator" + (" (--quick)" if args.quick else ""))
    for name in args.section or list(SECTIONS):
        SECTIONS[name](args.quick)


if __name__ == "__main__":
    main()
