"""pipejax against a MaxText-style pipeline: compiled temp bytes per device of one training step.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/maxtext_style.py            # m = 4, 8, 16, 32 (minutes)
    PYTHONPATH=. .venv/bin/python benchmarks/maxtext_style.py --quick    # m = 4, 8 (smoke run)
    PYTHONPATH=. .venv/bin/python benchmarks/maxtext_style.py --all-modes  # + estimate of every mode

Every pipejax row is also set beside ``pj.memory_estimate``'s prediction (the formula of
``docs/pipeline.md``, "Memory per device"); a ratio outside 0.85-1.15 (``TOLERANCE``) is flagged
and fails the run.
``--all-modes`` also compiles gpipe, circular, 1f1b and zb-h1 with ``checkpoint="never"`` (and
zb-h1 and ``"except_last"`` where they apply) for that check.

The reference ("MaxText-style") is written here from the published design of MaxText's pipeline
layer (``src/maxtext/layers/pipeline.py``; no code copied), in ``shard_map`` form:

- weights stacked on a leading stage axis sharded over the ``stage`` mesh axis ((repeats, stages,
  ...) for the circular variant); all stages run at once, ``jax.vmap`` over the (local) stage axis;
- a rotating state buffer of stage inputs, ``lax.scan`` over ``m + n - 1`` iterations (GPipe) or
  ``v m + n - 1`` (circular, ``v`` repeats); each iteration ``jax.checkpoint``-ed with a policy that
  saves only the stages' input (``checkpoint_name(..., "iteration_input")``), so the backward
  recomputes the iteration from it;
- the shift to the next stage with ``lax.ppermute`` (shift right for GPipe, rotate right for the
  circular variant);
- one input/output buffer ``state_io`` of shape (n, m / n, micro, ...), sharded over the stage
  axis: at iteration ``i`` stage 0 reads slot ``i mod (m / n)`` of its shard (micro-batch ``i``),
  then that slot shifts one stage left and the last stage writes its output into it; at the end
  the outputs sit in their original blocks, so one local roll of the slot axis puts them in order
  and the output stays sharded over the stage axis (never replicated);
- the circular variant keeps MaxText's circular storage: every device stores the rotated outputs
  of the last ``m`` iterations in a buffer of ``m`` micro-batches (only when ``m > n``), written
  one iteration late from a "mover" buffer, from which stage 0 reads micro-batch ``i mod m`` on its
  later repeats (for ``m == n`` the rotated outputs feed stage 0 directly). ``m`` must be a
  multiple of ``n``; stage ``d`` at iteration ``i`` uses the weights of repeat
  ``max(i - d, 0) // m`` (clipped), picked by a dynamic index.

Bubble iterations compute on zeros or stale values, as MaxText's do; their outputs never reach the
loss. The model (issue 23): 8 pre-RMSNorm MLP blocks ``h + W2 gelu(W1 rmsnorm(h))``, seq 32, emb 64,
mlp 128, float32, micro-batches of 2 sequences, 4 fake CPU devices. The loss is the batch mean of
the per-sequence sum of squared differences to fixed targets; the metric is
``jax.jit(value_and_grad(loss)).lower(...).compile().memory_analysis().temp_size_in_bytes`` (per
device: the compiled program is one device's SPMD program).
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
import numpy as np  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pipejax as pj  # noqa: E402
from benchmarks._common import header, kib, normal, section, table  # noqa: E402

LAYERS, SEQ, EMB, MLP, MICRO = 8, 32, 64, 128, 2
REPEATS = 2  # circular variants: 8 stages of 1 block on 4 devices
# How far the estimate may be from XLA's bytes. ``R`` is what ``jax.vjp`` keeps, so it follows
# JAX's differentiation rules while XLA's bytes follow its own fusion: on jax 0.10.2 the rows
# below are 0.935-1.066; jax 0.11.2 keeps one gelu residual fewer per block (R 481 -> 417 KiB
# per stage) where XLA holds the same buffers, and the m = 4 rows fall to 0.894-0.900.
TOLERANCE = 0.15
AXIS = "stage"


# --- the model ------------------------------------------------------------------------------------


def block(p, h):
    """A pre-RMSNorm MLP block with a residual: ``h + W2 gelu(W1 rmsnorm(h))``."""
    z = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * p["scale"]
    return h + jax.nn.gelu(z @ p["w1"]) @ p["w2"]


def stage_fn(p, h, key=None):
    """The blocks of one stage in turn; ``p``'s leaves have a leading layer axis."""
    for j in range(p["w1"].shape[0]):
        h = block(jax.tree.map(lambda a, j=j: a[j], p), h)
    return h


def init_params():
    """The 8 blocks' parameters stacked on a leading layer axis (8, ...)."""
    return {
        "scale": 1.0 + normal((LAYERS, EMB), 0, 0.1),
        "w1": normal((LAYERS, EMB, MLP), 1, EMB**-0.5),
        "w2": normal((LAYERS, MLP, EMB), 2, MLP**-0.5),
    }


def sq(y, t):
    """Per-sequence loss: the sum of squared differences."""
    return jnp.sum((y - t) ** 2, axis=(-2, -1))


def composed_loss(params, x, t):
    """The un-pipelined model on the whole batch: the numerical reference."""
    return jnp.mean(sq(stage_fn(params, x), t))


# --- the MaxText-style reference ------------------------------------------------------------------


def maxtext_style(mesh, m: int, repeats: int = 1):
    """``loss(params, x, t)`` through a MaxText-style pipeline over the ``N`` devices of ``mesh``.

    ``params`` leaves have leading axes (N, layers per stage, ...) for ``repeats == 1`` and
    (repeats, N, layers per stage, ...) otherwise (entry [r, d] is stage r N + d).
    """
    n, v = N, repeats
    if m % n:
        raise ValueError(f"MaxText-style pipeline: micro-batches m={m} must be a multiple of N={n}.")
    per_stage = m // n  # state_io slots per device
    iterations = v * m + n - 1
    circ_storage = v > 1 and m > n  # MaxText's condition for its circular buffer
    shift_right = [(d, d + 1) for d in range(n - 1)]
    rotate_right = [(d, (d + 1) % n) for d in range(n)]
    shift_left = [(d + 1, d) for d in range(n - 1)]
    policy = jax.checkpoint_policies.save_only_these_names("iteration_input")
    wspec = P(AXIS) if v == 1 else P(None, AXIS)

    def run(params, state_io):
        # per device: params (1, L, ...) or (v, 1, L, ...); state_io (1, m/n, micro, seq, emb)
        d = jax.lax.axis_index(AXIS)
        act = state_io[:, 0]  # (1, micro, seq, emb): one stage input per local stage
        shift = jnp.zeros_like(act)  # zeros_like keeps `act`'s varying type over the stage axis
        # MaxText's circular storage, and its "mover": the last iteration's outputs, stored one
        # iteration late (so the ppermute may overlap the next iteration's compute)
        circ = (jnp.zeros_like(act, shape=(m, *act.shape)), jnp.zeros_like(act)) if circ_storage else None

        def iteration(carry, i):
            state_io, shift, circ = carry
            slot = i % per_stage
            io_slice = jax.lax.dynamic_index_in_dim(state_io, slot, axis=1, keepdims=False)
            if v == 1:
                later = shift  # device 0's shift is zeros: bubble
            else:
                later = (
                    jax.lax.dynamic_index_in_dim(circ[0], i % m, keepdims=False) if circ_storage else shift
                )
            first = jnp.where(i < m, io_slice, later)
            stages_in = checkpoint_name(jnp.where(d == 0, first, shift), "iteration_input")
            if v == 1:
                w = params
            else:  # the repeat this device's stage works on at iteration i
                r = jnp.clip(jnp.maximum(i - d, 0) // m, 0, v - 1)
                w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), params)
            out = jax.vmap(stage_fn)(w, stages_in)  # every stage at once
            new_shift = jax.lax.ppermute(out, AXIS, shift_right if v == 1 else rotate_right)
            if circ_storage:  # every device stores the rotated outputs of the iteration before
                moved_out = jax.lax.ppermute(circ[1], AXIS, rotate_right)
                circ = jax.lax.dynamic_update_index_in_dim(circ[0], moved_out, (i - n) % m, axis=0), out
            moved = jax.lax.ppermute(io_slice, AXIS, shift_left)  # the slot moves one stage left
            moved = jnp.where(d == n - 1, out, moved)  # and takes the last stage's output
            state_io = jax.lax.dynamic_update_index_in_dim(state_io, moved, slot, axis=1)
            return (state_io, new_shift, circ), None

        body = jax.checkpoint(iteration, policy=policy)
        (state_io, _, _), _ = jax.lax.scan(body, (state_io, shift, circ), jnp.arange(iterations))
        # output j sits on device j // (m/n), slot (j + n - 1) mod (m/n): roll the slots back
        return jnp.roll(state_io, -(n - 1), axis=1)

    piped = jax.shard_map(run, mesh=mesh, in_specs=(wspec, P(AXIS)), out_specs=P(AXIS))

    def loss(params, x, t):
        state_io = x.reshape(n, per_stage, MICRO, *x.shape[1:])
        y = piped(params, state_io).reshape(x.shape)
        return jnp.mean(sq(y, t))

    return loss


# --- the variants ---------------------------------------------------------------------------------


def setup(name: str, m: int, mesh, checkpoint: str = "always"):
    """(value_and_grad function, its arguments) of a variant at ``m`` micro-batches."""
    params = init_params()
    x, t = normal((m * MICRO, SEQ, EMB), 3), normal((m * MICRO, SEQ, EMB), 4, 0.5)
    x, t = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, t))
    put = lambda tree, spec: jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)
    if name == "MaxText-style":
        stacked = jax.tree.map(lambda a: a.reshape(N, LAYERS // N, *a.shape[1:]), params)
        return jax.value_and_grad(maxtext_style(mesh, m)), (put(stacked, P(AXIS)), x, t)
    if name == "MaxText-style circular":
        stacked = jax.tree.map(lambda a: a.reshape(REPEATS, N, LAYERS // (N * REPEATS), *a.shape[1:]), params)
        return jax.value_and_grad(maxtext_style(mesh, m, REPEATS)), (put(stacked, P(None, AXIS)), x, t)
    pipe, stacked = pipejax_variant(name, m, mesh, checkpoint)
    return pipe.value_and_grad(sq), (pipe.place(stacked), x, t)


def pipejax_variant(name: str, m: int, mesh, checkpoint: str = "always"):
    """The pipeline of a pipejax variant and the model's parameters stacked for it (``name``: a
    schedule; "circular" and "interleaved-1f1b" with ``REPEATS`` stages per device)."""
    looped = name in ("circular", "interleaved-1f1b")
    kw = {"schedule": name, "repeats": REPEATS} if looped else {"schedule": name}
    stages = N * REPEATS if looped else N
    pipe = pj.pipeline(stage_fn, num_stages=stages, chunks=m, checkpoint=checkpoint, mesh=mesh, **kw)
    stacked = jax.tree.map(lambda a: a.reshape(stages, LAYERS // stages, *a.shape[1:]), init_params())
    return pipe, stacked


ROWS = [  # (label, setup name, reference label)
    ("MaxText-style", "MaxText-style", None),
    ("pipejax gpipe", "gpipe", "MaxText-style"),
    ("MaxText-style circular (2 repeats)", "MaxText-style circular", None),
    ("pipejax circular (2 repeats)", "circular", "MaxText-style circular (2 repeats)"),
    ("pipejax 1f1b", "1f1b", "MaxText-style"),
]
RATIO_LABELS = {
    "pipejax gpipe": "ratio gpipe / MaxText-style",
    "pipejax circular (2 repeats)": "ratio circular / MaxText-style circular",
    "pipejax 1f1b": "ratio 1f1b / MaxText-style",
}


def compile_all(ms, mesh):
    """Per (row, m): (compiled step, its arguments, temp bytes, trace+lower+compile seconds)."""
    got = {}
    for label, name, _ in ROWS:
        for m in ms:
            f, args = setup(name, m, mesh)
            t0 = time.perf_counter()
            compiled = jax.jit(f).lower(*args).compile()
            seconds = time.perf_counter() - t0
            got[label, m] = (compiled, args, compiled.memory_analysis().temp_size_in_bytes, seconds)
            print(f"  compiled {label}, m={m}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return got


def check(got, m: int) -> bool:
    """Every variant's loss and gradients at ``m`` against the composed model's; prints a table."""
    args = got[ROWS[0][0], m][1]
    x, t = args[1], args[2]
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(composed_loss))(init_params(), x, t)
    rows, ok = [], True
    for label, _, _ in ROWS:
        compiled, args, _, _ = got[label, m]
        loss, grads = compiled(*args)
        loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
        errs = []
        for k, r in ref_grads.items():
            g = np.asarray(grads[k]).reshape(r.shape)  # any stage layout flattens to (8, ...)
            errs.append(float(np.max(np.abs(g - r)) / np.max(np.abs(r))))
        passed = loss_err <= 1e-5 and max(errs) <= 1e-5
        ok &= passed
        rows.append(
            [label, f"{float(loss):.6f}", f"{loss_err:.1e}", f"{max(errs):.1e}", "yes" if passed else "NO"]
        )
    print(f"\nm={m}: the composed model's loss is {float(ref_loss):.6f}.\n")
    print(table(["variant", "loss", "loss rel. err", "grad rel. err", "pass"], rows, align="lrrrl"))
    return ok


def memory(got, ms) -> None:
    section("Memory: compiled temp bytes per device of one training step (KiB)")
    act = MICRO * SEQ * EMB * 4
    print(
        f"{LAYERS} pre-RMSNorm MLP blocks (seq {SEQ}, emb {EMB}, mlp {MLP}, float32) on {N} fake CPU\n"
        f"devices; micro-batches of {MICRO} sequences (one activation: {kib(act)} KiB). GPipe rows:\n"
        f"{N} stages of {LAYERS // N} blocks; circular rows: {N * REPEATS} stages of "
        f"{LAYERS // (N * REPEATS)} block, {REPEATS} per device.\n"
        "pipejax: checkpoint='always'.\n"
        "Ratio rows: pipejax / the MaxText-style row of the same kind (1f1b against GPipe's).\n"
    )
    rows = []
    for label, _, _ in ROWS:
        rows.append([label, *(kib(got[label, m][2]) for m in ms)])
    for label, _, ref in ROWS:
        if ref is not None:
            rows.append([RATIO_LABELS[label], *(f"{got[label, m][2] / got[ref, m][2]:.2f}x" for m in ms)])
    print(table(["variant", *(f"m={m}" for m in ms)], rows, align="l" + "r" * len(ms)))


PIPEJAX = {"pipejax gpipe": "gpipe", "pipejax circular (2 repeats)": "circular", "pipejax 1f1b": "1f1b"}
EXTRA_MODES = [  # --all-modes: (schedule, checkpoint) beside the "always" rows above
    ("zb-h1", "always"),
    ("gpipe", "never"),
    ("circular", "never"),
    ("1f1b", "never"),
    ("zb-h1", "never"),
    ("gpipe", "except_last"),
    ("circular", "except_last"),
]


def estimates(got, ms, mesh, all_modes: bool) -> bool:
    """``pj.memory_estimate`` beside XLA's temp bytes for every pipejax row; True if all within
    ``TOLERANCE``."""
    section("Estimate: pj.memory_estimate against XLA's temp bytes (KiB per device)")
    print(
        'The formula of docs/pipeline.md ("Memory per device"), from A, R, O and P measured on the\n'
        "stages with jax.eval_shape; ratio = estimate / XLA. Flag: OUT when the ratio leaves "
        f"{1 - TOLERANCE:.2f}-{1 + TOLERANCE:.2f}.\n"
    )
    cells = [(s, "always", got[label, m][2], m) for label, s in PIPEJAX.items() for m in ms]
    for name, mode in EXTRA_MODES if all_modes else []:
        for m in ms:
            f, args = setup(name, m, mesh, mode)
            cells.append(
                (name, mode, jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes, m)
            )
    rows, ok = [], True
    for name, mode, temp, m in cells:
        pipe, stacked = pipejax_variant(name, m, mesh, mode)
        est = pj.memory_estimate(pipe, stacked, jax.ShapeDtypeStruct((m * MICRO, SEQ, EMB), jnp.float32))
        ratio = est.total / temp
        inside = abs(ratio - 1) <= TOLERANCE
        ok &= inside
        terms = (
            f"{kib(est.stash)} + {kib(est.work)} + {kib(est.outputs)} + {kib(est.loop)} + {kib(est.params)}"
        )
        rows.append(
            [name, mode, m, kib(temp), kib(est.total), f"{ratio:.3f}", "ok" if inside else "OUT", terms]
        )
    head = ["schedule", "checkpoint", "m", "XLA KiB", "estimate KiB", "ratio", "flag"]
    print(table([*head, "stash + work + outputs + loop + params"], rows, align="llrrrrll"))
    return ok


def compile_times(got, ms) -> None:
    section("Compile time: trace + lower + compile seconds (one compile each, noisy)")
    print("One compile per cell on a shared 2-core machine: noisy, read only large differences.\n")
    rows = [[label, *(f"{got[label, m][3]:.1f}" for m in ms)] for label, _, _ in ROWS]
    print(table(["variant", *(f"m={m}" for m in ms)], rows, align="l" + "r" * len(ms)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m = 4, 8 only: a smoke run")
    ap.add_argument("--all-modes", action="store_true", help="estimate check of every schedule and mode")
    args = ap.parse_args(argv)
    header("pipejax against a MaxText-style pipeline", args.quick)
    ms = (4, 8) if args.quick else (4, 8, 16, 32)
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    start = time.perf_counter()
    got = compile_all(ms, mesh)
    section("Numerical check against the composed model")
    print(
        "Relative errors: |loss - ref| / |ref|, and per gradient leaf max |g - ref| / max |ref| (the\n"
        "largest over the leaves). Pass: both <= 1e-5. m=8 also runs the circular reference's\n"
        f"circular storage (used only when m > {N})."
    )
    ok = all([check(got, m) for m in ms[:2]])
    memory(got, ms)
    close = estimates(got, ms, mesh, args.all_modes)
    compile_times(got, ms)
    print(f"\nTotal {time.perf_counter() - start:.1f} s.")
    if not ok:
        raise SystemExit("a variant's loss or gradients differ from the composed model's")
    if not close:
        raise SystemExit(
            f"pj.memory_estimate is more than {TOLERANCE:.0%} from XLA's temp bytes (flagged OUT above)"
        )


if __name__ == "__main__":
    main()
