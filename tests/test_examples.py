"""The examples and the code in the docs run as tests: each example in a fresh process, the docs'
pages in groups of pages, one fresh process per group.

A subprocess gives each script its own JAX, initialised with the 4 fake CPU devices it asks for,
independent of the strict settings this test process runs under.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PATIENT_COLLECTIVES

ROOT = Path(__file__).resolve().parents[1]


def run_python(args, timeout=300):
    flags = f"--xla_force_host_platform_device_count=4 {PATIENT_COLLECTIVES}"
    # A script's own folder comes first on sys.path, not the checkout: put the checkout there so that
    # the scripts import this pipejax, not another installed copy.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_train_mlp_pipeline_short():
    proc = run_python([str(ROOT / "examples" / "train_mlp_pipeline.py"), "--short"])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout

    # The step-0 checks ran and passed (the script exits non-zero otherwise).
    assert "step-0 check (no dropout)" in out, out
    assert "step-0 check (dropout, keys from pj.stage_key)" in out, out

    # Training made progress: the last train and test losses are clearly below the first ones.
    losses = [
        (float(train), float(test))
        for train, test in re.findall(r"train loss ([\d.]+)\s+test loss ([\d.]+)", out)
    ]
    assert len(losses) >= 3, out
    (train0, test0), (train1, test1) = losses[0], losses[-1]
    assert train1 < 0.9 * train0, out
    assert test1 < test0, out


def python_blocks(markdown):
    """The ```python blocks of a markdown file, joined in order into one script."""
    return "\n".join(re.findall(r"```python\n(.*?)```", markdown, re.S))


# The pages whose python blocks run as tests, in groups. The pages of a group run one after the
# other in one process, each page as its own script with its own globals (so a page cannot use
# what another page defined), and the group pays for one JAX start-up. A group is named after its
# first guide, and the name is the test's id (tests/conftest.py orders the longest ids first).
# The pages of a guide are read in order and share no names: each page repeats its own setup.
# (docs/multihost.md's script runs in tests/test_multihost.py, in one process and on two: a run
# here would repeat the one-process run. NOT_IN_GROUPS below lists the pages left out.)
PIPELINE_GUIDE = ["stages", "schedules", "tables", "choosing", "training", "memory", "meshes", "guarantees"]
FLAX_GUIDE = ["linen", "nnx", "training", "layers", "checkpoints", "batchnorm"]
DOC_GROUPS = {
    "README.md": ["README.md"],
    # the pipeline guide, then the shorter guides of the core library
    "docs/pipeline.md": [
        *(f"docs/pipeline_{name}.md" for name in PIPELINE_GUIDE),
        "docs/checkpointing.md",
        "docs/balance.md",
        "docs/batchnorm.md",
        "docs/migrating_from_torchgpipe.md",
    ],
    "docs/flax.md": [f"docs/flax_{name}.md" for name in FLAX_GUIDE],
    "docs/invertible.md": ["docs/invertible.md"],
}

# Runs the pages named on its command line in turn. A page's script keeps the page's line numbers
# (the text around its blocks becomes blank lines), so a traceback names the page and its line.
RUN_PAGES = r"""
import json as _json, re as _re, sys as _sys
for _page in _sys.argv[1:]:
    with open(_page) as _file:
        _parts = _re.split(r"(```python\n.*?```)", _file.read(), flags=_re.S)
    _source = "".join(
        "\n" + _part[len("```python\n") : -3]
        if _part.startswith("```python\n")
        else "\n" * _part.count("\n")
        for _part in _parts
    )
    if "_calls" in globals():  # COUNT_COMPILES ran: count each page's calls apart
        _calls.clear()
    print("PAGE", _page, flush=True)
    exec(compile(_source, _page, "exec"), {"__name__": "__main__"})
    if "_calls" in globals():
        print("COMPILES", _page, _json.dumps(dict(_calls)), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("group", list(DOC_GROUPS))
def test_docs_code_runs(group):
    """Every python snippet of each page runs, in order, as one script (their asserts included).

    The train steps of the pages in ``TRAIN_STEPS`` must compile on their first call only: a
    prelude counts the XLA compilations of every call of every function a page jits.
    """
    pages = DOC_GROUPS[group]
    for page in pages:
        assert "import pipejax as pj" in python_blocks((ROOT / page).read_text()), page
    counted = any(page in TRAIN_STEPS for page in pages)
    # the longest groups (the Flax guide, the pipeline guide) run for minutes on a loaded 2-core
    # machine: a timeout here guards against a hang, not against slowness
    script = (COUNT_COMPILES if counted else "") + RUN_PAGES
    proc = run_python(["-c", script, *pages], timeout=900)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for page in pages:
        if page not in TRAIN_STEPS:
            continue
        calls = json.loads(re.search(rf"^COMPILES {re.escape(page)} (.*)$", proc.stdout, re.M)[1])
        for name in TRAIN_STEPS[page]:
            counts = calls[name]
            assert len(counts) >= 3 and counts[0] >= 1, (page, name, counts)
            assert counts[1:] == [0] * (len(counts) - 1), f"{page}: {name} compiled again: {counts}"


# Pages with python blocks that DOC_GROUPS leaves out, and why.
NOT_IN_GROUPS = {
    "docs/multihost.md": "tests/test_multihost.py runs it",
    "docs/quickstart.md": "tests/test_docs.py runs it",
    "docs/hessian.md": "its blocks are fragments that use names they do not define",
}


def test_docs_pages_with_code_are_in_groups():
    """A docs page with python blocks (a new page of a guide, say) is in a group or said to be left out."""
    grouped = {page for pages in DOC_GROUPS.values() for page in pages}
    for path in sorted((ROOT / "docs").glob("*.md")):
        page = f"docs/{path.name}"
        if python_blocks(path.read_text()) and page not in NOT_IN_GROUPS:
            assert page in grouped, f"{page} has python blocks: add it to DOC_GROUPS in {__file__}"


# No surprise recompiles: the training loops of these pages compile once (tests/test_flax_recompile.py
# checks the same for pretrained weights and NNX modules built outside the mesh).
TRAIN_STEPS = {
    "docs/flax_linen.md": ["train_step"],
    "docs/flax_nnx.md": ["ntrain_step"],
    "docs/flax_training.md": ["train_step", "ltrain_step", "nlm_train_step"],
    "docs/flax_checkpoints.md": ["ntrain_step"],
    "README.md": [],
    "docs/quickstart.md": ["train_step"],
}
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COUNT_COMPILES = f"""
import collections, json, jax
from flax import nnx
import pipejax.flax  # (library-internal jits are made at import time, before the wrap)
_events, _calls, _depth = [], collections.defaultdict(list), []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _events.append(name) if name == "{COMPILE_EVENT}" else None)
def _counting(jit):
    def wrap(fun=None, **kw):
        if fun is None:
            return lambda f: wrap(f, **kw)
        jitted = jit(fun, **kw)
        def call(*args, **kwargs):  # (nnx.jit calls a jax.jit inside: count the outermost call)
            if _depth:
                return jitted(*args, **kwargs)
            before = len(_events)
            _depth.append(1)
            try:
                out = jitted(*args, **kwargs)
            finally:
                _depth.pop()
            _calls[getattr(fun, "__name__", "?")].append(len(_events) - before)
            return out
        return call
    return wrap
jax.jit, nnx.jit = _counting(jax.jit), _counting(nnx.jit)
"""
REPORT_COMPILES = '\nprint("COMPILES", json.dumps(dict(_calls)))\n'


@pytest.mark.slow
def test_train_transformer_lm_short(tmp_path):
    out_dir = tmp_path / "lm"
    proc = run_python(
        [str(ROOT / "examples" / "train_transformer_lm.py"), "--short", "--out", str(out_dir)], timeout=600
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    # The step-0 check (pipelined vs nn.Sequential, loss and gradients) ran and passed.
    match = re.search(r"step-0 check: loss ([\d.]+) vs plain ([\d.]+)", out)
    assert match, out
    assert abs(float(match[1]) - float(match[2])) <= 1e-4 * float(match[2]), out
    # Training made progress, and the loss curve was drawn.
    first, last = map(float, re.search(r"train loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < 0.9 * first, out
    assert (out_dir / "loss.png").stat().st_size > 5_000


@pytest.mark.slow
def test_checkpoint_orbax_short(tmp_path):
    pytest.importorskip("orbax.checkpoint")  # the optional extra pipejax[checkpoint]
    script = ROOT / "examples" / "checkpoint_orbax.py"
    proc = run_python([str(script), "--short", "--out", str(tmp_path / "ckpt")])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert "resumed on the same mesh: losses bitwise equal to the uninterrupted run" in out, out
    saved, restored = re.search(r"eval loss ([\d.]+) \(saved model ([\d.]+)\)", out).groups()
    assert abs(float(saved) - float(restored)) <= 1e-5 * float(saved), out
    assert "re-cut for a 2 x 2 data x stage mesh" in out and "checks passed" in out, out
    assert (tmp_path / "ckpt" / "state").is_dir()


@pytest.mark.slow
def test_checkpoint_layouts_short(tmp_path):
    pytest.importorskip("orbax.checkpoint")  # the optional extra pipejax[checkpoint]
    script = ROOT / "examples" / "checkpoint_layouts.py"
    proc = run_python([str(script), "--short", "--out", str(tmp_path / "ckpt")])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    for same in ("4 stages", "balance [4, 4]"):
        assert f"{same}: losses bitwise equal to the uninterrupted run" in out, out
    moved = re.findall(r"^(.*): losses .* max relative difference (\S+)$", out, re.M)
    assert [name for name, _ in moved] == ["2 stages x 2 data", "2 stages x 2 model", "balance [3, 5]"], out
    assert all(float(err) <= 1e-6 for _, err in moved) and "checks passed" in out, out


@pytest.mark.slow
def test_hessian_spectrum_short(tmp_path):
    png = tmp_path / "density.png"
    proc = run_python([str(ROOT / "examples" / "hessian_spectrum.py"), "--short", "--out", str(png)])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    top = [float(v) for v in re.search(r"top-5 eigenvalues: \[([^\]]*)\]", out)[1].split()]
    assert len(top) == 5 and top == sorted(top, reverse=True) and top[0] > 0, out
    est, err = map(float, re.search(r"trace: ([-\d.]+) \+- ([\d.]+)", out).groups())
    assert err > 0 and est > top[0] - 4 * err, out  # the trace exceeds the top eigenvalue (PSD bulk)
    assert png.stat().st_size > 5_000  # the density plot was drawn


@pytest.mark.slow
def test_hessian_during_training_short(tmp_path):
    png = tmp_path / "training.png"
    script = ROOT / "examples" / "hessian_during_training.py"
    proc = run_python([str(script), "--short", "--out", str(png)])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    rows = re.findall(
        r"step +(\d+) +loss ([\d.]+) +top eigenvalue ([-\d.]+) +trace ([-\d.]+) \+- ([\d.]+)", out
    )
    assert [int(r[0]) for r in rows] == [0, 3, 6], out  # evaluated every 3 steps of the short run
    stages = re.findall(r"stage traces \[([^\]]*)\]", out)
    assert len(stages) == 3 and all(len(s.split(",")) == 3 for s in stages), out  # one trace per stage
    assert all(float(r[2]) > 0 for r in rows), out  # cross-entropy at a small init: a positive top
    assert png.stat().st_size > 5_000


@pytest.mark.slow
def test_train_glow_digits_short(tmp_path):
    png = tmp_path / "samples.png"
    script = ROOT / "examples" / "train_glow_digits.py"
    proc = run_python([str(script), "--short", "--out", str(png)], timeout=600)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    # The step-0 check (constant-memory vs plain-autodiff gradients) ran and passed, with less memory.
    assert "step-0 check: constant vs linear gradient" in out, out
    constant, linear = map(float, re.search(r"constant ([\d.]+) MiB, linear ([\d.]+) MiB", out).groups())
    assert constant < linear, out
    # Training made progress: held-out bits/dim fell, below a uniform model's 4 bits; samples were drawn.
    bpd = [float(v) for v in re.findall(r"test bpd ([\d.]+)", out)]
    assert len(bpd) >= 3 and bpd[-1] < bpd[0] and bpd[-1] < 4.0, out
    assert png.stat().st_size > 5_000


@pytest.mark.slow
def test_demo_short(tmp_path):
    """`python -m pipejax.demo` end to end with small settings: checks pass, report written.

    In the fresh-clone CI (``.ci/run``) the Quickstart's first command has just run the demo with
    its default settings, and passed; this test then checks that run's output and report
    (``PIPEJAX_DEMO_LOG``, ``PIPEJAX_DEMO_REPORT``) instead of running the demo again.
    """
    if os.environ.get("PIPEJAX_DEMO_REPORT"):
        out_dir = Path(os.environ["PIPEJAX_DEMO_REPORT"])
        stdout = Path(os.environ["PIPEJAX_DEMO_LOG"]).read_text()
    else:
        out_dir = tmp_path / "demo"
        args = ["-m", "pipejax.demo", "--steps", "30", "--flow-steps", "30", "--lanczos-steps", "12"]
        proc = run_python([*args, "--probes", "5", "--out", str(out_dir)], timeout=600)
        assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        stdout = proc.stdout
    assert "equal (tolerance" in stdout and "bitwise equal" in stdout, stdout
    assert "CHECK FAILED" not in stdout, stdout
    summary = (out_dir / "summary.md").read_text()
    for heading in ("## Training", "## Checks", "## Curvature", "## Constant-memory flow", "## Memory"):
        assert heading in summary, summary
    for png in ("loss.png", "spectral_density.png", "memory_vs_depth.png"):
        assert (out_dir / png).stat().st_size > 5_000, png


def test_demo_rejects_bad_options():
    proc = run_python(["-m", "pipejax.demo", "--stages", "0"], timeout=120)
    assert proc.returncode == 2 and "--stages must be >= 1, got 0" in proc.stderr, proc.stderr
    proc = run_python(["-m", "pipejax.demo", "--stages", "64"], timeout=120)
    assert proc.returncode == 2 and "--stages 64 needs 64 devices" in proc.stderr, proc.stderr
