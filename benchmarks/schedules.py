"""Training schedules: memory against micro-batches, executed slots, compile time, predicted step time.

Run from the repository root::

    .venv/bin/python benchmarks/schedules.py            # all sections (a few minutes on 2 cores)
    .venv/bin/python benchmarks/schedules.py --quick    # smoke run

Sections (markdown tables):

1. ``memory``: compiled temp bytes of one training step (``value_and_grad``) of a 4-stage
   pipeline on 4 fake CPU devices against the number of micro-batches ``m``, for GPipe (each
   checkpoint mode; ``jax.value_and_grad`` of the forward pipeline) and for "1f1b" and "zb-h1"
   (the program that owns the backward pass; "always" recomputes the stage in B and W, "never"
   keeps F's residuals, "dots" -- ``jax.checkpoint_policies.dots_saveable`` -- keeps what that
   policy saves). The SPMD program is one device's program, so the bytes are per device.
   ``sharded``: the same with ``param_specs`` (tensor-parallel stages on a (stage, model) mesh).
   ``local``: the same without a mesh, with compile times (the training schedules are gradient
   accumulation on one device).
   ``v_shape``: V-Half and ZB-V (2 stages per device in a V) against 1F1B, ZB-H1 and
   interleaved 1F1B on the same model (each device's share of 4 layers cut into 1 or 2
   stages), activations larger than parameters: temp bytes per device against ``m`` and their
   ratio to 1F1B's. ``v_blocks``: the same comparison on residual MLP blocks (4x hidden), whose
   residuals outweigh their input as a transformer block's do.
   ``head``: a last stage with a wide head and its loss: its residuals kept apart from the
   stash (as the engine does where that pays) against one container for every stage.
2. ``slots``: the F/B/W slots each device executed, counted inside the program, against the
   table, and the table's lockstep bubble against the theory.
3. ``compile``: compile time of one training step against GPipe's (checkpoint "always", the
   same recomputation). Noisy on a shared machine: medians of interleaved rounds.
4. ``stash_write``: decision 0035's A/B, the stash write as a dropped-index scatter against the
   select it replaced, in one process (temp bytes, compile seconds, step time, bitwise equality).
   ``stash_pool``: decision 0036's, interleaved 1F1B's stash as one pool per device against a
   ring per stage, likewise.
   ``estimate``: :func:`pipejax.memory_estimate` against XLA's temp bytes for every training
   schedule (the pooled tables included), on three models. ``stages_not_alike``: GPipe and
   circular on stages given as a list, every checkpoint mode, the estimate beside.
5. ``predicted``: step time on ``n`` devices predicted from F, B and W costs measured on this
   CPU: GPipe with ``benchmarks/_simulate.py`` (lockstep), 1F1B and ZB-H1 from their tables
   (:meth:`pipejax.Schedule.step_time`, lockstep: a tick lasts as long as its busiest device).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

N = 4  # stages = fake devices
if __name__ == "__main__":
    import os

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N}"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pipejax as pj  # noqa: E402
from benchmarks import _simulate as sim  # noqa: E402
from benchmarks._common import (  # noqa: E402
    header,
    interleaved_times,
    kib,
    normal,
    ratio_stats,
    section,
    table,
    temp_bytes,
)
from pipejax._src.schedules import tables as sched  # noqa: E402
from pipejax._src.training import step as train  # noqa: E402

WIDTH, LAYERS, MICRO = 128, 3, 16  # a stage: LAYERS tanh dense layers; rows per micro-batch


def stage(p, x, key):
    for j in range(LAYERS):
        x = jnp.tanh(x @ p["w"][j] + p["b"][j])
    return x


def sq(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


POLICIES = {"dots": jax.checkpoint_policies.dots_saveable}  # named policies of the tables


def setup(m, name, checkpoint="always", repeats=1, on_mesh=True):
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,)) if on_mesh else None
    S = N * repeats  # interleaved: `repeats` stages per device
    mode = POLICIES.get(checkpoint, checkpoint)
    pipe = pj.pipeline(
        stage, num_stages=S, chunks=m, schedule=name, checkpoint=mode, mesh=mesh, repeats=repeats
    )
    params = {
        "w": normal((S, LAYERS, WIDTH, WIDTH), 0, WIDTH**-0.5),
        "b": normal((S, LAYERS, WIDTH), 1, 0.1),
    }
    x, t = normal((m * MICRO, WIDTH), 2), normal((m * MICRO, WIDTH), 3)
    return pipe, pipe.value_and_grad(sq), (params, x, t)


VARIANTS = [
    ("gpipe", "never"),
    ("gpipe", "except_last"),
    ("gpipe", "always"),
    ("1f1b", "always"),
    ("1f1b", "dots"),
    ("1f1b", "never"),
    ("zb-h1", "always"),
    ("zb-h1", "dots"),
    ("zb-h1", "never"),
]


def memory(quick: bool) -> None:
    section("Memory: compiled temp bytes per device of one training step against m")
    ms = (8,) if quick else (4, 8, 16, 32, 64)
    # --quick: a smoke run, each schedule once (the other sections compile the other modes)
    variants = [("gpipe", "always"), ("1f1b", "dots"), ("zb-h1", "never")] if quick else VARIANTS
    rows, got = [], {}
    for name, ckpt in variants:
        row = [f"{name} {ckpt}"]
        for m in ms:
            _, f, args = setup(m, name, ckpt)
            got[(name, ckpt, m)] = temp_bytes(f, *args)
            row.append(kib(got[(name, ckpt, m)]))
        hi = ms[-1]
        row.append(f"{got[(name, ckpt, hi)] / got[(name, ckpt, 8)]:.2f}x")
        rows.append(row)
    act = MICRO * WIDTH * 4
    print(
        f"{N} homogeneous stages of {LAYERS} tanh dense layers ({WIDTH} wide, float32) on {N} fake CPU "
        f"devices, micro-batches of {MICRO} rows (one activation: {kib(act)} KiB). KiB per device."
    )
    print()
    print(
        table(
            ["schedule", *(f"m={m}" for m in ms), f"m={ms[-1]} / m=8"], rows, align="l" + "r" * (len(ms) + 1)
        )
    )


V_WIDTH, V_MICRO, V_LAYERS = 64, 512, 4  # activations (128 KiB) well above a layer's parameters


def v_stage(layers):
    def stage(p, x, key):
        for j in range(layers):
            x = jnp.tanh(x @ p["w"][j] + p["b"][j])
        return x

    return stage


V_HIDDEN = 4 * V_WIDTH  # the residual MLP blocks' hidden width


def v_block_stage(layers):
    """``layers`` residual MLP blocks, ``x + tanh(x W1) W2`` (``V_WIDTH -> V_HIDDEN -> V_WIDTH``):
    a block keeps more than its input (the hidden activations), as a transformer block does."""

    def stage(p, x, key):
        for j in range(layers):
            x = x + jnp.tanh(x @ p["w1"][j]) @ p["w2"][j]
        return x

    return stage


def v_problem(name, v, m, ckpt, mesh, overlap=False, blocks=False, micro=V_MICRO):
    """The V section's model as ``v`` stages a device (``V_LAYERS // v`` layers each; ``blocks``:
    residual MLP blocks instead of tanh layers), on micro-batches of ``micro`` rows: its pipeline
    under schedule ``name`` and its ``(params, x, t)``."""
    S, per = N * v, V_LAYERS // v
    pipe = pj.pipeline(
        (v_block_stage if blocks else v_stage)(per), num_stages=S, chunks=m, schedule=name, repeats=v,
        mesh=mesh, checkpoint=ckpt, overlap=overlap,
    )  # fmt: skip
    if blocks:
        w1 = normal((S, per, V_WIDTH, V_HIDDEN), 0, V_WIDTH**-0.5)
        params = {"w1": w1, "w2": normal((S, per, V_HIDDEN, V_WIDTH), 1, V_HIDDEN**-0.5)}
    else:
        w, b = normal((S, per, V_WIDTH, V_WIDTH), 0, V_WIDTH**-0.5), normal((S, per, V_WIDTH), 1, 0.1)
        params = {"w": w, "b": b}
    return pipe, (params, normal((m * micro, V_WIDTH), 2), normal((m * micro, V_WIDTH), 3))


def estimate(quick: bool) -> None:
    """``pj.memory_estimate`` against XLA's temp bytes, for every training schedule, on the V
    sections' models and on residual blocks whose parameters outweigh the micro-batch."""
    section("pj.memory_estimate against XLA's temp bytes per device, every training schedule")
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    m = 8
    runs = (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2))
    models = [("tanh layers", False, V_MICRO), ("residual blocks", True, V_MICRO)]
    models.append(("residual blocks", True, 16))
    if quick:
        runs, models = runs[3:4], models[2:]
    rows, ratios = [], []
    for label, blocks, micro in models:
        for ckpt in ("always",) if quick else ("always", "never"):
            for name, v in runs:
                pipe, (params, x, t) = v_problem(name, v, m, ckpt, mesh, blocks=blocks, micro=micro)
                params = pipe.place(params)  # as the estimate assumes (unplaced: a copy of them all)
                est = pj.memory_estimate(pipe, params, x)
                got = temp_bytes(pipe.value_and_grad(sq), params, x, t)
                ratios.append(est.total / got)
                terms = (est.stash, est.work, est.params)
                rows.append([f"{label}, {micro} rows", f"{name} {ckpt}", kib(got), kib(est.total),
                             f"{est.total / got:.3f}", *(kib(b) for b in terms)])  # fmt: skip
    print(
        f"{N} devices, each holding {V_LAYERS} tanh layers or residual MLP blocks ({V_WIDTH} -> "
        f"{V_HIDDEN} -> {V_WIDTH}, float32) as one stage (1f1b, zb-h1) or two (interleaved v=2, "
        f"v-half, zb-v); m = {m} micro-batches of 512 rows (activations outweigh a stage's "
        "parameters) or 16 (the parameters outweigh them). KiB per device; the estimate's stash, "
        "work and parameter terms beside its total."
    )
    print()
    heads = ["model", "schedule", "XLA", "estimate", "estimate / XLA", "stash", "work", "params"]
    print(table(heads, rows, align="llrrrrrr"))
    print()
    print(f"estimate / XLA: {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} programs.")


def v_blocks(quick: bool) -> None:
    """The V section's comparison on residual MLP blocks, whose residuals outweigh their input."""
    section("V-Half and ZB-V against 1F1B on residual MLP blocks: temp bytes per device against m")
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    ms = (8,) if quick else (8, 16, 32)
    plain = (("1f1b", 1), ("v-half", 2)) if quick else (("1f1b", 1), ("zb-h1", 1), ("v-half", 2), ("zb-v", 2))
    got, rows = {}, []
    for ckpt in ("never",) if quick else ("always", "never"):
        for name, v in plain:
            for m in ms:
                pipe, args = v_problem(name, v, m, ckpt, mesh, blocks=True)
                got[(name, ckpt, m)] = temp_bytes(pipe.value_and_grad(sq), *args)
            row = [f"{name} {ckpt}", *(kib(got[(name, ckpt, m)]) for m in ms)]
            row += [f"{got[(name, ckpt, m)] / got[('1f1b', ckpt, m)]:.3f}" for m in ms]
            rows.append([*row, f"{got[(name, ckpt, ms[-1])] / got[(name, ckpt, 8)]:.2f}x"])
    print(
        f"{N} devices, each holding {V_LAYERS} residual MLP blocks x + tanh(x W1) W2 ({V_WIDTH} -> "
        f"{V_HIDDEN} -> {V_WIDTH}, float32) as one stage (1f1b, zb-h1) or two (v-half, zb-v); "
        f"micro-batches of {V_MICRO} rows. KiB per device; '/ 1f1b': against 1F1B with the same "
        "checkpoint mode."
    )
    print()
    heads = ["schedule", *(f"m={m}" for m in ms), *(f"/ 1f1b m={m}" for m in ms), f"m={ms[-1]} / m=8"]
    print(table(heads, rows, align="l" + "r" * (2 * len(ms) + 1)))


def v_shape(quick: bool) -> None:
    """V-Half against 1F1B and interleaved 1F1B on one model: each device's share is ``V_LAYERS``
    layers, one stage of them (1F1B) or two of half of them (interleaved, V-Half)."""
    section("V-Half and ZB-V against 1F1B on the same model: temp bytes per device against m")
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    ms = (8,) if quick else (8, 16, 32)
    got, rows = {}, []
    plain = (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2))
    runs = [(name, v, False) for name, v in plain if not quick or name in ("1f1b", "v-half", "zb-v")]
    if not quick:  # ZB-H1 at one step's floor (2n - 2 W cotangents); sends that overlap compute:
        # a deeper stash (V: a larger pool)
        runs += [("zb-floor", 1, False), ("1f1b", 1, True), ("v-half", 2, True), ("zb-v", 2, True)]
    for ckpt in ("never",) if quick else ("always", "never"):  # --quick: the V's and 1F1B, once
        for name, v, overlap in runs:
            row = [f"{name} {ckpt}{', overlap' if overlap else ''}"]
            for m in ms:
                pipe, args = v_problem(name, v, m, ckpt, mesh, overlap)
                key = (name, ckpt, m, overlap)
                got[key] = temp_bytes(pipe.value_and_grad(sq), *args)
                row.append(kib(got[key]))
            row += [f"{got[(name, ckpt, m, overlap)] / got[('1f1b', ckpt, m, False)]:.3f}" for m in ms]
            row.append(f"{got[(name, ckpt, ms[-1], overlap)] / got[(name, ckpt, 8, overlap)]:.2f}x")
            rows.append(row)
    print(
        f"{N} devices, each holding {V_LAYERS} tanh dense layers ({V_WIDTH} wide, float32) as one "
        f"stage (1f1b, zb-h1, zb-floor) or two (interleaved v=2, v-half, zb-v); micro-batches of "
        f"{V_MICRO} rows (one activation: {kib(V_MICRO * V_WIDTH * 4)} KiB). KiB per device; '/ 1f1b': "
        "against 1F1B with the same checkpoint mode (without overlap; 'overlap': `overlap=True`, sends "
        "that overlap compute)."
    )
    print()
    heads = ["schedule", *(f"m={m}" for m in ms), *(f"/ 1f1b m={m}" for m in ms), f"m={ms[-1]} / m=8"]
    print(table(heads, rows, align="l" + "r" * (2 * len(ms) + 1)))


HEAD_VOCAB, HEAD_MICRO = 2048, 128  # a head whose logits (1 MiB a micro-batch) outweigh a block's


def head(quick: bool) -> None:
    """The last stage's residuals kept apart from the stash (``slots._MeshSlots.on_device``),
    against the one container for every stage that the engine keeps where that does not pay
    (forced here with ``_MeshSlots.keep_last_apart = False``), on a model whose last
    stage carries a wide head and its cross-entropy: temp bytes, compile and step time, in one
    process (step times: medians of per-round ratios of interleaved rounds)."""
    from benchmarks._common import ratio_stats
    from pipejax._src.training.slots import _MeshSlots

    section("A wide head's residuals out of the stash: apart against one container (never, dots)")
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    m, rounds = (4, 3) if quick else (8, 15)

    def xent(y, t):
        return -jnp.take_along_axis(jax.nn.log_softmax(y), t[:, None], axis=-1)[:, 0]

    def build(name, ckpt, v):
        S, per = N * v, V_LAYERS // v
        body = v_stage(per)
        stages = [body] * (S - 1) + [lambda p, x, key: body(p, x, key) @ p["h"]]
        params = [
            {"w": normal((per, V_WIDTH, V_WIDTH), s, V_WIDTH**-0.5), "b": normal((per, V_WIDTH), 50 + s, 0.1)}
            for s in range(S)
        ]
        params[-1]["h"] = normal((V_WIDTH, HEAD_VOCAB), 99, V_WIDTH**-0.5)
        x = normal((m * HEAD_MICRO, V_WIDTH), 2)
        t = jnp.asarray(np.random.default_rng(3).integers(0, HEAD_VOCAB, m * HEAD_MICRO), jnp.int32)
        pipe = pj.pipeline(
            stages, chunks=m, schedule=name, repeats=v, mesh=mesh, checkpoint=POLICIES.get(ckpt, ckpt)
        )
        t0 = time.perf_counter()
        compiled = jax.jit(pipe.value_and_grad(xent)).lower(params, x, t).compile()
        return compiled, time.perf_counter() - t0, (params, x, t)

    rows = []
    names = (
        [("1f1b", 1)]
        if quick
        else [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2)]
    )
    for name, v in names:
        for ckpt in ("never",) if quick else ("never", "dots"):
            apart, c_apart, args = build(name, ckpt, v)
            _MeshSlots.keep_last_apart = False
            try:
                together, c_together, _ = build(name, ckpt, v)
            finally:
                _MeshSlots.keep_last_apart = True
            temps = [c.memory_analysis().temp_size_in_bytes for c in (together, apart)]
            times = interleaved_times({"together": together, "apart": apart}, args, rounds)
            med, q1, q3 = ratio_stats(times["apart"], times["together"])
            rows.append(
                [
                    f"{name} {ckpt}",
                    *(kib(t) for t in temps),
                    f"{temps[1] / temps[0]:.3f}",
                    f"{c_together:.2f}",
                    f"{c_apart:.2f}",
                    f"{np.median(times['together']) * 1e3:.1f}",
                    f"{med:.2f}x ({q1:.2f}-{q3:.2f})",
                ]
            )
    print(
        f"{N} devices; {V_LAYERS} tanh dense layers ({V_WIDTH} wide) per device as 1 stage "
        f"(1f1b, zb-h1) or 2 (interleaved v=2, v-half); the last stage adds a {HEAD_VOCAB}-wide "
        f"head and a cross-entropy; m={m} micro-batches of {HEAD_MICRO} rows. Temp KiB per "
        "device; compile: trace + lower + compile, seconds; step: median ms of the "
        "one-container program, and the per-round ratio apart / together (quartiles). The ZB "
        "tables defer the last stage's W: its inputs wait in a ring of n slots of their own."
    )
    print()
    heads = ["schedule", "together KiB", "apart KiB", "apart / together", "compile together s"]
    heads += ["compile apart s", "step together ms", "step apart / together"]
    print(table(heads, rows, align="l" + "r" * 7))


def local(quick: bool) -> None:
    """The same steps without a mesh: one device, where the training schedules are gradient
    accumulation (F and B of micro-batch ``i`` before ``i + 1``) and GPipe is
    ``jax.value_and_grad`` of the micro-batched scan."""
    section("Without a mesh: temp bytes and compile time of one training step against m")
    ms = (8,) if quick else (8, 64)
    variants = [("gpipe", "always"), ("1f1b", "always"), ("1f1b", "never")] if quick else VARIANTS
    rows, got = [], {}
    for name, ckpt in variants:
        row = [f"{name} {ckpt}"]
        for m in ms:
            _, f, args = setup(m, name, ckpt, on_mesh=False)
            t0 = time.perf_counter()
            compiled = jax.jit(f).lower(*args).compile()
            seconds = time.perf_counter() - t0
            got[m] = compiled.memory_analysis().temp_size_in_bytes
            row += [kib(got[m]), f"{seconds:.2f}"]
        row.append(f"{got[ms[-1]] / got[8]:.2f}x")
        rows.append(row)
    print(f"The memory section's {N} stages on one device. KiB; compile: trace + lower + compile, seconds.")
    print()
    heads = [h for m in ms for h in (f"m={m} KiB", f"m={m} compile s")]
    print(table(["schedule", *heads, f"m={ms[-1]} / m=8"], rows, align="l" + "r" * (2 * len(ms) + 1)))


def sharded_memory(quick: bool) -> None:
    """1F1B and ZB-H1 with ``param_specs``: tensor-parallel stages on a (stage, model) mesh."""
    section("Memory with param_specs: tensor-parallel stages (2 stages x 2 model shards)")
    ms = (8,) if quick else (8, 16, 64)
    mesh = jax.make_mesh((2, 2), ("stage", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    P = jax.sharding.PartitionSpec
    specs = {"w": P(None, None, "model"), "b": P(None, "model")}  # every layer column-split

    def split_stage(p, x, key):
        for j in range(LAYERS):
            x = jnp.tanh(x @ p["w"][j] + p["b"][j])  # XLA gathers the columns the next layer reads
        return x

    rows = []
    for name in ("gpipe", "1f1b", "zb-h1"):
        row, got = [name], {}
        for m in ms:
            pipe = pj.pipeline(
                split_stage,
                num_stages=2,
                chunks=m,
                schedule=name,
                checkpoint="always",
                mesh=mesh,
                param_specs=specs,
            )
            params = pipe.place(
                {
                    "w": normal((2, LAYERS, WIDTH, WIDTH), 0, WIDTH**-0.5),
                    "b": normal((2, LAYERS, WIDTH), 1, 0.1),
                }
            )
            x, t = normal((m * MICRO, WIDTH), 2), normal((m * MICRO, WIDTH), 3)
            got[m] = temp_bytes(pipe.value_and_grad(sq), params, x, t)
            row.append(kib(got[m]))
        row.append(f"{got[ms[-1]] / got[8]:.2f}x")
        rows.append(row)
    print("checkpoint='always'; KiB per device.")
    print()
    print(
        table(
            ["schedule", *(f"m={m}" for m in ms), f"m={ms[-1]} / m=8"], rows, align="l" + "r" * (len(ms) + 1)
        )
    )


def slots(quick: bool) -> None:
    section("Slots: executed F/B/W per device (counted in the program) against the table")
    rows = []
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2)):
        for m in (4, 8) if quick else (4, 8, 16):
            pipe, _, args = setup(m, name, repeats=v)
            counts = train.slot_counts(pipe, sq, *args)
            table_ = sched.training(name, N * v, m, v)
            s = table_.slots()
            expect = np.stack([s["F"], s["B"], s.get("W", np.zeros(N, int))], axis=1)
            f, b, w = 1.0, 1.0, 1.0  # equal costs: ZB's B and W are each half of 1F1B's B
            if name == "zb-h1":
                bubble, theory = table_.bubble_fraction(f, b, w), sched.zb_h1_bubble_fraction(N, m, f, b, w)
            elif name == "zb-v":  # stages of half the cost: ZB-H1's bubble
                bubble = table_.bubble_fraction(f / v, b / v, w / v)
                theory = sched.zb_h1_bubble_fraction(N, m, f, b, w)
            else:  # a stage of the interleaved schedule (and of the V) is 1/v of a device's share
                bubble = table_.bubble_fraction(f / v, (b + w) / v)
                theory = (
                    sched.v_half_bubble_fraction(N, m)
                    if name == "v-half"
                    else sched.circular_bubble_fraction(N, m, v)
                )
            rows.append(
                [
                    name if v == 1 else f"{name} v={v}",
                    m,
                    " ".join("/".join(str(int(c)) for c in row) for row in counts),
                    bool((counts == expect).all()),
                    table_.num_ticks,
                    table_.stash_pool()[0] if table_.pooled else table_.stash_slots(),
                    f"{bubble:.4f}",
                    f"{theory:.4f}",
                ]
            )
    print(
        "F/B/W per device 0..3; bubble: the table's lockstep idle fraction with costs F = 1, "
        "B = 2 (1f1b) or B = W = 1 (zb-h1), per device's share of the model; theory: "
        "(n-1)/(v m+n-1) for 1f1b (v = 1: GPipe's) and interleaved, "
        "(n-1)(F+B)/((m+n-1)(F+B)+mW) for zb-h1 and zb-v, (n-1)/(m+n-1) for v-half. stash: "
        "slots per stage held (interleaved, v-half, zb-v: one pool per device for both its stages)."
    )
    print()
    print(
        table(
            ["schedule", "m", "F/B/W", "= table", "ticks", "stash", "bubble", "theory"],
            rows,
            align="lrlrrrrr",
        )
    )


def compile_time(quick: bool) -> None:
    section("Compile time of one training step against GPipe (checkpoint='always')")
    rounds = 1 if quick else 3
    rows = []
    for m in (8,) if quick else (8, 32):
        times = {name: [] for name in ("gpipe", "1f1b", "zb-h1")}
        for _ in range(rounds):
            for name in times:
                _, f, args = setup(m, name)
                t0 = time.perf_counter()
                jax.jit(f).lower(*args).compile()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["gpipe"])
        for name, ts in times.items():
            rows.append([m, name, f"{statistics.median(ts):.2f}", f"{statistics.median(ts) / base:.2f}x"])
    print(f"Medians of {rounds} interleaved compiles each (trace + lower + compile); shared, noisy machine.")
    print()
    print(table(["m", "schedule", "seconds", "/ gpipe"], rows, align="rlrr"))


def predicted(quick: bool) -> None:
    section("Predicted step time on n devices from measured F, B, W costs (lockstep)")
    p = {"w": normal((LAYERS, WIDTH, WIDTH), 0, WIDTH**-0.5), "b": normal((LAYERS, WIDTH), 1, 0.1)}
    x = normal((64, WIDTH), 2)
    g = normal((64, WIDTH), 3)
    fwd = jax.jit(lambda p, x: stage(p, x, None))
    full = jax.jit(lambda p, x, g: jax.vjp(lambda p, x: stage(p, x, None), p, x)[1](g))
    dx = jax.jit(lambda p, x, g: jax.vjp(lambda x: stage(p, x, None), x)[1](g))
    dp = jax.jit(lambda p, x, g: jax.vjp(lambda p: stage(p, x, None), p)[1](g))
    t = interleaved_times(
        {
            "f": lambda: fwd(p, x),
            "fb": lambda: full(p, x, g),
            "fbx": lambda: dx(p, x, g),
            "fbw": lambda: dp(p, x, g),
        },
        (),
        rounds=20 if quick else 200,
    )
    f, fb, fbx, fbw = (float(np.median(t[k])) for k in ("f", "fb", "fbx", "fbw"))
    b, bx, bw = (max(v - f, 0.0) for v in (fb, fbx, fbw))
    print(
        f"One stage ({LAYERS} tanh layers, {WIDTH} wide, 64 rows, float32) on this CPU, medians: "
        f"F {f * 1e6:.1f} us, F+B {fb * 1e6:.1f} us, F+B(input) {fbx * 1e6:.1f} us, "
        f"F+W(params) {fbw * 1e6:.1f} us. With checkpoint='always' the schedules recompute the "
        "forward in each backward slot (a 1f1b B slot costs F+B, a zb-h1 B slot F+B(input), a W "
        "slot F+W(params)); with 'never' they keep F's residuals (B, B(input), W(params) alone). "
        "GPipe 'always' recomputes once per backward, 'never' not at all. Ratios: against GPipe "
        "with the same mode."
    )
    rows = []
    for n in (4, 8):
        for m in (8, 32):
            row = [n, m]
            for mode, one_b, zb_b, zb_w in (("always", fb, fbx, fbw), ("never", b, bx, bw)):
                common = dict(num_micro=m, backward=[b] * n, checkpoint=mode, lockstep=True)
                base = sim.simulate([f] * n, **common).makespan
                one = sched.one_f_one_b(n, m).step_time(f, one_b)
                zb = sched.zb_h1(n, m).step_time(f, zb_b, zb_w)
                # interleaved, v = 2: the device's share cut into 2 stages of half the cost each
                il = sched.interleaved_one_f_one_b(n, m, 2).step_time(f / 2, one_b / 2)
                row += [f"{base * 1e3:.3f}", f"{one / base:.2f}x", f"{zb / base:.2f}x", f"{il / base:.2f}x"]
            rows.append(row)
    print()
    heads = ["gpipe always ms", "1f1b always", "zb-h1 always", "interleaved v=2 always"]
    heads += ["gpipe never ms", "1f1b never", "zb-h1 never", "interleaved v=2 never"]
    print(table(["n", "m", *heads], rows))


def select_put(buf, value, slot, enabled):
    """The stash write before decision 0035: ``buf[slot] = where(enabled, value, buf[slot])``."""
    from jax import lax

    def one(a, v):
        old = lax.dynamic_index_in_dim(a, slot, keepdims=False)
        return lax.dynamic_update_index_in_dim(a, jnp.where(enabled, v, old), slot, 0)

    return jax.tree.map(one, buf, value)


def ab_rows(variants, patches, quick, blocks=False):
    """One table row per ``(schedule, checkpoint, repeats)`` of ``variants`` on the V sections'
    model (m = 8): the step built under each of the two ``patches`` (``{label: (set, undo)}``,
    the old way first), compared in one process: temp KiB, compile seconds (median of
    interleaved compiles, the order turned each round), the optimised module's lines, step time
    (median per-round ratio over interleaved rounds) and bitwise equality of loss and gradients."""
    rounds, compiles, m = (2, 1, 8) if quick else (15, 5, 8)
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    old, new = patches
    rows = []
    for name, ckpt, v in variants:
        got, seconds = {}, {k: [] for k in patches}
        for c in range(compiles):
            for label in list(patches)[:: 1 if c % 2 else -1]:
                set_, undo = patches[label]
                set_()  # read when the step is traced
                try:
                    pipe, args = v_problem(name, v, m, ckpt, mesh, blocks=blocks)
                    t0 = time.perf_counter()
                    got[label] = jax.jit(pipe.value_and_grad(sq)).lower(*args).compile()
                    seconds[label].append(time.perf_counter() - t0)
                finally:
                    undo()
        a, b = (jax.tree.leaves(got[k](*args)) for k in patches)
        same = all(bool(jnp.array_equal(p, q)) for p, q in zip(a, b, strict=True))
        times = interleaved_times(got, args, rounds)
        med, q1, q3 = ratio_stats(times[new], times[old])
        nbytes = {k: got[k].memory_analysis().temp_size_in_bytes for k in patches}
        lines = {k: got[k].as_text().count("\n") for k in patches}
        rows.append([
            f"{name} {ckpt}", kib(nbytes[old]), kib(nbytes[new]), f"{nbytes[new] / nbytes[old]:.3f}",
            *(f"{statistics.median(seconds[k]):.2f}" for k in patches), *(f"{lines[k]:,}" for k in patches),
            f"{np.median(times[old]) * 1e3:.1f}", f"{med:.2f}x ({q1:.2f}-{q3:.2f})", same,
        ])  # fmt: skip
    print(
        f"The v_shape section's model{' with residual MLP blocks' if blocks else ''} (m={m}); temp KiB "
        f"per device; compile: trace + lower + compile seconds, the median of {compiles} interleaved "
        f"compiles of each program; HLO lines: the optimised module's text; step: median ms of the "
        f"{old} program and the median per-round ratio {new} / {old} over {rounds} interleaved "
        "rounds (quartiles); bitwise: the loss and gradients of the two programs equal bit for bit."
    )
    print()
    heads = ["schedule", f"{old} KiB", f"{new} KiB", "ratio", f"compile {old} s", f"compile {new} s"]
    heads += [f"HLO lines {old}", f"HLO lines {new}", f"step {old} ms", f"step {new} / {old}", "bitwise"]
    print(table(heads, rows, align="l" + "r" * 9 + "l"))


def stash_write(quick: bool) -> None:
    """Decision 0035's measurement: the training slots' stash write as a dropped-index scatter
    (the engine's ``put``) against the select of the slot's old value it replaced, in one process."""
    from pipejax._src import engine

    section("The stash write: a dropped-index scatter against a select of the old slot (decision 0035)")
    variants = [("1f1b", "never", 1), ("v-half", "never", 2)]
    if not quick:
        variants += [("zb-h1", "never", 1), ("interleaved-1f1b", "never", 2), ("1f1b", "always", 1)]
        variants += [("zb-h1", "always", 1)]
    scatter = engine.put
    restore = lambda: setattr(engine, "put", scatter)  # the slots read `engine.put` when traced
    patches = {"select": (lambda: setattr(engine, "put", select_put), restore), "scatter": (restore, restore)}
    ab_rows(variants, patches, quick)


def stash_pool(quick: bool) -> None:
    """Decision 0036's measurement: interleaved 1F1B's stash as one pool per device
    (``Schedule.pooled``) against the ring per stage it kept before, in one process."""
    from pipejax._src.schedules.table import Schedule

    section("One stash pool per device against a ring per stage: interleaved 1F1B (decision 0036)")
    pooled = Schedule.pooled
    rings = property(lambda s: s.trains and s.placement == "v")  # the rule before: the V's only
    restore = lambda: setattr(Schedule, "pooled", pooled)
    patches = {"rings": (lambda: setattr(Schedule, "pooled", rings), restore), "pool": (restore, restore)}
    variants = [("interleaved-1f1b", "never", 2)] + ([] if quick else [("interleaved-1f1b", "always", 2)])
    ab_rows(variants, patches, quick)
    if not quick:
        print()
        ab_rows(variants, patches, quick, blocks=True)


def stages_not_alike(quick: bool) -> None:
    """GPipe and circular on stages given as a list (one ``lax.switch`` branch each): temp bytes
    per device in every checkpoint mode, and ``pj.memory_estimate`` beside them."""
    from benchmarks.planner import embedding_blocks_head, uniform

    section("Stages not alike (a list): GPipe and circular temp bytes per device, every mode")
    mesh = jax.make_mesh((N,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    models = [
        ("embedding + 6 blocks + head", embedding_blocks_head, (3, 2, 2, 1)),
        ("8 tanh blocks", uniform, (2,) * 4),
    ]
    modes = ("never",) if quick else ("always", "never", "except_last")
    rows = []
    for label, model, cut in models[:1] if quick else models:
        layers, params, x = model()
        for name, v in (("gpipe", 1), ("circular", 2)):
            part = pj.partition(layers, list(cut) if v == 1 else [1] * len(layers))
            stage_params = part.group(list(params))
            for mode in modes:
                pipe = pj.pipeline(
                    list(part.stages), chunks=8, checkpoint=mode, mesh=mesh, schedule=name, repeats=v
                )
                placed = pipe.place(stage_params)
                y = jax.eval_shape(lambda p, x, pipe=pipe: pipe(p, x), placed, x)
                got = temp_bytes(pipe.value_and_grad(sq), placed, x, jnp.zeros(y.shape, y.dtype))
                est = pj.memory_estimate(pipe, placed, x).total
                rows.append([label, f"{name} {mode}", kib(got), kib(est), f"{est / got:.2f}"])
    print(
        f"`benchmarks/planner.py`'s models on {N} devices, a batch of 64 in 8 micro-batches, the stages "
        "a list of partitions (GPipe: the planner's balance; circular: a layer a stage, 2 a device). "
        "KiB per device."
    )
    print()
    print(table(["model", "schedule", "XLA", "estimate", "estimate / XLA"], rows, align="llrrr"))


SECTIONS = {
    "memory": memory,
    "sharded": sharded_memory,
    "v_shape": v_shape,
    "v_blocks": v_blocks,
    "head": head,
    "local": local,
    "slots": slots,
    "compile": compile_time,
    "predicted": predicted,
    "stash_write": stash_write,
    "stash_pool": stash_pool,
    "estimate": estimate,
    "stages_not_alike": stages_not_alike,
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run with small sizes")
    ap.add_argument("--section", choices=sorted(SECTIONS), action="append")
    args = ap.parse_args(argv)
    kinds = "1f1b, zb-h1, zb-floor, interleaved-1f1b, v-half, zb-v"
    header(f"Training schedules ({kinds}) against GPipe", args.quick)
    for name in args.section or list(SECTIONS):
        SECTIONS[name](args.quick)


if __name__ == "__main__":
    main()
