"""Cost of pipejax.hessian: HVP against gradient, Lanczos against bare HVPs, float32 and float64.

Run from the repository root::

    .venv/bin/python benchmarks/hessian.py           # full run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/hessian.py --quick   # smoke run

The model is an MLP (tanh, softmax cross-entropy) on one batch, on one device. Every function is
compiled once before timing; times are wall times measured in interleaved rounds in one process,
and every ratio is the median of per-round ratios (with quartiles): these machines are shared and
noisy, and ratios taken side by side survive that where absolute times do not.

* ``HVP / grad``: forward-over-reverse (``fwd_rev``) and reverse-over-reverse (``rev_rev``) HVPs
  against ``jax.grad`` of the same loss.
* ``Lanczos / m HVPs``: ``pipejax.hessian.lanczos`` with ``m`` steps, partial (the default),
  partial with the basis stored in a narrower dtype (``basis_dtype``: float32 for float64,
  bfloat16 for float32), full reorthogonalisation, and none (no basis: what ``density`` runs
  with ``reorthogonalise="none"``), against ``m`` bare HVPs in one
  ``lax.fori_loop`` (same jit, same operator, each HVP fed the last normalised one). Lanczos
  returns ``T`` and not its basis, as ``eigenvalues`` and ``density`` use it (handing out the
  basis would copy its ``m x n`` numbers out of the loop's ``(m + 1) x n``). What Lanczos
  adds: the vector work of each step (the recurrence, a local pass, the norm, the row write);
  the passes against the whole basis, which read up to ``(m + 1) x n`` numbers (every step with
  ``"full"``, timed alone as the same Lanczos on a diagonal operator; with ``"partial"`` only the
  steps that Simon's estimate marks, counted); and the basis itself, ``(m + 1) x n`` fresh numbers
  per run whose pages the OS faults in one by one (counted). Times are wall and process CPU time
  (the latter much steadier on a shared machine). Memory: the basis's size and XLA's compiled
  temp bytes. The full run has a second batch size (2048).
"""

from __future__ import annotations

import argparse
import itertools
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, interleaved_times, ratio_stats, section, table, temp_bytes

from pipejax import hessian as ph
from pipejax._src.hessian import tree
from pipejax._src.hessian.lanczos import _lanczos


def make(sizes, batch, dtype, seed=0):
    rng = np.random.default_rng(seed)
    params = [
        {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), dtype), "b": jnp.zeros(b, dtype)}
        for a, b in itertools.pairwise(sizes)
    ]
    x = jnp.asarray(rng.standard_normal((batch, sizes[0])), dtype)
    y = jnp.asarray(rng.integers(0, sizes[-1], batch))
    return params, x, y


def loss(params, x, y):
    for j, p in enumerate(params):
        x = x @ p["w"] + p["b"][None]
        if j < len(params) - 1:
            x = jnp.tanh(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def fmt(stats):
    med, q1, q3 = stats
    return f"{med:.2f}x ({q1:.2f}-{q3:.2f})"


def hvp_rows(sizes, batch, rounds, dtype):
    params, x, y = make(sizes, batch, dtype)
    v = tree.normal(jax.random.key(1), params, dtype)
    grad = jax.jit(jax.grad(loss))
    fwd = jax.jit(lambda p, v, x, y: ph.hvp(loss, p, v, x, y))
    rev = jax.jit(lambda p, v, x, y: ph.hvp(loss, p, v, x, y, mode="rev_rev"))
    fns = {"grad": lambda p, v, x, y, g=grad: g(p, x, y), "fwd_rev": fwd, "rev_rev": rev}
    t = interleaved_times(fns, (params, v, x, y), rounds)
    return [jnp.dtype(dtype).name, f"{tree.size(params):,}", batch, f"{1e3 * np.median(t['grad']):.2f}",
            fmt(ratio_stats(t["fwd_rev"], t["grad"])), fmt(ratio_stats(t["rev_rev"], t["grad"]))]  # fmt: skip


def cpu_and_wall_times(fns, args, rounds):
    """Wall and process CPU times (seconds) in interleaved rounds, and minor page faults per call.

    CPU time counts the work of this process's threads only, so it is much less disturbed than
    wall time by other programs on a shared machine (its ratios are the steadier ones).
    """
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    names = list(fns)
    wall, cpu, faults = ({k: [] for k in names} for _ in range(3))
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fns[k](*args))
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    arr = lambda d: {k: np.asarray(v) for k, v in d.items()}
    return arr(wall), arr(cpu), {k: int(np.median(v)) for k, v in faults.items()}


def lanczos_rows(sizes, batch, m, rounds, dtype):
    """Lanczos (partial, partial with a narrower basis, full, none) against m bare HVPs; passes, memory."""
    params, x, y = make(sizes, batch, dtype)
    v = tree.normal(jax.random.key(1), params, dtype)
    narrow = jnp.dtype(jnp.float32 if dtype == jnp.float64 else jnp.bfloat16)
    # a diagonal operator with a spread spectrum: Lanczos on it costs the reorthogonalisation only
    diag = tree.normal(jax.random.key(2), params, dtype)
    diag = jax.tree.map(lambda a: jnp.abs(a) + jnp.asarray(1, dtype), diag)

    def matvec(p, x, y):
        return lambda u: ph.hvp(loss, p, u, x, y)

    def lanczos(reorth, basis_dtype=None):  # T and the pass count, as the tools use them
        def run(p, v, x, y):
            t, passes = _lanczos(matvec(p, x, y), v, m, None, False, "", reorth, basis_dtype=basis_dtype)
            return (t.diag, t.offdiag), passes

        return jax.jit(run)

    @jax.jit
    def reorth(p, v, x, y):  # full reorthogonalisation on the diagonal operator: the passes alone
        return ph.lanczos(lambda u: jax.tree.map(jnp.multiply, u, diag), v, m, reorthogonalise="full").diag

    @jax.jit
    def bare(p, v, x, y):  # m HVPs, each fed the last (normalised) one: no reorthogonalisation
        def body(i, u):
            w = matvec(p, x, y)(u)
            return tree.scale(1 / tree.norm(w), w)

        return jax.lax.fori_loop(0, m, body, v)

    narrow_name = f"partial, {jnp.dtype(narrow).name} basis"
    fns = {"bare": bare, "partial": lanczos("partial"), narrow_name: lanczos("partial", narrow),
           "full": lanczos("full"), "none": lanczos("none"), "reorth": reorth}  # fmt: skip
    args = (params, v, x, y)
    wall, cpu, faults = cpu_and_wall_times(fns, args, rounds)
    n = tree.size(params)
    hvp_ms = 1e3 * np.median(wall["bare"]) / m
    pass_ms = 1e3 * np.median(wall["reorth"]) / m
    mib = lambda b: f"{b / 2**20:.1f}"
    temp_bare = temp_bytes(bare, *args)
    rows = []
    same = jnp.dtype(dtype)
    for name, bdt in (("partial", same), (narrow_name, narrow), ("full", same), ("none", None)):
        out = fns[name](*args)
        passes = int(out[1])
        rows.append([
            jnp.dtype(dtype).name, f"{n:,}", batch, m, name, f"{hvp_ms:.2f}", f"{pass_ms:.2f}",
            f"{passes}/{m}",
            fmt(ratio_stats(wall[name], wall["bare"])), fmt(ratio_stats(cpu[name], cpu["bare"])),
            f"{faults[name] - faults['bare']:,}", mib(0 if bdt is None else (m + 1) * n * bdt.itemsize),
            mib(temp_bytes(fns[name], *args) - temp_bare),
        ])  # fmt: skip
    return rows


def breakdown_row(sizes, batch, m, rounds, dtype):
    """Where partial Lanczos's time over m bare HVPs goes, in CPU time, side by side: the basis
    (a bare loop that also writes each vector into an (m + 1) x n basis), the passes (their count
    times a full pass: an upper bound, since a pass reads only the rows written so far), the rest."""
    params, x, y = make(sizes, batch, dtype)
    v = tree.normal(jax.random.key(1), params, dtype)
    diag = jax.tree.map(
        lambda a: jnp.abs(a) + jnp.asarray(1, dtype), tree.normal(jax.random.key(2), params, dtype)
    )

    def matvec(p, x, y):
        return lambda u: ph.hvp(loss, p, u, x, y)

    def body(p, x, y):
        def step(u):
            w = matvec(p, x, y)(u)
            return tree.scale(1 / tree.norm(w), w)

        return step

    @jax.jit
    def bare(p, v, x, y):
        return jax.lax.fori_loop(0, m, lambda i, u: body(p, x, y)(u), v)

    @jax.jit
    def bare_basis(p, v, x, y):
        def loop(i, c):
            u = body(p, x, y)(c[0])
            return u, tree.set_row(c[1], i + 1, u)

        return jax.lax.fori_loop(0, m, loop, (v, tree.zeros_basis(v, m + 1, dtype)))[1]

    @jax.jit
    def partial(p, v, x, y):  # T's diagonal, and the pass count read below (no second program)
        t, passes = _lanczos(matvec(p, x, y), v, m, None, False, "", "partial")[:2]
        return t.diag, passes

    full_pass = jax.jit(
        lambda p, v, x, y: (
            ph.lanczos(lambda u: jax.tree.map(jnp.multiply, u, diag), v, m, reorthogonalise="full").diag
        )
    )
    fns = {"bare": bare, "bare + basis": bare_basis, "partial": partial, "full pass": full_pass}
    args = (params, v, x, y)
    _, cpu, _ = cpu_and_wall_times(fns, args, rounds)
    med = {k: float(np.median(t)) for k, t in cpu.items()}
    passes = int(partial(*args)[1])
    total = ratio_stats(cpu["partial"], cpu["bare"])[0] - 1
    basis = ratio_stats(cpu["bare + basis"], cpu["bare"])[0] - 1
    pass_share = passes * med["full pass"] / m / med["bare"]
    return [jnp.dtype(dtype).name, batch, f"{1e3 * med['bare'] / m:.2f}", f"{total:+.3f}", f"{basis:+.3f}",
            f"{passes}/{m}: <= {pass_share:+.3f}", f"{total - basis - pass_share:+.3f}"]  # fmt: skip


def run(sizes, batches, m, rounds, dtypes):
    rows_hvp = [hvp_rows(sizes, batches[0], rounds, dtype) for dtype in dtypes]
    section("HVP / grad")
    print(table(["dtype", "params", "batch", "grad (ms)", "fwd_rev / grad", "rev_rev / grad"], rows_hvp))
    rows_lz = [
        row
        for b in batches
        for dtype in dtypes
        for row in lanczos_rows(sizes, b, m, max(3, rounds // 4), dtype)
    ]
    section("Lanczos / m HVPs")
    print(
        table(
            ["dtype", "params", "batch", "m", "Lanczos", "HVP (ms/step)", "full pass (ms/step)", "passes",
             "wall / m HVPs", "CPU / m HVPs", "page faults / run", "basis (MiB)", "temp over bare (MiB)"],
            rows_lz,
        )
    )  # fmt: skip
    print(
        "\nHVP: the bare loop's wall time per step. full pass: Lanczos with full reorthogonalisation on a "
        "diagonal\noperator, i.e. one Gram-Schmidt pass per step alone. passes: the steps that ran a pass "
        "against the\nwhole basis (partial: where Simon's estimate of the lost orthogonality passed "
        "sqrt(eps); each such step\nand the next). wall, CPU: median (quartiles) of per-round ratios of wall "
        "time and of this process's CPU\ntime. page faults / run: minor page faults of one run beyond those "
        "of the bare loop (the basis is fresh\nmemory in every run, and each of its pages faults once). "
        "basis: (m + 1) x n x itemsize of the stored\nbasis; temp over bare: XLA's compiled temp bytes "
        "of the run minus those of the bare loop."
    )
    rows_bd = [breakdown_row(sizes, batches[0], m, max(3, rounds // 4), dtype) for dtype in dtypes]
    section("Where partial Lanczos's time goes (CPU time, over m bare HVPs)")
    print(
        table(
            [
                "dtype",
                "batch",
                "bare HVP (CPU ms/step)",
                "partial - 1",
                "basis",
                "passes",
                "rest (vector work)",
            ],
            rows_bd,
        )
    )
    print(
        "\nbasis: a bare loop that also writes each vector into an (m + 1) x n basis, over the bare loop "
        "(fresh memory\nevery run: page faults, zero-fill, row writes). passes: their count times a full "
        "pass (an upper bound: a\npass reads only the rows written so far). rest: the steps' own vector "
        "work (recurrence, local pass,\nnorm, scaling) and the loops."
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # float64 rows; float32 rows stay float32
    header("pipejax.hessian benchmark", args.quick)
    if args.quick:  # float32 only: the smoke run is compile-bound, one dtype halves it
        sizes, batches, m, rounds, dtypes = (16, 32, 10), (64,), 10, 6, (jnp.float32,)
    else:
        sizes, batches, m, rounds, dtypes = (
            (32, 256, 256, 10),
            (256, 2048),
            90,
            20,
            (jnp.float32, jnp.float64),
        )
    print(f"\nMLP {' -> '.join(map(str, sizes))}, Lanczos steps m = {m}, {rounds} rounds.")
    run(sizes, batches, m, rounds, dtypes)


if __name__ == "__main__":
    main()
