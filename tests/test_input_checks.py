"""Issue 25: every bad input gets a clear error, and no input gets a silently wrong result.

One test per rule, each matching the message's text (what was received, the rule, the fix), or
checking the value against a naive reference where the input is valid. Shapes are tiny and most
checks run at trace time, so nothing here compiles more than a few small programs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import pipejax as pj
import pipejax.hessian as ph
import pipejax.invertible as inv
from pipejax._src import checks
from pipejax.flax import LinenPipeline, on_mesh, restack, unstack

KEY = jax.random.key(0)


# --- the shared checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", [KEY, jax.random.PRNGKey(0)])
def test_check_key_accepts_one_key_and_returns_it(key):
    assert checks.check_key(key) is key
    assert checks.check_key(None) is None
    assert jax.dtypes.issubdtype(checks.typed_key(key).dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize(
    "bad, msg",
    [
        (None, r"`key` of f must be a PRNG key \(e.g. jax.random.key\(0\)\), but got None"),
        (3, r"`key` of f must be a PRNG key such as `jax.random.key\(0\)`, but got int"),
        (jax.random.split(KEY, 3), r"`key` of f must be a single PRNG key.*batch of keys of shape \(3,\)"),
        (jax.random.split(jax.random.PRNGKey(0), 3), r"single PRNG key.*shape \(3, 2\)"),
    ],
)
def test_check_key_refuses_with_one_message(bad, msg):
    with pytest.raises(TypeError, match=msg):
        checks.check_key(bad, where="f", optional=False)


def test_check_int_and_callable():
    with pytest.raises(TypeError, match=r"`n` must be an int >= 1, but got bool True"):
        checks.check_int(True, "n")
    with pytest.raises(ValueError, match=r"`n` of f must be an int >= 2 \(pairs\), but got 1"):
        checks.check_int(1, "n", 2, "f", " (pairs)")
    with pytest.raises(TypeError, match=r"`g` must be a callable `g\(x\) -> y`, but got str"):
        checks.check_callable("tanh", "g", "g(x) -> y")


def test_stage_key_refuses_negative_and_non_integer_indices():
    with pytest.raises(ValueError, match=r"`microbatch` of stage_key must be a 0-based index.*got -1"):
        pj.stage_key(KEY, -1, 0)
    with pytest.raises(ValueError, match=r"`stage` of stage_key must be a 0-based index.*got -2"):
        pj.stage_key(KEY, 0, -2)
    with pytest.raises(TypeError, match=r"`stage` of stage_key must be an integer index.*float 1.5"):
        pj.stage_key(KEY, 0, 1.5)
    with pytest.raises(ValueError, match=r"`j` of layer_key must be a 0-based index"):
        pj.layer_key(KEY, -1)
    with pytest.raises(TypeError, match=r"`key` must be None or a PRNG key"):
        pj.stage_key(3, 0, 0)
    # traced indices are not known at trace time, and keep working
    traced = jax.jit(lambda i: jax.random.key_data(pj.stage_key(KEY, i, 1)))(jnp.int32(2))
    ref = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(KEY, 2), 1))
    np.testing.assert_array_equal(traced, ref)


# --- batch_norm -----------------------------------------------------------------------------------


def test_batch_norm_feature_mismatch_is_named_not_broadcast():
    x = jnp.ones((8, 3))
    with pytest.raises(
        ValueError, match=r"`state.mean` of batch_norm has shape \(4,\).*features of shape \(3,\)"
    ):
        pj.batch_norm(x, pj.batch_norm_init(4), train=False)
    # (1,) would broadcast silently against 3 features
    with pytest.raises(
        ValueError, match=r"`state.mean` of batch_norm has shape \(1,\).*batch_norm_init\(3\)"
    ):
        pj.batch_norm(x, pj.batch_norm_init(1), train=False)
    with pytest.raises(ValueError, match=r"`scale` of batch_norm has shape \(1,\).*one scale per feature"):
        pj.batch_norm(x, pj.batch_norm_init(3), train=True, scale=jnp.ones(1))
    with pytest.raises(TypeError, match=r"`x` of batch_norm must be a floating array.*int32"):
        pj.batch_norm(jnp.ones((8, 3), jnp.int32), pj.batch_norm_init(3), train=True)
    with pytest.raises(TypeError, match=r"`mask` must be a bool array.*float32.*weights > 0"):
        pj.batch_norm(x, pj.batch_norm_init(3), train=True, mask=jnp.ones(8, jnp.float32))
    with pytest.raises(ValueError, match=r"`stats.mean` has shape \(3,\), but `state.mean` has shape \(1,\)"):
        pj.batch_norm_update(pj.batch_norm_init(1), pj.moments(x))
    with pytest.raises(ValueError, match=r"`features` of batch_norm_init must be a positive int.*got 0"):
        pj.batch_norm_init(0)


# --- checkpoint_sequential and memory_report ------------------------------------------------------


def test_checkpoint_sequential_policy_must_be_a_jax_policy():
    layer = lambda p, x, key: jnp.tanh(x @ p)
    with pytest.raises(
        TypeError, match=r"`policy` of checkpoint_sequential.*the string 'always'.*jax.checkpoint_pol"
    ):
        pj.checkpoint_sequential(layer, segments=2, policy="always")
    with pytest.raises(
        TypeError, match=r"`policy` of checkpoint_sequential must be None or a jax.checkpoint pol.*int 3"
    ):
        pj.checkpoint_sequential(layer, policy=3)
    pj.checkpoint_sequential(layer, policy=jax.checkpoint_policies.dots_saveable)  # accepted


W, X = jnp.ones((3, 3), jnp.float32), jnp.ones((2, 3), jnp.float32)


def test_memory_report_non_scalar_int_and_non_callable():
    with pytest.raises(ValueError, match=r"fn must return a real scalar.*shape=\(2, 3\).*backward=False"):
        pj.memory_report(lambda w, x: jnp.tanh(x @ w), W, X)
    assert pj.memory_report(lambda w, x: jnp.tanh(x @ w), W, X, backward=False).output_bytes == 24
    ints = jnp.ones((3, 3), jnp.int32), jnp.ones((2, 3), jnp.int32)
    with pytest.raises(TypeError, match=r"respect to the first argument.*dtype int32.*backward=False"):
        pj.memory_report(lambda w, x: jnp.sum(x @ w), *ints)
    with pytest.raises(TypeError, match=r"`fn` of memory_report must be a callable.*str"):
        pj.memory_report("loss", W, X)
    with pytest.raises(TypeError, match=r"`backward` of memory_report must be True or False"):
        pj.memory_report(lambda w: jnp.sum(w), W, backward="yes")


def test_memory_report_while_loop_and_own_errors_get_a_note():
    def looped(w, x):
        body = lambda c: (jnp.tanh(c[0] @ w), c[1] + 1)
        return jnp.sum(jax.lax.while_loop(lambda c: c[1] < 3, body, (x, 0))[0])

    with pytest.raises(ValueError, match=r"Reverse-mode differentiation") as info:
        pj.memory_report(looped, W, X)
    assert any("backward=False" in note for note in info.value.__notes__)

    def mine(w, x):
        raise KeyError("w")

    with pytest.raises(KeyError) as info:  # the user's own exception keeps its type
        pj.memory_report(mine, W, X)
    assert any("pipejax.memory_report: raised by fn(*args)" in note for note in info.value.__notes__)


# --- pipejax.hessian ------------------------------------------------------------------------------


def test_lanczos_zero_start_refused_and_traced_zero_not_nan():
    with pytest.raises(ValueError, match=r"`v0` of lanczos is zero.*non-zero start vector"):
        ph.lanczos(lambda v: 2 * v, jnp.zeros(4), 3, key=KEY)
    with pytest.raises(ValueError, match=r"`v0` of lanczos has NaN or infinite entries"):
        ph.lanczos(lambda v: 2 * v, jnp.full(4, jnp.nan), 3, key=KEY)
    with pytest.raises(
        ValueError, match=r"`matvec` of lanczos must map a vector like `v0`.*\(4,\) to \(2,\)"
    ):
        ph.lanczos(lambda v: v[:2], jnp.ones(4), 3)
    with pytest.raises(TypeError, match=r"`v0` of lanczos must be a floating array.*int"):
        ph.lanczos(lambda v: v, jnp.arange(4), 3)
    # under jit the value is unknown: a random start instead; H = 2 I gives T = diag(2)
    for reorth in ("partial", "none"):
        run = lambda v, reorth=reorth: ph.lanczos(lambda v: 2 * v, v, 3, key=KEY, reorthogonalise=reorth)
        diag = jax.jit(run)(jnp.zeros(4)).diag
        np.testing.assert_allclose(diag, [2.0, 2.0, 2.0], rtol=1e-6)


def quad(p, x):
    return jnp.mean((x @ p["w"]) ** 2)


P, XB = {"w": jnp.ones(3)}, jnp.ones((4, 3))


def test_stream_empty_short_and_other_shapes():
    with pytest.raises(ValueError, match=r"`source` of stream gave no batch: it is empty"):
        ph.stream(lambda: iter([]), 2)
    with pytest.raises(ValueError, match=r"`source` of stream gave no batch"):
        ph.stream([], 2)
    with pytest.raises(ValueError, match=r"`source` of stream holds 1 batches, fewer than num_batches=2"):
        ph.stream([XB], 2)
    # an unsized source that ends early: its own ValueError, not a callback runtime error
    with pytest.raises(ValueError, match=r"told num_batches=2, but its source ended after 1 batches"):
        ph.hvp(quad, P, P, data=ph.stream(lambda: iter([XB]), 2))
    with pytest.raises(ValueError, match=r"shapes and dtypes of the first.*batch 1 has \(\(\(2, 3\)"):
        ph.trace(quad, P, key=KEY, num_probes=2, data=ph.stream(lambda: iter([XB, XB[:2]]), 2))


def test_progress_smooth_density_and_params_tree():
    with pytest.raises(TypeError, match=r"`progress` must be True, False or a function.*str 'yes'"):
        ph.eigenvalues(quad, P, XB, key=KEY, k=1, num_steps=2, progress="yes")
    with pytest.raises(TypeError, match=r"`progress` must be True, False or a function"):
        ph.density(quad, P, XB, key=KEY, num_steps=2, progress=1)
    with pytest.raises(
        TypeError, match=r"`d` of smooth_density must be the Density.*ArrayImpl of shape \(2, 3\)"
    ):
        ph.smooth_density(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"`d` of spectral_range must have nodes and weights of one shape"):
        ph.spectral_range(ph.Density(jnp.ones((2, 3)), jnp.ones((2, 2))))
    with pytest.raises(ValueError, match=r"`sigma_squared` of smooth_density must be a positive number"):
        ph.smooth_density(ph.Density(jnp.ones((1, 2)), jnp.ones((1, 2)) / 2), sigma_squared=0.0)
    # a v of another tree: both trees shown, before the loss runs
    with pytest.raises(ValueError, match=r"`v` must have the pytree structure of `params`.*'w'.*'a'"):
        ph.hvp(quad, {"a": jnp.ones(3)}, P, XB)
    # params of another tree than the loss reads: the KeyError keeps its type and gains a note
    with pytest.raises(KeyError) as info:
        ph.hvp(quad, {"a": jnp.ones(3)}, {"a": jnp.ones(3)}, XB)
    assert any("`params` is the tree `loss` reads" in note and "'a'" in note for note in info.value.__notes__)


# --- pipejax.invertible ---------------------------------------------------------------------------


def test_bits_per_dim_refuses_scaled_data_and_matches_levels():
    flow = inv.Flow(inv.AdditiveCoupling(hidden=4), event_shape=(2, 2, 2))  # identity at init
    levels = jnp.asarray(np.random.default_rng(0).integers(0, 16, (3, 2, 2, 2)))
    params = flow.init(KEY, jnp.zeros((3, 2, 2, 2)))
    key = jax.random.key(1)
    with pytest.raises(ValueError, match=r"`x` of Flow.bits_per_dim must hold whole numbers in \[0, 16\).*"
                       r"not all whole numbers.*jnp.round\(x \* 16\)"):  # fmt: skip
        flow.bits_per_dim(params, levels.astype(jnp.float32) / 16.0, key, num_bins=16)
    with pytest.raises(ValueError, match=r"whole numbers in \[0, 8\).*range over \[0, 15\]"):
        flow.bits_per_dim(params, levels, key, num_bins=8)
    with pytest.raises(ValueError, match=r"`x` of dequantize must hold whole numbers in \[0, 256\)"):
        inv.dequantize(jnp.array([[-1.0, 3.0]]), key)
    # integer levels in a float dtype are the same data: the same bits per dimension
    ref = flow.bits_per_dim(params, levels, key, num_bins=16)
    np.testing.assert_array_equal(
        flow.bits_per_dim(params, levels.astype(jnp.float32), key, num_bins=16), ref
    )
    # under jit the values are unknown: a wrong input gives NaN, never a plausible number
    bpd = jax.jit(lambda x: flow.bits_per_dim(params, x, key, num_bins=16))
    assert np.all(np.isnan(bpd(levels.astype(jnp.float32) / 16.0)))
    np.testing.assert_allclose(bpd(levels), ref, rtol=1e-6)


def test_forward_mode_through_a_constant_memory_chain_names_the_fix():
    chain = inv.Chain([inv.AdditiveCoupling(hidden=4)], repeat=2, memory="constant")
    x = jnp.ones((2, 4))
    params = chain.init(KEY, x)
    msg = r"Chain\(memory='constant'\).forward cannot be differentiated in forward mode.*memory='linear' or"
    with pytest.raises(TypeError, match=msg):
        jax.jacfwd(lambda x: chain.forward(params, x)[0])(x)
    with pytest.raises(TypeError, match=msg):  # under jit as well, where JAX would fail only when lowering
        jax.jit(lambda x: jax.jvp(lambda x: chain.forward(params, x)[0], (x,), (x,))).lower(x)
    with pytest.raises(TypeError, match=r"Chain\(memory='constant'\).inverse"):
        jax.jacfwd(lambda y: chain.inverse(params, y)[0])(x)
    assert jax.grad(lambda x: jnp.sum(chain.forward(params, x)[0]))(x).shape == (2, 4)  # reverse mode works


# --- pipejax.flax ---------------------------------------------------------------------------------


def stacked(make, n=3):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make(rngs)

    return create(nnx.Rngs(0))


class _Gain(nnx.Module):
    def __init__(self):
        self.g = nnx.Param(jnp.ones(()))


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.gain = _Gain()


def test_unstack_refuses_a_module_that_is_not_a_stack():
    wrong = {
        True: r"bias has shape \(\), but Linear as configured makes it of shape \(4,\)",
        False: r"kernel has shape \(4,\), but Linear as configured makes it of shape \(4, 4\)",
    }
    for use_bias, leaf in wrong.items():
        with pytest.raises(ValueError, match=r"`stack` \(Linear\) is not a layer stack.*" + leaf):
            unstack(nnx.Linear(4, 4, use_bias=use_bias, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"leading sizes \[4, 8\].*pass \[module\]"):
        unstack(nnx.Linear(4, 8, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"`stack` of unstack must be an nnx.Module.*list"):
        unstack([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])
    # real stacks, Flax layers of several kinds, pass
    assert [m.kernel.shape for m in unstack(stacked(lambda r: nnx.Linear(4, 4, rngs=r)))] == [(4, 4)] * 3
    assert len(unstack(stacked(lambda r: nnx.MultiHeadAttention(2, 4, decode=False, rngs=r)))) == 3
    # a per-layer scalar parameter of a user module: refused unless the stack is confirmed
    blocks = stacked(_Block, 4)
    with pytest.raises(ValueError, match=r"parameter gain/g is a scalar.*unstack\(stack, num_layers=4\)"):
        unstack(blocks)
    assert [b.gain.g.shape for b in unstack(blocks, num_layers=4)] == [()] * 4
    with pytest.raises(ValueError, match=r"`num_layers` of unstack is 3.*leading axis of size 4"):
        unstack(blocks, num_layers=3)


def test_restack_empty_and_mixed():
    with pytest.raises(ValueError, match=r"`layers` of restack is empty"):
        restack([])
    with pytest.raises(ValueError, match=r"layers\[1\] \(Linear\) differs from layers\[0\]"):
        restack([nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 3, rngs=nnx.Rngs(0))])
    with pytest.raises(TypeError, match=r"`layers\[1\]` of restack must be an nnx.Module, but got int"):
        restack([nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 3])


def test_on_mesh_refuses_an_axis_name():
    with pytest.raises(
        TypeError, match=r"`mesh` of on_mesh must be a jax.sharding.Mesh.*str 'stage'.*axis name"
    ):
        on_mesh({"w": jnp.ones(3)}, "stage")


class _Tanh(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(x)


class _Gained(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("g", nn.initializers.ones, (), x.dtype)


def test_linen_from_sequential_checks_the_tree():
    layers = [nn.Dense(3), _Tanh(), _Gained(), nn.Dense(3)]
    pipe = LinenPipeline(layers, balance=[2, 2])
    x = jnp.ones((4, 3), jnp.float32)
    seq = nn.Sequential(layers).init(KEY, x)["params"]
    without = lambda name: {"params": {k: v for k, v in seq.items() if k != name}}
    with pytest.raises(ValueError, match=r"no parameters for layers_0 \(Dense\), which holds parameters"):
        pipe.from_sequential(without("layers_0"))
    # a layer of the user's own: not knowable at conversion, named when apply finds no variable
    variables = pipe.from_sequential(without("layers_2"))
    with pytest.raises(Exception, match=r"collection is empty") as info:
        pipe.apply(variables, x)
    assert any("layer 2 (_Gained)" in note and "from_sequential" in note for note in info.value.__notes__)


def test_siblings_train_flag_temperature_and_dtype():
    with pytest.raises(TypeError, match=r"`train` of batch_norm must be True or False, but got str 'False'"):
        pj.batch_norm(jnp.ones((2, 3)), pj.batch_norm_init(3), train="False")  # a truthy string trained
    with pytest.raises(TypeError, match=r"`unbiased` of batch_norm_update must be True or False"):
        pj.batch_norm_update(pj.batch_norm_init(3), pj.moments(jnp.ones((2, 3))), unbiased=None)
    flow = inv.Flow(inv.AdditiveCoupling(hidden=4), event_shape=(2,))
    params = flow.init(KEY, jnp.ones((3, 2)))
    with pytest.raises(
        ValueError, match=r"`temperature` of Flow.sample must be a (finite )?scalar >= 0.*-1.0"
    ):
        flow.sample(params, KEY, 2, temperature=-1.0)
    with pytest.raises(
        TypeError, match=r"`temperature` of Flow.sample must be a (finite )?scalar >= 0.*'hot'"
    ):
        flow.sample(params, KEY, 2, temperature="hot")
    with pytest.raises(TypeError, match=r"`dtype` of dequantize must be a floating dtype"):
        inv.dequantize(jnp.zeros((2, 3), jnp.int32), KEY, dtype=jnp.int32)


# --- counts: one rule (issue 39) ------------------------------------------------------------------
# Every count of the public API goes through `checks.integer`: any integral type (numpy's
# included) is accepted as the same count, a bool (Python's or numpy's) is refused. Each entry
# builds something from the count `n` and returns a plain value to compare against `n = 2`.

_LAYER = lambda p, x, key: jnp.tanh(x @ p)
_LAYERS = [lambda p, x, key: x] * 4
_HET = pj.pipeline(pj.partition(_LAYERS, [2, 2]).stages)
_LOSS = lambda w, x: jnp.sum((x @ w) ** 2)
_WH, _XH = jnp.array([1.0, 2.0]), jnp.ones((3, 2))
_FLOW = inv.Flow(inv.ActNorm(), (2,))

COUNTS = {
    # the counts issue 39 found refused as numpy integers (or checked by a rule of their own)
    "checkpoint_sequential segments": lambda n: pj.checkpoint_sequential(_LAYER, segments=n)(
        jnp.stack([jnp.eye(3)] * 4), jnp.ones((2, 3))
    ).tolist(),
    "partition balance": lambda n: pj.partition(_LAYERS, [n, 2]).balance,
    "partition devices": lambda n: pj.partition(_LAYERS, [2, 2], devices=n).devices,
    "balance_costs num_stages": lambda n: tuple(pj.balance_costs([1.0, 2.0, 3.0, 4.0], n)),
    "balance num_stages": lambda n: tuple(pj.balance(_LAYERS, [None] * 4, X, n, by="memory")),
    "from_layers balance": lambda n: pj.from_layers(_HET, [W] * 4, balance=[n, 2])[0][0].tolist(),
    # counts already on the shared helper: kept there
    "pipeline num_stages": lambda n: repr(pj.pipeline(_LAYER, num_stages=n)),
    "pipeline chunks": lambda n: repr(pj.pipeline(_LAYER, num_stages=2, chunks=n)),
    "pipeline repeats": lambda n: repr(pj.pipeline(_LAYER, num_stages=4, schedule="circular", repeats=n)),
    "gpipe_schedule num_stages": lambda n: pj.gpipe_schedule(n, 3).table.tolist(),
    "one_f_one_b_schedule num_micro": lambda n: pj.one_f_one_b_schedule(2, n).forward.tolist(),
    "circular_schedule repeats": lambda n: pj.circular_schedule(2, 2, n).table.tolist(),
    "zb_h1_bubble_fraction num_stages": lambda n: pj.zb_h1_bubble_fraction(n, 4, 1.0, 1.0, 1.0),
    "microbatch_plan chunks": lambda n: tuple(pj.microbatch_plan(4, n)),
    "layer_costs repeats": lambda n: len(pj.layer_costs(_LAYERS, [None] * 4, X, by="time", repeats=n)),
    "hessian smooth_density num_points": lambda n: ph.smooth_density(
        ph.Density(jnp.ones((1, 2)), jnp.full((1, 2), 0.5)), num_points=n
    )[0].tolist(),
    "hessian stream num_batches": lambda n: ph.stream([(_XH,)] * 2, n).num_batches,
    "hessian trace num_probes": lambda n: ph.trace(_LOSS, _WH, _XH, key=KEY, num_probes=n)[0].tolist(),
    "AdditiveCoupling hidden": lambda n: inv.AdditiveCoupling(n).hidden,
    "AffineCoupling hidden": lambda n: inv.AffineCoupling(n).hidden,
    "batch_norm_init features": lambda n: pj.batch_norm_init(n).mean.shape,
    "LinenPipeline num_stages": lambda n: LinenPipeline([nn.Dense(2)] * 4, num_stages=n).num_stages,
    "Chain repeat": lambda n: inv.Chain([inv.ActNorm()], repeat=n).repeat,
    "Chain segments": lambda n: inv.Chain([inv.ActNorm()], repeat=4, memory="sqrt", segments=n).segments,
    "InvertibleLinear permutation": lambda n: inv.InvertibleLinear(n).permutation,
    "dequantize num_bins": lambda n: inv.dequantize(jnp.zeros((1, 2), jnp.int32), KEY, num_bins=n).tolist(),
    "Flow event_shape": lambda n: inv.Flow(inv.ActNorm(), (n,)).event_shape,
    "Flow.sample num_samples": lambda n: _FLOW.sample(_FLOW.init(KEY, _XH), KEY, n).shape,
}

_COUNT_CASES = [pytest.param(name, make, id=name) for name, make in COUNTS.items()]


@pytest.mark.parametrize("name, make", _COUNT_CASES)
def test_counts_take_numpy_integers_and_refuse_bools(name, make):
    with jax.numpy_dtype_promotion("standard"):
        want = make(2)
        for n in (np.int64(2), np.int32(2)):
            assert make(n) == want, (name, type(n))
        for flag in (True, np.True_):
            with pytest.raises(TypeError, match=r"bool"):
                make(flag)


# --- keys and dropout: one message for a key that is not a key; a traced drop_rate ---------------


def test_layer_key_refuses_an_int_key_with_the_key_message():
    with pytest.raises(
        TypeError,
        match=r"`stage_key` of layer_key must be None or a PRNG key such as `jax\.random\.key\(0\)`, "
        r"but got int",
    ):
        pj.layer_key(3, 0)


def test_dropout_refuses_an_int_key_with_the_key_message():
    with pytest.raises(
        TypeError,
        match=r"`key` of dropout must be None or a PRNG key such as `jax\.random\.key\(0\)`, but got int"
        r".*one key per row",
    ):
        pj.dropout(jnp.ones((4, 3)), 3, 0.5)


@pytest.mark.parametrize("rate", ["0.1", None, True])
def test_dropout_refuses_a_drop_rate_that_is_not_a_number(rate):
    with pytest.raises(
        TypeError, match=rf"`drop_rate` of dropout must be a float in \[0, 1\).*but got {type(rate).__name__}"
    ):
        pj.dropout(jnp.ones((4, 3)), KEY, rate)


def test_dropout_takes_a_traced_drop_rate():
    x = jnp.ones((8, 1000))
    apply = jax.jit(lambda r: pj.dropout(x, KEY, r))
    assert jnp.array_equal(apply(0.3), pj.dropout(x, KEY, 0.3))  # the same mask and scale
    assert jnp.array_equal(apply(0.0), x)
    assert jnp.array_equal(apply(1.0), jnp.zeros_like(x))  # all dropped: zeros, not NaN
    keys = jax.random.split(KEY, 8)
    assert jnp.array_equal(jax.jit(lambda r: pj.dropout(x, keys, r))(0.3), pj.dropout(x, keys, 0.3))
    with pytest.raises(
        TypeError,
        match=r"`drop_rate` of dropout must be a float scalar, but got a traced array of shape \(2,\)",
    ):
        jax.jit(lambda r: pj.dropout(x, KEY, r))(jnp.ones(2))


# --- found by the issue-39 probe, at its last run ------------------------------------------------


def test_the_launcher_refuses_a_process_count_it_cannot_stop():
    """`-n 10000` forked faster than SIGTERM could stop it: the launcher starts at most 256."""
    from pipejax import launch

    with pytest.raises(ValueError, match=r"`processes` \(--processes\) must be at most 256, but got 300"):
        launch.launch(["-c", "pass"], processes=300)
    with pytest.raises(SystemExit):
        launch.main(["-n", "10000", "x.py"])


def test_cost_and_moment_inputs_that_reached_python_internals():
    with pytest.raises(TypeError, match=r"`costs\[1\]` is None; every cost must be a real number"):
        pj.balance_costs([1.0, None], 1)
    empty = pj.Moments(jnp.zeros((0,)), jnp.zeros((0, 3)), jnp.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"`stacked` of merge_moments holds no set"):
        pj.merge_moments(empty)


def test_a_layer_without_flops_costs_zero_flops():
    """XLA leaves the flop count out of a program that does none (a reshape): a cost of 0."""
    dense = lambda p, x, k: jnp.tanh(x @ p)
    flatten = lambda p, x, k: x.reshape(x.shape[0], -1)
    w = jnp.ones((4, 4))
    costs = pj.layer_costs([flatten, dense, dense], [None, w, w], jnp.ones((6, 4)))
    assert costs[0] == 0 and costs[1] > 0
    assert pj.balance([flatten, dense, dense], [None, w, w], jnp.ones((6, 4)), 2) == (2, 1)


def test_stage_leaves_with_different_layer_counts_and_abstract_params():
    pipe = pj.pipeline(lambda p, x, k: x * p["b"][0], num_stages=2)
    with pytest.raises(ValueError, match=r"holds 2 layers per stage .* but leaf \['b'\] holds 3"):
        pj.to_layers(pipe, {"w": jnp.ones((2, 2, 4, 4)), "b": jnp.ones((2, 3, 4))})
    affine = lambda p, x, k: x * p
    two = pj.pipeline([affine, affine])
    with pytest.raises(TypeError, match=r"`params` leaf \[0\] is a jax.ShapeDtypeStruct"):
        two(jax.eval_shape(lambda: [jnp.float32(1), jnp.float32(2)]), jnp.ones((4, 2), jnp.float32))
    with pytest.raises(TypeError, match=r"`params` leaf \[0\] is a jax.ShapeDtypeStruct"):
        two.value_and_grad(lambda y, t: jnp.sum(y, -1))(
            jax.eval_shape(lambda: [jnp.float32(1), jnp.float32(2)]), jnp.ones((4, 2)), jnp.ones((4, 2))
        )


def test_an_invertible_stage_without_its_logdet_says_what_to_pass():
    stage = inv.as_stage(inv.ActNorm())
    x = jnp.ones((8, 2))
    params = inv.ActNorm().init(KEY, x)
    with pytest.raises(TypeError, match=r"as_stage\(ActNorm\) takes the pair `\(x, logdet\)`, but got an"):
        pj.pipeline([stage], chunks=2)([params], x)
