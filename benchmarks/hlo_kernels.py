"""Kernels and bytes per loop iteration of compiled programs, read from their optimised HLO text.

``gpu.py --dump-hlo DIR`` writes each program's optimised HLO (``compiled.as_text()``) to
``DIR/<label>.txt``; this script reads such files and prints, per program, every ``while`` loop
(its trip count, where XLA knows it) with the kernels one iteration launches, grouped by kind,
and the bytes their results write::

    python benchmarks/hlo_kernels.py DIR/*.txt          # a table per program
    python benchmarks/hlo_kernels.py --top 10 FILE      # and the largest kernels of each loop

A kernel is a top-level instruction of the loop body that does work on the device: a fusion
(XLA's ``kLoop``, ``kInput``, ``kCustom`` kinds; ``gemm_fusion`` and ``triton`` names are
matmuls), a custom call (cuBLAS, cuDNN), a copy, a collective. Tuples, parameters, constants,
bitcasts and ``get-tuple-element`` launch nothing; a ``conditional`` (XLA:CPU's slots) is not
counted, nor are its branches' kernels (a loop inside a branch is listed on its own). "Bytes
written" is the size of each result, so an in-place ``dynamic-update-slice`` fusion counts its
whole buffer: read it as an upper bound. Works on any backend's text; the GPU's is what a
per-tick cost is counted on.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier"}
ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4}
ITEMSIZE |= {"s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
SHAPE = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([\d,]*)\]")
INSTR = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(")


def computations(text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
    """``({computation: [(instruction, result type, opcode, line)]}, entry computation)``."""
    comps, current, entry = {}, None, ""
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            m = INSTR.match(line)
            if m:
                comps[current].append((m.group(1), m.group(2), m.group(3), line))
    return comps, entry


def nbytes(type_text: str) -> int:
    total = 0
    for dtype, dims in SHAPE.findall(type_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * ITEMSIZE[dtype]
    return total


def kind(name: str, opcode: str, line: str) -> str:
    """A kernel's kind: the fusion's name without its number (``loop_add_fusion``), or the opcode."""
    if opcode == "fusion":
        return re.sub(r"[.\d]+$", "", name)
    if opcode == "custom-call":
        return "custom-call " + re.search(r'custom_call_target="([^"]+)"', line).group(1)
    return opcode


def loops(comps, name, depth=0, seen=None):
    """``(body, trip count or None, depth)`` of every ``while`` reachable from ``name``."""
    seen = set() if seen is None else seen
    for _, _, opcode, line in comps.get(name, []):
        if opcode == "while":
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            if body not in seen:
                seen.add(body)
                yield body, int(trip.group(1)) if trip else None, depth
                yield from loops(comps, body, depth + 1, seen)
        elif opcode == "conditional":
            called = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = called.group(1) if called else " ".join(re.findall(r"_computation=%?([\w.\-]+)", line))
            for branch in re.findall(r"[\w.\-]+", names):
                if branch in comps and branch not in seen:
                    seen.add(branch)
                    yield from loops(comps, branch, depth + 1, seen)


def body_kernels(comps, body):
    """``[(kind, bytes written, instruction, result type)]`` of one iteration of ``body``."""
    out = []
    for name, result, opcode, line in comps[body]:
        if opcode in FREE or opcode in ("while", "conditional"):
            continue
        out.append((kind(name, opcode, line), nbytes(result), name, result))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=0, help="also list each loop's largest kernels")
    args = ap.parse_args()
    for path in args.files:
        comps, entry = computations(path.read_text())
        print(f"## {path.stem}\n")
        print("| loop | trip | kernels | MiB written | by kind (count, MiB) |")
        print("|:--|--:|--:|--:|:--|")
        for body, trip, depth in loops(comps, entry):
            ks = body_kernels(comps, body)
            groups = collections.defaultdict(lambda: [0, 0])
            for k, b, _, _ in ks:
                groups[k][0] += 1
                groups[k][1] += b
            top = sorted(groups.items(), key=lambda kv: -kv[1][1])
            kinds = "; ".join(f"{k} {c}, {b / 2**20:,.1f}" for k, (c, b) in top[:6])
            mib = sum(b for _, b, _, _ in ks) / 2**20
            print(f"| {'  ' * depth}{body} | {trip or '?'} | {len(ks)} | {mib:,.1f} | {kinds} |")
            for k, b, name, result in sorted(ks, key=lambda r: -r[1])[: args.top]:
                print(f"|   {name} | | | {b / 2**20:,.1f} | {k} {result[:60]} |")
        print()


if __name__ == "__main__":
    main()
