"""A tiny Gemma-style NNX model, pipelined as it is: no wrapper layers, dropout on (issue 24).

The model (written for this test, in the style of current NNX decoders) has what made the issue's
user add wrapper layers:

* an embedder, three decoder blocks and a head: a final RMSNorm and the unembedding **tied** to
  the embedder's table (Gemma's ``embedder.decode``). The model holds one table; pipelined, the
  head (last stage) holds a copy of it, made one weight with ``tied=`` (each copy's gradient is
  the sum, the gradient of the one table);
* blocks with pre-RMSNorm attention, local (sliding window) on blocks 0 and 2, global on block 1,
  rotary positions, and a gated MLP; the positions and the attention mask reach every block
  through ``context=`` as the keyword arguments ``segment_pos=`` and ``attn_mask=``, and the
  block's ``cache`` argument (``None`` in training) as the flag ``cache=None``;
* ``nnx.Dropout(rate)`` holding **no** rng stream, called with ``rngs=`` at call time;
* blocks that return ``(cache, x)``: the pipeline is built with ``carry=1``;
* a weighted cross-entropy returning ``(per-example sums, per-example weights)``: the loss is
  ``sum(losses) / sum(weights)`` over the batch (padding tokens have weight 0).

Checks, on a 2-stage mesh, batch 7 in 3 micro-batches (the last one padded), float64:

* dropout off: loss and gradients of GPipe (``nnx.value_and_grad`` of the module's call) and of
  ``value_and_grad`` with the "1f1b" schedule equal the unpipelined model's on the whole batch
  (``rtol=1e-10``: micro-batching reorders float sums);
* dropout on: the unpipelined model run micro-batch by micro-batch, each block called with the
  documented call-time ``rngs`` (``nnx.Rngs(dropout=k)`` reseeded with ``k = fold_in(
  pj.stage_key(key, i, s), j)``), gives the same loss and gradients as both schedules (GPipe
  storing every residual, 1F1B recomputing each stage in its backward slot), and another loss than
  dropout off. (``tests/test_flax_call_rngs.py`` checks the checkpoint modes bitwise.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pipejax as pj
from pipejax.flax import NNXPipeline

F = jnp.float64
V, D, HEADS, HEAD_DIM, HIDDEN, L = 17, 8, 2, 4, 16, 6  # vocabulary, width, heads, MLP, length
WINDOWS = (3, None, 3)  # per block: a sliding window of 3 positions (local), or global
DROP = 0.25
BATCH, CHUNKS, BALANCE = 7, 3, (2, 3)  # micro-batches of 3 (the last has 2 rows and a padding row)
TOL = dict(rtol=1e-10, atol=1e-12)  # float64; micro-batching reorders sums
KEY = jax.random.key(11)


def rope(x, positions):
    """Rotary position embedding of ``x: (B, L, heads, head_dim)`` at ``positions: int[B, L]``."""
    half = x.shape[-1] // 2
    freq = 10_000.0 ** (-jnp.arange(half, dtype=x.dtype) / half)
    angle = positions.astype(x.dtype)[:, :, None, None] * freq[None, None, None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class RMSNorm(nnx.Module):
    """Gemma's RMSNorm, ``x / rms(x) * (1 + scale)`` (``nnx.RMSNorm`` promotes float64 with float32,
    which this test suite's strict dtype promotion refuses)."""

    def __init__(self, rngs):
        self.scale = nnx.Param(jnp.zeros((D,), F))

    def __call__(self, x):
        return (
            x
            * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            * (1 + self.scale[...])[None, None, :]
        )


class Attention(nnx.Module):
    def __init__(self, window, rngs):
        dense = lambda din, dout: nnx.Linear(din, dout, use_bias=False, param_dtype=F, rngs=rngs)
        self.q, self.k, self.v = (dense(D, HEADS * HEAD_DIM) for _ in range(3))
        self.out = dense(HEADS * HEAD_DIM, D)
        self.window = window  # None: global attention

    def __call__(self, x, segment_pos, attn_mask):
        b, n, _ = x.shape
        heads = lambda t: t.reshape(b, n, HEADS, HEAD_DIM)
        q, k, v = rope(heads(self.q(x)), segment_pos), rope(heads(self.k(x)), segment_pos), heads(self.v(x))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM**-0.5
        mask = attn_mask
        if self.window is not None:  # local: only the last `window` positions
            mask = mask & (segment_pos[:, :, None] - segment_pos[:, None, :] < self.window)
        probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -1e30), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, HEADS * HEAD_DIM))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.gate = nnx.Linear(D, HIDDEN, use_bias=False, param_dtype=F, rngs=rngs)
        self.up = nnx.Linear(D, HIDDEN, use_bias=False, param_dtype=F, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, D, use_bias=False, param_dtype=F, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """A decoder block as current NNX decoders write it: returns ``(cache, x)``, and its dropout
    takes ``rngs`` at call time."""

    def __init__(self, window, rngs):
        self.pre_attention_norm = RMSNorm(rngs)
        self.attn = Attention(window, rngs)
        self.pre_ffw_norm = RMSNorm(rngs)
        self.mlp = MLP(rngs)
        self.dropout = nnx.Dropout(DROP)  # no rng stream: `rngs` comes with the call

    def __call__(self, x, segment_pos, cache, attn_mask, rngs=None):
        if cache is not None:
            raise NotImplementedError("decoding with a cache is out of this test's scope")
        x = x + self.dropout(self.attn(self.pre_attention_norm(x), segment_pos, attn_mask), rngs=rngs)
        x = x + self.dropout(self.mlp(self.pre_ffw_norm(x)), rngs=rngs)
        return cache, x


class Embedder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, param_dtype=F, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens) * D**0.5


def unembed(x, table):
    return x @ table.T  # logits against the embedding table


class Head(nnx.Module):
    """The pipeline's last layer: the model's final norm, and its own copy of the embedding table
    (tied to the embedder's with ``tied=``: on another stage, it must be a copy)."""

    def __init__(self, final_norm, table):
        self.final_norm = final_norm
        self.table = nnx.Param(table)

    def __call__(self, x):
        return unembed(self.final_norm(x), self.table[...])


class GemmaLike(nnx.Module):
    def __init__(self, rngs):
        self.embedder = Embedder(rngs)
        self.blocks = nnx.List([Block(window, rngs) for window in WINDOWS])
        self.final_norm = RMSNorm(rngs)

    def layers(self):
        """The layers to pipeline: the head gets a copy of the table (see ``TIED``)."""
        return [self.embedder, *self.blocks, Head(self.final_norm, self.embedder.embed.embedding[...])]

    def __call__(self, tokens, segment_pos, attn_mask, rngs=None):
        x = self.embedder(tokens)
        for block in self.blocks:
            _, x = block(x, segment_pos, None, attn_mask, rngs=rngs)
        return unembed(self.final_norm(x), self.embedder.embed.embedding[...])  # one table


# the embedder's table (layer 0) and the head's copy (layer 4, the other stage): one weight
TIED = [[(0, "embed/embedding"), (4, "table")]]


def weighted_ce(logits, targets):
    """Per-example sums of the token losses, and per-example weights (the pipeline's loss contract)."""
    labels, weights = targets
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights, axis=-1), jnp.sum(weights, axis=-1)


def batch():
    """Tokens with padding (id 0) after each sequence's length, positions, mask, targets."""
    ids = jax.random.randint(jax.random.key(0), (BATCH, L + 1), 1, V)
    lengths = jnp.array([7, 5, 6, 4, 7, 3, 6])
    ids = jnp.where(jnp.arange(L + 1)[None, :] < lengths[:, None], ids, 0)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(L)[None, :], (BATCH, L))
    real = tokens > 0
    causal = positions[:, :, None] >= positions[:, None, :]
    attn_mask = causal & real[:, None, :]
    context = {"segment_pos": positions, "attn_mask": attn_mask}
    return tokens, context, (labels, (labels > 0).astype(F))


def make_model():
    return GemmaLike(nnx.Rngs(params=0))


def loss_of(model, tokens, context, targets):
    """The unpipelined model's loss on the whole batch."""
    logits = model(tokens, context["segment_pos"], context["attn_mask"])
    return mean_loss(weighted_ce(logits, targets))


def mean_loss(out):
    losses, weights = out
    return jnp.sum(losses) / jnp.sum(weights)


def layer_grads(model, grads):
    """The per-layer Param states of a gradient of ``model`` (as ``pipe.layer_params`` gives them;
    the head's table copy gets the one table's gradient, what each tied copy must get)."""
    copy = nnx.clone(model)
    nnx.update(copy, grads)
    return [nnx.state(layer, nnx.Param) for layer in copy.layers()]


def pipeline_of(model, mesh, **options):
    return NNXPipeline(
        model.layers(), balance=BALANCE, chunks=CHUNKS, mesh=mesh, carry=1, tied=TIED, **options
    )


def pipelined(pipe, schedule, tokens, context, targets, *, deterministic, key=None):
    """``(loss, per-layer grads)`` of the pipeline: GPipe by ``nnx.value_and_grad`` of its call,
    a training schedule by its ``value_and_grad``."""
    kw = dict(deterministic=deterministic, rngs=key, context=context, cache=None)
    if schedule == "gpipe":

        def loss(pipe):
            return mean_loss(weighted_ce(pipe(tokens, **kw), targets))

        value, grads = nnx.jit(nnx.value_and_grad(loss))(pipe)
    else:
        value, grads = nnx.jit(lambda p: p.value_and_grad(weighted_ce)(tokens, targets, **kw))(pipe)
    return value, pipe.layer_params(grads)


def by_hand(model, tokens, context, targets, key):
    """The unpipelined model micro-batch by micro-batch, each block given the documented rngs."""
    xs, _, plan = pj.split_microbatches((tokens, context), CHUNKS)
    firsts = np.cumsum((0, *BALANCE))
    outs = []
    for i in range(plan.num_micro):
        tok, ctx = jax.tree.map(lambda a, i=i: a[i], xs)
        h = tok
        for index, layer in enumerate(model.layers()):
            s = int(np.searchsorted(firsts, index, side="right")) - 1
            k = jax.random.fold_in(pj.stage_key(key, i, s), index - int(firsts[s]))
            if isinstance(layer, Block):
                rngs = nnx.Rngs(dropout=k)
                nnx.reseed(rngs, dropout=k)
                _, h = layer(h, ctx["segment_pos"], None, ctx["attn_mask"], rngs=rngs)
            else:
                h = layer(h)
        outs.append(h)
    return mean_loss(weighted_ce(pj.merge_microbatches(jnp.stack(outs), plan), targets))


def assert_close(a, b, **tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), a, b)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2,), ("stage",))


def test_without_wrappers_dropout_off_equals_the_model(mesh):
    tokens, context, targets = batch()
    model = make_model()
    model.eval()

    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss_of))(model, tokens, context, targets)
    ref_grads = layer_grads(model, ref_grads)
    for schedule in ("gpipe", "1f1b"):
        pipe = pipeline_of(model, mesh, schedule=schedule)
        loss, grads = pipelined(pipe, schedule, tokens, context, targets, deterministic=True)
        np.testing.assert_allclose(loss, ref_loss, **TOL, err_msg=schedule)
        assert_close(grads, ref_grads, **TOL)


def test_dropout_on_uses_call_time_rngs_with_the_documented_keys(mesh):
    tokens, context, targets = batch()
    model = make_model()
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(by_hand))(model, tokens, context, targets, KEY)
    ref_grads = layer_grads(model, ref_grads)
    results = {}
    for schedule, checkpoint in (("gpipe", "never"), ("1f1b", "always")):
        pipe = pipeline_of(model, mesh, schedule=schedule, checkpoint=checkpoint)
        results[schedule, checkpoint] = pipelined(
            pipe, schedule, tokens, context, targets, deterministic=False, key=KEY
        )
    for name, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, ref_loss, **TOL, err_msg=str(name))
        assert_close(grads, ref_grads, **TOL)
    model.eval()  # dropout really ran
    assert abs(float(nnx.jit(loss_of)(model, tokens, context, targets)) - float(ref_loss)) > 1e-3
