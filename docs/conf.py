"""Sphinx configuration for the pipejax documentation.

Build (warnings are errors, as in CI)::

    .venv/bin/sphinx-build -W --keep-going -b html docs build/docs

The guides are Markdown (MyST); the API reference is generated from the docstrings by autodoc and
autosummary (Google style, read by napoleon). Adding a guide takes one line in a ``toctree`` of
``index.md``; adding a public name to a module's ``__all__`` adds it to the reference by itself.
"""

import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout, not some other installed pipejax

# Importing pipejax imports JAX; keep it on the CPU and quiet whatever machine builds the docs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from sphinx.util import logging  # noqa: E402

import pipejax  # noqa: E402

logger = logging.getLogger(__name__)

project = "pipejax"
author = "the pipejax authors"
copyright = "the pipejax authors"
release = pipejax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

root_doc = "index"
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
templates_path = ["_templates"]
exclude_patterns = ["_build", "_templates", "Thumbs.db", ".DS_Store"]

# MyST: anchors for headings down to level 4, so `pipeline.md#randomness` links resolve.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "dollarmath"]

# API reference: one page per public object, from each public module's `__all__`.
autosummary_generate = True
autosummary_ignore_module_all = False
autosummary_imported_members = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False


def _public_modules():
    """`pipejax` and its API submodules, as module objects.

    An API module has no `_`-prefixed part in its name and defines `__all__` (the house rule for
    public names); a public module without `__all__` is a program (`python -m pipejax.demo`).
    """
    found = [pipejax]
    for info in pkgutil.walk_packages(pipejax.__path__, "pipejax."):
        if not any(part.startswith("_") for part in info.name.split(".")) and _defines_all(info.name):
            found.append(importlib.import_module(info.name))
    return found


def _defines_all(module_name):
    """Whether the module's source assigns `__all__`.

    The source is read, not imported: a program module may configure JAX when imported.
    """
    tree = ast.parse(Path(importlib.util.find_spec(module_name).origin).read_text())
    targets = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


PUBLIC_MODULES = _public_modules()


def _show_aliased_classes_under_public_names():
    """Give a class exported under another name (`Plan` as `MicrobatchPlan`) that name.

    autodoc renders a class whose ``__name__`` differs from the documented name as "alias of ..."
    without its docstring. Renaming ``__name__`` (not ``__qualname__``, which ``inspect`` uses to
    find the source) in this build process only makes it document the class under its public name.
    """
    for module in PUBLIC_MODULES:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj) and obj.__name__ != name and obj.__module__.startswith("pipejax._src"):
                obj.__name__ = name


_show_aliased_classes_under_public_names()


def _case_collisions():
    """Page names for objects whose names differ only in case (`balance`, `Balance`).

    autosummary writes one file per object; on case-insensitive file systems (macOS, Windows)
    those two would be one file. The class keeps its name with a suffix.
    """
    mapping = {}
    for module in PUBLIC_MODULES:
        names = [module.__name__ + "." + n for n in getattr(module, "__all__", ())]
        lower = [n.lower() for n in names]
        for full in names:
            if lower.count(full.lower()) > 1 and inspect.isclass(_public_object(full)):
                mapping[full] = full + "-class"
    return mapping


def _public_object(full_name):
    """The object a dotted public name (`pipejax.hessian.Density`) refers to."""
    module_name, _, attr = full_name.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


autosummary_filename_map = _case_collisions()


def _drop_builtin_docstrings(app, what, name, obj, options, lines):
    """A constant such as a tuple has no docstring of its own; do not show its type's."""
    type_doc = type(obj).__doc__
    if what in ("data", "attribute") and isinstance(type_doc, str) and lines:
        if "\n".join(lines).strip() == inspect.cleandoc(type_doc).strip():
            lines.clear()


def _rst_text(comment):
    """A source comment as reStructuredText: `x` as inline code, other markup characters escaped."""
    parts = re.split(r"(`+[^`]+`+)", comment)
    out = []
    for part in parts:
        if part.startswith("`"):
            out.append("``" + part.strip("`") + "``")
        else:
            out.append(re.sub(r"([\\*|_])", r"\\\1", part))
    return "".join(out)


def _field_comments_as_docs(app, what, name, obj, options, lines):
    """NamedTuple fields: show the field's trailing source comment instead of "Alias for field number N".

    The library documents each field of a NamedTuple with a comment on its line (its shape, dtype
    and meaning: ``mean: jax.Array  # float[*features]: running mean``); autodoc cannot see those.
    """
    if what != "attribute" or not lines or not re.fullmatch(r"Alias for field number \d+", lines[0]):
        return
    owner_name, _, field = name.rpartition(".")
    try:
        source = inspect.getsource(_public_object(owner_name))
    except (AttributeError, ImportError, OSError, TypeError):
        return
    found = re.search(rf"^\s+{re.escape(field)}\s*:[^#\n]*#\s*(.+?)\s*$", source, flags=re.MULTILINE)
    lines[:] = [_rst_text(found.group(1))] if found else []


def _check_reference_lists_every_module(app):
    """Warn (an error under -W) when a public module is missing from api/index.md."""
    listed = (DOCS / "api" / "index.md").read_text()
    for module in PUBLIC_MODULES:
        if not re.search(rf"^\s+{re.escape(module.__name__)}\s*$", listed, flags=re.MULTILINE):
            logger.warning(
                "public module %s is not in the API reference: add it to the autosummary list "
                "in docs/api/index.md",
                module.__name__,
            )


def _clean_generated_pages(app):
    """Remove the pages autosummary generated last time, so a removed name leaves no stale page."""
    shutil.rmtree(DOCS / "api" / "_generated", ignore_errors=True)


def setup(app):
    app.connect("builder-inited", _clean_generated_pages, priority=100)  # before autosummary (500)
    app.connect("builder-inited", _check_reference_lists_every_module)
    app.connect("autodoc-process-docstring", _drop_builtin_docstrings)
    app.connect("autodoc-process-docstring", _field_comments_as_docs)


html_theme = "furo"
html_title = f"pipejax {release}"
