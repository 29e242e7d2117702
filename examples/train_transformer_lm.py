"""Train a small Flax Transformer language model through a 4-stage pipeline (``pipejax.flax``).

The model is an ordinary Flax Linen model: a token and position embedding, a stack of Transformer
blocks, and a read-out head. Only the stack is pipelined: ``LinenPipeline`` cuts the blocks into 4
stages, one per (simulated CPU) device, and streams micro-batches through them, with dropout and
checkpointing. The embedding and the head run outside the pipeline, as in any Flax model.

As in Flax's lm1b example, the attention mask (causal, and no attention to or from padding, id 0)
is built once from the token ids and every block takes it as its keyword argument
``decoder_mask=``. The pipeline receives it as a side input, ``context={"decoder_mask": mask}``:
it is cut into micro-batches with the activations and each block is called with its micro-batch's
rows, so the blocks are those of the plain model, unchanged.

The training text is generated (no downloads): sentences from a tiny grammar, so that a
character-level model has something to learn. The script

1. checks at step 0 that the pipelined loss and gradients equal those of the same blocks run as a
   plain stack (parameters mapped with ``LinenPipeline.to_sequential``);
2. trains with optax's AdamW, printing a progress bar with the loss and the throughput;
3. writes a PNG of the loss curve and a text sample from the trained model into ``--out``.

Run ``python examples/train_transformer_lm.py`` (150 steps, a few minutes on 2 CPU cores) or with
``--short`` (12 steps of a 4-block model, one block per stage; the tests use it).
"""

import os

# Four fake CPU devices, one per stage; set before JAX initialises its CPU backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from pipejax.flax import LinenPipeline

NUM_STAGES = 4
SEQ_LEN = 48
D_MODEL, HEADS, BLOCKS = 64, 4, 8  # 8 blocks, 2 per stage (--short: 4, 1 per stage)
DROP_RATE = 0.1  # probability of dropping
TOLERANCE = 1e-4  # step-0 check, relative: float32 sums in another order differ by ~1e-6


# --- the training text ------------------------------------------------------------------------------


def generate_text(num_sentences: int, seed: int = 0) -> str:
    """Sentences from a tiny grammar: subjects, verbs, objects, and a little arithmetic."""
    rng = np.random.default_rng(seed)
    subjects = ["the cat", "a dog", "the old fox", "my sister", "the robot", "a small bird", "the teacher"]
    verbs = ["sees", "likes", "follows", "draws", "finds", "helps", "counts"]
    objects = ["the moon", "a red ball", "two apples", "the river", "a blue door", "the garden"]
    sentences = []
    for _ in range(num_sentences):
        if rng.random() < 0.3:
            a, b = rng.integers(0, 10, size=2)
            sentences.append(f"{a} plus {b} is {a + b}.")
        else:
            s, v, o = rng.choice(subjects), rng.choice(verbs), rng.choice(objects)
            sentences.append(f"{s} {v} {o}.")
    return " ".join(sentences)


class Vocab:
    """Characters <-> integer ids; id 0 is padding."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i + 1 for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([self.index[c] for c in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i) - 1] for i in ids if int(i) > 0)


def batches(ids: np.ndarray, batch: int, seed: int):
    """Endless random windows of ``SEQ_LEN + 1`` characters: inputs and next-character targets."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - SEQ_LEN - 1, size=batch)
        windows = np.stack([ids[s : s + SEQ_LEN + 1] for s in starts])
        yield jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


# --- the model ----------------------------------------------------------------------------------


def decoder_mask(ids):
    """lm1b's decoder mask: causal, and no attention to or from padding (``bool[B, 1, L, L]``)."""
    return nn.combine_masks(nn.make_attention_mask(ids > 0, ids > 0), nn.make_causal_mask(ids))


class Block(nn.Module):
    """A pre-norm Transformer block: masked self-attention and an MLP, each with dropout."""

    @nn.compact
    def __call__(self, h, decoder_mask=None, deterministic: bool = True):
        a = nn.LayerNorm()(h)
        a = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=DROP_RATE)(
            a, a, mask=decoder_mask, deterministic=deterministic
        )
        h = h + nn.Dropout(DROP_RATE)(a, deterministic=deterministic)
        m = nn.Dense(4 * D_MODEL)(nn.LayerNorm()(h))
        m = nn.Dense(D_MODEL)(nn.gelu(m))
        return h + nn.Dropout(DROP_RATE)(m, deterministic=deterministic)


class Blocks(nn.Module):
    """The blocks in sequence, unpipelined, each given the mask (``nn.Sequential``'s parameter names)."""

    num_blocks: int = BLOCKS

    @nn.compact
    def __call__(self, h, decoder_mask=None, deterministic: bool = True):
        for index in range(self.num_blocks):
            h = Block(name=f"layers_{index}")(h, decoder_mask, deterministic)
        return h


class LanguageModel(nn.Module):
    """Embedding -> blocks (pipelined, or plain ``Blocks``) -> head."""

    vocab: int
    num_blocks: int = BLOCKS
    pipelined: bool = True
    mesh: jax.sharding.Mesh | None = None
    chunks: int = 4
    checkpoint: str = "except_last"

    def setup(self):
        self.tokens = nn.Embed(self.vocab, D_MODEL)
        self.positions = self.param("positions", nn.initializers.normal(0.02), (SEQ_LEN, D_MODEL))
        if self.pipelined:
            blocks = [Block() for _ in range(self.num_blocks)]
            self.blocks = LinenPipeline(
                blocks, num_stages=NUM_STAGES, chunks=self.chunks, checkpoint=self.checkpoint, mesh=self.mesh
            )
        else:
            self.blocks = Blocks(self.num_blocks)
        self.norm = nn.LayerNorm()
        self.head = nn.Dense(self.vocab)

    def __call__(self, ids, deterministic: bool = True):
        h = self.tokens(ids) + self.positions[None, : ids.shape[1]]
        mask = decoder_mask(ids)
        if self.pipelined:  # a side input: every block receives its micro-batch's rows as decoder_mask=
            h = self.blocks(h, context={"decoder_mask": mask}, deterministic=deterministic)
        else:
            h = self.blocks(h, mask, deterministic=deterministic)
        return self.head(self.norm(h))


def sequential_params(pipelined: LanguageModel, params):
    """The plain model's parameters from the pipelined model's: only the blocks differ."""
    stack = LinenPipeline([Block() for _ in range(pipelined.num_blocks)], num_stages=NUM_STAGES)
    mapped = stack.to_sequential({"params": params["blocks"]})["params"]
    return {**params, "blocks": mapped}


def loss_fn(model, params, ids, targets, key):
    rngs = None if key is None else {"dropout": key}
    logits = model.apply({"params": params}, ids, deterministic=key is None, rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# --- helpers --------------------------------------------------------------------------------------


def relative_difference(a, b) -> float:
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def progress(step: int, total: int, loss: float, tokens_per_s: float | None, width: int = 30) -> None:
    """One-line progress bar, redrawn in place on a terminal and printed every 10% otherwise."""
    done = int(width * step / total)
    speed = "" if tokens_per_s is None else f"  {tokens_per_s:,.0f} tok/s"
    line = f"[{'#' * done}{'.' * (width - done)}] step {step:>4}/{total}  loss {loss:.3f}{speed}"
    if sys.stdout.isatty():
        print("\r" + line, end="" if step < total else "\n", flush=True)
    elif step == total or step % max(1, total // 10) == 0:
        print(line, flush=True)


def sample(model, params, vocab: Vocab, prompt: str, length: int, key) -> str:
    """Greedy-free sampling, one character at a time, from the last ``SEQ_LEN`` characters."""
    ids = list(vocab.encode(prompt))
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    for i in range(length):
        window = np.asarray(ids[-SEQ_LEN:], np.int32)
        padded = np.pad(window, (0, SEQ_LEN - len(window)))[None]  # id 0: padding, masked
        logits = apply(params, jnp.asarray(np.repeat(padded, NUM_STAGES, axis=0)))[0, len(window) - 1]
        ids.append(int(jax.random.categorical(jax.random.fold_in(key, i), logits)))
    return vocab.decode(ids)


def save_plot(losses, num_blocks: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(np.arange(len(losses)), losses, lw=1, label="train (dropout on)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title(f"Transformer LM, {num_blocks} blocks in {NUM_STAGES} pipeline stages")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps (default: 150)")
    parser.add_argument(
        "--short", action="store_true", help="run 12 steps of a 4-block model only (for the tests)"
    )
    parser.add_argument("--batch", type=int, default=32, help="sequences per mini-batch (default: 32)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: 4)")
    parser.add_argument("--checkpoint", default="except_last", choices=pj.CHECKPOINT_MODES)
    parser.add_argument("--out", type=Path, default=Path("out/transformer_lm"), help="output folder")
    args = parser.parse_args(argv)
    steps = 12 if args.short else args.steps
    num_blocks = NUM_STAGES if args.short else BLOCKS  # --short: one block per stage, half the compiling
    if steps < 1 or args.batch < 1 or args.chunks < 1:
        parser.error(f"--steps, --batch and --chunks must be >= 1, got {steps}, {args.batch}, {args.chunks}")

    text = generate_text(4000)
    vocab = Vocab(text)
    ids = vocab.encode(text)
    data = batches(ids, args.batch, seed=1)
    print(f"text: {len(text):,} characters, vocabulary {len(vocab)}; {jax.device_count()} devices")

    mesh = jax.make_mesh((NUM_STAGES,), ("stage",))
    model = LanguageModel(len(vocab), num_blocks, mesh=mesh, chunks=args.chunks, checkpoint=args.checkpoint)
    plain = LanguageModel(len(vocab), num_blocks, pipelined=False)
    x0, y0 = next(data)
    with jax.set_mesh(mesh):
        params = jax.jit(model.init)(jax.random.key(0), x0)["params"]
    shapes = jax.eval_shape(plain.init, jax.random.key(0), x0)  # shapes only: nothing runs
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
    print(f"model: {count:,} parameters; {num_blocks} blocks in {NUM_STAGES} stages, chunks={args.chunks}")

    # 1. Step 0: the pipeline computes what the plain model computes (no dropout).
    grad = jax.jit(jax.value_and_grad(loss_fn, argnums=1), static_argnums=0)
    loss_p, grads_p = grad(model, params, x0, y0, None)
    loss_s, grads_s = grad(plain, sequential_params(model, params), x0, y0, None)
    loss_diff = abs(float(loss_p) - float(loss_s)) / abs(float(loss_s))
    grad_diff = relative_difference(sequential_params(model, grads_p), grads_s)
    print(
        f"step-0 check: loss {float(loss_p):.6f} vs plain {float(loss_s):.6f} (relative {loss_diff:.1e}), "
        f"gradients relative {grad_diff:.1e}"
    )
    if not (loss_diff < TOLERANCE and grad_diff < TOLERANCE):
        print("step-0 check FAILED: the pipeline does not match the plain model", file=sys.stderr)
        return 1

    # 2. Train, with dropout keys derived per step (the pipeline derives per micro-batch and stage).
    optimizer = optax.adamw(3e-3, weight_decay=0.01)
    with jax.set_mesh(mesh):
        opt_state = jax.jit(optimizer.init)(params)

    @jax.jit
    def train_step(params, opt_state, x, y, key):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, x, y, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, key = [], jax.random.key(42)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = next(data)
        params, opt_state, loss = train_step(params, opt_state, x, y, jax.random.fold_in(key, step))
        losses.append(float(loss))  # waits for the step
        if step == 1:  # the first step compiles; throughput counts the steps after it
            compiled, start = time.perf_counter() - start, time.perf_counter()
        speed = None if step == 1 else (step - 1) * args.batch * SEQ_LEN / (time.perf_counter() - start)
        progress(step, steps, losses[-1], speed)
    print(
        f"train loss {np.mean(losses[:3]):.3f} -> {np.mean(losses[-3:]):.3f} over {steps} steps "
        f"(first step with compilation {compiled:.1f} s, then {time.perf_counter() - start:.1f} s)"
    )

    # 3. Outputs: the loss curve, and a sample.
    args.out.mkdir(parents=True, exist_ok=True)
    save_plot(losses, num_blocks, args.out / "loss.png")
    eval_loss = float(jax.jit(loss_fn, static_argnums=0)(model, params, *next(data), None))
    print(f"eval loss (no dropout) {eval_loss:.3f}; wrote {args.out / 'loss.png'}")
    if not args.short:
        print("sample:", sample(model, params, vocab, "the cat ", 60, jax.random.key(7)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
