"""Where the test suite's time goes: the slowest tests, the time by file, and how much of it jax
spent tracing, lowering and compiling.

Reads the JUnit report of a pytest run (``--junitxml``) and, when the run had
``PIPEJAX_TEST_TIMINGS=<folder>``, the per-test jax timings that ``tests/conftest.py`` writes
there (one JSON file per test process)::

    d=$(mktemp -d) && git clone -q . "$d" && (cd "$d" && PIPEJAX_TEST_TIMINGS=/tmp/timings \\
        PYTEST_ADDOPTS="--junitxml=/tmp/junit.xml" CI=true bash .ci/run)
    .venv/bin/python benchmarks/suite_time.py --junit /tmp/junit.xml --timings /tmp/timings

A test's time (the JUnit report's: setup, call and teardown) splits into jax's trace, lower and
compile seconds in the test's own process, and the rest: running programs, the tests' own
Python, eager operations, and the processes a test starts (examples, docs pages, benchmarks),
whose compiles are not counted. "compile" includes loading a program from the persistent
compilation cache (a hit); trace seconds count a jit traced inside another's trace twice.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from benchmarks._common import section, table

ROOT = Path(__file__).resolve().parents[1]
EVENTS = {
    "trace": "/jax/core/compile/jaxpr_trace_duration",
    "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile": "/jax/core/compile/backend_compile_duration",
    "hits": "/jax/compilation_cache/cache_hits",
    "misses": "/jax/compilation_cache/cache_misses",
}
SPLIT = ("trace", "lower", "compile")


class Case(NamedTuple):
    """One test of the report: its pytest node id, its file and its wall seconds."""

    nodeid: str
    file: str
    seconds: float


def node_id(classname: str, name: str) -> tuple[str, str]:
    """``(node id, file)`` of a JUnit test case: the longest prefix of ``classname`` that names a
    file of the checkout is the module (the rest: classes)."""
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        path = "/".join(parts[:k]) + ".py"
        if (ROOT / path).exists():
            return "::".join([path, *parts[k:], name]), path
    return f"{classname}::{name}", classname


def read_junit(path: Path) -> tuple[list[Case], float]:
    """The report's tests and the run's wall seconds."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = []
    for case in root.iter("testcase"):
        if case.find("skipped") is not None and float(case.get("time", 0)) < 0.01:
            continue
        nodeid, file = node_id(case.get("classname", ""), case.get("name", ""))
        tests.append(Case(nodeid, file, float(case.get("time", 0))))
    return tests, sum(float(s.get("time", 0)) for s in suites)


def read_timings(folder: Path | None) -> dict[str, collections.Counter]:
    """Per node id, the summed jax events of every test process (``{}`` without a folder)."""
    spent = collections.defaultdict(collections.Counter)
    for file in sorted(folder.glob("*.json")) if folder else ():
        for nodeid, events in json.loads(file.read_text()).items():
            spent[nodeid].update({k: events.get(v, 0) for k, v in EVENTS.items()})
    return spent


def split_row(seconds: float, events: collections.Counter) -> list[str]:
    parts = [events[k] for k in SPLIT]
    return [*(f"{p:,.0f}" for p in parts), f"{seconds - sum(parts):,.0f}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", type=Path, required=True, help="pytest's --junitxml report")
    ap.add_argument("--timings", type=Path, help="the PIPEJAX_TEST_TIMINGS folder of the same run")
    ap.add_argument("--slowest", type=int, default=20)
    ap.add_argument("--files", type=int, default=15, help="files listed by name; the rest summed")
    args = ap.parse_args(argv)
    if args.timings is not None and not args.timings.is_dir():
        ap.error(f"--timings {args.timings}: no such folder (the run's PIPEJAX_TEST_TIMINGS)")
    tests, wall = read_junit(args.junit)
    spent = read_timings(args.timings)
    total = sum(t.seconds for t in tests)
    print("# Where the test suite's time goes\n")
    print(
        f"{len(tests)} tests in {wall:,.1f} s of wall time; {total:,.0f} worker-seconds (their own "
        f"times summed over the workers, {total / wall if wall else 0:.2f} workers busy on average)."
    )
    split_heads = ["trace s", "lower s", "compile s", "rest s"] if spent else []

    section(f"The slowest {args.slowest} tests")
    slowest = sorted(tests, key=lambda t: -t.seconds)[: args.slowest]
    rows = [[f"{t.seconds:.2f}", f"`{t.nodeid}`", *(split_row(t.seconds, spent[t.nodeid]) if spent else [])]
            for t in slowest]  # fmt: skip
    print(table(["seconds", "test", *split_heads], rows, align="rl" + "r" * len(split_heads)))

    section("Time by file")
    by_file = collections.defaultdict(lambda: [0.0, collections.Counter()])
    for t in tests:
        by_file[t.file][0] += t.seconds
        by_file[t.file][1].update(spent.get(t.nodeid, {}))
    ordered = sorted(by_file.items(), key=lambda kv: -kv[1][0])
    shown, rest = ordered[: args.files], ordered[args.files :]
    rest_sum = [sum(v[0] for _, v in rest), sum((v[1] for _, v in rest), collections.Counter())]
    everything = [total, sum((v[1] for _, v in ordered), collections.Counter())]

    def row(name, seconds, events):
        share = f"{seconds / total:.1%}" if total else "-"
        return [f"{seconds:,.0f}", share, name, *(split_row(seconds, events) if spent else [])]

    rows = [row(f"`{name}`", s, ev) for name, (s, ev) in shown]
    if rest:
        rows.append(row(f"the other {len(rest)} files", *rest_sum))
    rows.append(row("all", *everything))
    heads = ["worker-seconds", "share", "file", *split_heads]
    print(table(heads, rows, align="rrl" + "r" * len(split_heads)))

    if spent:
        section("Where the worker-seconds go")
        ev = everything[1]
        names = {t.nodeid for t in tests}
        outside = sum((c for k, c in spent.items() if k not in names), collections.Counter())
        parts = {name: ev[name] for name in SPLIT} | {"rest": total - sum(ev[k] for k in SPLIT)}
        rows = [[name, f"{s:,.0f}", f"{s / total:.1%}"] for name, s in parts.items()]
        print(table(["part", "seconds", "share"], rows, align="lrr"))
        print(
            f"\nPersistent compilation cache: {ev['hits']:,.0f} hits and {ev['misses']:,.0f} misses in "
            f"the tests; outside any test (collection, module set-up): {outside['compile']:,.0f} s "
            f"compiling, {outside['trace']:,.0f} s tracing."
        )


if __name__ == "__main__":
    main()
