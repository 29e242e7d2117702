"""The documentation site builds with warnings as errors, and its API reference is complete.

The build runs Sphinx in a fresh process (it imports pipejax and JAX on its own) into a temporary
directory. The docstring examples are not run here: pytest's ``--doctest-modules`` over ``pipejax/``
runs them. The Python blocks of the quickstart run as one script, as the other pages' do in
``tests/test_examples.py``.
"""

import ast
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import pipejax

pytestmark = pytest.mark.slow  # a Sphinx build and a script that compiles a pipeline

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def public_modules():
    """`pipejax` and its API submodules: no `_`-prefixed part, and an `__all__`.

    A public module without `__all__` is a program (`python -m pipejax.demo`), not API.
    """
    names = ["pipejax"]
    for info in pkgutil.walk_packages(pipejax.__path__, "pipejax."):
        if not any(part.startswith("_") for part in info.name.split(".")) and defines_all(info.name):
            names.append(info.name)
    return names


def defines_all(module_name):
    """Whether the module's source assigns `__all__`.

    The source is read, not imported: importing a program module (the demo sets
    `jax_num_cpu_devices`) could change JAX's setup in this test process.
    """
    tree = ast.parse(Path(importlib.util.find_spec(module_name).origin).read_text())
    targets = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def read_inventory(path):
    """The ``{name: role}`` entries of a Sphinx ``objects.inv`` (version 2: 4 header lines, zlib body)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    assert data.startswith(b"# Sphinx inventory version 2"), data[:header_end]
    entries = {}
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        match = re.match(r"(\S+)\s+(\S+):(\S+)\s+", line)
        if match:
            entries.setdefault(match[1], set()).add(f"{match[2]}:{match[3]}")
    return entries


def build_site(out):
    """Runs ``sphinx-build -W`` into ``out``; returns the HTML directory."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(out / "html"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # -W turns every warning into an error: a broken link, a page missing from the navigation, a
    # docstring that does not parse. The message names the file and line.
    assert proc.returncode == 0, f"sphinx-build exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return out / "html"


def test_docs_site(tmp_path):
    """The site builds with warnings as errors, and its pages and API reference are complete.

    One build, then every check of it: autosummary writes its pages into docs/api/_generated, so
    two builds at once (as pytest-xdist could run them for separate tests) would race there.
    """
    site = build_site(tmp_path)
    check_pages(site)
    check_reference_is_complete(site)
    check_reference_shows_docstrings(site)


def check_pages(built_site):
    assert (built_site / "index.html").is_file()
    assert (built_site / "quickstart.html").is_file()
    # Pages linked from the index and images referenced by the guides are in the site.
    assert (built_site / "pipeline.html").is_file()
    assert list((built_site / "_images").glob("memory_vs_depth*.png"))


def check_reference_is_complete(built_site):
    """Each public module and every name in its ``__all__`` has an entry, under its public name."""
    inventory = read_inventory(built_site / "objects.inv")
    missing = []
    for module_name in public_modules():
        if "py:module" not in inventory.get(module_name, set()):
            missing.append(module_name)
        module = importlib.import_module(module_name)
        assert module.__all__, module_name
        for name in module.__all__:
            roles = inventory.get(f"{module_name}.{name}", set())
            if not roles & {"py:function", "py:class", "py:data", "py:exception"}:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"not in the API reference: {missing}; add new modules to docs/api/index.md"
    assert {"pipejax", "pipejax.flax", "pipejax.hessian", "pipejax.invertible", "pipejax.launch"} <= set(
        public_modules()
    )


def check_reference_shows_docstrings(built_site):
    """A page carries the docstring's summary, its Args as a parameter list and its Examples."""
    page = (built_site / "api" / "_generated" / "pipejax.pipeline.html").read_text()
    summary = pipejax.pipeline.__doc__.strip().splitlines()[0]
    text = re.sub(r"<[^>]+>", "", page)
    assert re.sub(r"`+", "", summary) in text
    assert "chunks" in text and "Parameters" in text and "&gt;&gt;&gt;" in page
    # A class exported under another name is documented with its docstring, not as an alias.
    plan = re.sub(
        r"<[^>]+>", "", (built_site / "api" / "_generated" / "pipejax.MicrobatchPlan.html").read_text()
    )
    assert "alias of" not in plan
    assert pipejax.MicrobatchPlan.__doc__.strip().splitlines()[0].split("``")[0] in plan


def python_blocks(markdown):
    """The ```python blocks of a markdown file, joined in order into one script."""
    return "\n".join(re.findall(r"```python\n(.*?)```", markdown, re.S))


def test_quickstart_code_runs():
    """The quickstart runs, trains, and its train step compiles on its first call only."""
    from tests.test_examples import COUNT_COMPILES, REPORT_COMPILES

    source = python_blocks((DOCS / "quickstart.md").read_text())
    assert "import pipejax as pj" in source
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_COMPILES + source + REPORT_COMPILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "(64, 32)" in proc.stdout, proc.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first, proc.stdout
    counts = json.loads(re.search(r"^COMPILES (.*)$", proc.stdout, re.M)[1])["train_step"]
    assert counts[0] >= 1 and counts[1:] == [0] * (len(counts) - 1), f"train_step compiled again: {counts}"
