"""Strict JAX for every test, configured before JAX initialises its backend.

4 fake CPU devices (so meshes of up to 4 stages run on any machine), float64 available,
and numpy rank/dtype promotion that raises instead of silently broadcasting or upcasting.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
