"""One process of the multi-host test: a 4-stage pipeline whose mesh spans 2 processes.

Run by ``tests/test_multihost.py`` as::

    python -m pipejax.launch --processes 2 --devices-per-process 2 tests/multihost_worker.py

Every process runs this same script (a multi-controller JAX program). The stages are the
heterogeneous ``tokens`` layout of ``tests/models.py`` with one more hidden stage, so every stage
boundary has its own structure, shapes and dtypes. Each process loads only its half of the batch
and builds global arrays with ``jax.make_array_from_process_local_data``; the pipeline's outputs
and gradients (with respect to the parameters and the float input) come back as global arrays,
which ``process_allgather`` reads. Every process checks them against the stages composed on the
whole batch in plain numpy-backed JAX, and exits non-zero on any mismatch. A last case runs data x
pipeline parallelism: a ``("data", "stage")`` mesh whose data axis spans the processes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pipejax import launch

info = launch.initialize()  # before any JAX computation

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipejax as pj  # noqa: E402
from tests import models  # noqa: E402

BATCH, CHUNKS = 28, 5  # 5 micro-batches of 6 examples, the last with 2 padding rows
RTOL, ATOL = 1e-12, 1e-13  # float64; a pipeline adds rows' values in another order at most


def hidden(p, hs, key):
    """``(h: f64[b, WIDE], skip)`` -> ``(tanh(h @ w + c), skip)``: a fourth, middle stage."""
    h, skip = hs
    return jnp.tanh(h @ p["w"] + p["c"][None]), skip


STAGES = (models.embed, models.wide, hidden, models.head)


def stage_params():
    r = np.random.default_rng(7)
    first, second, last = models.token_params()
    middle = {
        "w": jnp.asarray(r.normal(size=(models.WIDE, models.WIDE)) / np.sqrt(models.WIDE)),
        "c": jnp.asarray(r.normal(size=(models.WIDE,))),
    }
    return [first, second, middle, last]


def loss_of(apply, mesh):
    def loss(params, feats, ids, labels):
        logits = apply(params, {"ids": ids, "feats": feats})  # replicated over the mesh
        # Match the labels to the logits: on an Explicit mesh, JAX cannot transpose a gather of
        # replicated logits at batch-sharded indices (single-process too).
        labels = jax.reshard(labels, NamedSharding(mesh, PartitionSpec()))
        return models.token_loss(logits, labels)

    return loss


def gather(tree):
    """Every leaf of a global array pytree, whole, on every process (numpy)."""
    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def check(name, got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL, err_msg=name)
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) for g, w in pairs)
    print(f"{name}: matches the composition (max abs error {err:.1e})", flush=True)


def main() -> None:
    start = time.perf_counter()
    assert jax.process_count() == 2 and jax.local_device_count() == 2, (jax.process_count(), jax.devices())
    mesh = jax.make_mesh((4,), ("stage",))
    owners = [d.process_index for d in mesh.devices.flat]
    print(f"process {info.process_id} of {info.num_processes}: mesh devices owned by processes {owners}")
    assert sorted(set(owners)) == [0, 1], owners  # the pipeline really crosses processes

    # Every process builds the same parameters and the same full batch (same seeds); each then
    # feeds only its own rows, as a data loader would, into global arrays sharded over the mesh.
    params = stage_params()
    x = models.token_inputs(BATCH)
    labels = jnp.asarray(np.arange(BATCH) % models.CLASSES, jnp.int32)
    rows = slice(info.process_id * BATCH // 2, (info.process_id + 1) * BATCH // 2)
    batch_sharding = NamedSharding(mesh, PartitionSpec("stage"))
    to_global = lambda a: jax.make_array_from_process_local_data(batch_sharding, np.asarray(a)[rows])
    ids, feats, glabels = to_global(x["ids"]), to_global(x["feats"]), to_global(labels)
    assert not feats.is_fully_addressable  # each process holds only its rows

    apply = pj.pipeline(STAGES, chunks=CHUNKS, mesh=mesh, checkpoint="always")
    placed = apply.place(params)  # each device holds its own stage's parameters
    assert not placed.buffers[0].is_fully_addressable

    # Outputs: a global array, replicated over the mesh.
    y = jax.jit(apply)(placed, {"ids": ids, "feats": feats})
    check("outputs", gather(y), models.compose(STAGES, params, x))

    # Gradients with respect to the stage parameters and the float input, one compiled step.
    loss = loss_of(apply, mesh)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    value, (g_params, g_feats) = step(placed, feats, ids, glabels)
    compose = lambda p, f: models.compose(STAGES, p, {"ids": x["ids"], "feats": f})
    ref_loss = lambda p, f: models.token_loss(compose(p, f), labels)
    ref_value, (ref_params, ref_feats) = jax.value_and_grad(ref_loss, argnums=(0, 1))(params, x["feats"])
    check("loss", gather(value), ref_value)
    check("gradient wrt params", gather(g_params).unpack(), ref_params)  # StageParams -> per stage
    check("gradient wrt x", gather(g_feats), ref_feats)

    # Homogeneous stages, with inputs that are the same numpy arrays on every process (JAX takes
    # them as replicated) and an eager call.
    stacked = pj.pipeline(models.residual, num_stages=4, chunks=3, mesh=mesh, checkpoint="except_last")
    w, h = models.stacked_params(), np.asarray(models.stacked_inputs(7))  # 3 micro-batches of 3, 2 padding
    reference = models.compose([models.residual] * 4, models.unstack(w, 4), h)
    check("homogeneous outputs", gather(stacked(stacked.place(w), h)), reference)
    sq = lambda w, h: jnp.sum(stacked(w, h) ** 2)
    ref_sq = lambda w, h: jnp.sum(models.compose([models.residual] * 4, models.unstack(w, 4), h) ** 2)
    g = jax.jit(jax.grad(sq, argnums=(0, 1)))(stacked.place(w), h)
    check("homogeneous gradients", gather(g), jax.grad(ref_sq, argnums=(0, 1))(w, h))

    # Data x pipeline: a (data, stage) mesh whose data axis spans the processes, so each process
    # runs one data shard's pipeline on its own rows; gradients are summed across processes.
    grid = np.asarray(jax.devices()).reshape(2, 2)  # row q: the devices of process q
    mesh2 = jax.sharding.Mesh(grid, ("data", "stage"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    dp = pj.pipeline(models.residual, num_stages=2, chunks=4, mesh=mesh2, data_axis_name="data")
    w2, h2 = models.stacked_params(2), np.asarray(models.stacked_inputs(8))  # 2 micro-batches per shard
    mine = slice(info.process_id * 4, (info.process_id + 1) * 4)
    gh2 = jax.make_array_from_process_local_data(NamedSharding(mesh2, PartitionSpec("data")), h2[mine])
    assert not gh2.is_fully_addressable
    ref2 = lambda w, h: models.compose([models.residual] * 2, models.unstack(w, 2), h)
    check("data x pipeline outputs", gather(jax.jit(dp)(dp.place(w2), gh2)), ref2(w2, h2))
    sq2 = lambda w, h: jnp.sum(dp(w, h) ** 2)
    g2 = jax.jit(jax.grad(sq2, argnums=(0, 1)))(dp.place(w2), gh2)
    want2 = jax.grad(lambda w, h: jnp.sum(ref2(w, h) ** 2), argnums=(0, 1))(w2, h2)
    check("data x pipeline gradients", gather(g2), want2)
    print(f"process {info.process_id}: all checks passed in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
