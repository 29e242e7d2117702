"""Strict JAX for every test, configured before JAX initialises its backend.

4 fake CPU devices (so meshes of up to 4 stages run on any machine), float64 available,
and numpy rank/dtype promotion that raises instead of silently broadcasting or upcasting.
"""

import os

# XLA's CPU collectives (ppermute, psum between fake devices) abort a program whose devices do not all
# reach a collective within a timeout. On a loaded 2-core machine (pytest -n 2, each process running
# 4 fake devices) a slow but healthy step can exceed the default, so the tests, and the scripts they
# start, wait 5 minutes.
PATIENT_COLLECTIVES = (
    "--xla_cpu_collective_timeout_seconds=300 --xla_cpu_collective_call_terminate_timeout_seconds=300"
)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4 " + PATIENT_COLLECTIVES
).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# A script that the multi-host test starts in launched processes, not a test module: importing it
# (pytest's --doctest-modules imports every module) would call pipejax.launch.initialize().
collect_ignore = ["multihost_worker.py", "hessian_sharding_worker.py"]
