"""A local multi-process launcher for ``jax.distributed`` (like ``torchrun``), and its other half.

``python -m pipejax.launch --processes 2 --devices-per-process 2 script.py args...`` starts two
Python processes on this machine. Each process learns who it is from environment variables and
calls :func:`initialize` before any JAX computation; :func:`initialize` gives it its CPU devices
and joins it to the others through ``jax.distributed`` over loopback, with the gloo CPU
collectives. Together they then run one multi-controller JAX program: every process runs the same
script, a mesh may span the devices of all processes, and XLA collectives (``ppermute``,
``psum``) move data between processes.

The launcher owns the processes: it prefixes every output line with the process's index, stops
the others as soon as one fails (its exit code becomes the launcher's) or leaves without joining
while the others wait to, stops all after ``--timeout`` seconds (exit code 124) or when it is sent
SIGINT, SIGTERM or SIGHUP (exit code 128 + the signal's number: 130, 143, 129), and ends every
process group when it returns, so that no child of any process is left behind.

The modules: :mod:`~pipejax._src.launch.process` is what runs in each process
(:func:`initialize`, :class:`ProcessInfo`, the environment variables the launcher sets);
:mod:`~pipejax._src.launch.launcher` starts and stops the processes (:func:`launch`, its signal
handling); :mod:`~pipejax._src.launch.validation` checks the command and the counts;
:mod:`~pipejax._src.launch.cli` is the command line (:func:`main`).
"""

from pipejax._src.launch.cli import main as main
from pipejax._src.launch.launcher import launch as launch
from pipejax._src.launch.process import ProcessInfo as ProcessInfo
from pipejax._src.launch.process import initialize as initialize

__all__ = ["ProcessInfo", "initialize", "launch", "main"]
