"""A Flax-examples-style Transformer LM through the adapters, its attention mask a side input.

The model is lm1b's in miniature: token embedding plus learned positions, decoder blocks (pre-norm
causal self-attention with dropout, an MLP, residual dropout), a final LayerNorm and a head. The
attention mask is built once per batch as lm1b builds it (``nn.make_attention_mask`` of the
padding, combined with ``nn.make_causal_mask``) and reaches every block as its keyword argument
``decoder_mask=`` through ``context={"decoder_mask": mask}``: no wrapper module, parameter paths
those of the plain model. The batch of 5 in ``chunks=2`` leaves a padding row in the last
micro-batch; the blocks run in 2 stages of one block each, without a mesh, to keep the test
cheap (``tests/test_flax_context.py`` runs side inputs on meshes).

Dropout is on, in float64. Its masks cannot match those of the plain model run on the whole batch
(that draws one mask per layer for the whole batch, the pipeline one per micro-batch, stage and
layer), so the reference is the plain model (the same embedding, head and block modules,
parameters mapped with ``to_sequential``, the blocks in a Python loop, unpipelined) run micro-batch
by micro-batch through the blocks with the keys the adapters document: ``fold_in(pj.stage_key(key,
i, s), j)`` for layer ``j`` of stage ``s`` on micro-batch ``i``, where ``key`` is the pipeline's key
(Linen: ``make_rng("dropout")`` of the module at the same path, ``"blocks"``, in the same model;
NNX: the key given as ``rngs=``). Loss and every gradient (blocks, embedding, positions, norm,
head) agree to ``1e-10`` (micro-batching reorders sums), and another key gives another loss
(dropout really ran). Without dropout the pipelined blocks equal the whole-batch plain model:
``test_flax_linen.py``, ``test_flax_nnx.py`` and ``test_flax_context.py``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pipejax as pj
from pipejax.flax import LinenPipeline, NNXPipeline
from tests import models

F = jnp.float64
V, D, HEADS, L, BLOCKS = 13, 8, 2, 6, 2  # vocabulary, width, heads, sequence length, blocks
BATCH, CHUNKS, BALANCE = 5, 2, (1, 1)  # micro-batches of 3: the last holds 2 rows and a padding row
DROP = 0.2
CKPT = "never"  # (no recomputation: a smaller program to compile; the checkpoint modes have their tests)
TOL = dict(rtol=1e-10, atol=1e-12)
KEY = jax.random.key(3)  # the dropout key of the step


def batch():
    """Token ids with padding (id 0) after each sequence's length, and next-token targets."""
    ids = jax.random.randint(jax.random.key(0), (BATCH, L + 1), 1, V)
    lengths = jnp.array([7, 5, 6, 4, 7])
    ids = jnp.where(jnp.arange(L + 1)[None, :] < lengths[:, None], ids, 0)
    return ids[:, :-1], ids[:, 1:]


def decoder_mask(tokens):
    """lm1b's decoder mask: causal, and no attention to or from padding (``bool[B, 1, L, L]``)."""
    padding = nn.make_attention_mask(tokens > 0, tokens > 0, dtype=jnp.bool_)
    return nn.combine_masks(padding, nn.make_causal_mask(tokens, dtype=jnp.bool_), dtype=jnp.bool_)


def token_loss(logits, targets):
    """Mean cross-entropy over the real (non-padding) target tokens."""
    weights = (targets > 0).astype(F)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * weights) / jnp.sum(weights)


def replay(run, h, mask, key):
    """The blocks unpipelined, micro-batch by micro-batch, with the pipeline's documented keys.

    ``run(l, h, mask, rng)`` applies block ``l``; ``rng`` is ``None`` for the whole batch at once.
    """
    if key is None:
        for index in range(BLOCKS):
            h = run(index, h, mask, None)
        return h
    hs, _, plan = pj.split_microbatches(h, CHUNKS)
    ms, _, _ = pj.split_microbatches(mask, CHUNKS)
    outs = []
    for i in range(plan.num_micro):
        out, index = hs[i], 0
        for s, size in enumerate(BALANCE):
            for j in range(size):
                out = run(index, out, ms[i], jax.random.fold_in(pj.stage_key(key, i, s), j))
                index += 1
        outs.append(out)
    return pj.merge_microbatches(jnp.stack(outs), plan)


# --- Linen ------------------------------------------------------------------------------------


def norm():
    return nn.LayerNorm(dtype=F, param_dtype=F, force_float32_reductions=False)  # float64 statistics


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, with dropout, as in Flax's lm1b example."""

    @nn.compact
    def __call__(self, h, decoder_mask=None, deterministic: bool = True):
        a = norm()(h)
        a = nn.MultiHeadDotProductAttention(
            num_heads=HEADS, dtype=F, param_dtype=F, dropout_rate=DROP, deterministic=deterministic
        )(a, mask=decoder_mask)
        h = h + nn.Dropout(DROP)(a, deterministic=deterministic)
        m = nn.Dense(2 * D, dtype=F, param_dtype=F)(norm()(h))
        m = nn.Dense(D, dtype=F, param_dtype=F)(nn.gelu(m))
        return h + nn.Dropout(DROP)(m, deterministic=deterministic)


class Replayed(nn.Module):
    """The reference for the blocks: the plain layers (``layers_<l>``, as ``to_sequential`` names them)."""

    @nn.compact
    def __call__(self, h, *, context, deterministic: bool = True):
        key = None if deterministic else self.make_rng("dropout")  # the pipeline's one draw

        def run(index, h, mask, rng):
            params = self.get_variable("params", f"layers_{index}")
            rngs = {} if rng is None else {"dropout": rng}
            return DecoderBlock().apply({"params": params}, h, mask, deterministic, rngs=rngs)

        return replay(run, h, context["decoder_mask"], key)


class LinenLM(nn.Module):
    mesh: jax.sharding.Mesh | None = None
    pipelined: bool = True

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        positions = self.param("positions", nn.initializers.normal(0.5), (L, D), F)
        h = nn.Embed(V, D, param_dtype=F)(tokens) + positions[None]
        if self.pipelined:
            blocks = [DecoderBlock() for _ in range(BLOCKS)]
            stack = LinenPipeline(
                blocks, balance=BALANCE, chunks=CHUNKS, checkpoint=CKPT, mesh=self.mesh, name="blocks"
            )
        else:
            stack = Replayed(name="blocks")
        h = stack(h, context={"decoder_mask": decoder_mask(tokens)}, deterministic=deterministic)
        return nn.Dense(V, dtype=F, param_dtype=F)(norm()(h))


def test_linen_lm_mask_as_side_input_matches_the_plain_model():
    tokens, targets = batch()
    model, plain = LinenLM(), LinenLM(pipelined=False)  # (no mesh: test_flax_context.py has meshes)
    stack = LinenPipeline([DecoderBlock() for _ in range(BLOCKS)], balance=BALANCE)

    def loss(model, params, key):
        logits = model.apply({"params": params}, tokens, False, rngs={"dropout": key})
        return token_loss(logits, targets)

    grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
    params = model.init(jax.random.key(1), tokens)["params"]
    mapped = {**params, "blocks": stack.to_sequential({"params": params["blocks"]})["params"]}
    got_loss, got = grad(model, params, KEY)
    want_loss, want = grad(plain, mapped, KEY)
    other_loss, _ = grad(model, params, jax.random.key(4))  # (the same program: no compile)
    np.testing.assert_allclose(got_loss, want_loss, **TOL)
    got = {**got, "blocks": stack.to_sequential({"params": got["blocks"]})["params"]}
    models.assert_trees_close(nn.unbox(got), nn.unbox(want), **TOL)
    assert abs(float(other_loss) - float(got_loss)) > 1e-3  # dropout ran: another key, another loss


# --- NNX --------------------------------------------------------------------------------------


class NNXDecoderBlock(nnx.Module):
    """The same block in NNX; its dropout layers hold rng streams, which the pipeline reseeds."""

    def __init__(self, rngs: nnx.Rngs):
        kw = dict(dtype=F, param_dtype=F, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(D, **kw), nnx.LayerNorm(D, **kw)
        self.attention = nnx.MultiHeadAttention(HEADS, D, dropout_rate=DROP, decode=False, **kw)
        self.up, self.down = nnx.Linear(D, 2 * D, **kw), nnx.Linear(2 * D, D, **kw)
        self.drop1, self.drop2 = nnx.Dropout(DROP, rngs=rngs), nnx.Dropout(DROP, rngs=rngs)

    def __call__(self, h, decoder_mask=None):
        a = self.attention(self.norm1(h), mask=decoder_mask)
        h = h + self.drop1(a)
        return h + self.drop2(self.down(nnx.gelu(self.up(self.norm2(h)))))


class NNXReplayed(nnx.Module):
    """The reference for the blocks: the plain layers, reseeded as the pipeline documents."""

    def __init__(self, layers):
        self.layers = nnx.List(layers)

    def __call__(self, h, *, context, rngs, deterministic):
        def run(index, h, mask, rng):
            layer = self.layers[index]
            layer.set_attributes(deterministic=deterministic, raise_if_not_found=False)
            if rng is not None:
                nnx.reseed(layer, dropout=rng)
            return layer(h, decoder_mask=mask)

        return replay(run, h, context["decoder_mask"], None if deterministic else rngs)


class NNXLM(nnx.Module):
    def __init__(self, stack, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, param_dtype=F, rngs=rngs)
        self.positions = nnx.Param(jax.random.normal(rngs.params(), (L, D), F) * 0.5)
        self.blocks = stack
        self.norm = nnx.LayerNorm(D, dtype=F, param_dtype=F, rngs=rngs)
        self.head = nnx.Linear(D, V, dtype=F, param_dtype=F, rngs=rngs)

    def __call__(self, tokens, key, deterministic):
        h = self.embed(tokens) + self.positions[None]
        context = {"decoder_mask": decoder_mask(tokens)}
        h = self.blocks(h, context=context, rngs=key, deterministic=deterministic)
        return self.head(self.norm(h))


def test_nnx_lm_mask_as_side_input_matches_the_plain_model():
    tokens, targets = batch()

    @nnx.jit
    def grad(model, key):
        return nnx.value_and_grad(lambda m: token_loss(m(tokens, key, False), targets))(model)

    blocks = [NNXDecoderBlock(nnx.Rngs(params=i, dropout=100 + i)) for i in range(BLOCKS)]
    pipe = NNXPipeline(blocks, balance=BALANCE, chunks=CHUNKS, checkpoint=CKPT)  # no mesh: one scan
    model = NNXLM(pipe, nnx.Rngs(7))
    plain = NNXLM(NNXReplayed(pipe.to_sequential()), nnx.Rngs(7))
    with jax.numpy_dtype_promotion("standard"):  # (nnx.LayerNorm reduces float64 with float32)
        got_loss, got = grad(model, KEY)
        want_loss, want = grad(plain, KEY)
        other_loss, _ = grad(model, jax.random.key(4))
    np.testing.assert_allclose(got_loss, want_loss, **TOL)
    for name in ("embed", "positions", "norm", "head"):
        models.assert_trees_close(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), **TOL)
    for layer, mine in enumerate(pipe.layer_params(got["blocks"])):  # the packed gradient, per layer
        ref = want["blocks"]["layers"][layer]
        assert [p for p, _ in nnx.to_flat_state(mine)] == [p for p, _ in nnx.to_flat_state(ref)]
        models.assert_trees_close(jax.tree.leaves(mine), jax.tree.leaves(ref), **TOL)
    assert abs(float(other_loss) - float(got_loss)) > 1e-3
