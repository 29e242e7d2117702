"""Training schedules through the Flax adapters: compile time and memory of one train step.

Run from the repository root::

    .venv/bin/python benchmarks/flax_schedules.py            # 3 rounds
    .venv/bin/python benchmarks/flax_schedules.py --quick    # smoke run (1 round, m = 4 only)

The model is the one of ``docs/flax.md``, "Training schedules": an embedding (mean over 8
tokens), ``BLOCKS`` residual dropout blocks (``WIDTH`` wide) and a head, all the layers of one
adapter (``LinenPipeline`` or ``NNXPipeline``) cut into 4 stages on 4 fake CPU devices, float32.
The step is the adapter's ``value_and_grad(loss_fn)`` (per-example cross-entropy, dropout on),
jitted; with ``schedule="gpipe"`` that is ``jax.value_and_grad`` of the module's call (what a
Flax user wrote before these schedules existed), with ``"1f1b"`` / ``"zb-h1"`` the program that
owns the backward pass. All use ``checkpoint="always"`` (the training schedules recompute each
stage in its backward slot; so does GPipe "always").

* compile: seconds to trace, lower and compile a fresh step (a new module and step each time, so
  nothing is cached), medians of interleaved rounds; shared machine, noisy: compare ratios.
* temp KiB: the compiled program's ``memory_analysis().temp_size_in_bytes`` (per device: the
  SPMD program is one device's), against the number of micro-batches ``m`` (micro-batches of
  ``MICRO`` rows, so the batch grows with ``m``).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks._common import header, kib, section, table
from pipejax.flax import LinenPipeline, NNXPipeline

V, WIDTH, CLASSES, BLOCKS, MICRO, STAGES = 100, 64, 10, 8, 8, 4
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def ce(logits, labels):  # one loss per example
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


class MeanEmbed(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Embed(V, WIDTH)(tokens).mean(axis=1)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        y = nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(h)))
        return h + nn.Dropout(0.1)(y, deterministic=deterministic)


class NMeanEmbed(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, WIDTH, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens).mean(axis=1)


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, h):
        return h + self.dropout(nnx.gelu(self.linear(self.norm(h))))


def options(schedule, m, mesh):
    return dict(num_stages=STAGES, chunks=m, mesh=mesh, schedule=schedule, checkpoint="always")


def linen_step(schedule, m, mesh, tokens, labels):
    """A fresh jitted Linen step and its arguments."""
    layers = [MeanEmbed(), *[Block() for _ in range(BLOCKS)], nn.Dense(CLASSES)]
    pipe = LinenPipeline(layers, **options(schedule, m, mesh))
    params = jax.jit(pipe.init)(jax.random.key(0), tokens)["params"]
    step = pipe.value_and_grad(ce)

    def fn(params, tokens, labels, key):
        return step({"params": params}, tokens, labels, rngs={"dropout": key}, deterministic=False)

    return fn, (params, tokens, labels, jax.random.key(1))


def nnx_step(schedule, m, mesh, tokens, labels):
    """A fresh jitted NNX step (a pure function of the model's state) and its arguments."""
    rngs = nnx.Rngs(params=0, dropout=1)
    layers = [NMeanEmbed(rngs), *[NBlock(rngs) for _ in range(BLOCKS)], nnx.Linear(WIDTH, CLASSES, rngs=rngs)]
    pipe = NNXPipeline(layers, rngs=rngs, deterministic=False, **options(schedule, m, mesh))
    graphdef, state = nnx.split(pipe)

    def fn(state, tokens, labels, key):
        return nnx.merge(graphdef, state).value_and_grad(ce)(tokens, labels, rngs=key)

    return fn, (state, tokens, labels, jax.random.key(1))


ADAPTERS = {"Linen": linen_step, "NNX": nnx_step}


def compile_once(make, schedule, m, mesh):
    """(seconds to trace + lower + compile a fresh step, temp bytes of the compiled step)."""
    tokens = jax.random.randint(jax.random.key(2), (m * MICRO, 8), 0, V)
    labels = jnp.arange(m * MICRO) % CLASSES
    fn, args = make(schedule, m, mesh, tokens, labels)
    start = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower().compile()
    seconds = time.perf_counter() - start
    return seconds, compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, m = 4 only")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    ms = (4,) if args.quick else (4, 16)
    header("Training schedules through the Flax adapters", args.quick)
    mesh = jax.make_mesh((STAGES,), ("stage",))

    seconds = {(a, s, m): [] for a in ADAPTERS for s in SCHEDULES for m in ms}
    temp = {}
    for r in range(rounds):
        keys = list(seconds)
        for key in keys if r % 2 == 0 else reversed(keys):
            adapter, schedule, m = key
            t, b = compile_once(ADAPTERS[adapter], schedule, m, mesh)
            seconds[key].append(t)
            temp[key] = b

    section(f"Compile time of one adapter train step against the GPipe step (m = {ms[0]})")
    rows = []
    for adapter in ADAPTERS:
        base = statistics.median(seconds[(adapter, "gpipe", ms[0])])
        for schedule in SCHEDULES:
            med = statistics.median(seconds[(adapter, schedule, ms[0])])
            rows.append([adapter, schedule, f"{med:.2f}", f"{med / base:.2f}x"])
    print(table(["adapter", "schedule", "seconds", "/ gpipe"], rows, "llrr"))
    print(f"\nmedians of {rounds} round(s) (trace + lower + compile), order reversed every other round")

    section("Temp bytes per device of one adapter train step against m (KiB)")
    rows = []
    for adapter in ADAPTERS:
        for schedule in SCHEDULES:
            cells = [kib(temp[(adapter, schedule, m)]) for m in ms]
            grow = [f"{temp[(adapter, schedule, ms[-1])] / temp[(adapter, schedule, ms[0])]:.2f}x"]
            rows.append([adapter, schedule, *cells, *(grow if len(ms) > 1 else [])])
    ratio = [f"m={ms[-1]} / m={ms[0]}"] if len(ms) > 1 else []
    print(
        table(
            ["adapter", "schedule", *(f"m={m}" for m in ms), *ratio],
            rows,
            "ll" + "r" * (len(ms) + len(ratio)),
        )
    )
    print(f"\n{STAGES} stages on {STAGES} fake CPU devices, micro-batches of {MICRO} sequences, float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
