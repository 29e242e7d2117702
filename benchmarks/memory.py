"""Activation memory against depth: plain backprop, per-layer checkpoints, sqrt(L) segments.

Run from the repository root::

    .venv/bin/python benchmarks/memory.py                 # full run, L = 8 ... 512, writes the plot
    .venv/bin/python benchmarks/memory.py --quick         # smoke run (small L, no plot by default)
    .venv/bin/python benchmarks/memory.py --plot out.png  # also write the plot elsewhere

The model is a stack of ``L`` residual layers ``x + dropout(tanh(x @ W + b))`` of width 64 on a
batch of 1,024, float32, with dropout drawn from ``fold_in(key, l)`` for layer ``l``. Every method
runs the layers as a ``lax.scan`` (so each compiles once, whatever ``L``), and they compute
bitwise-identical gradients (checked before anything is measured):

* ``plain``: an un-checkpointed ``lax.scan``; backward keeps every layer's internals.
* ``per-layer``: ``pj.checkpoint_sequential(layer, segments=L)``; backward keeps each layer's input
  and recomputes the layer.
* ``sqrt(L)``: ``pj.checkpoint_sequential(layer)``, about ``sqrt(L)`` segments of ``sqrt(L)``
  layers (Chen et al. 2016).
* ``reversible``: a chain of ``L`` additive couplings with ``memory="constant"`` from
  ``pipejax.invertible`` (the same width and batch; its own network, so its time ratio compares
  two models; ``benchmarks/invertible.py`` compares it with its own ``"linear"`` chain).

Memory is XLA's compiled ``temp_size_in_bytes`` of ``jit(grad(loss))`` from ``pj.memory_report``
(deterministic on CPU), with the bytes of the residuals autodiff saves; parameters and their
gradients are arguments and outputs, not temps. Time is the wall time of
one ``jit(grad(loss))`` step as a ratio to ``plain`` at the same depth, measured in interleaved
rounds in one process (median of per-round ratios): these machines are shared and noisy.
"""

from __future__ import annotations

import os

# The reversible chain's LU-free couplings call no LAPACK, but jaxlib's OpenBLAS threads spin on a
# busy 2-core machine; one thread keeps timings steady (set before JAX loads it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
import pipejax as pj
from benchmarks._common import header, interleaved_times, kib, normal, ratio_stats, section, table

ROOT = Path(__file__).resolve().parents[1]
PLOT = ROOT / "docs" / "memory_vs_depth.png"
DROP_RATE = 0.1  # probability of dropping a unit
SQRT_TIME_TARGET = 1.4  # Chen et al. report about +30% for sqrt(L) checkpointing
FULL = {"depths": (8, 16, 32, 64, 128, 256, 512), "width": 64, "batch": 1024, "rounds": 15}
QUICK = {"depths": (8, 16), "width": 16, "batch": 64, "rounds": 3}


def layer(p, x, key):
    """One residual layer with dropout; ``key`` is this layer's key."""
    h = jnp.tanh(x @ p["w"] + p["b"][None])
    return x + pj.dropout(h, key, DROP_RATE)


def plain_scan(params, x, key):
    """The reference: an un-checkpointed scan; layer ``l`` draws with ``fold_in(key, l)``."""

    def step(h, xs):
        p, index = xs
        return layer(p, h, jax.random.fold_in(key, index)), None

    index = jnp.arange(params["w"].shape[0], dtype=jnp.int32)
    return jax.lax.scan(step, x, (params, index))[0]


def methods(depth: int) -> dict:
    """``name -> apply(params, x, key)`` for every method measured at this depth."""
    return {
        "plain": plain_scan,
        "per-layer": pj.checkpoint_sequential(layer, segments=depth),
        "sqrt(L)": pj.checkpoint_sequential(layer),
    }


def reversible(depth: int, width: int, x, key):
    """A chain of ``depth`` additive couplings with ``memory="constant"`` (``pipejax.invertible``).

    Its own model (each coupling runs a ``width/2 -> width/2`` two-layer net with dropout on half
    the features), so its time ratio to ``plain`` compares two different networks of equal width,
    depth and batch. Returns ``(loss, params)``.
    """
    import pipejax.invertible as inv

    chain = inv.Chain(
        [inv.AdditiveCoupling(hidden=width // 2, drop_rate=DROP_RATE)], repeat=depth, memory="constant"
    )
    params = jax.jit(chain.init)(jax.random.key(depth), x)

    def loss(p, x, key):
        return jnp.mean(chain.forward(p, x, key)[0] ** 2)

    return loss, params


def make_inputs(depth: int, width: int, batch: int):
    params = {
        "w": normal((depth, width, width), seed=depth, scale=0.5 / np.sqrt(width)),
        "b": normal((depth, width), seed=depth + 1, scale=0.1),
    }
    return params, normal((batch, width), seed=7), jax.random.key(0)


def measure(cfg) -> list[dict]:
    """One row per (depth, method): temp bytes and the time ratio to plain at that depth."""
    rows = []
    for depth in cfg["depths"]:
        params, x, key = make_inputs(depth, cfg["width"], cfg["batch"])
        grads, reports = {}, {}
        for name, apply in methods(depth).items():

            def loss(p, x, key, apply=apply):
                return jnp.mean(apply(p, x, key) ** 2)

            grads[name] = jax.jit(jax.grad(loss)).lower(params, x, key).compile()
            reports[name] = pj.memory_report(loss, params, x, key)
        reference = grads["plain"](params, x, key)
        for name, fn in grads.items():  # the methods are interchangeable: bitwise equal gradients
            for a, b in zip(jax.tree.leaves(fn(params, x, key)), jax.tree.leaves(reference), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} at L={depth}")
        calls = {name: functools.partial(fn, params, x, key) for name, fn in grads.items()}
        rev_loss, rev_params = reversible(depth, cfg["width"], x, key)
        reports["reversible"] = pj.memory_report(rev_loss, rev_params, x, key)
        rev_grad = jax.jit(jax.grad(rev_loss)).lower(rev_params, x, key).compile()
        calls["reversible"] = functools.partial(rev_grad, rev_params, x, key)
        times = interleaved_times(calls, (), cfg["rounds"])
        for name in calls:
            med, q1, q3 = ratio_stats(times[name], times["plain"])
            rows.append(
                {
                    "depth": depth,
                    "method": name,
                    "temp": reports[name].temp_bytes,
                    "residuals": reports[name].residual_bytes,
                    "ms": float(np.median(times[name]) * 1e3),
                    "ratio": med,
                    "iqr": (q1, q3),
                }
            )
        print(f"  L={depth}: done", flush=True)
    return rows


def report(rows: list[dict], cfg) -> None:
    names = list(dict.fromkeys(r["method"] for r in rows))
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    by = {(r["depth"], r["method"]): r for r in rows}
    section("Compiled temp bytes of jit(grad(loss)) (KiB)")
    print(
        f"Width {cfg['width']}, batch {cfg['batch']}, float32. One activation is "
        f"{kib(cfg['width'] * cfg['batch'] * 4)} KiB. 'x L={cfg['depths'][0]}' is the growth from the "
        "smallest depth.\n"
    )
    first = depths[0]
    print(
        table(
            ["L", *(f"{n}" for n in names), *(f"{n} x L={first}" for n in names)],
            [
                [d]
                + [kib(by[d, n]["temp"]) for n in names]
                + [f"{by[d, n]['temp'] / by[first, n]['temp']:.2f}" for n in names]
                for d in depths
            ],
        )
    )
    section("Residuals autodiff saves for backward (KiB, from pj.memory_report)")
    print(
        "What reverse-mode autodiff of the loss keeps for the backward pass, arguments excluded:\n"
        "checkpointing shows up as fewer, smaller residuals (a scan's residuals are stacked per step).\n"
    )
    print(table(["L", *names], [[d] + [kib(by[d, n]["residuals"]) for n in names] for d in depths]))
    section("Time per training step, as a ratio to plain at the same depth")
    print(
        f"Median over {cfg['rounds']} interleaved rounds of (method time / plain time in the same\n"
        f"round), interquartile range in brackets; 'plain ms' is plain's median step time. Target for\n"
        f"sqrt(L): <= {SQRT_TIME_TARGET}.\n"
    )
    print(
        table(
            ["L", "plain ms", *(n for n in names if n != "plain")],
            [
                [d, f"{by[d, 'plain']['ms']:.2f}"]
                + [
                    f"{by[d, n]['ratio']:.2f} [{by[d, n]['iqr'][0]:.2f}-{by[d, n]['iqr'][1]:.2f}]"
                    for n in names
                    if n != "plain"
                ]
                for d in depths
            ],
            align="rr" + "l" * (len(names) - 1),
        )
    )
    sqrt_ratios = [by[d, "sqrt(L)"]["ratio"] for d in depths]
    worst = max(sqrt_ratios)
    verdict = "met" if worst <= SQRT_TIME_TARGET else "MISSED"
    median = np.median(sqrt_ratios)
    print(f"\nsqrt(L) time ratio: median over depths {median:.2f}, worst {worst:.2f}: {verdict}.")
    big, small = depths[-1], depths[0]
    growth = {n: by[big, n]["temp"] / by[small, n]["temp"] for n in names}
    print(
        f"Memory growth L={small} -> L={big} ({big // small}x the layers, sqrt {np.sqrt(big / small):.1f}x): "
        + ", ".join(f"{n} {g:.2f}x" for n, g in growth.items())
        + "."
    )


def plot(rows: list[dict], path: Path) -> None:
    """Memory against depth (log-log) beside the time overhead, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["method"] for r in rows))
    series = {n: [r for r in rows if r["method"] == n] for n in names}
    styles = {"plain": "o-", "per-layer": "s-", "sqrt(L)": "^-", "reversible": "D-"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rs in series.items():
        depths = [r["depth"] for r in rs]
        left.plot(depths, [r["temp"] / 2**20 for r in rs], styles.get(name, "o-"), label=name)
        right.plot(depths, [r["ratio"] for r in rs], styles.get(name, "o-"), label=name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth L (layers)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    left.set_yscale("log", base=2)
    left.set_ylabel("activation memory of jit(grad): XLA temp MiB")
    left.set_title("Memory against depth")
    right.axhline(SQRT_TIME_TARGET, color="grey", linestyle=":", label=None)
    right.set_ylabel("time per step / plain")
    right.set_title("Time overhead (interleaved, median)")
    fig.suptitle("pipejax checkpointing on CPU: residual tanh layers, width 64, batch 1024, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nWrote {path}.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test (seconds)")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"where to write the PNG (default: {PLOT.relative_to(ROOT)} on a full run, none with --quick)",
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    header("pipejax memory against depth", args.quick)
    start = time.perf_counter()
    rows = measure(cfg)
    report(rows, cfg)
    path = args.plot if args.plot is not None else (None if args.quick else PLOT)
    if path is not None:
        plot(rows, path)
    print(f"\nTotal {time.perf_counter() - start:.1f} s.")


if __name__ == "__main__":
    main()
