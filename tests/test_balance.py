"""`pj.partition` and `pj.balance`: layers grouped into stages, and the balance that groups them.

* A pipeline over partitioned stages equals the layers applied in turn (forward, with keys, with
  per-example keys, and gradients read back per layer with ``ungroup``).
* The solver against brute force over every contiguous cut.
* The cost models against what they must see: a wide matmul, parameter bytes, residuals.
* Every error message, matched on the numbers it must give.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

B, VOCAB, WIDTH, HIDDEN, CLASSES = 10, 7, 4, 6, 3

# --- a heterogeneous layer stack: ints, tuples with int leaves, randomness ----------------------


def embed(p, x, key):  # {"ids": int32[b, 3], "feats": f64[b, 2]} -> (f64[b, WIDTH], int32[b, 3])
    return p["table"][x["ids"]].mean(axis=1) + x["feats"] @ p["proj"], x["ids"]


def dense(p, hx, key):  # (f64[b, WIDTH], ids) -> same
    h, ids = hx
    return jnp.tanh(h @ p["w"] + p["c"][None]), ids


def noise(p, hx, key):  # adds key-dependent noise, so the layer's key is visible in its output
    h, ids = hx
    if key is None:
        return h, ids
    if key.ndim == 0:
        draw = jax.random.normal(key, h.shape, h.dtype)
    else:  # per-example keys: one key per row
        draw = jax.vmap(lambda k: jax.random.normal(k, h.shape[1:], h.dtype))(key)
    return h + jnp.asarray(0.1, h.dtype) * draw, ids


def merge(p, hx, key):  # (h, ids) -> f64[b, WIDTH]; uses the int leaf
    h, ids = hx
    return h + ids[:, :1].astype(h.dtype) * p


def up(p, h, key):  # f64[b, WIDTH] -> f64[b, HIDDEN]
    return jnp.tanh(h @ p["w"])


def head(p, h, key):  # f64[b, HIDDEN] -> f64[b, CLASSES]
    return h @ p["w"]


LAYERS = (embed, dense, noise, merge, up, head)
BALANCE = (2, 3, 1)  # torchgpipe's example balance: 6 layers, 3 stages


def layer_params(seed=0):
    r = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(r.normal(size=shape) / np.sqrt(shape[0]))
    return [
        {"table": normal(VOCAB, WIDTH), "proj": normal(2, WIDTH)},
        {"w": normal(WIDTH, WIDTH), "c": normal(WIDTH)},
        None,
        jnp.asarray(0.01),
        {"w": normal(WIDTH, HIDDEN)},
        {"w": normal(HIDDEN, CLASSES)},
    ]


def batch(seed=1):
    r = np.random.default_rng(seed)
    return {
        "ids": jnp.asarray(r.integers(0, VOCAB, (B, 3)), jnp.int32),
        "feats": jnp.asarray(r.normal(size=(B, 2))),
    }


def sequential(params, x, layer_keys=None):
    """The layers applied in turn; ``layer_keys[l]`` is layer l's key (None: no keys)."""
    for idx, (layer, p) in enumerate(zip(LAYERS, params, strict=True)):
        x = layer(p, x, None if layer_keys is None else layer_keys[idx])
    return x


def stage_and_index(idx):
    """(stage, index within the stage) of layer ``idx`` under BALANCE."""
    offsets = np.cumsum((0, *BALANCE))
    s = int(np.searchsorted(offsets, idx, side="right") - 1)
    return s, idx - int(offsets[s])


# float64 throughout: the pipeline runs the same operations on micro-batches instead of the whole
# batch, which changes nothing but XLA's blocking of the small matmuls (rounding at 1e-16).
RTOL, ATOL = 1e-12, 1e-12


@pytest.fixture(scope="module")
def part():
    return pj.partition(LAYERS, BALANCE, devices=3)


def test_pipeline_over_partition_equals_sequential(part):
    params, x = layer_params(), batch()
    pipe = pj.pipeline(part.stages, chunks=3, mesh=part.mesh())
    y = pipe(part.group(params), x)
    np.testing.assert_allclose(y, sequential(params, x), rtol=RTOL, atol=ATOL)
    assert y.shape == (B, CLASSES)


def test_stateful_partition_equals_the_layers_in_turn():
    """Stateful layers grouped into stages: each layer gets its own state and the row mask, the
    stage returns the list of its layers' stats; the pipeline equals the layers applied in turn
    to every micro-batch."""

    def norm(p, x, key, state, mask):
        y, moments = pj.batch_norm(x @ p, state, train=True, mask=mask)
        return jnp.tanh(y), moments

    def plain(p, x, key, state, mask):
        assert state is None
        return x @ p, jnp.sum(jnp.where(mask[:, None], x, 0.0))

    layers = [norm, plain, norm, plain, norm]
    ws = [jax.random.normal(k, (6, 6)) for k in jax.random.split(jax.random.key(0), 5)]
    state = [pj.batch_norm_init(6) if f is norm else None for f in layers]
    part = pj.partition(layers, [2, 3], stateful=True)
    x = jax.random.normal(jax.random.key(1), (10, 6))  # 3 micro-batches of 4 rows: 2 padding rows
    y, stats = pj.pipeline(part.stages, chunks=3, stateful=True)(part.group(ws), x, state=part.group(state))
    xs, mask, plan = pj.split_microbatches(x, 3)
    outs, per_micro = [], []
    for i in range(plan.num_micro):
        h, layer_stats = xs[i], []
        for f, w, st in zip(layers, ws, state, strict=True):
            h, stat = f(w, h, None, st, mask[i])
            layer_stats.append(stat)
        outs.append(h)
        per_micro.append(layer_stats)
    np.testing.assert_allclose(y, pj.merge_microbatches(jnp.stack(outs), plan), rtol=RTOL, atol=ATOL)
    # stage s's stats: the list of its layers' stats, one row per micro-batch
    for s, (lo, hi) in enumerate([(0, 2), (2, 5)]):
        for j in range(hi - lo):
            expected = jax.tree.map(lambda *a: jnp.stack(a), *[m[lo + j] for m in per_micro])
            jax.tree.map(
                lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), stats[s][j], expected
            )


def test_layer_keys_inside_a_stage(part):
    """Layer j of stage s on micro-batch i draws from fold_in(stage_key(key, i, s), j)."""
    params, x, key = layer_params(), batch(), jax.random.key(7)
    pipe = pj.pipeline(part.stages, chunks=2, mesh=part.mesh())
    y = pipe(part.group(params), x, key)

    xs, _, plan = pj.split_microbatches(x, 2)
    outs = []
    for i in range(plan.num_micro):
        layer_keys = []
        for idx in range(len(LAYERS)):
            s, j = stage_and_index(idx)
            layer_keys.append(jax.random.fold_in(pj.stage_key(key, i, s), j))
        outs.append(sequential(params, jax.tree.map(lambda a, i=i: a[i], xs), layer_keys))
    np.testing.assert_allclose(y, pj.merge_microbatches(jnp.stack(outs), plan), rtol=RTOL, atol=ATOL)
    # The noise layer really drew: the result differs from the keyless one.
    assert not np.allclose(y, pipe(part.group(params), x), atol=1e-3)


def test_layer_keys_with_per_example_keys(part):
    """Per-example stage keys are folded key by key: example e, stage s, layer j."""
    params, x, key = layer_params(), batch(), jax.random.key(3)
    pipe = pj.pipeline(part.stages, chunks=4, per_example_keys=True)
    y = pipe(part.group(params), x, key)
    rows = []
    for e in range(B):
        layer_keys = []
        for idx in range(len(LAYERS)):
            s, j = stage_and_index(idx)
            stage_key = jax.random.fold_in(jax.random.fold_in(key, e), s)
            layer_keys.append(jax.random.fold_in(stage_key, j)[None])  # a batch of one key
        rows.append(sequential(params, jax.tree.map(lambda a, e=e: a[e : e + 1], x), layer_keys)[0])
    np.testing.assert_allclose(y, jnp.stack(rows), rtol=RTOL, atol=ATOL)


def test_layer_key_rule():
    key = jax.random.key(0)
    data = jax.random.key_data
    np.testing.assert_array_equal(data(pj.layer_key(key, 2)), data(jax.random.fold_in(key, 2)))
    batch_keys = jax.random.split(key, 3)
    folded = pj.layer_key(batch_keys, 1)
    for r in range(3):
        np.testing.assert_array_equal(data(folded[r]), data(jax.random.fold_in(batch_keys[r], 1)))
    raw = jax.random.PRNGKey(0)  # a raw uint32[2] key
    np.testing.assert_array_equal(pj.layer_key(raw, 4), jax.random.fold_in(raw, 4))
    assert pj.layer_key(None, 0) is None


def test_layers_get_none_without_a_key():
    seen = []

    def record(p, x, key):
        seen.append(key)
        return x

    part = pj.partition([record] * 3, [2, 1])
    pj.pipeline(part.stages, chunks=2)(part.group([None] * 3), jnp.ones((4, 2)))
    assert seen and all(k is None for k in seen)


def test_gradients_through_partition_match_sequential(part):
    """Gradients w.r.t. the placed (packed) stage parameters, read back per layer."""
    params, x = layer_params(), batch()
    pipe = pj.pipeline(part.stages, chunks=2, checkpoint="always", mesh=part.mesh())
    placed = pipe.place(part.group(params))

    def loss(p):
        return jnp.sum(jnp.sin(pipe(p, x)))

    grads = part.ungroup(jax.jit(jax.grad(loss))(placed))  # a StageParams -> per-layer list
    expected = jax.grad(lambda ps: jnp.sum(jnp.sin(sequential(ps, x))))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)  # sums of per-micro-batch grads


def test_group_ungroup_round_trip(part):
    params = layer_params()
    grouped = part.group(params)
    assert [len(g) for g in grouped] == list(BALANCE)
    assert grouped[1][0] is params[2] and grouped[2][0] is params[5]
    back = part.ungroup(grouped)
    assert len(back) == len(params) and all(a is b for a, b in zip(back, params, strict=True))
    assert part.offsets == (0, 2, 5, 6)
    assert part.num_stages == 3
    assert part.devices == tuple(jax.devices()[:3])
    assert list(part.mesh().devices.flat) == list(part.devices)
    assert "balance=(2, 3, 1)" in repr(part)


# --- the solver ------------------------------------------------------------------------------------


def brute_force(costs, k):
    """Every cut of len(costs) layers into k non-empty contiguous stages, best first by the
    documented order: least maximum, then least sum of squares, then smallest balance."""
    n = len(costs)
    candidates = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        balance = tuple(b - a for a, b in itertools.pairwise(bounds))
        stage = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        candidates.append((max(stage), sum(c * c for c in stage), balance))
    return min(candidates)


def test_solver_matches_brute_force_with_ties_and_zeros():
    """200 random cases, n <= 9, integer costs in 0..4 (many ties and zeros; sums are exact)."""
    r = np.random.default_rng(0)
    for _ in range(200):
        n = int(r.integers(1, 10))
        k = int(r.integers(1, n + 1))
        costs = [float(c) for c in r.integers(0, 5, n)]
        worst, sumsq, balance = brute_force(costs, k)
        got = pj.balance_costs(costs, k)
        assert got == balance, (costs, k, got, balance)
        assert got.max_stage_cost == worst and sum(c * c for c in got.stage_costs) == sumsq


def test_solver_matches_brute_force_on_real_costs():
    """100 random real-valued cases: the same optimal bottleneck (bitwise: both sum left to right)
    and the same sum of squares up to the rounding of its summation order."""
    r = np.random.default_rng(1)
    for _ in range(100):
        n = int(r.integers(1, 10))
        k = int(r.integers(1, n + 1))
        costs = list(r.exponential(size=n))
        worst, sumsq, _ = brute_force(costs, k)
        got = pj.balance_costs(costs, k)
        bounds = np.cumsum((0, *got))
        stage = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]  # as brute_force sums
        assert max(stage) == worst
        assert math.isclose(sum(c * c for c in stage), sumsq, rel_tol=1e-12)
        assert math.isclose(got.max_stage_cost, worst, rel_tol=1e-14)  # reported with math.fsum


def test_solver_tie_rules():
    assert pj.balance_costs([0, 0, 0, 0], 2) == (1, 3)  # all equal: the earliest cut
    assert pj.balance_costs([5, 0, 0], 2) == (1, 2)
    assert pj.balance_costs([1, 1, 1, 1], 2) == (2, 2)  # the only cut with max 2
    assert pj.balance_costs([2, 1, 1, 2], 3) == (1, 2, 1)  # max 2 in every stage
    assert pj.balance_costs([3, 1, 1, 1, 3], 2) == (2, 3)  # (3, 2) ties on max and sum of squares


def test_balance_object():
    b = pj.balance_costs(np.array([1.0, 2.0, 3.0, 4.0]), 2)
    assert b == (3, 1) and isinstance(b, tuple)
    assert b.stage_costs == (6.0, 4.0) and b.max_stage_cost == 6.0
    assert b.costs == (1.0, 2.0, 3.0, 4.0) and b.by == "costs"
    table = b.table()
    assert "0-2" in table and "60%" in table and "40%" in table
    assert pj.partition([lambda p, x, k: x] * 4, b).balance == (3, 1)


# --- cost models -----------------------------------------------------------------------------------


def matmul(p, x, key):
    return x @ p


def block(p, x, key):  # width -> p.shape[1] -> width
    return jnp.tanh(x @ p) @ p.T


def test_flops_of_a_matmul():
    """XLA counts 2·b·i·o for the forward; the backward adds dx and dW, two more matmuls."""
    w = jax.ShapeDtypeStruct((8, 5), jnp.float32)
    x = jnp.ones((6, 8), jnp.float32)
    (fwd,) = pj.layer_costs([matmul], [w], x, backward=False)
    (train,) = pj.layer_costs([matmul], [w], x)
    assert fwd == 2 * 6 * 8 * 5
    assert train == 3 * fwd


def test_flops_put_a_wide_layer_alone():
    narrow, wide = jnp.ones((8, 8)), jnp.ones((8, 256))
    params = [narrow, narrow, wide, narrow, narrow]
    b = pj.balance([block] * 5, params, jnp.ones((16, 8)), 3)
    assert b.by == "flops"
    assert b.costs[2] > 10 * max(b.costs[:2] + b.costs[3:])
    assert b == (2, 1, 2)
    # Abstract parameters give the same costs (nothing is run).
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    assert pj.layer_costs([block] * 5, abstract, jnp.ones((16, 8))) == b.costs


def test_equal_layers_compile_once():
    """Layers with the same function and types share one compiled program: 5 equal layers trace
    the layer fewer than 5 times (one compile, plus the shape propagation that JAX caches)."""
    traces = []

    def counted(p, x, key):
        traces.append(1)
        return jnp.tanh(x @ p)

    costs = pj.layer_costs([counted] * 5, [jnp.ones((8, 8))] * 5, jnp.ones((4, 8)))
    assert len(set(costs)) == 1 and costs[0] > 0
    assert len(traces) < 5


def test_flops_through_heterogeneous_layers():
    """Int inputs, tuples with int leaves, a parameterless layer, and a key."""
    costs = pj.layer_costs(LAYERS, layer_params(), batch(), key=jax.random.key(0))
    assert len(costs) == 6 and all(c >= 0 for c in costs)
    assert costs[4] > costs[5] > 0  # tanh(h @ w[4, 6]) vs h @ w[6, 3]


def test_memory_counts_params_times_scale_plus_residuals():
    w = jnp.ones((8, 5), jnp.float32)  # 160 bytes
    x = jnp.ones((6, 8), jnp.float32)  # 192 bytes, saved for dW
    (two,) = pj.layer_costs([matmul], [w], x, by="memory")
    (four,) = pj.layer_costs([matmul], [w], x, by="memory", param_scale=4.0)
    (acts,) = pj.layer_costs([matmul], [w], x, by="memory", param_scale=0.0, activation_scale=3.0)
    assert two == 2 * 160 + 192
    assert four - two == 2 * 160
    assert acts == 3 * 192
    # A parameterless layer: sin saves cos(x) (its derivative), not its input.
    (sine,) = pj.layer_costs([lambda p, x, k: jnp.sin(x)], [None], x, by="memory")
    assert sine == 192


def test_memory_balance_follows_param_scale():
    """A parameter-heavy layer (big w, small batch) and activation-heavy parameterless layers: with
    param_scale 0 the activations decide the cut; with a large one the parameters do."""
    heavy = jnp.ones((16, 16))  # 2 KiB of parameters, residual: its input, 4·16·8 = 512 bytes

    def act(p, x, k):  # parameterless, saves cos(x): 512 bytes
        return jnp.sin(x)

    layers, params, x = [matmul, act, act, act], [heavy, None, None, None], jnp.ones((4, 16))
    by_acts = pj.balance(layers, params, x, 2, by="memory", param_scale=0.0)
    by_params = pj.balance(layers, params, x, 2, by="memory", param_scale=100.0)
    assert by_acts.costs == (512.0, 512.0, 512.0, 512.0) and by_acts == (2, 2)
    assert by_params.costs == (100 * 2048 + 512, 512.0, 512.0, 512.0) and by_params == (1, 3)


def test_time_returns_a_valid_balance():
    narrow, wide = jnp.ones((8, 8)), jnp.ones((8, 64))
    b = pj.balance([block] * 4, [narrow, wide, narrow, narrow], jnp.ones((16, 8)), 2, by="time", repeats=3)
    assert b.by == "time" and len(b) == 2 and sum(b) == 4 and min(b) >= 1
    assert len(b.costs) == 4 and all(c > 0 for c in b.costs)


def test_time_runs_abstract_parameters_as_zeros():
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    costs = pj.layer_costs([matmul, matmul], [w, w], jnp.ones((4, 8), jnp.float32), by="time", warmup=0)
    assert len(costs) == 2 and all(c > 0 for c in costs)


# --- errors ------------------------------------------------------------------------------------------


def ident(p, x, key):
    return x


@pytest.mark.parametrize(
    ("balance", "error", "match"),
    [
        ([2, 0, 4], ValueError, r"`balance\[1\]` is 0; every entry must be a positive int"),
        ([3, -1, 4], ValueError, r"`balance\[1\]` is -1"),
        ([2.0, 4], TypeError, r"`balance\[0\]` is 2.0 \(float\)"),
        ([True, 5], TypeError, r"`balance\[0\]` is True"),
        ([2, 3], ValueError, r"sums to 5 layers, but `layers` has 6"),
        ([2, 5], ValueError, r"sums to 7 layers, but `layers` has 6"),
        ([], ValueError, r"`balance` is empty"),
        ("24", TypeError, r"`balance` must be a sequence of positive ints"),
    ],
)
def test_balance_errors(balance, error, match):
    with pytest.raises(error, match=match):
        pj.partition([ident] * 6, balance)


def test_devices_errors():
    with pytest.raises(ValueError, match=r"There are 2 devices but 3 stages"):
        pj.partition([ident] * 3, [1, 1, 1], devices=2)
    with pytest.raises(ValueError, match=r"There are 1 devices but 2 stages"):
        pj.partition([ident] * 3, [2, 1], devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"`devices` is 9, but only 4 devices exist"):
        pj.partition([ident] * 3, [2, 1], devices=9)
    with pytest.raises(ValueError, match=r"lists a device more than once"):
        pj.partition([ident] * 3, [2, 1], devices=[jax.devices()[0]] * 2)
    with pytest.raises(TypeError, match=r"`devices\[1\]` must be a jax.Device, but got int"):
        pj.partition([ident] * 3, [2, 1], devices=[jax.devices()[0], 1])
    with pytest.raises(TypeError, match=r"not a Mesh"):
        pj.partition([ident] * 3, [2, 1], devices=jax.make_mesh((2,), ("stage",)))
    # Extra devices are fine: stage s gets the s-th.
    assert pj.partition([ident] * 3, [2, 1], devices=jax.devices()[1:]).devices == tuple(jax.devices()[1:3])


def test_layers_errors():
    with pytest.raises(ValueError, match=r"`layers` is empty"):
        pj.partition([], [1])
    with pytest.raises(TypeError, match=r"`layers\[1\]` must be a callable"):
        pj.partition([ident, 3], [2])


def test_group_ungroup_and_stage_params_errors(part):
    with pytest.raises(ValueError, match=r"`layer_params` has 5 entries, but the partition has 6 layers"):
        part.group([None] * 5)
    with pytest.raises(ValueError, match=r"`stage_params` has 2 entries, but the partition has 3 stages"):
        part.ungroup([[None, None], [None] * 3])
    with pytest.raises(ValueError, match=r"Stage 1 holds 3 layers, so stage_params\[1\] must be a list of 3"):
        part.ungroup([[None, None], [None] * 2, [None]])
    bad = part.group(layer_params())
    bad[0] = bad[0][:1]
    with pytest.raises(ValueError, match=r"Stage 0 holds 2 layers, so the params of stage 0 must be a list"):
        pj.pipeline(part.stages)(bad, batch())


@pytest.mark.parametrize(
    ("costs", "k", "error", "match"),
    [
        ([1, 2, 3], 0, ValueError, r"`num_stages` is 0, but 3 layers allow 1 to 3 stages"),
        ([1, 2, 3], 4, ValueError, r"`num_stages` is 4, but 3 layers allow 1 to 3 stages"),
        ([1, 2, 3], 2.0, TypeError, r"`num_stages` must be an int"),
        ([1, -2, 3], 2, ValueError, r"`costs\[1\]` is -2.0; every cost must be finite and >= 0"),
        ([1, 2, math.nan], 2, ValueError, r"`costs\[2\]` is nan"),
        ([math.inf, 2], 1, ValueError, r"`costs\[0\]` is inf"),
        ([1, "2"], 1, TypeError, r"`costs\[1\]` is '2'; every cost must be a real number"),
        ([], 1, ValueError, r"non-empty 1-D"),
    ],
)
def test_solver_errors(costs, k, error, match):
    with pytest.raises(error, match=match):
        pj.balance_costs(costs, k)


def test_cost_model_errors():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    with pytest.raises(ValueError, match=r"`by` must be one of 'flops', 'time', 'memory', but got 'size'"):
        pj.balance([matmul] * 2, [w, w], x, 2, by="size")
    with pytest.raises(ValueError, match=r"`layer_params` has 1 entries but there are 2 layers"):
        pj.layer_costs([matmul] * 2, [w], x)
    with pytest.raises(ValueError, match=r"`num_stages` is 3, but 2 layers allow 1 to 2 stages"):
        pj.balance([matmul] * 2, [w, w], x, 3)
    with pytest.raises(ValueError, match=r"`param_scale` must be a finite number >= 0, but got -1"):
        pj.layer_costs([matmul], [w], x, by="memory", param_scale=-1)
    with pytest.raises(ValueError, match=r"`repeats` must be an int >= 1, but got 0"):
        pj.layer_costs([matmul], [w], x, by="time", repeats=0)
    with pytest.raises(ValueError, match=r"Layer 1 could not be applied to the output of layer 0"):
        pj.layer_costs([matmul] * 2, [w, jnp.ones((5, 8))], x)
    with pytest.raises(ValueError, match=r"Layer 0 could not be applied to `sample_x`"):
        pj.layer_costs([matmul], [w], jnp.ones((4, 3)))


@pytest.mark.parametrize("devices", [0, -1])
def test_devices_count_must_be_positive(devices):
    # -1 once sliced `jax.devices()[:-1]`: every device but the last.
    with pytest.raises(
        ValueError,
        match=rf"`devices` of partition must be a positive count .*but got {devices}; pass at least 2",
    ):
        pj.partition([ident] * 3, [2, 1], devices=devices)


def test_mesh_hint_for_a_mesh_as_devices_works():
    mesh = jax.make_mesh((2,), ("stage",))
    with pytest.raises(TypeError, match=r"not a Mesh: pass `list\(mesh\.devices\.flat\)`"):
        pj.partition([ident] * 3, [2, 1], devices=mesh)
    assert pj.partition([ident] * 3, [2, 1], devices=list(mesh.devices.flat)).devices == tuple(
        mesh.devices.flat
    )


@pytest.mark.parametrize(
    "axis_name, error, match",
    [
        ("", ValueError, r"`axis_name` is the empty string; name an axis of the mesh"),
        (3, TypeError, r"`axis_name` must be a str, but got int 3"),
        (None, TypeError, r"`axis_name` must be a str, but got NoneType None"),
    ],
)
def test_mesh_axis_name_errors(axis_name, error, match):
    with pytest.raises(error, match=match):
        pj.partition([ident] * 3, [2, 1], devices=2).mesh(axis_name=axis_name)
