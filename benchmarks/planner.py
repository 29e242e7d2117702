"""The planner's sweeps: what `pj.plan_pipeline` chooses for three models under two budgets.

Run from the repository root::

    .venv/bin/python benchmarks/planner.py           # the three models (a few minutes on 2 cores)
    .venv/bin/python benchmarks/planner.py --quick   # one model, estimated bytes: a smoke run

Models (on 4 fake CPU devices, float32, a batch of 64): ``uniform``, 8 equal ``tanh`` blocks
32 wide; ``embedding_blocks_head``, a 512-row embedding (a gather: no flops), 6 blocks and a
256-wide head (many flops); ``stateful``, 8 blocks every other one with BatchNorm (state: its
running statistics). Each is planned over every schedule, ``chunks`` 2 and 8 and checkpoint
``"always"`` and ``"never"``, its bytes compiled; then the same sweep is chosen again under a
budget halfway between the smallest candidate's bytes and the loose choice's
(:meth:`pipejax.PipelinePlan.under`). Each sweep prints fastest first (``exhaustive=True``:
every candidate measured), the choice and the runner-up marked; steps are in flops (the layers'
``pj.layer_costs``), temp bytes per device. A last table counts the candidates the default plan
measures (only those its choice depends on) and its time, against the exhaustive sweep's.
``tests/test_planner.py`` checks these models' plans against a naive reference.
"""

from __future__ import annotations

import argparse
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

import pipejax as pj  # noqa: E402
from benchmarks._common import header, section, table  # noqa: E402

CHUNKS = (2, 8)
SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b", "v-half", "zb-v")
MODES = ("always", "never")  # (the planner's mode sweep covers except_last too)
HEADROOM = 1.25


def block(p, x, key):
    return jnp.tanh(x @ p["w"] + p["b"][None])


def embed(p, tokens, key):
    return p[tokens]  # a gather: no flops, a big table


def head(p, x, key):
    return x @ p  # a wide projection: many flops


def uniform():
    k = jax.random.split(jax.random.key(0), 8)
    params = [{"w": jax.random.normal(k[i], (32, 32)) * 0.3, "b": jnp.zeros(32)} for i in range(8)]
    return [block] * 8, params, jax.random.normal(jax.random.key(1), (64, 32))


def embedding_blocks_head():
    k = jax.random.split(jax.random.key(2), 8)
    blocks = [{"w": jax.random.normal(k[i], (32, 32)) * 0.3, "b": jnp.zeros(32)} for i in range(6)]
    params = [jax.random.normal(k[6], (512, 32)), *blocks, jax.random.normal(k[7], (32, 256))]
    return [embed, *([block] * 6), head], params, jnp.arange(64) % 512


def norm_block(p, x, key, state, mask):  # a stateful layer: dense, BatchNorm, tanh
    h, moments = pj.batch_norm(x @ p["w"], state, train=True, mask=mask, scale=p["g"], bias=p["b"])
    return jnp.tanh(h), moments


def plain_block(p, x, key, state, mask):  # a stateful layer without state
    return block(p, x, key), None


def stateful():
    k = jax.random.split(jax.random.key(3), 8)
    params, state, layers = [], [], []
    for i in range(8):
        w = {"w": jax.random.normal(k[i], (32, 32)) * 0.3}
        if i % 2:
            params.append({**w, "b": jnp.zeros(32)})
            state.append(None)
            layers.append(plain_block)
        else:
            params.append({**w, "g": jnp.ones(32), "b": jnp.zeros(32)})
            state.append(pj.batch_norm_init(32))
            layers.append(norm_block)
    return layers, params, jax.random.normal(jax.random.key(4), (64, 32)), state


def budgets(plan):
    """A loose budget and a tight one: halfway between the smallest candidate's bytes and the
    loose choice's (with the headroom)."""
    smallest = min(c.temp_bytes for c in plan.sweep)
    return HEADROOM * (smallest + plan.best.temp_bytes) / 2


def measured(plan) -> int:
    return sum(c.temp_bytes is not None for c in plan.sweep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, estimated bytes: a smoke run")
    args = ap.parse_args()
    header("The planner's sweeps", args.quick)
    mesh = jax.make_mesh((N,), ("stage",))
    models = {"uniform": uniform} if args.quick else {
        "uniform": uniform, "embedding_blocks_head": embedding_blocks_head, "stateful": stateful,
    }  # fmt: skip
    rows, against = [], []
    for name, model in models.items():
        layers, params, x, *state = model()
        options = dict(
            chunks=CHUNKS, checkpoints=MODES, headroom=HEADROOM, layer_state=state[0] if state else None
        )
        if args.quick:
            options.update(memory="estimate", schedules=SCHEDULES, checkpoints=("always",))
        else:
            options.update(schedules=SCHEDULES)
        # as a user plans (bytes measured where the choice needs them), then the whole sweep
        t0 = time.perf_counter()
        lazy = pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e9, **options)
        t1 = time.perf_counter()
        loose = pj.plan_pipeline(
            layers, params, x, mesh=mesh, memory_per_device=1e9, exhaustive=True, **options
        )
        t2 = time.perf_counter()
        tight_budget = budgets(loose)
        tight = loose.under(tight_budget, headroom=HEADROOM)
        t3 = time.perf_counter()
        lazy_tight = lazy.under(tight_budget, headroom=HEADROOM)
        t4 = time.perf_counter()
        for label, full, got, seconds in (
            ("loose (1e9 bytes)", loose, lazy, (t1 - t0, t2 - t1)),
            (f"tight ({tight_budget / 1024:,.1f} KiB)", tight, lazy_tight, (t4 - t3, None)),
        ):
            same = (got.best, got.runner_up) == (full.best, full.runner_up)
            rows.append([
                name, label, len(full.sweep), measured(got), f"{seconds[0]:.1f}",
                "-" if seconds[1] is None else f"{seconds[1]:.1f}", same,
            ])  # fmt: skip
        if not args.quick and not state:  # the estimate's choices against the compiled sweep's
            against += estimated_against_compiled(name, layers, params, x, mesh, options, loose, tight_budget)
        section(f"{name}: a loose budget (1e9 bytes)")
        print(loose.table())
        section(f"{name}: a tight budget ({tight_budget / 1024:,.1f} KiB, headroom {HEADROOM})")
        print(tight.table())
    section("Measured as needed against the whole sweep")
    print(
        "Candidates measured by the default plan (bytes in order of the step, until two fit) and "
        "its seconds, against the exhaustive sweep's (`exhaustive=True`); the tight plan is the "
        "default plan's `under(budget)`, which measures only what the loose one had not. "
        "'same choice': the best and the runner-up are the exhaustive sweep's."
    )
    print()
    heads = ["model", "budget", "candidates", "measured", "seconds", "exhaustive seconds", "same choice"]
    print(table(heads, rows, align="llrrrrl"))
    if against:
        section("Estimated bytes against compiled: the same choice?")
        print(
            '`memory="estimate"` (pj.memory_estimate, nothing compiled) against the compiled sweep '
            "above, every schedule: the estimate / XLA range over the sweep's candidates (the "
            "schedules that own the backward, and autodiff's), the "
            "estimate's choice under each budget, its compiled bytes and whether they fit, and the "
            "compiled sweep's choice. The stateful model is left out (the estimate refuses state)."
        )
        print()
        heads = ["model", "budget", "estimate / XLA, training tables", "estimate / XLA, GPipe and circular"]
        heads += ["estimate's choice", "its XLA KiB", "fits", "compiled choice"]
        print(table(heads, against, align="llllrrll"))


def estimated_against_compiled(name, layers, params, x, mesh, options, loose, tight_budget) -> list:
    """Rows of the last table: the plan chosen on estimated bytes against the compiled one."""
    estimate = pj.plan_pipeline(layers, params, x, mesh=mesh, memory_per_device=1e9, exhaustive=True,
                                **{**options, "memory": "estimate"})  # fmt: skip
    xla = {c._key: c.temp_bytes for c in loose.sweep}
    forward = {"gpipe", "circular"}  # autodiff of a forward table; the others own the backward

    def span(keep):
        ratios = [c.temp_bytes / xla[c._key] for c in estimate.sweep if keep(c.schedule)]
        return f"{min(ratios):.2f}-{max(ratios):.2f}"

    spans = [span(lambda s: s not in forward), span(lambda s: s in forward)]
    label = lambda c: "-" if c is None else f"{c.schedule} m={c.chunks} {c.checkpoint}"
    out = []
    tight = loose.under(tight_budget, headroom=HEADROOM)
    for budget, text, compiled in (
        (1e9, "loose (1e9 bytes)", loose),
        (tight_budget, f"tight ({tight_budget / 1024:,.1f} KiB)", tight),
    ):
        best = estimate.under(budget, headroom=HEADROOM).best
        bytes_ = None if best is None else xla[best._key]
        fits = bytes_ is not None and bytes_ * HEADROOM <= budget
        kib = "-" if bytes_ is None else f"{bytes_ / 1024:,.1f}"
        out.append([name, text, *spans, label(best), kib, fits, label(compiled.best)])
    return out


if __name__ == "__main__":
    main()
