"""Compile time of a pipelined Flax train step against the plain one (the Transformer LM example).

The model is ``examples/train_transformer_lm.py``'s: token and position embedding, 8 pre-norm
Transformer blocks (masked self-attention, MLP, dropout), head. Three variants:

* **pipelined, mask as side input**: the example's model. The blocks run in a ``LinenPipeline`` of
  4 stages on 4 simulated CPU devices (``chunks`` micro-batches), and lm1b's decoder mask (causal
  and padding, ``(B, 1, L, L)``) reaches them as ``context={"decoder_mask": mask}``;
* **pipelined, mask built in each block**: the same pipeline whose blocks build a causal mask
  themselves (no side input; what the example did before side inputs, and it cannot see padding);
* **plain**: the example's unpipelined model on one device, the mask passed to every block.

The train step is ``value_and_grad`` of the loss (dropout on) plus an AdamW update, jitted. Each
of the three phases is timed separately, for a fresh function each time (no cache can be hit),
the variants in turn (the order reversed every other round):

* trace: ``jax.jit(step).trace(*args)`` (Python: Flax, the pipeline's construction, jaxpr);
* lower: ``traced.lower()`` (jaxpr -> StableHLO);
* compile: ``lowered.compile()`` (XLA).

Run ``python benchmarks/flax_compile.py`` (3 rounds) or ``--quick`` (1 round, the same model).
The machine is shared and the numbers are wall times: compare the columns of one run.
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_transformer_lm as lm
from _common import section, table

from pipejax.flax import LinenPipeline


class CausalBlock(nn.Module):
    """The example's block with a causal mask built inside it (no side input, no padding mask)."""

    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2], jnp.int32))
        return lm.Block(name="block")(h, mask, deterministic)


class InBlockMaskLM(nn.Module):
    """The example's pipelined model, its blocks building their own mask."""

    vocab: int
    mesh: jax.sharding.Mesh
    chunks: int

    @nn.compact
    def __call__(self, ids, deterministic: bool = True):
        positions = self.param("positions", nn.initializers.normal(0.02), (lm.SEQ_LEN, lm.D_MODEL))
        h = nn.Embed(self.vocab, lm.D_MODEL)(ids) + positions[None, : ids.shape[1]]
        blocks = [CausalBlock() for _ in range(lm.BLOCKS)]
        stack = LinenPipeline(
            blocks, num_stages=lm.NUM_STAGES, chunks=self.chunks, checkpoint="except_last", mesh=self.mesh
        )
        return nn.Dense(self.vocab)(nn.LayerNorm()(stack(h, deterministic=deterministic)))


def phases(model, params, opt_state, x, y, key, mesh):
    """Seconds to trace, lower and compile a fresh jitted train step of ``model``."""
    optimizer = optax.adamw(3e-3, weight_decay=0.01)

    def step(params, opt_state, x, y, key):  # a new function object: nothing cached
        loss, grads = jax.value_and_grad(lm.loss_fn, argnums=1)(model, params, x, y, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    out = {}
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        traced = jax.jit(step).trace(params, opt_state, x, y, key)
        out["trace"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered = traced.lower()
        out["lower"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered.compile()
        out["compile"] = time.perf_counter() - start
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds

    text = lm.generate_text(400)
    vocab = lm.Vocab(text)
    x, y = next(lm.batches(vocab.encode(text), args.batch, seed=1))
    mesh = jax.make_mesh((lm.NUM_STAGES,), ("stage",))
    one = jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1])
    variants = {
        "pipelined, mask as side input": (lm.LanguageModel(len(vocab), mesh=mesh, chunks=args.chunks), mesh),
        "pipelined, mask built in each block": (InBlockMaskLM(len(vocab), mesh, args.chunks), mesh),
        "plain (one device)": (lm.LanguageModel(len(vocab), pipelined=False), one),
    }
    optimizer = optax.adamw(3e-3, weight_decay=0.01)
    inputs = {}
    for name, (model, m) in variants.items():
        with jax.set_mesh(m):
            params = jax.jit(model.init)(jax.random.key(0), x)["params"]
            inputs[name] = (params, optimizer.init(params))
    times = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))  # (3 variants)
        for name in order:
            model, m = variants[name]
            times[name].append(phases(model, *inputs[name], x, y, jax.random.key(1), m))

    section(f"Compile time of one train step (LM example, batch {args.batch}, chunks {args.chunks})")
    rows = []
    for name in variants:
        med = {k: statistics.median(t[k] for t in times[name]) for k in ("trace", "lower", "compile")}
        rows.append([name, *(f"{med[k]:.2f}" for k in med), f"{sum(med.values()):.2f}"])
    ratios = {"side input / plain": (0, 2), "in-block mask / plain": (1, 2), "side input / in-block": (0, 1)}
    for label, (a, b) in ratios.items():
        ratio = [float(u) / float(v) for u, v in zip(rows[a][1:], rows[b][1:], strict=True)]
        rows.append([label, *(f"{r:.2f}x" for r in ratio)])
    print(table(["variant", "trace s", "lower s", "compile s", "total s"], rows, "lrrrr"))
    devices = jax.device_count()
    print(f"\nmedians of {rounds} round(s), order reversed every other round; {devices} CPU devices; shared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
