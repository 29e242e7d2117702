"""What a refactor of the engine must keep: the programs it lowers, and the size of its code.

Run from the repository root::

    .venv/bin/python benchmarks/programs.py                       # both sections (about a minute)
    .venv/bin/python benchmarks/programs.py --save /tmp/before.txt
    .venv/bin/python benchmarks/programs.py --compare /tmp/before.txt
    .venv/bin/python benchmarks/programs.py --quick               # smoke run

Sections (markdown tables):

1. ``fingerprints``: every schedule ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b"),
   with and without a mesh, with heterogeneous and homogeneous stages, in every checkpoint mode
   ("dots": ``jax.checkpoint_policies.dots_saveable``), and the features (stateful stages, a
   weighted loss with ``context=``, per-example keys, aux outputs with an aux loss, the forward
   call, ``param_specs``, a data axis): ``jax.jit(...).lower(...)`` of each program, a hash of
   its StableHLO text with function names normalised, and its line count. A refactor that
   leaves every hash as it was leaves every program as it was: the same memory, compile time
   and numbers, on every backend. ``--save`` writes the table, ``--compare`` lists the programs
   whose hash moved (and exits 1 if any did). Forward-over-reverse (``jax.jvp`` of
   ``value_and_grad``) is lowered for GPipe and circular. The text depends on the JAX version,
   so compare two trees in one environment (run the old tree with ``PYTHONPATH=<old tree>``),
   never against hashes recorded elsewhere.
2. ``lines``: the lines of the modules of the tick loop and the training program (total, and
   code without docstrings, comments and blank lines), beside the two files they grew from when
   issue 22 was filed (``engine.py`` + ``train.py`` at d0e1f4f), read with ``git show`` when
   the checkout has that history.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

if __name__ == "__main__":
    import os

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pipejax as pj  # noqa: E402
from benchmarks._common import header, section, table  # noqa: E402

W = 8  # features
SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b")
REPEATS = {"circular": 2, "interleaved-1f1b": 2}
MODES = {
    "always": "always",
    "never": "never",
    "except_last": "except_last",
    "dots": jax.checkpoint_policies.dots_saveable,
}
BASELINE = "d0e1f4f"  # engine.py + train.py: 1,463 lines when issue 22 was filed
MODULES = (
    "engine",
    "training/slots.py",
    "training/stage_grad.py",
    "training/step.py",
)  # a folder: its .py files


def stage(p, x, key, context=None):
    x = jnp.tanh(x @ p["w"] + p["b"][None])
    if context is not None:
        x = x * context[:, None]
    if key is not None:
        x = pj.dropout(x, key, 0.1)
    return x


def stateful_stage(p, x, key, state, mask):
    h = stage(p, x, key) + state["shift"][None]
    return h, {"sum": jnp.sum(jnp.where(mask[:, None], h, 0.0), axis=0)}


def aux_stage(p, x, key):
    h = stage(p, x, key)
    return h, {"l": jnp.sum(h**2, axis=-1)}


def loss(y, t):
    return jnp.sum((y - t) ** 2, axis=-1)


def weighted_loss(y, t):
    return jnp.sum((y - t[0]) ** 2, axis=-1) * t[1], t[1]


def params(num):
    r = np.random.default_rng(0)
    return [
        {
            "w": jnp.asarray(r.normal(size=(W, W)) / W**0.5, jnp.float32),
            "b": jnp.asarray(r.normal(size=(W,)), jnp.float32),
        }
        for _ in range(num)
    ]


def stack(tree_list):
    return jax.tree.map(lambda *a: jnp.stack(a), *tree_list)


def fingerprint(fn, *args, **kwargs) -> str:
    """``hash lines`` of the lowered program, or ``refused Error`` where it is refused."""
    try:
        text = jax.jit(fn).lower(*args, **kwargs).as_text()
    except (TypeError, ValueError, NotImplementedError) as e:
        return f"refused {type(e).__name__}"
    normalised = re.sub(r"@[A-Za-z_0-9.$-]+", "@F", text)  # function names (Python's, jax's)
    return f"{hashlib.sha1(normalised.encode()).hexdigest()[:12]} {len(text.splitlines())}"


def programs(quick: bool):
    """``(name, thunk)`` for every program of the fingerprints section."""
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(16, W)), jnp.float32)
    tokens = (x, jnp.asarray(r.integers(0, 3, 16), jnp.float32))
    key = jax.random.key(0)
    schedules = ("gpipe", "1f1b") if quick else SCHEDULES
    for name in schedules:
        rep = REPEATS.get(name, 1)
        for meshed in (True,) if quick else (False, True):
            mesh = jax.make_mesh((4 // rep,), ("stage",)) if meshed else None
            for homogeneous in (False, True):
                kw = {"chunks": 4, "schedule": name, "mesh": mesh, **({"repeats": rep} if rep > 1 else {})}
                ps, state = params(4), [{"shift": jnp.zeros((W,), jnp.float32)}] * 4
                if homogeneous:
                    ps, state = stack(ps), stack(state)

                def build(f, _h=homogeneous, _kw=kw, **more):
                    if _h:
                        return pj.pipeline(f, num_stages=4, **_kw, **more)
                    return pj.pipeline([f] * 4, **_kw, **more)

                where = f"{name} {'mesh' if meshed else 'none'} {'hom' if homogeneous else 'het'}"
                for mode_name, mode in MODES.items():
                    if quick and mode_name not in ("always", "never"):
                        continue

                    def vg(_m=mode, _b=build, _p=ps):
                        try:
                            pipe = _b(stage, checkpoint=_m)
                        except ValueError:
                            return "error: ValueError"
                        return fingerprint(pipe.value_and_grad(loss), _p, x, x, key)

                    yield f"{where} {mode_name}", vg
                    if name in ("gpipe", "circular") and mode_name in ("always", "except_last"):

                        def hvp(_m=mode, _b=build, _p=ps):
                            step = _b(stage, checkpoint=_m).value_and_grad(loss)
                            grads = lambda q: step(q, x, x, key)[1]
                            return fingerprint(lambda p: jax.jvp(grads, (p,), (p,))[1], _p)

                        yield f"{where} {mode_name} hvp", hvp
                if quick:
                    continue
                yield (
                    f"{where} stateful",
                    lambda _b=build, _p=ps, _s=state: fingerprint(
                        _b(stateful_stage, stateful=True).value_and_grad(loss), _p, x, x, key, state=_s
                    ),
                )
                yield (
                    f"{where} weighted + context",
                    lambda _b=build, _p=ps: fingerprint(
                        _b(stage).value_and_grad(weighted_loss), _p, x, tokens, key, context=tokens[1] + 1
                    ),
                )
                yield (
                    f"{where} per-example keys",
                    lambda _b=build, _p=ps: fingerprint(
                        _b(stage, per_example_keys=True).value_and_grad(loss), _p, x, x, key
                    ),
                )
                yield (
                    f"{where} aux",
                    lambda _b=build, _p=ps: fingerprint(
                        _b(aux_stage, aux="mean").value_and_grad(loss, aux_loss=lambda a: jnp.sum(a["l"])),
                        _p,
                        x,
                        x,
                        key,
                    ),
                )
                yield f"{where} forward", lambda _b=build, _p=ps: fingerprint(_b(stage), _p, x, key)
    if quick:
        return
    explicit = (AxisType.Explicit,) * 2
    for name in SCHEDULES:
        rep = REPEATS.get(name, 1)
        extra = {"repeats": rep} if rep > 1 else {}
        shape = (2, 2) if rep > 1 else (4, 1)  # 4 stages on 2 devices x 2 model shards, or 4 x 1
        model = jax.make_mesh(shape, ("stage", "model"), axis_types=explicit)
        specs = {"w": P(None, "model"), "b": P("model")}

        def sharded(_n=name, _mesh=model, _x=extra, _specs=specs):
            pipe = pj.pipeline(
                stage, num_stages=4, chunks=4, schedule=_n, mesh=_mesh, param_specs=_specs, **_x
            )
            return fingerprint(pipe.value_and_grad(loss), stack(params(4)), x, x, key)

        yield f"{name} param_specs", sharded
        data = jax.make_mesh((2, 2), ("data", "stage"), axis_types=explicit)
        stages = 4 if rep > 1 else 2

        def data_axis(_n=name, _x=extra, _s=stages, _mesh=data):
            pipe = pj.pipeline(
                stage, num_stages=_s, chunks=4, schedule=_n, mesh=_mesh, data_axis_name="data", **_x
            )
            return fingerprint(pipe.value_and_grad(loss), stack(params(_s)), x, x, key)

        yield f"{name} data axis", data_axis


def fingerprints_section(quick: bool, save: str | None, compare: str | None) -> int:
    section("Fingerprints: lowered programs (StableHLO, function names normalised)")
    rows = [[name, *thunk().split(" ", 1)] for name, thunk in programs(quick)]
    print(table(["program", "hash", "lines"], rows, align="lll"))
    if save:
        Path(save).write_text("".join(f"{n}\t{h}\t{ln}\n" for n, h, ln in rows))
        print(f"\nsaved {len(rows)} fingerprints to {save}")
    if not compare:
        return 0
    before = {}
    for line in Path(compare).read_text().splitlines():
        n, h, ln = line.split("\t")
        before[n] = (h, ln)
    moved = [[n, *before[n], h, ln] for n, h, ln in rows if n in before and before[n] != (h, ln)]
    missing = sorted(set(before) - {n for n, _, _ in rows})
    print(f"\nagainst {compare}: {len(rows) - len(moved)} of {len(rows)} programs unchanged")
    if moved:
        print(
            table(["program", "hash before", "lines before", "hash now", "lines now"], moved, align="lllll")
        )
    if missing:
        print(f"not lowered now: {', '.join(missing)}")
    return 1 if moved else 0


def counts(source: str) -> tuple[int, int]:
    """``(lines, code lines)``: code leaves out docstrings, comments and blank lines."""
    lines = source.splitlines()
    skip = {i + 1 for i, line in enumerate(lines) if not line.strip() or line.strip().startswith("#")}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    skip.update(range(first.lineno, first.end_lineno + 1))
    return len(lines), len(lines) - len(skip)


def lines_section() -> None:
    section("Lines: the tick loop and the training program")
    src = ROOT / "pipejax" / "_src"
    rows, total = [], [0, 0]
    for module in MODULES:
        files = sorted((src / module).glob("*.py")) if (src / module).is_dir() else [src / module]
        n, code = map(sum, zip(*(counts(f.read_text()) for f in files), strict=True))
        rows.append([f"pipejax/_src/{module}" + ("/" if len(files) > 1 else ""), f"{n:,}", f"{code:,}"])
        total = [total[0] + n, total[1] + code]
    rows.append(["all of them", f"{total[0]:,}", f"{total[1]:,}"])
    then = [0, 0]
    for module in ("engine.py", "train.py"):
        shown = subprocess.run(
            ["git", "show", f"{BASELINE}:pipejax/_src/{module}"], capture_output=True, text=True, cwd=ROOT
        )
        if shown.returncode != 0:
            rows.append([f"{module} at {BASELINE}", "(not in this checkout's history)", ""])
            continue
        n, code = counts(shown.stdout)
        rows.append([f"{module} at {BASELINE}", f"{n:,}", f"{code:,}"])
        then = [then[0] + n, then[1] + code]
    if then[0]:
        rows.append([f"engine.py + train.py at {BASELINE}", f"{then[0]:,}", f"{then[1]:,}"])
    print(table(["module", "lines", "code lines"], rows, align="lrr"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer programs")
    ap.add_argument("--section", choices=["fingerprints", "lines"], action="append")
    ap.add_argument("--save", help="write the fingerprints to this file")
    ap.add_argument("--compare", help="compare the fingerprints with a file written by --save")
    args = ap.parse_args(argv)
    header(__doc__.splitlines()[0], args.quick)
    status = 0
    for name in args.section or ["fingerprints", "lines"]:
        if name == "fingerprints":
            status = fingerprints_section(args.quick, args.save, args.compare)
        else:
            lines_section()
    return status


if __name__ == "__main__":
    sys.exit(main())
