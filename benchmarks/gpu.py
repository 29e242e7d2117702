"""One accelerator: the pipelined training step beside the composed model and fair baselines.

Run from the repository root on a machine with a GPU (or TPU)::

    python benchmarks/gpu.py                       # full sizes, the MLP model
    python benchmarks/gpu.py --model transformer   # full sizes, a decoder-only transformer
    python benchmarks/gpu.py --size cpu            # moderate sizes that a CPU runs in minutes
    python benchmarks/gpu.py --quick               # a smoke run (any backend, CPU included)

On one device the pipeline runs with ``mesh=None``: the same schedule table on one device,
every stage in turn on each micro-batch (no bubble). Rows for the same stages given as a list
(heterogeneous: a Python loop of direct calls) and for the circular schedule on a one-device
mesh run the other forms of the same work. Two baselines do the pipeline's work without its
machinery: gradient accumulation over the same ``m`` micro-batches in a ``lax.scan`` (the stages
composed, loss and gradients summed, then divided by the batch: the pipeline's loss, a mean of
per-example losses), with no remat (the baseline of ``checkpoint="never"``) and with
``jax.checkpoint`` around each stage call (that of ``"always"``; ``"except_last"`` has none).
``jax.value_and_grad`` of the stages composed on the whole batch is the third reference.

Per program: step time (median of interleaved rounds) and its median per-round ratio to the
composed step and to the matching scan (target: at most 1.10x), model FLOP utilisation, compile
time (trace + lower + compile) and XLA's compiled temp bytes. Model FLOPs are counted
analytically: training = 3x the forward matmul FLOPs (remat recompute is overhead, not model
FLOPs); attention counts QK^T and AV halved for the causal mask. The peak is ``--peak-tflops`` or
a table keyed by the device kind (bfloat16 dense; for the float32 MLP the TF32 dense peak, as a
GPU runs float32 matmuls as TF32 by default); unknown devices (a CPU) print n/a. Every program's
loss is checked against the composed model's first (relative difference printed).

Models (``--model``): ``mlp`` (default), stages of pre-RMSNorm GELU MLP blocks in float32;
``transformer``, stages of decoder blocks (pre-RMSNorm, causal multi-head self-attention by
``jax.nn.dot_product_attention``, a SwiGLU MLP, residuals) with float32 parameters computed in
bfloat16 (``--compute float32``: in float32), on activations ``[batch, seq, width]`` of that
dtype, the loss (per-example mean squared error over seq and width) in float32. Pipeline
speed-ups need several devices and are not measured here.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import jax
import jax.numpy as jnp

import pipejax as pj
from benchmarks._common import interleaved_times, kib, normal, table

# dense peak TFLOP/s per device kind: (bfloat16, float32 run as TF32)
PEAK_TFLOPS = {
    "NVIDIA H200": (989.0, 494.5),
    "NVIDIA H100 80GB HBM3": (989.0, 494.5),
    "NVIDIA A100-SXM4-80GB": (312.0, 156.0),
    "NVIDIA A100-SXM4-40GB": (312.0, 156.0),
}
# (S, L, width, hidden, m, micro, rounds) for the MLP; (..., heads, seq) more for the transformer
SIZES = {
    "mlp": {
        "quick": (4, 1, 64, 128, 4, 8, 3),
        "cpu": (4, 2, 256, 1024, 8, 16, 10),
        "full": (4, 2, 2048, 8192, 8, 32, 15),
    },
    "transformer": {
        "quick": (4, 1, 64, 192, 4, 2, 3, 2, 32),
        "cpu": (4, 1, 128, 352, 8, 2, 10, 4, 128),
        "full": (4, 2, 2048, 5632, 8, 4, 10, 16, 2048),
    },
}
BASELINE = {"never": "scan (no remat)", "always": "scan (jax.checkpoint per stage)"}
TARGET = 1.10


def rms(x):  # pre-RMSNorm, in float32
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def mlp_stage(p, x, key):
    for j in range(p["w"].shape[0]):
        x = x + jax.nn.gelu(rms(x) @ p["w"][j]) @ p["v"][j]  # MLP block with a residual
    return x


def transformer_stage(p, x, key, compute=jnp.bfloat16):
    p = jax.tree.map(lambda a: a.astype(compute), p)
    for j in range(p["qkv"].shape[0]):
        q, k, v = jnp.einsum("btw,wcnh->cbtnh", rms(x) * p["g1"][j], p["qkv"][j])
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jnp.einsum("btnh,nhw->btw", a, p["o"][j])
        h = rms(x) * p["g2"][j]
        x = x + (jax.nn.silu(h @ p["gate"][j]) * (h @ p["up"][j])) @ p["down"][j]
    return x


def mlp(S, L, width, hidden, batch):
    params = {
        "w": normal((S, L, width, hidden), 0, width**-0.5),
        "v": normal((S, L, hidden, width), 1, hidden**-0.5),
    }
    x, t = normal((batch, width), 2), normal((batch, width), 3)
    return SimpleNamespace(
        stage=mlp_stage,
        loss=lambda y, t: jnp.sum((y - t) ** 2, axis=-1),
        params=params,
        args=(params, x, t),
        flops=3 * S * L * 4 * batch * width * hidden,
        tf32=True,  # float32 matmuls: the TF32 peak
        text=f"{S} homogeneous stages of {L} pre-RMSNorm MLP blocks ({width} -> {hidden} -> {width}, "
        "float32)",
    )


def transformer(S, L, width, hidden, batch, heads, seq, compute="bfloat16"):
    dh = width // heads
    params = {
        "qkv": normal((S, L, width, 3, heads, dh), 0, width**-0.5),
        "o": normal((S, L, heads, dh, width), 1, (2 * S * L * width) ** -0.5),
        "gate": normal((S, L, width, hidden), 2, width**-0.5),
        "up": normal((S, L, width, hidden), 3, width**-0.5),
        "down": normal((S, L, hidden, width), 4, (2 * S * L * hidden) ** -0.5),
        "g1": jnp.ones((S, L, width)),
        "g2": jnp.ones((S, L, width)),
    }
    dtype = jnp.dtype(compute)
    x, t = normal((batch, seq, width), 5).astype(dtype), normal((batch, seq, width), 6)
    per_layer = 2 * batch * seq * (4 * width**2 + 3 * width * hidden) + 2 * batch * seq**2 * width
    return SimpleNamespace(
        stage=transformer_stage if compute == "bfloat16" else partial(transformer_stage, compute=dtype),
        loss=lambda y, t: jnp.mean((y.astype(jnp.float32) - t) ** 2, axis=(1, 2)),
        params=params,
        args=(params, x, t),
        flops=3 * S * L * per_layer,
        tf32=compute == "float32",  # bfloat16, or float32 run as TF32
        text=(
            f"{S} homogeneous stages of {L} decoder blocks (width {width}, {heads} heads, SwiGLU "
            f"hidden {hidden}, sequence {seq}; float32 parameters, {compute} compute)"
        ),
    )


def composed(model, S):
    def step(params, x, t):
        def loss(p):
            y = x
            for s in range(S):
                y = model.stage(jax.tree.map(lambda a, s=s: a[s], p), y, None)
            return jnp.mean(model.loss(y, t))

        return jax.value_and_grad(loss)(params)

    return step


def scan_step(model, S, m, remat):
    """Gradient accumulation: the stages composed on each of ``m`` micro-batches in a ``lax.scan``."""
    f = jax.checkpoint(model.stage) if remat else model.stage

    def loss(ps, x, t):
        for p in ps:
            x = f(p, x, None)
        return jnp.sum(model.loss(x, t))

    def step(params, x, t):
        stages = [jax.tree.map(lambda a, s=s: a[s], params) for s in range(S)]

        def body(acc, xt):
            return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss)(stages, *xt)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), stages))
        cut = lambda a: a.reshape(m, -1, *a.shape[1:])
        (total, grads), _ = jax.lax.scan(body, zero, (cut(x), cut(t)))
        n = x.shape[0]
        return total / n, jax.tree.map(lambda *g: jnp.stack(g) / n, *grads)

    return step


OWN_BACKWARD = ("1f1b", "zb-h1", "zb-floor", "interleaved-1f1b", "v-half", "zb-v")  # the training tables
TWO_CHUNKS = ("interleaved-1f1b", "v-half", "zb-v")


def compile_seconds(fn, *args):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0, compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke run (= --size quick)")
    ap.add_argument("--size", choices=["quick", "cpu", "full"], default="full")
    ap.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument(
        "--compute",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the transformer's compute and activation dtype (parameters stay float32)",
    )
    ap.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU (default: by device kind)")
    ap.add_argument(
        "--rows",
        help="comma-separated labels (or label prefixes) of the programs to run; the composed model always "
        "runs (the reference loss), and a row's scan baseline runs with it. Default: every row",
    )
    ap.add_argument("--rounds", type=int, help="timing rounds (default: by size)")
    ap.add_argument("--dump-hlo", metavar="DIR", help="write each program's optimised HLO to DIR/<label>.txt")
    ap.add_argument(
        "--probe-runtime-row",
        action="store_true",
        help="also run 1F1B with stacked stages adding each parameter cotangent into its accumulator row "
        "at a runtime index (decision 0018's next step on a GPU; bitwise the same gradients)",
    )
    opts = ap.parse_args()
    quick = opts.quick or opts.size == "quick"
    size = SIZES[opts.model]["quick" if quick else opts.size]
    S, L, width, hidden, m, micro, rounds, *rest = size
    rounds = opts.rounds or rounds
    if opts.model == "mlp":
        if opts.compute != "bfloat16":
            ap.error("--compute applies to --model transformer (the MLP computes in float32)")
        model = mlp(S, L, width, hidden, m * micro)
    else:
        model = transformer(S, L, width, hidden, m * micro, *rest, compute=opts.compute)
    dev = jax.devices()[0]
    peak = opts.peak_tflops or PEAK_TFLOPS.get(dev.device_kind, (None, None))[model.tf32]
    kind = "--peak-tflops" if opts.peak_tflops else ("TF32" if model.tf32 else "bfloat16") + " dense"
    print(f"## One device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}\n")
    print(
        f"{model.text}, batch {m * micro} in m = {m} micro-batches of {micro}; `mesh=None`. "
        f"Model FLOPs per step {model.flops / 1e12:.3g} TFLOP; peak "
        + (f"{peak:g} TFLOP/s ({kind})." if peak else "unknown (MFU n/a).")
        + "\n"
    )
    stage, sq, args = model.stage, model.loss, model.args
    variants = {"composed (jax.value_and_grad)": (composed(model, S), args, None)}
    for ckpt, label in BASELINE.items():
        variants[label] = (scan_step(model, S, m, ckpt == "always"), args, None)
    # every schedule; the two-chunk ones (interleaved 1F1B and the V's) hold S / 2 stages a device
    # of a table for S / 2 devices, run on this one
    for name, ckpt in [
        ("gpipe", "never"),
        ("gpipe", "except_last"),
        ("gpipe", "always"),
        *((name, ckpt) for name in OWN_BACKWARD for ckpt in ("always", "never")),
    ]:
        if quick and ckpt == "always" and name not in ("gpipe", "1f1b"):
            continue  # the smoke run: each schedule once (the tests run every mode of every one)
        repeats = 2 if name in TWO_CHUNKS else 1
        pipe = pj.pipeline(stage, num_stages=S, chunks=m, schedule=name, repeats=repeats, checkpoint=ckpt)
        variants[f"{name} {ckpt}"] = (pipe.value_and_grad(sq), args, BASELINE.get(ckpt))
    # the same stages given as a list (one function per stage: a Python loop of direct calls), and
    # the same work on a one-device mesh (the circular table, S stages on one device)
    as_list = ([jax.tree.map(lambda a, s=s: a[s], model.params) for s in range(S)], *args[1:])
    for name in ("gpipe", "1f1b"):
        pipe = pj.pipeline([stage] * S, chunks=m, schedule=name, checkpoint="always")
        variants[f"{name} always, stages as a list"] = (pipe.value_and_grad(sq), as_list, BASELINE["always"])
    mesh = jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1])
    pipe = pj.pipeline(
        stage, num_stages=S, chunks=m, schedule="circular", repeats=S, mesh=mesh, checkpoint="always"
    )
    variants["circular always, one-device mesh"] = (pipe.value_and_grad(sq), args, BASELINE["always"])
    if opts.probe_runtime_row:
        for ckpt in ("always", "never"):
            pipe = pj.pipeline(stage, num_stages=S, chunks=m, schedule="1f1b", checkpoint=ckpt)
            fn = runtime_row(pipe.value_and_grad(sq))
            variants[f"1f1b {ckpt}, accumulator row at a runtime index"] = (fn, args, BASELINE[ckpt])
    variants = select(variants, opts.rows, ap)
    compiled, rows, failed = {}, [], []
    ref_loss = None
    for label, (fn, fn_args, _) in variants.items():
        try:
            secs, c = compile_seconds(fn, *fn_args)
            loss = float(c(*fn_args)[0])
        except Exception as e:  # out of memory on a large model: the row says so, the others run
            failed.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print(f"# {failed[-1]}", file=sys.stderr, flush=True)
            continue
        compiled[label] = (c, fn_args)
        ref_loss = loss if ref_loss is None else ref_loss
        mem = c.memory_analysis()
        rel = f"{abs(loss - ref_loss) / abs(ref_loss):.1e}"
        rows.append([label, f"{secs:.2f}", kib(mem.temp_size_in_bytes), rel])
        print(f"# {label}: compile {secs:.2f} s, temp {rows[-1][2]} KiB", file=sys.stderr, flush=True)
        if opts.dump_hlo:
            out = Path(opts.dump_hlo)
            out.mkdir(parents=True, exist_ok=True)
            (out / (re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_") + ".txt")).write_text(c.as_text())
    # each program runs on its own arguments (`interleaved_times` passes the same to all)
    calls = {label: (lambda *_, c=c, a=a: c(*a)) for label, (c, a) in compiled.items()}
    times = interleaved_times(calls, (), rounds=rounds)
    verdicts = []
    composed_t = times.get("composed (jax.value_and_grad)")
    for row in rows:
        tt, base = times[row[0]], variants[row[0]][2]
        base = base if base in times else None
        step = statistics.median(tt)
        vs_scan = statistics.median(list(tt / times[base])) if base else None
        if base:
            verdicts.append((row[0], vs_scan))
        row[2:2] = [
            f"{step * 1e3:.2f}",
            f"{statistics.median(list(tt / composed_t)):.2f}" if composed_t is not None else "-",
            f"{vs_scan:.2f}" if base else "-",
            f"{model.flops / step / (peak * 1e12):.1%}" if peak else "n/a",
        ]
    heads = ["program", "compile s", "step ms", "step / composed", "step / scan", "MFU", "temp KiB"]
    print(table([*heads, "loss rel. diff"], rows, align="lrrrrrrr"))
    over = [f"{label} ({r:.2f}x)" for label, r in verdicts if r > TARGET]
    print(
        f"\nRows within {TARGET:.2f}x of their scan (never: no remat, always: jax.checkpoint per "
        f"stage): {len(verdicts) - len(over)} of {len(verdicts)}"
        + (f"; over: {', '.join(over)}." if over else ".")
    )
    for line in failed:
        print(f"Failed: {line}")


def runtime_row(fn):
    """``fn`` traced with the stacked stages' ``add_row`` reading and writing the accumulator's row
    at a runtime index (an optimization barrier hides the constant from XLA), so that XLA:GPU sees
    a ``dynamic-slice`` and a ``dynamic-update-slice`` at the same index, the pattern it updates in
    place; the library adds at a static index (``a.at[s].add``), which XLA:GPU rewrites whole
    (decision 0018). A probe: it patches the kind while ``fn`` is traced."""
    from jax import lax

    from pipejax._src.kinds import HomogeneousKind

    def add_row(self, acc, s, delta):
        r = lax.optimization_barrier(jnp.int32(s))

        def one(a, t):
            row = lax.dynamic_index_in_dim(a, r, keepdims=False)
            return lax.dynamic_update_index_in_dim(a, row + t.astype(a.dtype), r, 0)

        return jax.tree.map(one, acc, delta)

    def traced(*args):
        static = HomogeneousKind.add_row
        HomogeneousKind.add_row = add_row
        try:
            return fn(*args)
        finally:
            HomogeneousKind.add_row = static

    return traced


def select(variants, rows, ap):
    """The programs ``--rows`` names (labels or label prefixes), the composed model and their scans."""
    if not rows:
        return variants
    wanted = [w.strip() for w in rows.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(label.startswith(w) for label in variants)]
    if unknown:
        ap.error(f"--rows: no program's label starts with {unknown}; the labels are {list(variants)}")
    keep = {"composed (jax.value_and_grad)"}
    for label, (_, _, base) in variants.items():
        if any(label.startswith(w) for w in wanted):
            keep |= {label} | ({base} if base else set())
    return {label: v for label, v in variants.items() if label in keep}


if __name__ == "__main__":
    main()
