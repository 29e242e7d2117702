"""Train a deep MLP through a 4-stage GPipe pipeline on 4 simulated CPU devices.

This is the tutorial example of ``pipejax.pipeline``. It walks through a complete training set-up:

1. write a 16-layer MLP as 4 *stage functions* ``stage(params, x, key) -> y`` of 4 dense layers each;
2. wrap them in ``pj.pipeline`` with 8 micro-batches, checkpointing and a 4-device mesh;
3. lay the parameters out with ``apply.place`` so that each device stores only its own stage;
4. check at step 0 that the pipeline computes the same loss, gradients and dropout masks as the
   plain (un-pipelined) model;
5. train with optax's Adam, with dropout driven by the PRNG key the pipeline hands each stage.

Run it with ``bash scripts/demo.sh`` or ``python examples/train_mlp_pipeline.py``; it needs no
downloads and no accelerator. ``--short`` runs a few steps (the tests use it).
"""

import os

# Four fake CPU devices, one per pipeline stage. This must happen before JAX is imported: JAX reads
# the flag once, when it initialises its CPU backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj

NUM_STAGES = 4
LAYERS_PER_STAGE = 4  # 16 dense layers in all
IN_DIM, WIDTH, OUT_DIM = 16, 128, 1
DROP_RATE = 0.05  # the probability of *dropping* a unit
TOLERANCE = 1e-4  # step-0 check, relative; float32 sums in another order differ by ~1e-6


# --- the model ------------------------------------------------------------------------------------


def dropout(x, key, drop_rate):
    """Inverted dropout: zeroes each entry with probability ``drop_rate`` and rescales the rest.

    ``key=None`` means no dropout (evaluation). The pipeline passes ``None`` to every stage when it
    is called without a key.
    """
    if key is None or drop_rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - drop_rate, x.shape)
    return jnp.where(keep, x / (1.0 - drop_rate), jnp.zeros_like(x))


def make_stage(is_last):
    """A pipeline stage: ``stage(params, x, key) -> y``, here a run of dense layers.

    ``params`` is a list of ``{"w", "b"}`` layers. Every layer is ``relu(x @ w + b)`` followed by
    dropout, except the network's very last layer, a linear read-out. The pipeline gives the stage
    one key per micro-batch; each layer folds in its own index to draw an independent mask.
    """

    def stage(params, x, key):
        for j, layer in enumerate(params):
            x = x @ layer["w"] + layer["b"]
            if is_last and j == len(params) - 1:
                return x  # the read-out: no activation, no dropout
            x = jax.nn.relu(x)
            x = dropout(x, None if key is None else jax.random.fold_in(key, j), DROP_RATE)
        return x

    return stage


# The four stages are *heterogeneous*: the first takes 16 features, the last returns 1, so their
# parameter shapes differ. (Stages that all had the same parameter and activation types would be
# *homogeneous*: `pj.pipeline(stage, num_stages=4)` with parameters stacked on a stage axis.)
STAGES = [make_stage(is_last=s == NUM_STAGES - 1) for s in range(NUM_STAGES)]


def init_params(key):
    """One parameter pytree per stage: a list of He-initialised dense layers."""
    params = []
    for s, k_stage in enumerate(jax.random.split(key, NUM_STAGES)):
        sizes = [IN_DIM if s == 0 else WIDTH] + [WIDTH] * LAYERS_PER_STAGE
        if s == NUM_STAGES - 1:
            sizes[-1] = OUT_DIM
        keys = jax.random.split(k_stage, LAYERS_PER_STAGE)
        layers = []
        for k, d_in, d_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
            w = jax.random.normal(k, (d_in, d_out)) * jnp.sqrt(2.0 / d_in)
            layers.append({"w": w, "b": jnp.zeros((d_out,))})
        params.append(layers)
    params[-1][-1]["w"] = 0.1 * params[-1][-1]["w"]  # a small read-out: start near y = 0
    return params


def sequential_model(params, x, key=None):
    """The same network without a pipeline: the stages composed on the whole batch.

    It is the reference at step 0. It gives every stage the same key; the pipeline instead gives
    stage ``s`` on micro-batch ``i`` the key ``pj.stage_key(key, i, s)`` (see ``check_dropout``).
    """
    for stage, p in zip(STAGES, params, strict=True):
        x = stage(p, x, key)
    return x


# --- the data -------------------------------------------------------------------------------------

# The function to learn depends on the input through 4 fixed random directions.
TASK_DIRECTIONS = jax.random.normal(jax.random.key(1234), (IN_DIM, 4)) / jnp.sqrt(IN_DIM)


def make_data(key, n):
    """``n`` examples of a synthetic regression task: a smooth nonlinear function plus noise."""
    k_x, k_noise = jax.random.split(key)
    x = jax.random.normal(k_x, (n, IN_DIM))
    z = x @ TASK_DIRECTIONS
    y = jnp.sin(2.0 * z[:, :1]) + z[:, 1:2] * z[:, 2:3] + 0.5 * jnp.cos(3.0 * z[:, 3:4])
    return x, y + 0.05 * jax.random.normal(k_noise, (n, 1))


# --- the step-0 checks ----------------------------------------------------------------------------


def relative_difference(a, b):
    """max |a - b| / max |b| over matching leaves of two pytrees."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v))) for u, v in pairs)


def check_against_sequential(apply, params, params_list, loss_fn, x, y):
    """Pipelined loss and gradients (no dropout) vs the stages composed on the whole batch."""
    pipe_loss, pipe_grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, y, None)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: jnp.mean((sequential_model(p, x) - y) ** 2))(
        params_list
    )
    # The gradient with respect to a `StageParams` is a `StageParams`. Fetched to the host, its
    # `unpack()` gives back the per-stage pytrees, in the form of `params_list`.
    pipe_grads = jax.device_get(pipe_grads).unpack()
    loss_diff = relative_difference(pipe_loss, ref_loss)
    grad_diff = relative_difference(pipe_grads, ref_grads)
    print(
        f"step-0 check (no dropout): pipelined loss {float(pipe_loss):.6f}, un-pipelined "
        f"{float(ref_loss):.6f}; relative difference: loss {loss_diff:.1e}, gradients {grad_diff:.1e} "
        f"(tolerance {TOLERANCE:.0e})"
    )
    return max(loss_diff, grad_diff)


def check_dropout(apply, params, params_list, x, key):
    """Pipelined forward with dropout vs a by-hand loop that derives the keys with ``pj.stage_key``.

    The pipeline cuts ``x`` into micro-batches (``pj.split_microbatches``) and gives stage ``s`` on
    micro-batch ``i`` the key ``fold_in(fold_in(key, i), s)``. Replaying that by hand must draw the
    same dropout masks, whatever the mesh or checkpoint mode.
    """
    xs, _, plan = pj.split_microbatches(x, apply.chunks)
    outs = []
    for i in range(plan.num_micro):
        h = xs[i]
        for s, (stage, p) in enumerate(zip(STAGES, params_list, strict=True)):
            h = stage(p, h, pj.stage_key(key, i, s))
        outs.append(h)
    ref = pj.merge_microbatches(jnp.stack(outs), plan)
    diff = relative_difference(apply(params, x, key), ref)
    print(f"step-0 check (dropout, keys from pj.stage_key): relative difference {diff:.1e}")
    return diff


# --- training -------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps (default: 250)")
    parser.add_argument("--short", action="store_true", help="run 20 steps only (for the tests)")
    parser.add_argument("--checkpoint", default="always", choices=pj.CHECKPOINT_MODES, help="checkpoint mode")
    args = parser.parse_args(argv)
    steps, print_every = (20, 5) if args.short else (args.steps, 25)
    batch, chunks = 256, 8

    # One device per stage: a 1-D mesh whose axis is called "stage" (pipejax's default axis name).
    mesh = jax.make_mesh((NUM_STAGES,), ("stage",))

    # The pipeline. Each mini-batch of 256 is cut into 8 micro-batches of 32 that stream through the
    # 4 devices (GPipe). checkpoint="always" keeps only the activation entering each stage, per
    # micro-batch, and recomputes the stage's internal activations in the backward pass
    # ("except_last", the library default, also keeps the internals of the last ticks).
    apply = pj.pipeline(STAGES, chunks=chunks, checkpoint=args.checkpoint, mesh=mesh)
    schedule = apply.schedule(batch)
    print(apply)
    print(
        f"{batch} examples per step in {schedule.num_micro} micro-batches, {schedule.num_ticks} "
        f"ticks, bubble fraction {schedule.bubble_fraction():.2f}"
    )

    k_init, k_train, k_test, k_drop = jax.random.split(jax.random.key(0), 4)
    x_train, y_train = make_data(k_train, 16384)
    x_test, y_test = make_data(k_test, 1024)
    params_list = init_params(k_init)

    # `place` packs each stage's parameters into one flat buffer per dtype, stacks the stages and
    # shards the stage axis over the mesh: device s stores only stage s's parameters (padded to the
    # largest stage). Use the result everywhere in place of the list: in the pipeline, in
    # `jax.grad` and in optax.
    params = apply.place(params_list)
    print(f"{params}: {params.bytes_per_stage() / 1024:.0f} KiB of parameters per device")

    def loss_fn(params, x, y, key):
        pred = apply(params, x, key)  # key=None: no dropout
        return jnp.mean((pred - y) ** 2)

    # ---- step 0: the pipeline computes what the plain model computes ---------------------------
    # Up to float32 rounding: the matmuls see 8 micro-batches instead of one batch.
    x0, y0 = x_train[:batch], y_train[:batch]
    worst = max(
        check_against_sequential(apply, params, params_list, loss_fn, x0, y0),
        check_dropout(apply, params, params_list, x0, k_drop),
    )
    if not worst <= TOLERANCE:  # also catches nan
        sys.exit(f"FAILED: the pipeline differs from the un-pipelined model by {worst:.1e} > {TOLERANCE:.0e}")

    # ---- the training step ---------------------------------------------------------------------
    optimizer = optax.adam(2e-3)
    # A StageParams is a pytree like any other, so optax takes it as it is. Make the state inside
    # the mesh context: then Adam's scalar step count lives on the mesh, as it will once
    # `train_step` returns it, and `train_step` compiles once instead of twice.
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(lambda params, x, y: loss_fn(params, x, y, None))  # no key: no dropout

    rng = np.random.default_rng(0)
    start = compiled = time.perf_counter()
    for step in range(steps):
        idx = rng.choice(x_train.shape[0], batch, replace=False)
        # A fresh dropout key per step. The pipeline derives one key per (micro-batch, stage) from
        # it, so a checkpointed stage recomputed in the backward pass redraws the same masks.
        key = jax.random.fold_in(k_drop, step)
        params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx], key)
        if step % print_every == 0 or step == steps - 1:
            test = eval_loss(params, x_test, y_test)
            print(f"step {step:4d}  train loss {float(loss):.4f}  test loss {float(test):.4f}")
        if step == 0:
            compiled = time.perf_counter()  # the first step includes compiling `train_step`
    per_step = (time.perf_counter() - compiled) / max(steps - 1, 1)
    print(
        f"first step (with compilation) {compiled - start:.1f} s, then {1e3 * per_step:.0f} ms per step "
        "(4 simulated devices share this machine's cores: no speed-up is expected from them)"
    )


if __name__ == "__main__":
    main()
