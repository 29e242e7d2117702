"""Benchmarks of ``pipejax.invertible``: memory and time against depth, and reconstruction drift.

Run from the repository root::

    .venv/bin/python benchmarks/invertible.py            # full run (a few minutes on 2 CPU cores)
    .venv/bin/python benchmarks/invertible.py --quick    # smoke run (well under a minute)
    .venv/bin/python benchmarks/invertible.py --section drift

The model is a chain of ``K`` Glow steps for vectors -- ``ActNorm``, ``InvertibleLinear``,
``AffineCoupling(hidden=32)`` -- on a batch of 4,096 examples of width 64, float32 (the sizes of
issue 5: parameters are small next to activations). The loss is a flow's NLL, so gradients flow
through both the output and the log-determinant. ``block="additive"`` uses two additive couplings
per step instead (a RevNet-like block).

Sections (each prints markdown tables):

1. ``memory``: compiled temp bytes of ``jit(grad(loss))`` (XLA's ``memory_analysis``,
   deterministic on CPU) for ``memory="linear"``, ``"sqrt"`` and ``"constant"``, and wall time per
   step as a ratio to ``"linear"`` at the same depth, measured in interleaved rounds in one process
   (median of per-round ratios). Before timing, the three gradients are checked to agree
   (float32, 1e-4 relative).
2. ``time``: the same time ratios at a small batch (256), where the step is compute-bound.
3. ``drift``: how far ``"constant"`` drifts from plain autodiff with depth, in float32 and
   float64: the largest error of the inputs it rebuilds (``Chain.reconstruction_errors``) and
   the relative error of its gradient, with parameters moved off the identity initialisation by
   noise of two sizes (a tame flow, and one that overflows float32 at some depth).

``memory_rows(cfg)`` returns the memory section's numbers for ``benchmarks/memory.py``'s plot.
"""

from __future__ import annotations

import os

# InvertibleLinear's inverse calls LAPACK (two triangular solves of C x C matrices) through
# jaxlib's scipy OpenBLAS. On a loaded 2-core machine OpenBLAS's spinning worker threads turn each
# 0.1 ms solve into 10-20 ms; one thread is the right setting for such tiny solves. It must be set
# before OpenBLAS loads, i.e. before JAX is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
import pipejax.invertible as inv
from benchmarks._common import header, interleaved_times, kib, ratio_stats, section, table

MODES = inv.MEMORY_MODES  # ("linear", "sqrt", "constant")
TIME_TARGET = 1.5  # constant-memory step time / linear; memcnn reports 1.16-1.47x
FULL = {"depths": (4, 8, 16, 32, 64), "width": 64, "hidden": 32, "batch": 4096, "rounds": 15}
QUICK = {"depths": (2, 4), "width": 16, "hidden": 8, "batch": 256, "rounds": 3}
TIME_FULL = {"depths": (16, 64), "width": 64, "hidden": 32, "batch": 256, "rounds": 30}
TIME_QUICK = {"depths": (4,), "width": 16, "hidden": 8, "batch": 64, "rounds": 3}
DRIFT_FULL = {"depths": (8, 32, 128, 512), "width": 16, "hidden": 32, "batch": 256, "sigmas": (0.02, 0.08)}
DRIFT_QUICK = {"depths": (4,), "width": 8, "hidden": 8, "batch": 32, "sigmas": (0.02,)}


def block_layers(block: str, hidden: int, scale_bound: float = 2.0) -> list:
    if block == "glow":
        return [
            inv.ActNorm(),
            inv.InvertibleLinear(),
            inv.AffineCoupling(hidden=hidden, scale_bound=scale_bound),
        ]
    if block == "additive":
        return [inv.AdditiveCoupling(hidden=hidden), inv.AdditiveCoupling(hidden=hidden, flip=True)]
    raise ValueError(f"`block` must be 'glow' or 'additive', but got {block!r}.")


def nll(chain):
    def loss(params, x):
        y, logdet = chain.forward(params, x)
        return jnp.mean(0.5 * jnp.sum(y * y, axis=1) - logdet)

    return loss


def perturbed(params, seed: int, sigma: float, width: int):
    """Parameters moved off their identity initialisation by noise of std ``sigma / sqrt(width)``.

    At init the couplings are the identity and the linear layers permutations; the noise makes
    every layer a non-trivial map. Random maps compound: the chain's outputs can grow
    exponentially with depth, so a small ``sigma`` is a tame flow at the depths measured, and a
    larger one overflows float32 at some depth.
    """
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    std = sigma / np.sqrt(width)
    moved = [a + jnp.asarray(rng.standard_normal(a.shape) * std, a.dtype) for a in leaves]
    return jax.tree.unflatten(treedef, moved)


def data(batch: int, width: int, dtype, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, width)), dtype)


def rel_err(a, b) -> float:
    a, b = (np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(t)]) for t in (a, b))
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sci(value: float, spec: str = ".1e") -> str:
    """``value`` formatted, or ``overflow`` for inf/NaN (the float range was exhausted)."""
    return format(value, spec) if np.isfinite(value) else "overflow"


# --- memory and time ------------------------------------------------------------------------------


def measure(cfg: dict, block: str = "glow", timing: bool = True) -> dict[str, list[tuple[int, int, float]]]:
    """``mode -> [(depth, temp bytes, time ratio to "linear"), ...]`` for the three memory modes.

    ``cfg`` has ``depths``, ``width``, ``batch``, ``rounds`` and optionally ``hidden`` (default
    ``width // 2``). The time ratio is NaN when ``timing`` is False.
    """
    hidden = cfg.get("hidden", max(1, cfg["width"] // 2))
    x = data(cfg["batch"], cfg["width"], jnp.float32)
    out: dict[str, list[tuple[int, int, float]]] = {m: [] for m in MODES}
    for depth in cfg["depths"]:
        chains = {m: inv.Chain(block_layers(block, hidden), repeat=depth, memory=m) for m in MODES}
        params = perturbed(jax.jit(chains["linear"].init)(jax.random.key(0), x), depth, 0.04, cfg["width"])
        steps = {m: jax.jit(jax.grad(nll(c))).lower(params, x).compile() for m, c in chains.items()}
        grads = {m: step(params, x) for m, step in steps.items()}
        for m in ("sqrt", "constant"):
            err = rel_err(grads[m], grads["linear"])
            assert err < 1e-4, f"{m} gradient differs from linear by {err:.2e} at depth {depth}"
        ratios = {m: float("nan") for m in MODES}
        if timing:
            times = interleaved_times(steps, (params, x), cfg["rounds"])
            ratios = {m: ratio_stats(times[m], times["linear"])[0] for m in MODES}
        for m in MODES:
            out[m].append((depth, int(steps[m].memory_analysis().temp_size_in_bytes), ratios[m]))
    return out


def memory_rows(cfg: dict, memory: str = "constant", block: str = "additive") -> list[tuple[int, int, float]]:
    """``[(depth, temp bytes, time ratio to its own "linear" chain), ...]`` for one memory mode.

    For ``benchmarks/memory.py``, whose ``cfg`` gives ``depths``, ``width``, ``batch`` and
    ``rounds``; the default block is two additive couplings, the reversible analogue of a residual
    layer of that width.
    """
    return measure(cfg, block=block)[memory]


def time_table(rows: dict, depths) -> str:
    """The sqrt and constant chains' step times as ratios to the linear chain, one row per depth."""
    return table(
        ["depth K", "sqrt / linear time", "constant / linear time", f"constant <= {TIME_TARGET}x"],
        [
            [
                d,
                f"{rows['sqrt'][i][2]:.2f}",
                f"{rows['constant'][i][2]:.2f}",
                rows["constant"][i][2] <= TIME_TARGET,
            ]
            for i, d in enumerate(depths)
        ],
    )


def memory_section(cfg: dict) -> None:
    section(
        f"Memory and time against depth (Glow steps, batch {cfg['batch']}, width {cfg['width']}, "
        f"hidden {cfg['hidden']}, float32)"
    )
    rows = measure(cfg)
    base = {m: rows[m][0][1] for m in MODES}
    depth0 = cfg["depths"][0]
    print(
        table(
            ["depth K", *(f"{m} temp KiB" for m in MODES), *(f"{m} / K={depth0}" for m in MODES)],
            [
                [d, *(kib(rows[m][i][1]) for m in MODES), *(f"{rows[m][i][1] / base[m]:.2f}x" for m in MODES)]
                for i, d in enumerate(cfg["depths"])
            ],
        )
    )
    print()
    print(time_table(rows, cfg["depths"]))
    print(
        f"\nTimes: median of per-round ratios over {cfg['rounds']} interleaved rounds of one "
        "jit(grad(loss)) step each."
    )


def time_section(cfg: dict) -> None:
    section(
        f"Time at a small batch (Glow steps, batch {cfg['batch']}, width {cfg['width']}, "
        f"hidden {cfg['hidden']}, float32)"
    )
    rows = measure(cfg)
    print(time_table(rows, cfg["depths"]))
    print(
        "\nWith small activations the step is compute-bound, and the constant-memory backward pass "
        "pays for its extra inverse; with large ones (the memory section) plain autodiff's stored "
        "activations cost more memory traffic than the recomputation."
    )


# --- drift ----------------------------------------------------------------------------------------


def drift_rows(cfg: dict, sigma: float) -> list[list]:
    rows = []
    for depth in cfg["depths"]:
        row = [depth]
        for dtype in (jnp.float32, jnp.float64):
            x = data(cfg["batch"], cfg["width"], dtype, seed=1)
            step = block_layers("glow", cfg["hidden"])
            chains = {m: inv.Chain(step, repeat=depth, memory=m) for m in ("linear", "constant")}
            params = jax.jit(chains["linear"].init)(jax.random.key(1), x)
            params = perturbed(params, depth, sigma, cfg["width"])

            def program(params, x, chains=chains):
                errors = chains["constant"].reconstruction_errors(params, x)
                y = chains["linear"].forward(params, x)[0]
                grads = {m: jax.grad(nll(c))(params, x) for m, c in chains.items()}
                return jnp.max(jnp.abs(y)), errors, grads

            y_max, errors, grads = jax.jit(program)(params, x)  # one compile per (depth, dtype)
            if dtype == jnp.float32:
                row.append(sci(float(y_max), ".3g"))
            row += [sci(float(jnp.max(errors))), sci(rel_err(grads["constant"], grads["linear"]))]
        rows.append(row)
    return rows


def drift_section(cfg: dict) -> None:
    section(
        f"Reconstruction drift against depth (Glow steps, batch {cfg['batch']}, width {cfg['width']}, "
        f"hidden {cfg['hidden']}, scale_bound 2)"
    )
    headers = ["depth K", "f32 max abs y", "f32 rebuild err", "f32 grad rel err"]
    headers += ["f64 rebuild err", "f64 grad rel err"]
    for sigma in cfg["sigmas"]:
        print(f"\nParameter noise sigma = {sigma} (std sigma / sqrt(width) on every parameter):\n")
        print(table(headers, drift_rows(cfg, sigma)))
    print(
        "\nmax abs y: the largest output of the float32 forward pass (the same in every memory "
        "mode); overflow: inf or NaN. rebuild err: max |rebuilt input - true input| over all "
        "repeats (Chain.reconstruction_errors); grad rel err: ||g_constant - g_linear|| / "
        "||g_linear|| over all parameters."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--section", action="append", choices=["memory", "time", "drift"], help="run only these"
    )
    args = parser.parse_args()
    sections = args.section or (["memory", "drift"] if args.quick else ["memory", "time", "drift"])
    jax.config.update("jax_enable_x64", True)  # for the float64 drift rows; every dtype here is explicit
    header("pipejax.invertible benchmarks", args.quick)
    if "memory" in sections:
        memory_section(QUICK if args.quick else FULL)
    if "time" in sections:
        time_section(TIME_QUICK if args.quick else TIME_FULL)
    if "drift" in sections:
        drift_section(DRIFT_QUICK if args.quick else DRIFT_FULL)


if __name__ == "__main__":
    main()
