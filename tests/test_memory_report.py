"""`pj.memory_report`: compiled memory and saved residuals, checked against known programs."""

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj

W = jnp.full((4, 16, 16), 0.1, jnp.float32)
X = jnp.ones((32, 16), jnp.float32)


def mlp(w, x):
    for layer in range(w.shape[0]):
        x = jnp.sin(x @ w[layer])
    return jnp.sum(x**2)


def test_residuals_of_a_known_program():
    report = pj.memory_report(mlp, W, X)
    own = [r for r in report.residuals if not r.source.startswith("from the argument")]
    # Per layer: the weight slice w[l] (16 x 16) and cos(x @ w[l]) (32 x 16); the outputs of
    # layers 0-2 (the next layer's input, for its weight's cotangent); the loss's 2 * x. All
    # float32. (sin, not tanh: JAX 0.11 saves one residual for tanh where 0.10 saved two.)
    assert all(r.dtype == np.float32 for r in own)
    assert sorted(r.shape for r in own) == [(16, 16)] * 4 + [(32, 16)] * 8
    assert report.residual_bytes == 4 * 16 * 16 * 4 + 8 * 32 * 16 * 4
    assert report.argument_bytes == W.nbytes + X.nbytes
    assert report.output_bytes == W.nbytes  # jit(grad) returns the gradient of w
    assert report.temp_bytes > 0
    assert "residuals" in str(report)


def test_checkpointing_shows_up_as_fewer_residuals():
    plain = pj.memory_report(mlp, W, X)
    remat = pj.memory_report(jax.checkpoint(mlp), W, X)
    assert remat.residual_bytes < plain.residual_bytes
    assert remat.residual_bytes == 0  # only the arguments are kept


def test_forward_only_program():
    report = pj.memory_report(lambda w, x: jnp.tanh(x @ w[0]), W, X, backward=False)
    assert report.output_bytes == 32 * 16 * 4


def test_pipeline_modes_ranked_by_memory():
    """On a 4-stage pipeline the per-device temp bytes order as always < except_last < never."""
    mesh = jax.make_mesh((4,), ("stage",))

    def stage(p, x, k):
        for layer in range(p.shape[0]):
            x = jnp.tanh(x @ p[layer])
        return x

    params = jnp.full((4, 4, 16, 16), 0.1, jnp.float32)
    x = jnp.ones((64, 16), jnp.float32)
    temps = {}
    for mode in ("always", "except_last", "never"):
        pipe = pj.pipeline(stage, num_stages=4, chunks=8, checkpoint=mode, mesh=mesh)
        report = pj.memory_report(lambda p, x, pipe=pipe: jnp.sum(pipe(p, x) ** 2), params, x)
        temps[mode] = report.temp_bytes
    assert temps["always"] < temps["except_last"] < temps["never"], temps
