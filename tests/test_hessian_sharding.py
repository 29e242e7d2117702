"""No resharding inside the Lanczos loop: XLA's partitioner must not replicate the basis.

XLA reports an involuntary replication on stderr of the process that compiles (a C++ log line,
not a Python warning), so the check runs the demo's pipelined model in a subprocess and reads its
stderr. Before the basis and the vectors were pinned to the parameters' shardings, it printed
``[SPMD] Involuntary full rematerialization`` for ``_eigenvalues_impl`` and ``_density_impl``.
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import without_compilation_cache

ROOT = Path(__file__).resolve().parents[1]


def test_lanczos_on_a_pipelined_model_does_not_reshard_its_basis():
    # (no compilation cache: a program loaded from it is not partitioned again, and logs nothing)
    env = without_compilation_cache(dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="0"))
    env.pop("XLA_FLAGS", None)
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "hessian_sharding_worker.py")],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done" in run.stdout
    lines = [line for line in run.stderr.splitlines() if "Involuntary full rematerialization" in line]
    assert not lines, "\n".join(line[:400] for line in lines)
