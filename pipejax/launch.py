"""Run a JAX program in several local processes: ``python -m pipejax.launch``.

``python -m pipejax.launch --processes 2 --devices-per-process 2 script.py`` starts two processes
with two CPU devices each; the script calls :func:`initialize` first, which joins it to the others
through ``jax.distributed``. See ``docs/multihost.md``.
"""

import sys

from pipejax._src.launch import ProcessInfo as ProcessInfo
from pipejax._src.launch import initialize as initialize
from pipejax._src.launch import launch as launch
from pipejax._src.launch import main as main

__all__ = ["ProcessInfo", "initialize", "launch", "main"]

if __name__ == "__main__":
    sys.exit(main())
