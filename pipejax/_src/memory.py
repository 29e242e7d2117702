"""Memory reports from the compiled program (what a step needs, what backward keeps), and a
per-device estimate of a pipeline's training step from its activation, residual and output sizes."""

from __future__ import annotations

import functools
import math
import operator
import reprlib
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from pipejax._src import checkpoint as ckpt
from pipejax._src import checks, compat, microbatch, options
from pipejax._src.engine import boundaries
from pipejax._src.pipeline import Pipeline
from pipejax._src.training.slots import last_apart_pays


class Residual(NamedTuple):
    """One value that reverse-mode autodiff saves for the backward pass."""

    shape: tuple[int, ...]
    dtype: Any  # numpy dtype, or JAX's key dtype for PRNG keys
    nbytes: int
    source: str  # where it comes from: "from the argument w", "output of tanh from file:line"


class MemoryReport(NamedTuple):
    """Memory of a compiled program (bytes, per device for SPMD programs) and its residuals."""

    temp_bytes: int  # XLA temporaries: activations kept for backward live here
    argument_bytes: int
    output_bytes: int
    residuals: tuple[Residual, ...]  # what autodiff of `fn` saves, arguments included

    @property
    def residual_bytes(self) -> int:
        """Bytes of the saved residuals that are not arguments of ``fn``."""
        return sum(r.nbytes for r in self.residuals if not r.source.startswith("from the argument"))

    def __str__(self) -> str:
        lines = [
            f"temp      {self.temp_bytes:>14,} bytes",
            f"arguments {self.argument_bytes:>14,} bytes",
            f"outputs   {self.output_bytes:>14,} bytes",
            f"residuals {self.residual_bytes:>14,} bytes in {len(self.residuals)} values:",
        ]
        lines += [
            f"  {getattr(r.dtype, 'name', r.dtype)}{list(r.shape)} {r.nbytes:,} bytes {r.source}"
            for r in self.residuals
        ]
        return "\n".join(lines)


def memory_report(fn: Callable[..., Any], *args: Any, backward: bool = True) -> MemoryReport:
    """Compiles ``fn`` and reports its memory, from XLA's compiled memory analysis.

    With ``backward=True`` (the default) ``fn`` must return a scalar (a loss) and the program
    measured is a training step's, ``jax.jit(jax.grad(fn))``; ``backward=False`` measures
    ``jax.jit(fn)``. ``residuals`` always lists what reverse-mode autodiff of ``fn`` saves for the
    backward pass, with shapes and sources: checkpointing shows up as fewer, smaller residuals.

    On CPU the numbers are deterministic, so they compare checkpoint modes, ``chunks`` or
    partitions exactly; for a ``shard_map`` program (a pipeline on a mesh) they are per device.

    Args:
      fn: the function to measure, e.g. ``lambda p, x: loss(pipe(p, x))``.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      backward: measure ``jit(grad(fn))`` (True) or ``jit(fn)`` (False).

    Returns:
      A :class:`MemoryReport`; ``print(report)`` gives a table.

    Raises:
      TypeError: ``fn`` not callable, ``backward`` not a bool, an argument (leaf) that is not an
        array, ``jax.ShapeDtypeStruct`` or number; with ``backward=True``, a first argument that
        is not floating point (``jax.grad`` differentiates with respect to it).
      ValueError: with ``backward=True``, an ``fn`` that does not return a real scalar, or no
        arguments. An error raised by ``fn`` itself, or by JAX differentiating it (a
        ``lax.while_loop`` in reverse mode), keeps its type and gains a note saying what
        ``memory_report`` was doing and that ``backward=False`` measures the forward program.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> loss = lambda w, x: jnp.sum(jnp.sin(x @ w))
      >>> report = pj.memory_report(loss, jnp.ones((4, 4)), jnp.ones((8, 4)))
      >>> [r.shape for r in report.residuals if not r.source.startswith("from the argument")]  # cos(x @ w)
      [(8, 4)]
    """
    _check(fn, args, backward)
    program = jax.jit(jax.grad(fn) if backward else fn)
    try:
        analysis = program.lower(*args).compile().memory_analysis()
    except Exception as err:  # fn itself traced (see _check): this is the differentiation failing
        if backward:
            err.add_note(
                "pipejax.memory_report: raised while compiling jax.grad(fn) (backward=True), i.e. "
                "reverse-mode differentiation of fn failed (e.g. a lax.while_loop cannot be "
                "differentiated in reverse mode). Pass backward=False to measure fn's forward program."
            )
        raise
    try:
        saved = compat.saved_residuals(fn, *args)
    except Exception as err:
        err.add_note(
            "pipejax.memory_report: raised while listing the residuals reverse-mode autodiff of fn "
            "saves; fn must be differentiable in reverse mode (no lax.while_loop) for that list."
        )
        raise
    residuals = []
    for aval, source in saved:
        shape = tuple(getattr(aval, "shape", ()))
        dtype = aval.dtype  # a numpy dtype, or an extended one (PRNG keys)
        itemsize = getattr(dtype, "itemsize", 0)
        residuals.append(Residual(shape, dtype, math.prod(shape) * itemsize, source))
    return MemoryReport(
        temp_bytes=int(analysis.temp_size_in_bytes),
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        residuals=tuple(residuals),
    )


def _check(fn: Any, args: tuple, backward: Any) -> None:
    """What ``memory_report`` needs, checked by tracing ``fn`` once (no compilation)."""
    checks.check_callable(fn, "fn", "fn(*args)", "memory_report")
    checks.check_bool(backward, "backward", "memory_report")
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        if not checks.array_like(leaf):
            raise TypeError(
                f"`args{jax.tree_util.keystr(path)}` of memory_report is {type(leaf).__name__} "
                f"{reprlib.repr(leaf)}, but the example arguments must be arrays, "
                "`jax.ShapeDtypeStruct`s or numbers (or pytrees of them): fn is compiled for their "
                "shapes and dtypes. Close over other values, e.g. "
                "`pj.memory_report(lambda w, x: fn(w, x, 'relu'), w, x)`."
            )
    structs = jax.tree.map(_struct, args)
    try:
        out = jax.eval_shape(fn, *args)
    except Exception as err:  # the user's own error keeps its type
        err.add_note(f"pipejax.memory_report: raised by fn(*args) with args {structs}.")
        raise
    if not backward:
        return
    if not args:
        raise ValueError(
            "memory_report with backward=True measures jax.grad(fn), which differentiates with respect "
            "to the first argument, but no argument was given. Pass the arguments, or backward=False."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(structs[0]):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"memory_report with backward=True measures jax.grad(fn), which differentiates with "
                f"respect to the first argument, but its leaf {jax.tree_util.keystr(path) or '<root>'} has "
                f"dtype {leaf.dtype}. Pass the floating-point parameters first, or backward=False to "
                "measure fn's forward program."
            )
    scalar = isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
    if not (scalar and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(
            f"memory_report with backward=True measures jax.grad(fn), so fn must return a real scalar "
            f"(a loss), but it returns {out}. Reduce the output (e.g. `jnp.sum(...)`), or pass "
            "backward=False to measure fn itself."
        )


def _struct(a: Any) -> jax.ShapeDtypeStruct:
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # Python scalars


# --- the estimate ---------------------------------------------------------------------------------


class MemoryEstimate(NamedTuple):
    """Predicted temp bytes per device of a pipeline's training step, term by term.

    ``total`` is the sum of the five terms; the sizes the terms are built from come first.
    """

    activation_bytes: int  # A: one micro-batch's activation entering a stage (the largest)
    residual_bytes: int  # R: what one stage's vjp keeps of one micro-batch (input included)
    output_bytes: int  # O: one micro-batch of the pipeline's output
    param_bytes: int  # P_d: the parameters of the stages one device holds (P: of one stage)
    stash: int  # what the forward keeps for the backward: per tick (GPipe), or per slot
    work: int  # one tick's working set: a stage's residuals and the messages in flight
    outputs: int  # the output micro-batches a device holds (GPipe and circular)
    loop: int  # circular: the activations waiting for their next round, and their cotangents
    params: int  # parameter-sized temporaries: a tick's parameter cotangent, when it has no room;
    # a pooled table's stage rows and a V's turned block; stages not alike: their flat row's
    # cotangent, and every stage's where ticks keep residuals
    total: int  # the sum of the five terms above


def memory_estimate(pipe: Pipeline, params: Any, x: Any) -> MemoryEstimate:
    r"""Predicts the per-device temp bytes of ``pipe``'s training step from its sizes.

    The step is ``pipe.value_and_grad(loss_fn)`` (for GPipe and circular the same program as
    ``jax.jit(jax.value_and_grad(...))`` of the loss of ``pipe(params, x)``), on a mesh; the
    estimate is of XLA's ``temp_size_in_bytes`` (:func:`memory_report`), the bytes beside the
    arguments and outputs. It is computed from these sizes, measured on the pipeline's own
    stages with ``jax.eval_shape`` (nothing is compiled):

    * ``A``: the bytes of one micro-batch's activation entering a stage (the largest boundary);
    * ``R``: the bytes of the residuals ``jax.vjp`` of a stage keeps that depend on the
      micro-batch (the stage input included; residuals of the parameters alone, such as the
      slice ``w[j]`` of a stacked weight, are not kept per micro-batch); the largest stage's;
    * ``O``: the bytes of one micro-batch of the pipeline's output;

    and ``P``, the parameter bytes of one stage (``P_d``: of the stages one device holds). With
    ``n`` devices, ``m`` micro-batches, ``T`` ticks (``v m + n - 1`` for ``v`` repeats) and ``K`` stash slots
    (:meth:`~pipejax._src.schedules.table.Schedule.stash_slots`):

    ========  ============  =================  ===============  =======  ==============
    schedule  mode          stash              work             outputs  loop, params
    ========  ============  =================  ===============  =======  ==============
    gpipe     "always"      T A                R + 2 A          M O      g
    gpipe     "never"       T R                R + 2 A          M O      g
    gpipe     except_last   (T - n) A + n R    R + 2 A          M O      g
    circular  as gpipe      as gpipe           R + 2 A          M O      2 L A, g
    1f1b      "always"      K A                R + 4 A                   g
    1f1b      "never"       K (R + O) (1)      3 (R + O) + 4 A           g
    zb-h1     as 1f1b       as 1f1b + n A      as 1f1b                   g
    zb-floor  as 1f1b       as 1f1b + G A (2)  as 1f1b                   g
    pooled    as 1f1b (3)   as 1f1b            as 1f1b                   g + P (+ P, + P_d)
    ========  ============  =================  ===============  =======  ==============

    (1) ``K R + K_last (R + O)`` where ``K O > (K_last + 1)(R + O)``: the last stage's residuals
    are then kept apart, in ``K_last`` slots of their own (1F1B: none; ZB-H1: ``n``; below).
    (2) ``G`` the table's :meth:`~pipejax.Schedule.cotangent_slots`: ``2 n - 2`` for
    ``m >= 2 (n - 1)``.
    (3) The tables whose devices hold several stages (:attr:`~pipejax.Schedule.pooled`:
    "interleaved-1f1b", "v-half", "zb-v"; a user's table with ``repeats > 1``): ``K`` is the
    size of the device's one pool (:meth:`~pipejax.Schedule.stash_pool`), and ``G`` the
    cotangent pool's (:meth:`~pipejax.Schedule.cotangent_pool`). A tick slices the row of the
    stage it runs from the device's parameters (``P``; a table with W slots slices W's too,
    ``+ P``), and a V runs on its device's block turned to the V's order (``+ P_d``).

    ``g = P`` when one stage's parameters ``P`` outweigh the residuals the tick's backward frees
    (``R``; 1F1B ``"never"``: ``3 (R + O)``), else 0: XLA puts the tick's parameter cotangent in
    their space when it fits. ``M = ceil(m / n)`` output micro-batches per device (the drain queue,
    on a mesh with Auto axes), ``m`` with Explicit axes (the output is returned replicated). Where the
    terms come from (``docs/pipeline_memory.md``, "Memory per device"): GPipe keeps per tick the
    stage input (``"always"``) or its residuals (``"never"``), and a backward tick holds one
    stage's residuals (recomputed, or read) with the cotangent it receives and the one it sends;
    1F1B keeps ``K`` slots, a tick receives and sends an activation and a cotangent, and with
    ``"never"`` a slot holds the last stage's loss residual too (one container for every stage),
    unless the ``K`` slots' share of it outweighs ``K_last + 1`` entries of the last stage's
    residuals: then those go to ``K_last`` slots of their own and one entry in the tick (1F1B
    runs the last stage's F and B in one tick: ``K_last = 0``, F hands them straight to B). A
    slot exists three times in a tick (F's residuals, their packed copy, B's read). The circular
    schedule also carries device 0's loop buffer of ``L`` activations waiting for their next
    round (``L = m - n + 1`` when ``m > n``; none when ``m <= n``, when a micro-batch starts its
    next round the tick it arrives) and its cotangent. ZB-H1 stashes ``n`` output cotangents for
    its W slots.

    Measured against XLA on CPU (``benchmarks/maxtext_style.py``, 4 devices, m = 4 to 32) the
    estimate is within 10 % on jax 0.10.2 (0.894 at m = 4 on jax 0.11.2, whose ``jax.vjp`` of
    gelu keeps one residual fewer while XLA's bytes stay); that is measured on that model and
    the tests', not guaranteed: ``R`` is what ``jax.vjp`` keeps, and XLA may keep less where it
    fuses a recomputation (a gelu stage's 1F1B: 1.27), or more where a stage's parameters are
    several times its residuals (1F1B ``"always"`` at ``P = 3.7 R``: 0.67). It assumes a loss
    that keeps one output-sized value per micro-batch (a squared error, a cross-entropy's
    softmax) and balanced stages. Stages given as a list (not alike) travel in one container
    sized for the largest boundary, the output's included (``A``); a tick adds its parameter
    cotangent into the device's flat row of packed parameters (one more ``P``); and GPipe's and
    the circular schedule's ``"never"`` keep in every tick the union of the stages' residuals
    (the tick's ``lax.switch`` keeps every branch's; of one shape and dtype, as many as the stage
    that keeps the most). ``benchmarks/planner.py`` prints the estimate against XLA on its
    models (``benchmarks/RESULTS.md``).
    ``benchmarks/schedules.py --section estimate`` measures every training schedule on three
    models (tanh layers and residual blocks, micro-batches of 512 and 16 rows, ``"always"`` and
    ``"never"``): the pooled tables read 0.85-1.12 of XLA's bytes there, the others 0.84-1.22.
    Use :func:`memory_report` for the exact number.

    Args:
      pipe: a :func:`pipeline` on a mesh, with any built-in schedule or a user's table,
        ``checkpoint`` "always", "never" or (GPipe and circular) "except_last".
      params: the pipeline's parameters, in any form it accepts (arrays or
        ``jax.ShapeDtypeStruct``).
      x: a batch as the pipeline takes it (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      A :class:`MemoryEstimate`: the sizes, the terms and ``total``, in bytes per device.

    Raises:
      TypeError: ``pipe`` is not a :class:`~pipejax._src.pipeline.Pipeline`.
      ValueError: a pipeline the formula does not cover (no mesh, a data axis, ``param_specs``,
        a stateful pipeline, a ``jax.checkpoint`` policy); and, as a
        call of the pipeline would, ``params`` or ``x`` that do not fit it: parameters without
        the pipeline's stages, a batch without a leading batch axis, or a stage that cannot be
        applied to what reaches it (the message names the stage boundary).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import pipejax as pj
      >>> mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> stage = lambda p, x, key: jnp.sin(x @ p)
      >>> pipe = pj.pipeline(stage, num_stages=4, chunks=8, checkpoint="always", mesh=mesh)
      >>> params = jnp.zeros((4, 32, 32), jnp.float32)
      >>> x = jnp.zeros((64, 32), jnp.float32)  # 8 micro-batches of 8 x 32: A = 1 KiB
      >>> est = pj.memory_estimate(pipe, params, x)
      >>> est.activation_bytes, est.residual_bytes, est.output_bytes  # R: x and cos(x @ p)
      (1024, 2048, 1024)
      >>> est.stash == 11 * 1024, est.work == 2048 + 2 * 1024, est.outputs == 2 * 1024
      (True, True, True)
      >>> est.params, est.total  # a stage's 4 KiB parameter cotangent outgrows R: its own buffer
      (4096, 21504)

    References:
      Huang et al. 2019, GPipe (arXiv:1811.06965); Narayanan et al. 2021, Megatron-LM
      (arXiv:2104.04473); Qi et al. 2023, Zero Bubble Pipeline Parallelism (arXiv:2401.10241).
    """
    _check_estimable(pipe)
    options.check_params_shape(params, pipe)  # as a call of the pipeline checks them
    batch = pipe.plan.check_batch(x)
    plan = microbatch.plan(batch, pipe.chunks)
    n, m, v = pipe.num_devices, plan.num_micro, pipe.repeats
    micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct((plan.micro_size, *jnp.shape(a)[1:]), _dtype(a)), x)
    unsharded = jax.tree.map(_struct, params)  # placed parameters' sharding types aside
    acts, residuals, residual_shapes, stage_params = [], [], [], []
    for s, stage in enumerate(pipe.stages):
        p = jax.eval_shape(lambda params, s=s: pipe.stage_params(params, s), unsharded)
        # the stage on what reaches it, as the pipeline infers it (a shape error names the boundary)
        out, _ = boundaries.stage_output(s, pipe, p, None, micro, None, None)
        acts.append(_nbytes(micro))
        size, shapes = _micro_residual_bytes(stage, p, micro)
        residuals.append(size)
        residual_shapes.append(shapes)
        stage_params.append(_nbytes(p))
        micro = out.structs()
    a, r, o = max(acts), max(residuals), _nbytes(micro)
    mixed = pipe.kind.name == "heterogeneous"
    if mixed:  # every boundary travels in one container, the output's included
        a = max(a, o)
    table = pipe.schedule(batch)  # the table the mesh runs (overlap: hops of two ticks)
    device = table.device_of(np.arange(len(stage_params)))  # a ring's d, d + n, ...; a V's d, 2n-1-d
    held = int(np.bincount(device, weights=stage_params, minlength=n).max())
    rows = 0
    if pipe.plan.schedule.owns_backward:
        k = table.stash_pool()[0] if table.pooled else table.stash_slots()
        slot = a if pipe.checkpoint == "always" else r + o
        # the last stage's residuals kept apart by the engine's rule: every slot shrinks by O,
        # and the last stage's take K_last slots of their own (1F1B: none, F hands them straight
        # to B) and one entry in the tick
        last = table.last_stage_slots()
        apart = pipe.checkpoint != "always" and last_apart_pays(k, o, last, slot)
        # W's output cotangents: a ring of `cotangent_slots` (ZB-H1: n)
        if "W" not in table.kinds:
            cot = 0
        else:
            cot = (table.cotangent_pool()[0] if table.pooled else table.cotangent_slots()) * a
        if table.pooled:  # the stage's parameter row each tick slices from the device's (and W's)
            rows = max(stage_params) * (2 if "W" in table.kinds else 1)
        if table.placement == "v":  # the device's block turned to the V's order, for the loop
            rows += held
        stash = (k * r + last * slot if apart else k * slot) + cot
        freed = r if pipe.checkpoint == "always" else 3 * slot
        outputs = loop = 0
    else:
        ticks, drain = table.num_ticks, table.drain_ticks  # drain: except_last's "never"
        # autodiff of the tick's switch among mixed stages keeps the residuals of every branch
        # in every tick, those of one shape and dtype shared
        kept = _union_bytes(residual_shapes) if mixed else r
        stash = {
            "always": ticks * a,
            "never": ticks * kept,
            "except_last": (ticks - drain) * a + drain * kept if ticks > drain else ticks * kept,
        }[pipe.checkpoint]
        freed = r
        split = n > 1 and not compat.is_explicit(pipe.mesh, pipe.axis_name)
        outputs = (-(-m // n) if split else m) * o
        h = table.hop  # the circular loop-back's delay line: m - h n + 1 slots
        loop = 2 * (m - h * n + 1) * a if v > 1 and m > h * n and n > 1 else 0
    work = freed + pipe.plan.schedule.activation_buffers * a
    if pipe.overlap:  # the messages sent during the next tick: an activation (and a cotangent)
        work += (2 if pipe.plan.schedule.owns_backward else 1) * a
    # a tick's parameter cotangent reuses the space of the residuals its backward has freed,
    # unless it is larger than they are
    grad = max(stage_params) if max(stage_params) > freed else 0
    if mixed:  # the cotangent added into the device's flat row of packed parameters
        grad += max(stage_params)
    if (
        mixed
        and not pipe.plan.schedule.owns_backward
        and any(p.keeps for p in ckpt.phases(pipe.checkpoint, table))
    ):
        # where ticks keep residuals each stage's parameters are unpacked outside the tick's
        # switch (`engine.stages`), and its backward gives every one of them a cotangent
        grad += sum(stage_params)
    grad += rows
    total = stash + work + outputs + loop + grad
    return MemoryEstimate(a, r, o, held, stash, work, outputs, loop, grad, total)


def _check_estimable(pipe: Any) -> None:
    """What the formula covers; anything else is refused with the reason and the way out."""
    if not isinstance(pipe, Pipeline):
        raise TypeError(
            f"memory_estimate: `pipe` must be a pipeline built by `pj.pipeline(...)`, but got "
            f"{type(pipe).__name__}. Pass the pipeline itself; for any other function, measure it "
            "with `pj.memory_report(fn, *args)`."
        )
    fix = "Measure this program with `pj.memory_report(fn, *args)` instead."
    refusals = [
        (pipe.mesh is None, "mesh=None", "the formula is per device of a mesh's stage axis"),
        (
            pipe.data_axis_name is not None,
            f"data_axis_name={pipe.data_axis_name!r}",
            "no data axis is modelled",
        ),
        (pipe.param_specs is not None, "param_specs", "parameters sharded within a stage are not modelled"),
        (pipe.stateful, "stateful=True", "stage state and statistics are not modelled"),
        (
            not isinstance(pipe.checkpoint, str),
            f"checkpoint={pipe.checkpoint!r}",
            'the formula covers checkpoint="always", "never" and (GPipe, circular) "except_last", '
            "not a policy, whose residuals are the policy's choice",
        ),
    ]
    for refused, value, rule in refusals:
        if refused:
            raise ValueError(f"memory_estimate: the pipeline has {value}, but {rule}. {fix}")


def _micro_residual_bytes(stage: Callable[..., Any], p: Any, x: Any) -> tuple[int, Counter]:
    """The residuals of ``jax.vjp`` of ``stage`` at ``(p, x)`` that depend on ``x``: their bytes,
    and how many of each shape and dtype there are."""

    def leaves(p, x):
        return jax.tree.leaves(jax.vjp(lambda p, x: stage(p, x, None), p, x)[1])

    closed = jax.make_jaxpr(leaves)(p, x)
    varying = closed.jaxpr.invars[len(jax.tree.leaves(p)) :]
    tainted = set(varying)
    for eqn in closed.jaxpr.eqns:  # an equation with an input that depends on x: all its outputs do
        if any(not isinstance(v, jex_core.Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    outs = [var for var in closed.jaxpr.outvars if not isinstance(var, jex_core.Literal)]
    kept = [v.aval for v in outs if v in tainted]
    return sum(map(_nbytes, kept)), Counter(map(_struct, kept))


def _union_bytes(kept: list[Counter]) -> int:
    """Bytes of the union of the stages' residuals: of each shape and dtype, as many as the stage
    that keeps the most."""
    union = functools.reduce(operator.or_, kept, Counter())
    return sum(count * _nbytes(struct) for struct, count in union.items())


def _dtype(a: Any) -> Any:
    return a.dtype if hasattr(a, "dtype") else jnp.result_type(a)


def _nbytes(tree: Any) -> int:
    """Bytes of a pytree of arrays or abstract values (PRNG keys count their key data)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        dtype = _dtype(leaf)
        itemsize = getattr(dtype, "itemsize", None) or jnp.dtype(jnp.uint32).itemsize
        total += math.prod(jnp.shape(leaf)) * itemsize
    return total
