"""Pipelines inside a (data, stage, model) mesh: bytes per device and collectives per kind.

The model is ``examples/pipeline_3d_mesh.py``'s: pre-LayerNorm Transformer blocks, one per stage,
on a 2 x 2 x 2 mesh of 8 simulated CPU devices. For each way of sharding the weights inside a
stage (``param_specs``): none, tensor (Megatron column/row splits over ``"model"``) and FSDP
(matrices stored split over ``"data"``), it compiles one training step (``jit`` of
``value_and_grad`` of the pipelined loss, then an optax adam update) and prints

* parameter and adam-state bytes one device stores (its shards), against one whole stage;
* the step's compiled temp bytes per device (``memory_analysis().temp_size_in_bytes``);
* the collectives in the compiled HLO, per kind, with the bytes each kind's results hold, and
  how many all-gathers produce a weight-shaped value (a whole weight gathered).

Run: ``python benchmarks/mesh3d.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])

import argparse  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_3d_mesh as model  # noqa: E402
from _common import section, table  # noqa: E402

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
ITEMSIZE = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}

WHY = {
    "none": "all-reduce: the pipeline's output replicated over the stage axis (a psum of exact "
    "zeros) and the stage's gradients summed over the data axis (one combined all-reduce); "
    "collective-permute: activations between stages and the input streamed to stage 0, forward "
    "and backward (each once in the tick loop's body)",
    "tensor": "all-reduce: the same two (the gradient sum now over half-size shards), plus the "
    "partial sums after the row-parallel projections (wo, w2) in the forward pass and the "
    "column-parallel inputs' cotangents (q/k/v, w1) in the backward pass, all on activations, "
    "each once in the loop body; no all-gather; collective-permute: as without sharding",
    "fsdp": "all-gather: each stored half of a matrix gathered once on entry to the pipeline's "
    "program (one per matrix); reduce-scatter: its gradient summed over the data axis and split "
    "again (one per matrix); all-reduce: the output, and the whole LayerNorm scales' gradients",
}


def collectives(hlo: str, weight_shapes: set[tuple[int, ...]]) -> tuple[dict[str, int], dict[str, int], int]:
    """Per kind: how many collectives and how many bytes their results hold; weight all-gathers."""
    count = dict.fromkeys(KINDS, 0)
    nbytes = dict.fromkeys(KINDS, 0)
    gathered_weights = 0
    pattern = re.compile(r"= (\([^)]*\)|\S+) (" + "|".join(KINDS) + r")(?:-start)?\(")
    for line in hlo.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        kind = m.group(2)
        count[kind] += 1
        for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            nbytes[kind] += int(np.prod(shape, dtype=np.int64)) * ITEMSIZE.get(dtype, 4)
            if kind == "all-gather" and tuple(d for d in shape if d != 1) in weight_shapes:
                gathered_weights += 1
    return count, nbytes, gathered_weights


def measure(sharding: str, batch: int, chunks: int):
    mesh = model.make_mesh()
    num_blocks = mesh.shape["stage"]
    params = model.block_params(num_blocks)
    apply, loss = model.pipelined_loss(mesh, num_blocks, chunks, model.block_specs(sharding))
    placed = apply.place(params)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(placed)
    x = jax.device_put(
        jnp.asarray(np.random.default_rng(1).normal(size=(batch, model.SEQ, model.EMBED)), jnp.float32),
        NamedSharding(mesh, P("data")),
    )

    @jax.jit
    def train_step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    compiled = train_step.lower(placed, opt_state, x).compile()
    weight_shapes = {tuple(a.shape[1:]) for a in jax.tree.leaves(params) if a.ndim == 3}
    count, nbytes, gathered = collectives(compiled.as_text(), weight_shapes)
    whole = sum(a.nbytes for a in jax.tree.leaves(params)) // num_blocks
    return {
        "params": model.device_bytes(placed),
        "adam": model.device_bytes(opt_state),
        "whole": whole,
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "count": count,
        "bytes": nbytes,
        "gathered": gathered,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    section("Pipelines in a (data, stage, model) = 2 x 2 x 2 mesh: one adam training step")
    print(
        f"Blocks: embed {model.EMBED}, {model.HEADS} heads, MLP {model.HIDDEN}, sequence {model.SEQ}; "
        f"batch {args.batch}, chunks {args.chunks}, float32, jax {jax.__version__}, "
        f"{jax.devices()[0].platform} x {jax.device_count()}.\n"
    )
    results = {s: measure(s, args.batch, args.chunks) for s in ("none", "tensor", "fsdp")}
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                f"{r['params']:,}",
                f"{r['params'] / r['whole']:.2f}",
                f"{r['adam']:,}",
                f"{r['temp']:,}",
                str(r["gathered"]),
            ]
        )
    print(
        table(
            [
                "sharding",
                "param bytes/device",
                "of a stage",
                "adam bytes/device",
                "temp bytes",
                "weight all-gathers",
            ],
            rows,
            align="lrrrrr",
        )
    )
    print("\nCollectives in the compiled step, per kind: count (bytes of their results, per device).\n")
    print(
        table(
            ["sharding", *KINDS],
            [[name, *(f"{r['count'][k]} ({r['bytes'][k]:,})" for k in KINDS)] for name, r in results.items()],
            align="l" + "r" * len(KINDS),
        )
    )
    print()
    for name, why in WHY.items():
        print(f"- {name}: {why}.")


if __name__ == "__main__":
    main()
