"""One accelerator: the pipelined training step beside the composed model.

Run from the repository root on a machine with a GPU (or TPU)::

    python benchmarks/gpu.py            # full sizes
    python benchmarks/gpu.py --quick    # a smoke run (any backend, CPU included)

On one device the pipeline runs with ``mesh=None``: the same schedule table on one device,
every stage in turn on each micro-batch (no bubble). Two more rows run GPipe's step on the
same stages given as a list (heterogeneous: a Python loop of direct calls) and the circular
schedule on a one-device mesh, the other forms of the same work. What this shows is the cost of the
pipeline's machinery on real hardware (micro-batching, the tick loop, the checkpoint modes and
the training schedules' own backward) against ``jax.value_and_grad`` of the stages composed on
the whole batch: step time (median of interleaved rounds), compile time (trace + lower +
compile) and XLA's compiled temp bytes. Every variant's loss is checked against the composed
model's first (relative difference printed; float32 matmuls may run as TF32 on a GPU).
Pipeline speed-ups need several devices and are not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import jax
import jax.numpy as jnp

import pipejax as pj
from benchmarks._common import interleaved_times, kib, normal, table


def stage(p, x, key):
    for j in range(p["w"].shape[0]):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # pre-RMSNorm
        x = x + jax.nn.gelu(h @ p["w"][j]) @ p["v"][j]  # MLP block with a residual
    return x


def sq(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def build(S, L, width, hidden, batch, dtype):
    params = {
        "w": normal((S, L, width, hidden), 0, width**-0.5).astype(dtype),
        "v": normal((S, L, hidden, width), 1, hidden**-0.5).astype(dtype),
    }
    x = normal((batch, width), 2).astype(dtype)
    t = normal((batch, width), 3).astype(dtype)
    return params, x, t


def composed(params, x, t):
    def loss(p):
        y = x
        for s in range(p["w"].shape[0]):
            y = stage(jax.tree.map(lambda a, s=s: a[s], p), y, None)
        return jnp.mean(sq(y, t))

    return jax.value_and_grad(loss)(params)


def compile_seconds(fn, *args):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0, compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    args = ap.parse_args()
    if args.quick:
        S, L, width, hidden, m, micro, rounds = 4, 1, 64, 128, 4, 8, 3
    else:
        S, L, width, hidden, m, micro, rounds = 4, 2, 2048, 8192, 8, 32, 15
    dtype = jnp.float32
    params, x, t = build(S, L, width, hidden, m * micro, dtype)
    dev = jax.devices()[0]
    print(f"## One device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}\n")
    print(
        f"{S} homogeneous stages of {L} pre-RMSNorm MLP blocks ({width} -> {hidden} -> {width}, "
        f"float32), batch {m * micro} in m = {m} micro-batches of {micro}; `mesh=None`.\n"
    )
    args = (params, x, t)
    variants = {"composed (jax.value_and_grad)": (composed, args)}
    for name, ckpt in [
        ("gpipe", "never"),
        ("gpipe", "except_last"),
        ("gpipe", "always"),
        ("1f1b", "always"),
        ("1f1b", "never"),
        ("zb-h1", "always"),
    ]:
        pipe = pj.pipeline(stage, num_stages=S, chunks=m, schedule=name, checkpoint=ckpt)
        variants[f"{name} {ckpt}"] = (pipe.value_and_grad(sq), args)
    # the same stages given as a list (one function per stage: a Python loop of direct calls), and
    # the same work on a one-device mesh (the circular table, S stages on one device)
    as_list = [jax.tree.map(lambda a, s=s: a[s], params) for s in range(S)]
    pipe = pj.pipeline([stage] * S, chunks=m, checkpoint="always")
    variants["gpipe always, stages as a list"] = (pipe.value_and_grad(sq), (as_list, x, t))
    mesh = jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1])
    pipe = pj.pipeline(
        stage, num_stages=S, chunks=m, schedule="circular", repeats=S, mesh=mesh, checkpoint="always"
    )
    variants["circular always, one-device mesh"] = (pipe.value_and_grad(sq), args)
    compiled, rows = {}, []
    ref_loss = None
    for label, (fn, fn_args) in variants.items():
        secs, c = compile_seconds(fn, *fn_args)
        compiled[label] = (c, fn_args)
        loss, _ = c(*fn_args)
        loss = float(loss)
        ref_loss = loss if ref_loss is None else ref_loss
        mem = c.memory_analysis()
        rows.append(
            [label, f"{secs:.2f}", kib(mem.temp_size_in_bytes), f"{abs(loss - ref_loss) / abs(ref_loss):.1e}"]
        )
    # each program runs on its own arguments (`interleaved_times` passes the same to all)
    calls = {label: (lambda *_, c=c, a=a: c(*a)) for label, (c, a) in compiled.items()}
    times = interleaved_times(calls, (), rounds=rounds)
    ref = times["composed (jax.value_and_grad)"]
    for row in rows:
        tt = times[row[0]]
        row[2:2] = [f"{statistics.median(tt) * 1e3:.2f}", f"{statistics.median(list(tt / ref)):.2f}"]
    print(
        table(
            ["program", "compile s", "step ms", "step / composed", "temp KiB", "loss rel. diff"],
            rows,
            align="lrrrrr",
        )
    )


if __name__ == "__main__":
    main()
