"""A pipeline inside a bigger mesh: tensor (Megatron) or FSDP sharding within each stage.

Each stage is a Transformer block (multi-head self-attention and an MLP, pre-LayerNorm). The mesh
is ``("data", "stage", "model")``. The pipeline cuts the blocks into stages over ``"stage"`` and
the batch over ``"data"``; within a stage the weights are sharded as ``Pipeline.place(params,
specs)`` says:

* ``--sharding tensor`` (Megatron): the query/key/value and first MLP projections are split by
  columns over ``"model"`` (each device holds some heads and some hidden units), the output
  projections by rows. XLA partitions the block's computation over ``"model"``: one all-reduce
  after each row-parallel projection, no all-gather of a weight.
* ``--sharding fsdp``: every matrix is stored split by rows over ``"data"`` (FSDP): a device
  stores half of its stage's weights; the pipeline gathers them whole on entry to its program and
  reduce-scatters their gradients.
* ``--sharding none``: every stage's weights whole on every device of its stage.

The script checks the pipeline's loss and gradients against the blocks composed in plain JAX, then
prints the per-device parameter bytes and a checksum of the gradients.

Run it on one machine with 8 simulated devices::

    python examples/pipeline_3d_mesh.py

or on 2 processes of 4 devices each (the same mesh, spanning the processes)::

    python -m pipejax.launch --processes 2 --devices-per-process 4 examples/pipeline_3d_mesh.py
"""

from __future__ import annotations

import argparse
import os
import sys

LAUNCHED = "PIPEJAX_PROCESS_ID" in os.environ
if LAUNCHED:
    from pipejax import launch

    launch.initialize()  # before any JAX computation
elif "jax" not in sys.modules:  # a standalone run: 8 simulated CPU devices
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pipejax as pj  # noqa: E402

EMBED, HEADS, HIDDEN, SEQ = 32, 4, 64, 8


def layer_norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def block(p, x, key):
    """One pre-LayerNorm Transformer block on ``x: [batch, SEQ, EMBED]``."""
    b, t, e = x.shape
    h = layer_norm(x, p["ln1"])
    q, k, v = (
        (h @ p[n]).reshape(b, t, HEADS, e // HEADS) for n in ("wq", "wk", "wv")
    )  # column-parallel: heads split over "model"
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(e // HEADS), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, e) @ p["wo"]  # row-parallel
    h = layer_norm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]  # column- then row-parallel


def block_params(num_blocks: int, seed: int = 0):
    """The blocks' parameters stacked on a leading block axis (homogeneous stages)."""
    r = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(r.normal(size=(num_blocks, *shape)) / np.sqrt(shape[0]), jnp.float32)
    return {
        "ln1": jnp.ones((num_blocks, EMBED), jnp.float32),
        "wq": normal(EMBED, EMBED),
        "wk": normal(EMBED, EMBED),
        "wv": normal(EMBED, EMBED),
        "wo": normal(EMBED, EMBED),
        "ln2": jnp.ones((num_blocks, EMBED), jnp.float32),
        "w1": normal(EMBED, HIDDEN),
        "w2": normal(HIDDEN, EMBED),
    }


def block_specs(sharding: str, axis: str = "model"):
    """Each parameter's sharding within its stage (without the stage axis)."""
    if sharding == "none":
        return None
    if sharding == "tensor":
        col, row = P(None, axis), P(axis, None)
        return {"ln1": None, "wq": col, "wk": col, "wv": col, "wo": row, "ln2": None, "w1": col, "w2": row}
    if sharding == "fsdp":
        rows = P("data", None)
        return {
            "ln1": None,
            "wq": rows,
            "wk": rows,
            "wv": rows,
            "wo": rows,
            "ln2": None,
            "w1": rows,
            "w2": rows,
        }
    raise ValueError(f"--sharding must be one of none, tensor, fsdp; got {sharding!r}")


def make_mesh(data: int = 2, stage: int = 2, model: int = 2):
    auto = (AxisType.Auto,) * 3
    return jax.make_mesh((data, stage, model), ("data", "stage", "model"), axis_types=auto)


def pipelined_loss(mesh, num_blocks: int, chunks: int, specs=None):
    apply = pj.pipeline(
        block, num_stages=num_blocks, chunks=chunks, mesh=mesh, data_axis_name="data", param_specs=specs
    )

    def loss(params, x):
        return jnp.mean(apply(params, x) ** 2)

    return apply, loss


def composed_loss(params, x):
    h = x
    for s in range(jax.tree.leaves(params)[0].shape[0]):
        h = block(jax.tree.map(lambda a, s=s: a[s], params), h, None)
    return jnp.mean(h**2)


def device_bytes(tree) -> int:
    """Bytes of ``tree`` that one device (this process's first) stores."""
    first = jax.local_devices()[0]
    return sum(
        s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == first
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sharding", default="tensor", choices=["none", "tensor", "fsdp"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    mesh = make_mesh()
    num_blocks = mesh.shape["stage"]
    params = block_params(num_blocks)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(args.batch, SEQ, EMBED)), jnp.float32)
    apply, loss = pipelined_loss(mesh, num_blocks, args.chunks, block_specs(args.sharding))
    placed = apply.place(params)
    x_global = jax.device_put(x, NamedSharding(mesh, P("data")))
    value, grads = jax.jit(jax.value_and_grad(loss))(placed, x_global)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(composed_loss))(params, x)  # one device
    grads = jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), grads)
    err = max(
        float(np.max(np.abs(g - np.asarray(r))))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )
    scale = max(float(np.max(np.abs(np.asarray(r)))) for r in jax.tree.leaves(ref_grads))
    ok = abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value)) and err <= 1e-4 * scale
    whole = sum(a.nbytes for a in jax.tree.leaves(params)) // num_blocks
    print(
        f"sharding={args.sharding} mesh={dict(mesh.shape)} loss={float(value):.6f} "
        f"(composed {float(ref_value):.6f})"
    )
    print(
        f"max |grad - composed grad| = {err:.2e} (largest gradient {scale:.2e}): {'ok' if ok else 'MISMATCH'}"
    )
    print(f"parameter bytes per device: {device_bytes(placed)} (one whole stage: {whole})")
    print(
        f"gradient checksum: {sum(float(np.sum(g.astype(np.float64))) for g in jax.tree.leaves(grads)):.6f}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
