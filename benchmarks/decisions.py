"""Where the engine's decisions are made: decision sites per file, reads of ``Pipeline``'s private
members, import circles, file sizes and core lines.

Run from the repository root::

    .venv/bin/python benchmarks/decisions.py                 # the tree as it is
    .venv/bin/python benchmarks/decisions.py --at ea5046a    # a commit, read with `git show`
    .venv/bin/python benchmarks/decisions.py --quick         # the same (it takes a second)

A decision site is a line of ``pipejax/_src`` (without ``hessian/`` and ``invertible/``, which
use the pipeline through its public API) that branches on one of the questions below, found
with the regular expressions in ``DECISIONS``, as ``grep`` would count them. Each question
should be answered by the object that owns it; the table says how many sites sit outside that
owner. It reads source text only: no JAX is imported.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks._common import header, section, table  # noqa: E402

SKIP = ("pipejax/_src/hessian/", "pipejax/_src/invertible/")
BRANCH = r"(\bif\b|\belif\b|\bwhile\b|\belse\b|\band\b|\bor\b|\bnot\b)"
# question -> (regular expression of a site, the owner's files: sites there are the owner's own)
DECISIONS = {
    "homogeneous or heterogeneous stages": (
        rf"({BRANCH}.*\bhomogeneous\b|\bhomogeneous\b.*{BRANCH}|isinstance\([^)]*(Homogeneous|Heterogeneous))",
        ("kinds.py", "engine/stages.py"),
    ),
    "mesh or `mesh=None`": (r"\bmesh is (not )?None\b", ("plan.py",)),
    "forward or training table": (
        r"(\bslots is (not )?None\b|isinstance\([^)]*TrainingSchedule|TRAINING_KINDS|\bowns_backward\b)",
        ("plan.py", "schedules/tables.py", "schedules/kinds.py"),
    ),
    "`(v, n, ...)` or `(S, ...)` parameter layout": (
        r"(is_device_major|repeats > 1 and [\w.]*num_devices > 1|\bdevice_major\()",
        ("params/forms.py",),
    ),
    "`isinstance(..., StageParams)`": (
        r"isinstance\([^)]*StageParams",
        ("params/placement.py", "params/forms.py", "kinds.py"),
    ),
}


def pipeline_privates(files: dict[str, str]) -> set[str]:
    """The private names of class ``Pipeline``: its ``_``-methods and the ``self._x`` it sets."""
    text = next(t for n, t in files.items() if n.endswith("_src/pipeline.py"))
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    names |= {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and n.attr.startswith("_")
    }
    return {n for n in names if not n.startswith("__")}


def sources(at: str | None) -> dict[str, str]:
    """``{path: text}`` of the Python files under ``pipejax/_src`` in the tree or at commit ``at``."""
    if at is None:
        return {
            str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "pipejax/_src").rglob("*.py"))
        }
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", at, "pipejax/_src"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    return {
        n: subprocess.run(
            ["git", "show", f"{at}:{n}"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of the code: comments and string literals (docstrings, messages)
    blanked, blank lines dropped. A question asked inside an error message is not a branch."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return []
    lines = text.splitlines()
    chars = [list(line) for line in lines]
    literal = {tokenize.STRING, tokenize.COMMENT}
    literal |= {
        getattr(tokenize, n)
        for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
        if hasattr(tokenize, n)
    }
    for tok in tokens:
        if tok.type not in literal:
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = chars[r - 1]
            lo, hi = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
            row[lo:hi] = " " * (hi - lo)
    return [(i, "".join(row)) for i, row in enumerate(chars, 1) if "".join(row).strip()]


def decision_rows(files: dict[str, str]) -> list[list[str]]:
    rows = []
    for question, (pattern, owners) in DECISIONS.items():
        rx = re.compile(pattern)
        per_file: dict[str, int] = {}
        for name, text in files.items():
            if name.startswith(SKIP):
                continue
            n = sum(1 for _, line in code_lines(text) if rx.search(line))
            if n:
                per_file[name.removeprefix("pipejax/_src/")] = n
        total = sum(per_file.values())
        outside = sum(n for f, n in per_file.items() if f not in owners)
        where = ", ".join(f"{f} {n}" for f, n in sorted(per_file.items(), key=lambda kv: -kv[1]))
        rows.append([question, str(total), str(len(per_file)), str(outside), ", ".join(owners), where])
    return rows


def module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def imports(files: dict[str, str]) -> dict[str, set[str]]:
    """Each ``pipejax._src`` module's imports of other ``pipejax._src`` modules (lazy ones too)."""
    mods = {module_name(p): t for p, t in files.items()}
    graph: dict[str, set[str]] = {}
    for mod, text in mods.items():
        deps = set()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipejax._src"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("pipejax._src"))
        # a package's __init__ that re-exports its modules is not a dependency of them
        graph[mod] = {
            d
            for d in deps
            if d in mods and d != mod and not (d.startswith(mod + ".") and _is_pkg(mod, files))
        }
    return graph


def _is_pkg(mod: str, files: dict[str, str]) -> bool:
    return mod.replace(".", "/") + "/__init__.py" in files


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            # importing a submodule runs its package's __init__ first, which is not a circle
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", help="read the tree at this commit (git show) instead of the checkout")
    ap.add_argument("--quick", action="store_true", help="the same run (kept for the suite's smoke test)")
    args = ap.parse_args()
    files = sources(args.at)
    header("Decision sites", args.quick)
    print(f"pipejax/_src read at {args.at or 'the checkout'}.")
    section("Decision sites (code lines that branch on the question; hessian/ and invertible/ not counted)")
    print(
        table(
            ["decision", "sites", "files", "outside the owner", "owner", "sites per file"],
            decision_rows(files),
        )
    )

    section("Reads of Pipeline's private members below pipeline.py")
    reads = [[name, str(i), read] for name, i, read in private_reads(files)]
    print(table(["file", "line", "read"], reads or [["(none)", "", ""]]))

    section("Import circles among pipejax._src modules")
    found = cycles(imports(files))
    print(table(["modules in one circle"], [[" <-> ".join(c)] for c in found] or [["(none)"]]))

    section("Files over 600 lines")
    big = [[n, f"{lines:,}"] for n, lines in long_files(files)]
    print(table(["file", "lines"], big or [["(none)", ""]]))

    section("Core lines (pipejax/_src without hessian/ and invertible/)")
    core = {n: t for n, t in files.items() if not n.startswith(SKIP)}
    total = sum(t.count("\n") for t in core.values())
    code = sum(len(code_lines(t)) for t in core.values())
    print(table(["files", "lines", "code lines"], [[str(len(core)), f"{total:,}", f"{code:,}"]]))
    print(f"\n`slots is None` in the tick loop (engine/): {slots_is_none(files)}")


def private_reads(files: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(file, line, read)`` for each read of a private member of ``Pipeline`` outside
    ``pipeline.py``."""
    private = re.compile(r"\b[\w.]+\.(" + "|".join(sorted(pipeline_privates(files))) + r")\b")
    return [
        (name.removeprefix("pipejax/_src/"), i, m.group(0))
        for name, text in files.items()
        if not name.endswith(("/pipeline.py",))
        for i, line in code_lines(text)
        for m in private.finditer(line.split("#", 1)[0])
    ]


def long_files(files: dict[str, str], limit: int = 600) -> list[tuple[str, int]]:
    """The files of ``pipejax/_src`` over ``limit`` lines, and their lines."""
    sizes = {n.removeprefix("pipejax/_src/"): t.count("\n") for n, t in files.items()}
    return [(n, lines) for n, lines in sizes.items() if lines > limit]


def slots_is_none(files: dict[str, str]) -> int:
    """How often the tick loop (``engine/``) asks whether it runs a training table."""
    return sum(len(re.findall(r"slots is None", t)) for n, t in files.items() if "/engine" in n)


if __name__ == "__main__":
    main()
