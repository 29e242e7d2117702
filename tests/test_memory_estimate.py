"""`pj.memory_estimate`: the per-device formula against XLA's compiled temp bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pipejax as pj
from pipejax._src import compat

WIDTH, HIDDEN, MICRO = 32, 64, 16


def block_stage(p, h, key=None):
    """Two residual MLP blocks ``h + tanh(h @ w1) @ w2``; ``p``'s leaves lead with a block axis."""
    for j in range(p["w1"].shape[0]):
        h = h + jnp.tanh(h @ p["w1"][j]) @ p["w2"][j]
    return h


def sq(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def setup(schedule, checkpoint, m):
    """8 residual blocks on 4 devices: one stage of 2 a device, or (circular, interleaved 1F1B,
    the V's) two stages of 1."""
    mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    stages, kw = (8, {"repeats": 2}) if schedule in ("circular", "interleaved-1f1b") else (4, {})
    stages = 8 if schedule in ("v-half", "zb-v") else stages
    pipe = pj.pipeline(
        block_stage, num_stages=stages, chunks=m, checkpoint=checkpoint, mesh=mesh, schedule=schedule, **kw
    )
    keys = jax.random.split(jax.random.key(0), 3)
    blocks = 8 // stages
    params = {
        "w1": 0.1 * jax.random.normal(keys[0], (stages, blocks, WIDTH, HIDDEN), jnp.float32),
        "w2": 0.1 * jax.random.normal(keys[1], (stages, blocks, HIDDEN, WIDTH), jnp.float32),
    }
    x = jax.random.normal(keys[2], (m * MICRO, WIDTH), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P()))
    return pipe, pipe.place(params), x


def xla_temp_bytes(pipe, params, x):
    """XLA's temp bytes per device of the training step the estimate predicts."""
    step = pipe.value_and_grad(sq)
    return pj.memory_report(step, params, x, x, backward=False).temp_bytes


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-floor"])
def test_estimate_within_10_percent_of_xla(schedule, checkpoint):
    pipe, params, x = setup(schedule, checkpoint, m=8)
    est = pj.memory_estimate(pipe, params, x)
    temp = xla_temp_bytes(pipe, params, x)
    assert abs(est.total / temp - 1) <= 0.10, (est, temp)


@pytest.mark.parametrize(
    "schedule, checkpoint", [("interleaved-1f1b", "always"), ("v-half", "never"), ("zb-v", "always")]
)
def test_tables_whose_devices_hold_several_stages(schedule, checkpoint):
    """The pooled tables: the stash is the device's one pool (and ZB-V's cotangent pool), a
    tick slices its stage's row of parameters (W's too), a V turns the device's block; within
    15 % of XLA (0.89-0.92 here; benchmarks/schedules.py --section estimate: 0.85-1.12)."""
    pipe, params, x = setup(schedule, checkpoint, m=8)
    est = pj.memory_estimate(pipe, params, x)
    table = pipe.schedule(x.shape[0])
    assert table.pooled
    a, p = est.activation_bytes, 2 * WIDTH * HIDDEN * 4  # a stage: one block
    slot = a if checkpoint == "always" else est.residual_bytes
    cot = table.cotangent_pool()[0] * a if schedule == "zb-v" else 0
    assert est.stash == table.stash_pool()[0] * slot + cot
    assert est.param_bytes == 2 * p  # two stages a device, wherever the table puts them
    rows = p * (2 if schedule == "zb-v" else 1) + (2 * p if schedule != "interleaved-1f1b" else 0)
    assert est.params - rows in (0, p)  # and the tick's parameter cotangent, where it has no room
    temp = xla_temp_bytes(pipe, params, x)
    assert abs(est.total / temp - 1) <= 0.15, (est, temp)


def test_a_users_table_is_estimated_from_its_own_slots():
    """A table written as actions (every F, then every B: GPipe's order) keeps all m inputs."""
    from tests.test_schedule_tables import all_f_then_all_b

    mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    _, params, x = setup("1f1b", "always", m=8)
    pipe = pj.pipeline(block_stage, num_stages=4, chunks=8, mesh=mesh, schedule=all_f_then_all_b)
    est = pj.memory_estimate(pipe, params, x)
    assert est.stash == 8 * est.activation_bytes
    assert abs(est.total / xla_temp_bytes(pipe, params, x) - 1) <= 0.15


def _embed(p, tokens, key):
    return p[tokens]


def _block(p, h, key):
    return jnp.tanh(h @ p)


def _head(p, h, key):
    return h @ p


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_stages_not_alike(checkpoint):
    """An embedding, two blocks and a wide head: every boundary travels in one container (the
    head's output, 8 KiB, is the largest: A = O), and the parameter cotangent is added into the
    device's flat row of packed parameters (one more P); within 15 % of XLA (1.01 and 1.14 on
    benchmarks/planner.py's model)."""
    mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), 4)
    params = [
        jax.random.normal(keys[0], (512, WIDTH), jnp.float32),
        *(0.1 * jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) for k in keys[1:3]),
    ]
    params.append(jax.random.normal(keys[3], (WIDTH, 256), jnp.float32))
    pipe = pj.pipeline(
        [_embed, _block, _block, _head], chunks=8, checkpoint=checkpoint, mesh=mesh, schedule="1f1b"
    )
    params, x = pipe.place(params), jnp.arange(64, dtype=jnp.int32) % 512
    est = pj.memory_estimate(pipe, params, x)
    assert est.activation_bytes == est.output_bytes == 8 * 256 * 4
    step = pipe.value_and_grad(sq)
    y = jnp.zeros((64, 256), jnp.float32)
    temp = pj.memory_report(step, params, x, y, backward=False).temp_bytes
    assert abs(est.total / temp - 1) <= 0.15, (est, temp)


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_stages_not_alike_keep_no_copy_of_their_parameters_per_tick(schedule):
    """GPipe and circular on stages given as a list, with `"never"`: each stage's parameters are
    unpacked outside the tick's switch, so the backward pass reads them once instead of a copy
    per tick (11 ticks of a 64 KiB embedding table kept 1,432.4 KiB on benchmarks/planner.py's
    model; 377.0 now); the gradients are bitwise those of `"always"`."""
    mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), 4)
    table = jax.random.normal(keys[0], (512, WIDTH), jnp.float32)  # 64 KiB
    blocks = [0.1 * jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) for k in keys[1:3]]
    params = [table, *blocks, jax.random.normal(keys[3], (WIDTH, 256), jnp.float32)]
    stages, kw = [_embed, _block, _block, _head], {}
    if schedule == "circular":  # 8 stages, 2 a device
        stages, kw = [_embed, *[_block] * 6, _head], {"repeats": 2}
        params = [table, *(blocks * 3), params[-1]]
    x, y = jnp.arange(64, dtype=jnp.int32) % 512, jnp.zeros((64, 256), jnp.float32)
    got = {}
    for mode in ("never", "always"):
        pipe = pj.pipeline(stages, chunks=8, checkpoint=mode, mesh=mesh, schedule=schedule, **kw)
        placed = pipe.place(params)
        got[mode] = jax.jit(pipe.value_and_grad(sq))(placed, x, y)
        if mode == "never":
            ticks = pipe.schedule(64).num_ticks
            temp = pj.memory_report(pipe.value_and_grad(sq), placed, x, y, backward=False).temp_bytes
            assert temp < ticks * table.nbytes / 2, (temp, ticks)
    for a, b in zip(jax.tree.leaves(got["never"]), jax.tree.leaves(got["always"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_estimate_keeps_the_last_stage_apart_as_the_engine_does():
    """With one tanh layer a stage keeps ``R = 3 A`` on jax 0.10 (the input, ``tanh`` and
    ``1 - tanh``) and ``2 A`` on jax 0.11, which saves one fewer: either way 1F1B's 7 slots'
    share of the loss's residual (``7 O``) outweighs one more entry of the last stage's
    residuals (``R + O``), so the engine hands those straight to B and no slot holds the loss's
    part; the estimate's stash is ``K R``, within 10 % of XLA (XLA: 82.1 -> 71.4 KiB)."""
    mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    layer = lambda p, h, key: jnp.tanh(h @ p)
    pipe = pj.pipeline(layer, num_stages=4, chunks=8, checkpoint="never", mesh=mesh, schedule="1f1b")
    params = pipe.place(0.1 * jax.random.normal(jax.random.key(0), (4, WIDTH, WIDTH), jnp.float32))
    x = jax.random.normal(jax.random.key(1), (8 * MICRO, WIDTH), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P()))
    est = pj.memory_estimate(pipe, params, x)
    a = WIDTH * MICRO * 4
    saved = compat.saved_residuals(lambda p, h: jnp.sum(layer(p, h, None)), params[0], x[:MICRO])
    r = a * sum(aval.shape == (MICRO, WIDTH) for aval, _ in saved)  # JAX's own count
    assert r in (2 * a, 3 * a), saved
    assert (est.residual_bytes, est.output_bytes, est.stash) == (r, a, 7 * r)
    assert abs(est.total / xla_temp_bytes(pipe, params, x) - 1) <= 0.10


def test_terms_follow_the_schedule():
    """1F1B's stash is flat in m from m = n - 1 on; GPipe's grows by A per micro-batch."""
    a = WIDTH * MICRO * 4
    stash = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (8, 16):
            pipe, params, x = setup(schedule, "always", m)
            stash[schedule, m] = pj.memory_estimate(pipe, params, x).stash
    assert stash["1f1b", 8] == stash["1f1b", 16] == 7 * a  # 2 n - 1 stage inputs
    assert stash["gpipe", 16] - stash["gpipe", 8] == 8 * a  # one input per tick


@pytest.mark.parametrize("m", [4, 8])
def test_circular_loop_buffer_is_a_delay_line(m):
    """A micro-batch waits max(m, n) - n ticks for its next round on device 0: no loop buffer
    at m = n, m - n + 1 slots (and their cotangents) past it; the estimate within 10% of XLA."""
    pipe, params, x = setup("circular", "always", m)
    est = pj.memory_estimate(pipe, params, x)
    assert est.loop == 2 * max(m - 4 + 1, 0) * (m > 4) * WIDTH * MICRO * 4
    temp = xla_temp_bytes(pipe, params, x)
    assert abs(est.total / temp - 1) <= 0.10, (est, temp)


def test_refuses_what_it_does_not_model():
    pipe, params, x = setup("gpipe", "always", 4)
    with pytest.raises(TypeError, match=r"must be a pipeline built by `pj\.pipeline"):
        pj.memory_estimate(block_stage, params, x)
    no_mesh = pj.pipeline(block_stage, num_stages=4, chunks=4, checkpoint="always")
    with pytest.raises(ValueError, match=r"has mesh=None, but the formula is per device.*memory_report"):
        pj.memory_estimate(no_mesh, params, x)
    policy = pj.pipeline(
        block_stage, num_stages=4, chunks=4, mesh=pipe.mesh, checkpoint=jax.checkpoint_policies.dots_saveable
    )
    with pytest.raises(ValueError, match="not a policy"):
        pj.memory_estimate(policy, params, x)
    data = jax.make_mesh((2, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = pj.pipeline(block_stage, num_stages=2, chunks=4, mesh=data, data_axis_name="data")
    with pytest.raises(ValueError, match="has data_axis_name='data', but no data axis is modelled"):
        pj.memory_estimate(sharded, params, x)


# --- inputs that do not fit the pipeline (issue 39) ---------------------------------------------


def pipeline_error(pipe, params, x):
    """The message of the pipeline's own call on these inputs."""
    with pytest.raises(Exception) as info:
        pipe(params, x)
    return type(info.value), str(info.value)


def test_parameters_of_the_wrong_shapes_name_the_stage_boundary_as_the_pipeline_does():
    """A stage that cannot be applied to what reaches it: the estimate raises the pipeline's own
    message (stage and boundary named), not JAX's `dot_general` error."""
    pipe, params, x = setup("gpipe", "always", 4)
    narrow = {
        "w1": jnp.zeros((4, 2, 16, HIDDEN), jnp.float32),
        "w2": jnp.zeros((4, 2, HIDDEN, WIDTH), jnp.float32),
    }
    kind, message = pipeline_error(pipe, narrow, x)
    assert kind is ValueError and message.startswith("Stage 0 could not be applied to a micro-batch of `x`")
    with pytest.raises(ValueError) as info:
        pj.memory_estimate(pipe, narrow, x)
    assert str(info.value) == message
    # heterogeneous stages: the boundary between stages 1 and 2
    het = pj.pipeline([block_stage] * 4, chunks=4, checkpoint="always", mesh=pipe.mesh)
    per_stage = [{k: v[s] for k, v in params.items()} for s in range(4)]
    per_stage[2] = {k: v[0] for k, v in narrow.items()}
    kind, message = pipeline_error(het, per_stage, x)
    assert message.startswith("Stage 2 could not be applied to the output of stage 1")
    with pytest.raises(ValueError, match=r"^Stage 2 could not be applied to the output of stage 1") as info:
        pj.memory_estimate(het, per_stage, x)
    assert str(info.value) == message


def test_parameters_and_batches_the_pipeline_refuses_are_refused_alike():
    pipe, params, x = setup("gpipe", "always", 4)
    het = pj.pipeline([block_stage] * 4, chunks=4, checkpoint="always", mesh=pipe.mesh)
    per_stage = [{k: v[s] for k, v in params.items()} for s in range(4)]
    cases = [
        (pipe, {k: v[:3] for k, v in params.items()}, x),  # 3 stages stacked, not 4
        (pipe, [1, 2], x),
        (het, per_stage[:3], x),
        (het, {"w1": 1.0}, x),
        (pipe, params, None),
        (pipe, params, jnp.ones((), jnp.float32)),
    ]
    for p, ps, xs in cases:
        kind, message = pipeline_error(p, ps, xs)
        with pytest.raises(kind) as info:
            pj.memory_estimate(p, ps, xs)
        assert str(info.value) == message


def test_memory_report_names_an_argument_that_is_not_an_array():
    loss = lambda w, x: jnp.sum(x @ w)
    w, x = jnp.ones((3, 3), jnp.float32), jnp.ones((2, 3), jnp.float32)
    with pytest.raises(TypeError, match=r"`args\[1\]\['act'\]` of memory_report is str 'relu'.*Close over"):
        pj.memory_report(lambda w, c: loss(w, c["x"]), w, {"x": x, "act": "relu"})
    with pytest.raises(TypeError, match=r"`backward` of memory_report must be True or False, but got str"):
        pj.memory_report(loss, w, x, backward="yes")
    with pytest.raises(TypeError, match=r"`fn` of memory_report must be a callable"):
        pj.memory_report(None, w, x)
