"""Benchmarks of ``pipejax.pipeline``: bubble, memory, overhead and compile time.

Run from the repository root::

    .venv/bin/python benchmarks/pipeline.py            # full run (several minutes on 2 CPU cores)
    .venv/bin/python benchmarks/pipeline.py --quick    # smoke run (well under a minute)
    .venv/bin/python benchmarks/pipeline.py --section memory --section compile

The script simulates 8 CPU devices (``--xla_force_host_platform_device_count=8``). Fake devices in
one process do not run in parallel, so nothing here measures a pipeline speed-up: the bubble is
measured by counting the stage executions that happen, memory from XLA's compiled memory analysis
(per device: with a mesh the compiled program is the per-device SPMD program), and time only as
ratios of programs run side by side on one device.

Sections (each prints markdown tables):

1. ``bubble``: stage executions per device, counted with ``jax.debug.callback`` inside the stage.
2. ``memory``: compiled temp bytes of ``jit(grad(loss))`` per device for each checkpoint mode,
   against a memory model; fitted per-micro-batch slopes; per-device parameter bytes of
   heterogeneous stages placed on a mesh.
3. ``overhead``: a one-stage pipeline without a mesh against plain ``jax.jit`` of the stage.
4. ``compile``: trace + lower + compile time of an 8-stage heterogeneous pipeline (every
   checkpoint mode, a mesh and ``mesh=None``, few and many chunks) and of a homogeneous 32-layer
   stack against the un-pipelined composed model, with jaxpr equation counts.
5. ``local``: ``mesh=None`` run time against the same stages run as a micro-batched ``lax.scan``.
6. ``inputs``: argument and temp bytes per device with ``x`` replicated or split over the stages.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import collections
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
import pipejax as pj
from benchmarks._common import header as print_header
from benchmarks._common import interleaved_times, kib, nbytes, normal, ratio_stats, section, table, temp_bytes

MODES = ("always", "except_last", "never")
OVERHEAD_TARGETS = {"never": 1.05, "always": 1.4}
COMPILE_TARGET = 2.0  # trace + lower + compile of jit(grad) over the composed model
EQNS_TARGET = 3.0  # jaxpr equations over the composed model's
CHUNKS_TARGET = 1.25  # compile time at many chunks over few, same batch
HOMO_TARGET = 1.5  # a homogeneous stack
LOCAL_TARGETS = {"always": 1.5, "except_last": 1.15, "never": 1.15}  # mesh=None over the micro-batched scan


def stage_mesh(n: int):
    return jax.make_mesh((n,), ("stage",))


# --- 1. bubble -----------------------------------------------------------------------------------


def bench_bubble(cfg) -> None:
    section("1. Bubble: stage executions per device, counted")
    print(
        "Stage s, `y = x * w` (one function per stage: heterogeneous stages, whose bubble ticks skip\n"
        "the stage; homogeneous stages on a mesh compute a bubble on a micro-batch of x instead and\n"
        "discard it), calls `jax.debug.callback(record, x[0, 0])` with its index s and the id of the\n"
        "micro-batch it works on (the input rows carry their micro-batch index). The callback runs\n"
        "only when the stage really executes, so bubble ticks that skip it are not counted. Mesh of n\n"
        "devices. T = ticks of the schedule (`apply.schedule(B).num_ticks`). 'fwd exec' is the\n"
        "count per device in one forward call; 'repeats' are executions on a micro-batch the device\n"
        "had already processed (a bubble tick that runs the stage anyway; its output is\n"
        "discarded), summed over devices; 'repeated ids' are those micro-batches. idle =\n"
        "1 - (fwd exec)/T, averaged over devices; 'useful idle' counts only distinct micro-batches.\n"
        "'grad exec' counts executions in one `jit(grad)` call (forward plus checkpoint\n"
        "recomputation). 'local' is the total over stages with mesh=None (one device runs all).\n"
    )
    log: list[tuple[int, int]] = []

    def record(s, i):
        log.append((int(s), int(i)))

    def stages(num):
        def make(s):
            def stage(p, x, key):
                jax.debug.callback(lambda i: record(s, i), x[0, 0])
                return x * p["w"]

            return stage

        return [make(s) for s in range(num)], [{"w": jnp.ones((), jnp.float32)} for _ in range(num)]

    def run(apply, params, x, grad):
        log.clear()
        if grad:
            f = jax.jit(jax.grad(lambda p: apply(p, x).sum()))
            jax.block_until_ready(f(params))
        else:
            jax.block_until_ready(apply(params, x))
        jax.effects_barrier()
        return list(log)

    rows, problems = [], []
    b = 2
    for n in cfg["bubble_n"]:
        mesh = stage_mesh(n)
        for m in cfg["bubble_m"]:
            x = jnp.repeat(jnp.arange(m, dtype=jnp.float32), b)[:, None] * jnp.ones((1, 3), jnp.float32)
            ideal = (n - 1) / (m + n - 1)
            for mode in MODES:
                fns, raw = stages(n)
                apply = pj.pipeline(fns, chunks=m, checkpoint=mode, mesh=mesh)
                params = apply.place(raw)
                ticks = apply.schedule(x.shape[0]).num_ticks
                fwd = run(apply, params, x, grad=False)
                per_dev = collections.Counter(s for s, _ in fwd)
                pairs = collections.Counter(fwd)
                distinct = collections.Counter(s for s, _ in pairs)
                execs = [per_dev[s] for s in range(n)]
                repeats = [per_dev[s] - distinct[s] for s in range(n)]
                repeated_ids = sorted({i for (s, i), c in pairs.items() if c > 1})
                if set(pairs) != {(s, i) for s in range(n) for i in range(m)}:
                    problems.append(f"n={n} m={m} {mode}: (stage, micro-batch) pairs run {sorted(pairs)}")
                grad = collections.Counter(s for s, _ in run(apply, params, x, grad=True))
                local = pj.pipeline(fns, chunks=m, checkpoint=mode, mesh=None)
                local_total = len(run(local, raw, x, grad=False))
                idle = 1 - np.mean(execs) / ticks
                useful_idle = 1 - np.mean([distinct[s] for s in range(n)]) / ticks
                rows.append(
                    [
                        n,
                        m,
                        mode,
                        ticks,
                        execs,
                        sum(repeats),
                        repeated_ids or "",
                        f"{idle:.3f}",
                        f"{useful_idle:.3f}",
                        f"{ideal:.3f}",
                        f"{pj.gpipe_bubble_fraction(n, m):.3f}",
                        [grad[s] for s in range(n)],
                        f"{local_total}/{n * m}",
                    ]
                )
    print(
        table(
            [
                "n",
                "m",
                "mode",
                "T",
                "fwd exec per device",
                "repeats",
                "repeated ids",
                "idle",
                "useful idle",
                "(n-1)/(m+n-1)",
                "pj.gpipe_bubble_fraction",
                "grad exec per device",
                "local exec/(n*m)",
            ],
            rows,
            align="rrlrlrlrrrrlr",
        )
    )
    if problems:
        print("\nPROBLEM: some (stage, micro-batch) pairs did not run exactly as scheduled:")
        for p in problems:
            print("  " + p)
    else:
        print("\nEvery (stage, micro-batch) pair ran at least once, and on the device holding that stage.")
    bench_bubble_circular(cfg, stages, run)


def bench_bubble_circular(cfg, stages, run) -> None:
    """GPipe against the circular schedule on the same n devices, counted as above."""
    print(
        "\nCircular schedule (`schedule='circular', repeats=v`): the same model cut into S = v*n\n"
        "stages, device d holding stages d, d+n, ...; each micro-batch goes round the devices v\n"
        "times. GPipe runs the same work as n stages of v sub-stages each, so one of its ticks costs\n"
        "v units (a unit: one sub-stage on one micro-batch) against 1 for a circular tick. Counted\n"
        "with the callback above, `checkpoint='always'` (bubble ticks skip the stage), one forward.\n"
        "'exec per device' counts stage calls; 'busy' and 'span' are in units; idle = 1 - busy/span.\n"
    )
    rows, problems = [], []
    b = 2
    for n, v, m in cfg["circ_cases"]:
        mesh = stage_mesh(n)
        x = jnp.repeat(jnp.arange(m, dtype=jnp.float32), b)[:, None] * jnp.ones((1, 3), jnp.float32)
        for name, num_stages, kw, unit in (
            ("gpipe", n, {}, v),
            ("circular", v * n, {"schedule": "circular", "repeats": v}, 1),
        ):
            fns, raw = stages(num_stages)
            apply = pj.pipeline(fns, chunks=m, checkpoint="always", mesh=mesh, **kw)
            schedule = apply.schedule(x.shape[0])
            log = run(apply, apply.place(raw), x, grad=False)
            per_dev = collections.Counter(s % n for s, _ in log)
            if sorted(log) != sorted((s, i) for s in range(num_stages) for i in range(m)):
                problems.append(f"{name} n={n} v={v} m={m}: pairs run {sorted(log)}")
            execs = [per_dev[d] for d in range(n)]
            busy, span = np.mean(execs) * unit, schedule.num_ticks * unit
            formula = pj.circular_bubble_fraction(n, m, v) if unit == 1 else pj.gpipe_bubble_fraction(n, m)
            rows.append(
                [
                    n,
                    v,
                    m,
                    name,
                    schedule.num_ticks,
                    execs,
                    f"{busy:g}",
                    f"{span:g}",
                    f"{1 - busy / span:.3f}",
                    f"{formula:.3f}",
                    f"{schedule.bubble_fraction():.3f}",
                ]
            )
    print(
        table(
            [
                "n",
                "v",
                "m",
                "schedule",
                "T",
                "exec per device",
                "busy",
                "span",
                "idle (counted)",
                "formula",
                "table",
            ],
            rows,
            align="rrrlrlrrrrr",
        )
    )
    print(
        "\nformula: GPipe (n-1)/(m+n-1), circular (n-1)/(v*m+n-1) (`pj.circular_bubble_fraction`);\n"
        "table: `apply.schedule(B).bubble_fraction()`."
    )
    if problems:
        print("\nPROBLEM: " + "; ".join(problems))


# --- 2. memory -----------------------------------------------------------------------------------


def mlp_stage(p, x, key):
    h = x
    for w in p["ws"]:
        h = jnp.tanh(h @ w)
    return h


def mlp_params(n: int, d: int, h: int, layers: int):
    shapes = [(d, h)] + [(h, h)] * (layers - 2) + [(h, d)]
    return {"ws": [normal((n, *s), seed=i, scale=1 / np.sqrt(s[0])) for i, s in enumerate(shapes)]}


def residual_bytes(stage, p, x) -> tuple[int, list[str]]:
    """Bytes plain autodiff saves for ``stage(p, x)``, excluding the arguments themselves."""
    _, vjp = jax.vjp(lambda p, x: stage(p, x, None), p, x)
    ids = {id(a) for a in jax.tree.leaves((p, x))}
    saved = [a for a in jax.tree.leaves(vjp) if id(a) not in ids]
    shapes = collections.Counter(f"{a.dtype}{list(a.shape)}" for a in saved)
    return sum(a.nbytes for a in saved), [f"{k} x{v}" for k, v in shapes.items()]


def model_bytes(mode: str, n: int, m: int, A: int, R: int, O: int) -> tuple[int, int]:  # noqa: E741
    """(initial model, corrected model) of per-device temp bytes."""
    T = m + n - 1
    initial = {
        "always": T * A + R + m * O,
        "never": T * R + m * O,
        "except_last": (m - 1) * A + n * R + m * O,
    }[mode]
    # Corrected (see docs/benchmark_pipeline.md): ticks with a full stage computation keep the
    # stage's residuals R and its input A; checkpointed ticks keep only the input A (none when
    # n == 1, where the input is read from the batch). "except_last" checkpoints all ticks but
    # the last n. Parameter-sized buffers (gradient accumulators, loop-state copies) are left
    # out: the tables report them as (measured - model) / P.
    a = A if n > 1 else 0
    kept = {"always": T, "never": 0, "except_last": max(T - n, 0)}[mode]
    corrected = kept * a + (T - kept) * (R + A) + m * O + (R if mode == "always" else 0)
    return initial, corrected


def phase_summary(mode: str, n: int, m: int) -> str:
    """The engine's scan phases as tick counts, ``c`` checkpointed, ``p`` not (private API)."""
    try:
        from pipejax._src import checkpoint as ckpt

        parts = []
        for ph in ckpt.phases(mode, pj.gpipe_schedule(n, m)):
            full = getattr(ph.remat, "keywords", {}).get("policy") is None  # nothing saveable
            remat = "c" if full else "p"
            parts.append(f"{ph.stop - ph.start}{remat}")
        return " ".join(parts)
    except Exception:  # diagnostics only; the engine's internals may change
        return "?"


def fit_slope(ms, ys) -> float:
    if len(ms) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(ms, float), np.asarray(ys, float), 1)[0])


def bench_memory(cfg) -> None:
    section("2. Memory: compiled temp bytes of jit(grad(loss)) per device")
    d, h, layers, b = cfg["mem_dims"]
    p1 = jax.tree.map(lambda a: a[0], mlp_params(1, d, h, layers))
    x1 = jnp.ones((b, d), jnp.float32)
    A = O = b * d * 4  # noqa: E741
    R, saved = residual_bytes(mlp_stage, p1, x1)
    P = nbytes(p1)
    single = temp_bytes(jax.grad(lambda p, x: jnp.sum(mlp_stage(p, x, None) ** 2)), p1, x1)
    print(
        f"Homogeneous stages: {layers} layers `h = tanh(h @ W)`, widths {d} -> {h} -> ... -> {d}; a\n"
        f"micro-batch has {b} examples (the micro-batch size is fixed, the batch is {b}*m).\n"
        f"loss = sum(pipeline(params, x) ** 2). Per stage and micro-batch:\n\n"
        f"* A = stage input = {kib(A)} KiB; O = pipeline output = {kib(O)} KiB\n"
        f"* R = residuals plain autodiff saves (jax.vjp, arguments excluded) = {kib(R)} KiB = "
        f"{R / A:.1f} A: {', '.join(saved)}\n"
        f"* P = one stage's parameters = {kib(P)} KiB; temp bytes of one stage's own jit(grad) "
        f"= {kib(single)} KiB (XLA fuses part of R away when there is no loop)\n\n"
        "Models (T = m + n - 1 ticks):\n\n"
        "* initial:   always T*A + R + m*O;  never T*R + m*O;  except_last (m-1)*A + n*R + m*O\n"
        "* corrected: k*A' + (T-k)*(R + A) + m*O (+ R with always, for the recomputation):\n"
        "             k checkpointed ticks keep their input A' (A' = A, or 0 if n = 1, where the\n"
        "             input is read from the batch), the other T - k ticks keep R and their input;\n"
        "             k = T (always), 0 (never), max(T - n, 0) (except_last). Parameter-sized\n"
        "             buffers (gradient accumulators, loop-state copies) are not modelled: see the\n"
        "             column (meas-corr)/P.\n\n"
        "'phases' lists the engine's scan phases in tick counts (c: checkpointed, p: not).\n"
    )
    grid: dict[tuple[str, int], list[tuple[int, int]]] = collections.defaultdict(list)
    rows = []
    for n in cfg["mem_n"]:
        mesh = stage_mesh(n)
        for mode in cfg["mem_modes"]:
            for m in cfg["mem_m"]:
                apply = pj.pipeline(mlp_stage, num_stages=n, chunks=m, checkpoint=mode, mesh=mesh)
                params = apply.place(mlp_params(n, d, h, layers))
                x = jnp.ones((b * m, d), jnp.float32)
                ma = (
                    jax.jit(jax.grad(lambda p, x, apply=apply: jnp.sum(apply(p, x) ** 2)))
                    .lower(params, x)
                    .compile()
                    .memory_analysis()
                )
                t = ma.temp_size_in_bytes
                grid[(mode, n)].append((m, t))
                initial, corr = model_bytes(mode, n, m, A, R, O)
                rows.append(
                    [
                        mode,
                        n,
                        m,
                        phase_summary(mode, n, m),
                        kib(t),
                        kib(initial),
                        f"{t / initial:.2f}",
                        kib(corr),
                        f"{t / corr:.2f}",
                        f"{(t - corr) / P:.2f}",
                        kib(ma.argument_size_in_bytes),
                    ]
                )
    print(
        table(
            [
                "mode",
                "n",
                "m",
                "phases",
                "temp KiB",
                "initial model",
                "meas/initial",
                "corrected model",
                "meas/corr",
                "(meas-corr)/P",
                "args KiB",
            ],
            rows,
            align="lrrlrrrrrrr",
        )
    )

    print(
        f"\nSlopes: least-squares fit of temp bytes against m over m >= max({cfg['slope_from']}, n + 1)\n"
        "(KiB per extra micro-batch; m > n so that every fit has the same phase structure), against\n"
        "the corrected model's slope. The initial model expects about A (always), R (never).\n"
    )
    srows = []
    for (mode, n), pts in grid.items():
        m0 = max(cfg["slope_from"], n + 1)
        pts = [(m, t) for m, t in pts if m >= m0]
        slope = fit_slope([m for m, _ in pts], [t for _, t in pts])
        pred = model_bytes(mode, n, m0 + 1, A, R, O)[1] - model_bytes(mode, n, m0, A, R, O)[1]
        srows.append(
            [
                mode,
                n,
                [m for m, _ in pts],
                kib(slope),
                f"{slope / A:.2f}",
                f"{slope / R:.3f}",
                kib(pred),
                f"{slope / pred:.3f}",
            ]
        )
    print(
        table(
            [
                "mode",
                "n",
                "m fitted",
                "slope KiB",
                "slope / A",
                "slope / R",
                "model slope KiB",
                "fitted/model",
            ],
            srows,
            align="lrlrrrrr",
        )
    )
    if cfg["mem_diagnostics"]:
        memory_diagnostics(cfg, A, R, O, P)
    bench_param_bytes(cfg)


def memory_diagnostics(cfg, A, R, O, P) -> None:  # noqa: E741
    d, h, layers, b = cfg["mem_dims"]
    print(
        "\nDiagnostics. (a) The constant: temp bytes of jit(grad) with respect to the parameters and\n"
        "the input (as above) against with respect to the input x only (no parameter-gradient\n"
        "accumulator). (b) 'phases' as above: a phase of one tick is a one-iteration loop, and each\n"
        "one costs about one R more than the model (compare neighbouring n or m).\n"
    )
    rows = []
    for mode, n, m in cfg["mem_diagnostics"]:
        apply = pj.pipeline(mlp_stage, num_stages=n, chunks=m, checkpoint=mode, mesh=stage_mesh(n))
        params = apply.place(mlp_params(n, d, h, layers))
        x = jnp.ones((b * m, d), jnp.float32)

        def loss(p, x, apply=apply):
            return jnp.sum(apply(p, x) ** 2)

        t_p = temp_bytes(jax.grad(loss), params, x)
        t_x = temp_bytes(jax.grad(loss, argnums=1), params, x)
        corr = model_bytes(mode, n, m, A, R, O)[1]
        rows.append(
            [
                mode,
                n,
                m,
                phase_summary(mode, n, m),
                kib(t_p),
                kib(t_x),
                f"{(t_p - t_x) / P:.2f}",
                kib(corr),
                f"{(t_p - corr) / R:+.2f}",
            ]
        )
    print(
        table(
            [
                "mode",
                "n",
                "m",
                "phases",
                "temp KiB (grad p, x)",
                "temp KiB (grad x)",
                "difference / P",
                "corrected model KiB",
                "(meas - model) / R",
            ],
            rows,
            align="lrrlrrrrr",
        )
    )


def bench_param_bytes(cfg) -> None:
    n = cfg["param_n"]
    print(
        f"\nParameter bytes per device: {n} heterogeneous stages of very different sizes, placed with\n"
        "`apply.place(params)` on a mesh of n devices. 'held' is read from the buffers'\n"
        "`addressable_shards` on each device; 'bytes_per_stage' is StageParams.bytes_per_stage().\n"
    )

    def dense(p, x, key):
        return jnp.tanh(x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype))

    cases = {
        "float32": [
            (16, 32, jnp.float32),
            (32, 512, jnp.float32),
            (512, 64, jnp.float32),
            (64, 16, jnp.float32),
        ],
        "float32 + bfloat16": [
            (16, 32, jnp.float32),
            (32, 512, jnp.bfloat16),
            (512, 64, jnp.float32),
            (64, 16, jnp.bfloat16),
        ],
    }
    rows = []
    for name, dims in cases.items():
        dims = dims[:n]
        stages = [dense] * len(dims)
        params = [{"w": jnp.ones((i, o), dt), "b": jnp.zeros((o,), dt)} for i, o, dt in dims]
        apply = pj.pipeline(stages, chunks=2, mesh=stage_mesh(len(dims)))
        placed = apply.place(params)
        held: dict = collections.Counter()
        for buf in placed.buffers:
            for shard in buf.addressable_shards:
                held[shard.device.id] += shard.data.nbytes
        per_stage = [nbytes(p) for p in params]
        total = sum(per_stage)
        devs = sorted(held)
        rows.append(
            [
                name,
                [kib(b) for b in per_stage],
                [kib(held[dv]) for dv in devs],
                kib(placed.bytes_per_stage()),
                kib(max(per_stage)),
                kib(total),
                f"{sum(held.values()) / total:.2f}",
            ]
        )
    print(
        table(
            [
                "dtypes",
                "stage params KiB",
                "held per device KiB",
                "bytes_per_stage",
                "largest stage",
                "total params",
                "sum held / total",
            ],
            rows,
            align="lllrrrr",
        )
    )


# --- 3. overhead ---------------------------------------------------------------------------------


def bench_overhead(cfg) -> None:
    section("3. Overhead: one-stage pipeline (chunks=1, mesh=None) against plain jax.jit")
    d, layers, batch = cfg["ovh_dims"]
    rounds = cfg["ovh_rounds"]

    def f(p, x, key=None):
        h = x
        for w in p:
            h = jnp.tanh(h @ w)
        return h

    params = [normal((d, d), seed=i, scale=1 / np.sqrt(d)) for i in range(layers)]
    x = normal((batch, d), seed=99)

    def loss_of(fn):
        return lambda p, x: jnp.sum(fn(p, x) ** 2)

    variants = {"plain": loss_of(f)}
    for mode in MODES:
        apply = pj.pipeline([f], chunks=1, checkpoint=mode, mesh=None)
        variants[mode] = loss_of(lambda p, x, apply=apply: apply([p], x))
    for chunks in cfg["ovh_context_chunks"]:  # context rows, no target: here recomputation is real
        apply = pj.pipeline([f], chunks=chunks, checkpoint="always", mesh=None)
        variants[f"always, chunks={chunks}"] = loss_of(lambda p, x, apply=apply: apply([p], x))
    fns = {k: jax.jit(jax.grad(v)).lower(params, x).compile() for k, v in variants.items()}
    temps = {k: fn.memory_analysis().temp_size_in_bytes for k, fn in fns.items()}
    ref = fns["plain"](params, x)
    for g in fns.values():  # warm up, and check that they agree
        out = g(params, x)
        for a, r in zip(out, ref, strict=True):
            # float32; chunks > 1 sums the gradient over micro-batches in another order
            r = np.asarray(r)
            np.testing.assert_allclose(np.asarray(a), r, rtol=1e-3, atol=1e-5 * np.abs(r).max())
        for _ in range(3):
            jax.block_until_ready(g(params, x))
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):  # interleaved, rotating the order every round
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k](params, x))
            times[k].append(time.perf_counter() - t0)
    plain = np.asarray(times["plain"])
    print(
        f"Stage: {layers} layers `tanh(h @ W)` of width {d}, batch {batch}; forward + backward\n"
        f"(`jit(grad(loss))`). {rounds} interleaved rounds (the order rotates each round), after\n"
        "warm-up. 'ratio' is the median over rounds of (variant time / plain time in the same round),\n"
        "with its interquartile range; 'temp' is the compiled temp bytes. Rows 'always, chunks=c'\n"
        "are context, without a target: a c-tick loop, where checkpointing really recomputes.\n"
    )
    rows = []
    for k in names:
        t = np.asarray(times[k])
        ratios = t / plain
        q1, med, q3 = np.percentile(ratios, [25, 50, 75])
        target = OVERHEAD_TARGETS.get(k)
        verdict = "" if target is None else ("met" if med <= target else "MISSED")
        rows.append(
            [
                k,
                f"{np.median(t) * 1e3:.2f}",
                f"{t.min() * 1e3:.2f}",
                f"{med:.3f}",
                f"{q1:.3f}-{q3:.3f}",
                f"{np.median(t) / np.median(plain):.3f}",
                kib(temps[k]),
                "" if target is None else f"<= {target}",
                verdict,
            ]
        )
    print(
        table(
            [
                "variant",
                "median ms",
                "min ms",
                "ratio",
                "ratio IQR",
                "median/median",
                "temp KiB",
                "target",
                "",
            ],
            rows,
            align="lrrrrrrrl",
        )
    )


# --- 4. compile time -----------------------------------------------------------------------------


def count_primitives(jaxpr) -> collections.Counter:
    """Equations per primitive, recursively through sub-jaxprs."""
    counts: collections.Counter = collections.Counter()
    stack = [jaxpr]
    while stack:
        j = stack.pop()
        for e in j.eqns:
            counts[e.primitive.name] += 1
            stack.extend(jex_core.jaxprs_in_params(e.params))
    return counts


def microbatched_loss(stages, chunks):
    """``sum(f(x)**2)`` of the stages run over ``chunks`` micro-batches in a plain ``lax.scan``:
    the hand-written reference the pipeline is compared with (no pipeline)."""

    def loss(ps, x):
        xs = x.reshape((chunks, x.shape[0] // chunks, -1))

        def body(total, xi):
            for stage, p in zip(stages, ps, strict=True):
                xi = stage(p, xi, None)
            return total + jnp.sum(xi**2), None

        return jax.lax.scan(body, jnp.zeros((), x.dtype), xs)[0]

    return loss


def compile_times(build, reps_results, sizes, name) -> None:
    """Trace, lower and XLA-compile ``build()``'s jitted function once, after clearing caches."""
    jax.clear_caches()
    fn, args = build()
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    reps_results.setdefault(name, []).append(np.array([t1 - t0, t2 - t1, t3 - t2]))
    sizes[name] = count_primitives(traced.jaxpr.jaxpr)


def compile_table(results, sizes, base_name, counted, targets) -> None:
    """One row per program: median times, ratio to ``base_name``, equations and ``counted``."""
    base = np.median(results[base_name], axis=0).sum()
    base_eqns = sum(sizes[base_name].values())
    base_count = max(sizes[base_name][counted], 1)
    rows = []
    for name, ts in results.items():
        med = np.median(ts, axis=0)
        ratio = med.sum() / base
        eqns, count = sum(sizes[name].values()), sizes[name][counted]
        target = targets.get(name)
        verdict = "" if target is None else ("met" if ratio <= target else "MISSED")
        eqn_verdict = "" if target is None else ("met" if eqns <= EQNS_TARGET * base_eqns else "MISSED")
        rows.append(
            [
                name,
                f"{med[0]:.2f}",
                f"{med[1]:.2f}",
                f"{med[2]:.2f}",
                f"{med.sum():.2f}",
                f"{ratio:.2f}",
                "" if target is None else f"<= {target}",
                verdict,
                f"{eqns} ({eqns / base_eqns:.1f}x) {eqn_verdict}",
                f"{count} ({count / base_count:.1f}x)",
            ]
        )
    print(
        table(
            [
                "program",
                "trace s",
                "lower s",
                "compile s",
                "total s",
                "ratio",
                "target",
                "",
                f"eqns (<= {EQNS_TARGET}x)",
                counted,
            ],
            rows,
            align="lrrrrrrlrr",
        )
    )


def hetero_programs(cfg, batch=None):
    """The heterogeneous section's programs, by name: ``name -> build``, ``build() -> (jitted, args)``.

    Stage functions are made afresh by every ``build``, so no tracing cache can be hit.
    """
    n, depth, batch_default, chunks, _ = cfg["comp"]
    batch = batch or batch_default
    widths = [64 if s % 2 == 0 else 128 for s in range(n + 1)]

    def make_stages():
        def one(s):
            def stage(p, x, key):
                h = jnp.tanh(x @ p["w_in"] + p["b"])
                for _ in range(depth):
                    h = h + jnp.tanh(h @ p["w"])
                return jnp.tanh(h @ p["w_out"])

            return stage

        return [one(s) for s in range(n)]

    def stage_params(s):
        i, o = widths[s], widths[s + 1]
        return {
            "w_in": normal((i, 2 * o), 3 * s, 1 / np.sqrt(i)),
            "b": jnp.zeros((2 * o,)),
            "w": normal((2 * o, 2 * o), 3 * s + 1, 1 / np.sqrt(2 * o)),
            "w_out": normal((2 * o, o), 3 * s + 2, 1 / np.sqrt(2 * o)),
        }

    params = [stage_params(s) for s in range(n)]
    x = jnp.ones((batch, widths[0]), jnp.float32)
    mesh = stage_mesh(n)
    placed = {}

    def place(where):
        if where not in placed:
            apply = pj.pipeline(make_stages(), chunks=chunks, mesh=mesh if where == "mesh" else None)
            placed[where] = apply.place(params)
        return placed[where]

    def composed():
        stages = make_stages()

        def loss(ps, x):
            h = x
            for stage, p in zip(stages, ps, strict=True):
                h = stage(p, h, None)
            return jnp.sum(h**2)

        return jax.jit(jax.grad(loss)), (params, x)

    def piped(mode, where, chunks):
        def build():
            apply = pj.pipeline(
                make_stages(), chunks=chunks, checkpoint=mode, mesh=mesh if where == "mesh" else None
            )
            return jax.jit(jax.grad(lambda p, x: jnp.sum(apply(p, x) ** 2))), (place(where), x)

        return build

    def scanned(chunks):  # context: the same stages over the micro-batches in a plain lax.scan
        return lambda: (jax.jit(jax.grad(microbatched_loss(make_stages(), chunks))), (params, x))

    many = cfg["comp_many_chunks"]
    programs = {
        "composed (no pipeline)": composed,
        SCAN_NAME: scanned(chunks),
        f"{SCAN_NAME}, chunks={many}": scanned(many),
    }
    for where, mode in cfg["comp_configs"]:
        programs[compile_label(n, mode, where, chunks)] = piped(mode, where, chunks)
    for where, mode in cfg["comp_chunks_configs"]:  # flat in chunks: same batch, more micro-batches
        programs[compile_label(n, mode, where, many)] = piped(mode, where, many)
    return programs


SCAN_NAME = "micro-batched lax.scan (no pipeline)"


def compile_label(n, mode, where, chunks):
    return f"{mode}, mesh={f'{n} devices' if where == 'mesh' else 'None'}, chunks={chunks}"


def measure_programs(programs, reps):
    results: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, collections.Counter] = {}
    for _ in range(reps):
        for name, build in programs.items():
            compile_times(build, results, sizes, name)
    return results, sizes


def bench_compile(cfg) -> None:
    n, depth, batch, chunks, reps = cfg["comp"]
    many = cfg["comp_many_chunks"]
    section(f"4. Compile time: {n}-stage pipelines against the composed model")
    programs = hetero_programs(cfg)
    results, sizes = measure_programs(programs, reps)
    print(
        f"(a) Heterogeneous stages. Stage s: `tanh(x @ W_in + b)`, {depth} residual layers\n"
        "`h + tanh(h @ W)`, "
        f"`tanh(h @ W_out)`; widths alternate 64 / 128 (so the stage functions and activation shapes\n"
        f"differ), batch {batch}. Time of `jax.jit(jax.grad(loss))`: trace (`.trace`), lower, compile\n"
        f"(XLA), after `jax.clear_caches()` and with freshly made stage functions; median of {reps}\n"
        "interleaved repetitions. 'eqns' and 'tanh' count jaxpr equations of the traced jit(grad),\n"
        "recursively (the composed model has one tanh per layer forward; backward reuses them).\n"
        "'micro-batched lax.scan' runs the same stages over the micro-batches in a plain scan:\n"
        "context, without a target (what XLA costs for a loop over micro-batches at all).\n"
    )
    targets = {k: COMPILE_TARGET for k in programs if "no pipeline" not in k}
    compile_table(results, sizes, "composed (no pipeline)", "tanh", targets)
    # flat in chunks, at the benchmark's batch and at a batch whose micro-batches keep >= 8 rows
    big = cfg["comp_chunks_big_batch"]
    big_programs = hetero_programs(cfg, batch=big)
    keep = [SCAN_NAME, f"{SCAN_NAME}, chunks={many}"]
    keep += [
        compile_label(n, mode, where, c) for where, mode in cfg["comp_chunks_configs"] for c in (chunks, many)
    ]
    big_results, _ = measure_programs({k: big_programs[k] for k in keep}, reps)
    flat = []
    for b, res in ((batch, results), (big, big_results)):
        pairs = [(SCAN_NAME, f"{SCAN_NAME}, chunks={many}", "micro-batched lax.scan (no pipeline)")]
        pairs += [
            (
                compile_label(n, mode, where, chunks),
                compile_label(n, mode, where, many),
                f"{mode}, mesh={'yes' if where == 'mesh' else 'None'}",
            )
            for where, mode in cfg["comp_chunks_configs"]
        ]
        for few_name, many_name, label in pairs:
            few = np.median(res[few_name], axis=0).sum()
            ratio = np.median(res[many_name], axis=0).sum() / few
            is_target = "no pipeline" not in label
            verdict = ("met" if ratio <= CHUNKS_TARGET else "MISSED") if is_target else ""
            rows = f"{b // chunks} -> {max(b // many, 1)}"
            target = f"<= {CHUNKS_TARGET}" if is_target else ""
            flat.append([label, str(b), rows, f"{ratio:.2f}", target, verdict])
    print(
        f"\nFlat in chunks: total compile time at chunks={many} over chunks={chunks}, at the same batch.\n"
        "When micro-batches shrink to a row or two, XLA:CPU emits each matrix product with so few\n"
        "rows as its own LLVM kernel ('dot_elemental' in the breakdown below) instead of calling\n"
        "Eigen, and the plain scan grows as much as the pipeline; so the ratio is also measured at\n"
        f"batch {big}, where micro-batches keep {big // many} rows or more.\n"
    )
    print(table(["program", "batch", "rows per micro-batch", "ratio", "target", ""], flat, align="lrrrrl"))
    names = list(sizes)
    top = sorted(set().union(*sizes.values()), key=lambda k: -max(c[k] for c in sizes.values()))
    top = top[: cfg["comp_top_primitives"]]
    print(
        f"\nWhere the equations come from: the {len(top)} most frequent primitives of each traced\n"
        "jit(grad) (counts, recursively through sub-jaxprs).\n"
    )
    print(
        table(
            ["primitive", *names],
            [[k, *(sizes[nm][k] for nm in names)] for k in top]
            + [["all", *(sum(sizes[nm].values()) for nm in names)]],
            align="l" + "r" * len(names),
        )
    )
    xla_breakdown(cfg)
    bench_compile_homogeneous(cfg, stage_mesh(n))


# --- where XLA's compile time goes ---------------------------------------------------------------

_XLA_LOG = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "cpu_compiler=2,ir_compiler=2"}


def xla_probe(cfg, name: str) -> None:
    """Child process: compiles program ``name`` once (its XLA log goes to stderr)."""
    fn, args = hetero_programs(cfg)[name]()
    print(f"probe {name}: ", end="", flush=True)
    jax.block_until_ready(args)
    fn.lower(*args).compile()
    print("compiled", flush=True)


def _seconds(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def parse_xla_log(text: str) -> dict | None:
    """The largest XLA:CPU compilation in ``text`` (the program; parameter set-up compiles small
    ones): HLO pass time, LLVM kernels and their compile times, total codegen time."""
    import re

    blocks, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Running HLO passes on \[(\S+)\] for CPU time: ([\d.]+) (us|ms|s)\b", line)
        if m:
            cur = {"hlo": _seconds(m[2], m[3]), "kernels": 0, "llvm": 0.0, "kinds": collections.Counter()}
            continue
        m = re.search(r"Compiled LLVM module: (\S+) time: ([\d.]+) (us|ms|s)\b", line)
        if m and cur is not None:
            t = _seconds(m[2], m[3])
            kind = re.sub(r"__compute_module_|_kernel_module|\.\d+", "", m[1])
            cur["kernels"] += 1
            cur["llvm"] += t
            cur["kinds"][kind] += t
            continue
        m = re.search(r"Compiling \[(\S+)\] for CPU using JIT time: ([\d.]+) (us|ms|s)\b", line)
        if m and cur is not None:
            cur["total"] = _seconds(m[2], m[3])
            blocks.append(cur)
            cur = None
    return max(blocks, key=lambda b: b["total"]) if blocks else None


def xla_breakdown(cfg) -> None:
    """Where XLA's compile time goes, per program: HLO passes against LLVM code generation, which
    XLA:CPU does per fused kernel (one LLVM module each). Read from XLA's own timers (its VLOG
    output) in a child process per program."""
    import subprocess

    n, _, _, chunks, _ = cfg["comp"]
    many = cfg["comp_many_chunks"]
    names = ["composed (no pipeline)", SCAN_NAME, f"{SCAN_NAME}, chunks={many}"]
    names += [compile_label(n, mode, where, chunks) for where, mode in cfg["comp_configs"]]
    names += [compile_label(n, mode, where, many) for where, mode in cfg["comp_chunks_configs"]]
    names = names[: cfg["comp_xla_programs"]]
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--xla-probe", name] + (["--quick"] if cfg is QUICK else [])
        env = {**os.environ, **_XLA_LOG}
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        info = parse_xla_log(run.stderr) if run.returncode == 0 else None
        if info is None:
            rows.append([name, "n/a", "", "", "", "(no XLA timing log: " + f"exit {run.returncode})"])
            continue
        top = ", ".join(f"{k} {v:.2f}" for k, v in info["kinds"].most_common(3))
        times = [f"{info[k]:.2f}" for k in ("hlo", "kernels", "llvm", "total")]
        times[1] = str(info["kernels"])
        rows.append([name, *times, top])
    print(
        "\nWhere XLA's time goes (one compile per program, in a child process, from XLA:CPU's own\n"
        "timers): 'HLO passes' is the optimisation pipeline; XLA:CPU then generates one LLVM module\n"
        "per fused kernel and compiles each ('LLVM s' sums their times, which may overlap on\n"
        "several threads; 'codegen s' is the wall time of that phase). Compile time follows the\n"
        "kernel count; the heaviest kernel kinds are listed with their LLVM seconds.\n"
    )
    print(
        table(
            ["program", "HLO passes s", "kernels", "LLVM s", "codegen s", "heaviest kernel kinds (s)"],
            rows,
            align="lrrrrl",
        )
    )


def bench_compile_homogeneous(cfg, mesh) -> None:
    n, per_stage, width, batch, chunks, reps = cfg["comp_homo"]

    def make_stage():
        def stage(p, h, key):
            for j in range(per_stage):
                h = h + jnp.tanh(h @ p["w"][j])
            return h

        return stage

    stacked = {"w": normal((n, per_stage, width, width), 7, 1 / np.sqrt(width))}
    x = jnp.ones((batch, width), jnp.float32)

    def composed():
        stage = make_stage()

        def loss(p, x):
            h = x
            for s in range(n):
                h = stage(jax.tree.map(lambda a, s=s: a[s], p), h, None)
            return jnp.sum(h**2)

        return jax.jit(jax.grad(loss)), (stacked, x)

    def scanned():
        stage = make_stage()

        def loss(p, x):
            return jnp.sum(jax.lax.scan(lambda h, ps: (stage(ps, h, None), None), x, p)[0] ** 2)

        return jax.jit(jax.grad(loss)), (stacked, x)

    def piped(mode, where):
        def build():
            apply = pj.pipeline(
                make_stage(),
                num_stages=n,
                chunks=chunks,
                checkpoint=mode,
                mesh=mesh if where == "mesh" else None,
            )
            return jax.jit(jax.grad(lambda p, x: jnp.sum(apply(p, x) ** 2))), (apply.place(stacked), x)

        return build

    configs = {"composed (no pipeline)": composed, "lax.scan over the stages": scanned}
    for where, mode in cfg["comp_homo_configs"]:
        configs[f"{mode}, mesh={f'{n} devices' if where == 'mesh' else 'None'}"] = piped(mode, where)
    results: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, collections.Counter] = {}
    for _ in range(reps):
        for name, build in configs.items():
            compile_times(build, results, sizes, name)
    print(
        f"\n(b) A homogeneous stack of {n * per_stage} layers `h + tanh(h @ W)` (width {width}): {n} stages\n"
        f"of {per_stage} layers, batch {batch}, chunks={chunks}. 'composed' applies the stage {n} times in\n"
        "Python (as a "
        "model is usually written); 'lax.scan over the stages' is the scan-over-layers idiom, shown for\n"
        "context without a target.\n"
    )
    targets = {
        k: HOMO_TARGET for k in configs if k not in ("composed (no pipeline)", "lax.scan over the stages")
    }
    compile_table(results, sizes, "composed (no pipeline)", "tanh", targets)


# --- 6. where the input lives -----------------------------------------------------------------------


def bench_inputs(cfg) -> None:
    n, width, batch, chunks = cfg["inputs"]
    section(f"6. Inputs: argument and temp bytes per device, {n}-stage mesh")
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = stage_mesh(n)

    def stage(p, x, key):
        return jnp.tanh(x @ p)

    apply = pj.pipeline(stage, num_stages=n, chunks=chunks, mesh=mesh)
    w = apply.place(normal((n, width, width), 5, 1 / np.sqrt(width)))
    x = normal((batch, width), 6)
    rows = []
    for name, spec in [
        ("replicated", PartitionSpec()),
        ("split over the stage axis", PartitionSpec("stage")),
    ]:
        xi = jax.device_put(x, NamedSharding(mesh, spec))
        grad = jax.jit(jax.grad(lambda w, x: jnp.sum(apply(w, x) ** 2), argnums=(0, 1)))
        mem = grad.lower(w, xi).compile().memory_analysis()
        rows.append([name, kib(nbytes(x)), kib(mem.argument_size_in_bytes), kib(mem.temp_size_in_bytes)])
    print(
        f"Homogeneous stage `tanh(x @ W)`, width {width}, batch {batch}, chunks={chunks}; compiled\n"
        "`jit(grad)` per device. The pipeline spreads the micro-batches over the stage axis and streams\n"
        "micro-batch t to stage 0 by tick t (one ppermute of one micro-batch per tick), so no device\n"
        "holds the whole batch inside the program; a batch passed in split over the stage axis also\n"
        "takes n times fewer argument bytes.\n"
    )
    print(table(["x passed", "x KiB (whole)", "argument KiB", "temp KiB"], rows, align="lrrr"))


# --- 5. mesh=None against a micro-batched scan ---------------------------------------------------


def bench_local(cfg) -> None:
    n, width, batch, chunks, rounds = cfg["local"]
    section(f"5. mesh=None: {n} heterogeneous stages against the same stages in a micro-batched lax.scan")
    widths = [width if s % 2 == 0 else 2 * width for s in range(n + 1)]

    def one(s):
        def stage(p, x, key):
            return jnp.tanh(jnp.tanh(x @ p["w_in"]) @ p["w_out"])

        return stage

    stages = [one(s) for s in range(n)]
    params = [
        {
            "w_in": normal((widths[s], 2 * widths[s + 1]), s, 1 / np.sqrt(widths[s])),
            "w_out": normal((2 * widths[s + 1], widths[s + 1]), 10 + s, 1 / np.sqrt(2 * widths[s + 1])),
        }
        for s in range(n)
    ]
    x = normal((batch, widths[0]), 99)

    def composed(ps, x):
        for stage, p in zip(stages, ps, strict=True):
            x = stage(p, x, None)
        return jnp.sum(x**2)

    variants = {
        "composed (whole batch)": composed,
        "micro-batched lax.scan": microbatched_loss(stages, chunks),
    }
    for mode in MODES:
        apply = pj.pipeline(stages, chunks=chunks, checkpoint=mode, mesh=None)
        variants[mode] = lambda p, x, apply=apply: jnp.sum(apply(p, x) ** 2)
    fns = {k: jax.jit(jax.grad(v)).lower(params, x).compile() for k, v in variants.items()}
    ref = fns["composed (whole batch)"](params, x)
    for f in fns.values():
        for a, r in zip(jax.tree.leaves(f(params, x)), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(r), rtol=2e-3, atol=1e-4 * float(np.abs(r).max())
            )
    times = interleaved_times(fns, (params, x), rounds)
    scan_t = times["micro-batched lax.scan"]
    print(
        f"Stage s: `tanh(tanh(x @ W_in) @ W_out)`, widths alternating {width} / {2 * width}, batch {batch},\n"
        f"chunks={chunks}; `jit(grad(loss))` run time, {rounds} interleaved rounds. 'ratio' is the\n"
        "median of "
        "per-round ratios to the micro-batched scan (IQR beside it).\n"
    )
    rows = []
    for k, t in times.items():
        med, q1, q3 = ratio_stats(t, scan_t)
        target = LOCAL_TARGETS.get(k)
        verdict = "" if target is None else ("met" if med <= target else "MISSED")
        rows.append(
            [
                k,
                f"{np.median(t) * 1e3:.2f}",
                f"{med:.3f}",
                f"{q1:.3f}-{q3:.3f}",
                "" if target is None else f"<= {target}",
                verdict,
            ]
        )
    print(table(["variant", "median ms", "ratio", "IQR", "target", ""], rows, align="lrrrrl"))


# --- driver --------------------------------------------------------------------------------------

FULL = {
    "bubble_n": (1, 2, 4),
    "bubble_m": (1, 4, 8, 16),
    "circ_cases": tuple((n, v, m) for n in (2, 4) for v in (2, 4) for m in (4, 8, 16)),
    "mem_dims": (64, 256, 4, 256),  # input width, hidden width, layers, micro-batch size
    "mem_n": (1, 2, 4),
    "mem_m": (1, 4, 8, 16),
    "mem_modes": MODES,
    "slope_from": 4,
    "mem_diagnostics": (
        ("always", 1, 4),
        ("always", 2, 4),
        ("always", 3, 4),
        ("always", 4, 4),
        ("always", 4, 8),
        ("never", 2, 4),
        ("never", 3, 4),
        ("except_last", 2, 2),
        ("except_last", 2, 3),
        ("except_last", 2, 4),
    ),
    "param_n": 4,
    "ovh_dims": (512, 4, 256),  # width, layers, batch
    "ovh_rounds": 60,
    "ovh_context_chunks": (2,),
    "comp": (8, 4, 64, 8, 3),  # stages, residual layers per stage, batch, chunks, repetitions
    "comp_configs": tuple((where, mode) for where in ("mesh", "none") for mode in MODES),
    "comp_many_chunks": 64,
    "comp_chunks_configs": (("mesh", "always"), ("none", "always")),
    "comp_chunks_big_batch": 512,
    "comp_xla_programs": 99,  # programs in the XLA breakdown (all)
    "comp_homo": (8, 4, 128, 64, 8, 3),  # stages, layers per stage, width, batch, chunks, repetitions
    "comp_homo_configs": tuple(
        (where, mode) for where in ("mesh", "none") for mode in ("always", "except_last")
    ),
    "local": (4, 256, 256, 4, 30),  # stages, width, batch, chunks, rounds
    "inputs": (4, 256, 512, 8),  # stages, width, batch, chunks
    "comp_top_primitives": 16,
}
QUICK = {
    "bubble_n": (2,),
    "bubble_m": (3,),
    "circ_cases": ((2, 2, 3),),
    "mem_dims": (16, 64, 3, 32),
    "mem_n": (2,),
    "mem_m": (3, 4),
    "mem_modes": ("always", "never"),
    "slope_from": 2,
    "mem_diagnostics": (),
    "param_n": 2,
    "ovh_dims": (128, 2, 64),
    "ovh_rounds": 5,
    "ovh_context_chunks": (),
    "comp": (2, 0, 16, 2, 1),
    "comp_configs": (("mesh", "always"),),
    "comp_many_chunks": 4,
    "comp_chunks_configs": (("mesh", "always"),),
    "comp_chunks_big_batch": 32,
    "comp_xla_programs": 1,  # one child process: the smoke run proves the probe and its parser
    "comp_homo": (2, 2, 16, 8, 2, 1),
    "comp_homo_configs": (("none", "always"),),
    "local": (2, 16, 8, 2, 3),
    "inputs": (2, 16, 8, 2),
    "comp_top_primitives": 6,
}
SECTIONS = {
    "bubble": bench_bubble,
    "memory": bench_memory,
    "overhead": bench_overhead,
    "compile": bench_compile,
    "local": bench_local,
    "inputs": bench_inputs,
}


def header(quick: bool) -> None:
    print_header("pipejax pipeline benchmarks", quick)
    print("(The devices are simulated CPU devices.)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test (< 60 s)")
    parser.add_argument("--section", action="append", choices=list(SECTIONS), help="run only these sections")
    parser.add_argument("--xla-probe", metavar="PROGRAM", help=argparse.SUPPRESS)  # see xla_breakdown
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.xla_probe:
        xla_probe(cfg, args.xla_probe)
        return
    header(args.quick)
    start = time.perf_counter()
    for name in args.section or list(SECTIONS):
        t0 = time.perf_counter()
        SECTIONS[name](cfg)
        print(f"\n({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"\nTotal {time.perf_counter() - start:.1f} s.")


if __name__ == "__main__":
    main()
