"""Helpers shared by the benchmark scripts: markdown tables, compiled bytes, interleaved timing."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; ``align`` is one letter per column, ``l`` or ``r`` (default: r)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "r" * len(headers)

    def line(row):
        padded = (c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align, strict=True))
        return "| " + " | ".join(padded) + " |"

    marks = zip(widths, align, strict=True)
    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1)) for w, a in marks)
    return "\n".join([line(headers), rule + "|", *(line(r) for r in cells)])


def kib(nbytes: float) -> str:
    return f"{nbytes / 1024:,.1f}"


def section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def temp_bytes(fn, *args) -> int:
    """Compiled XLA temp bytes of ``jax.jit(fn)`` on ``args`` (deterministic on CPU).

    A function that is jitted already is lowered as it is: if it ran on ``args``, JAX reuses its
    executable (wrapping it in another ``jax.jit`` would compile the same program again).
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def nbytes(tree) -> int:
    return sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def normal(shape, seed: int, scale: float = 1.0) -> jax.Array:
    """A float32 array of normal samples, made with numpy (jax.random compiles per shape)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def interleaved_times(
    fns: dict[str, Callable[..., object]], args: Sequence[object], rounds: int, warmup: int = 3
) -> dict[str, np.ndarray]:
    """Wall times (seconds) of each compiled function, measured in interleaved rounds.

    Every round runs each function once, in an order that rotates from round to round, so slow
    phases of a shared, noisy machine hit every variant alike. Compare variants with the median of
    per-round ratios, not with separate medians.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k](*args))
            times[k].append(time.perf_counter() - t0)
    return {k: np.asarray(v) for k, v in times.items()}


def ratio_stats(times: np.ndarray, reference: np.ndarray) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of per-round ratios ``times / reference``."""
    q1, med, q3 = np.percentile(times / reference, [25, 50, 75])
    return float(med), float(q1), float(q3)


def header(title: str, quick: bool) -> None:
    """Prints the run's title and the machine it ran on (git revision, versions, load)."""
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    import pipejax as pj

    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"# {title}" + (" (--quick)" if quick else ""))
    print(
        f"\npipejax {pj.__version__} (git {rev}), jax {jax.__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, load average {load}."
    )
