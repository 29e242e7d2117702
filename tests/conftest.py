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
collect_ignore = ["multihost_worker.py", "hessian_sharding_worker.py", "layers_worker.py"]

# The longest tests, longest first (by their CPU seconds in the fresh-clone CI's `--durations`
# list, which scripts/test.sh prints); each entry is the start of a test's name. scripts/test.sh
# runs `pytest -n 2 --maxschedchunk=1`: the two workers take tests one at a time in collection
# order, so these go first and the many short tests fill in at the end, instead of one worker
# finishing a long script alone while the other idles. Other tests marked `slow` come next. An
# entry that matches no test only changes the order.
LONGEST_FIRST = (
    "test_docs_code_runs[docs/flax.md]",
    "test_docs_code_runs[docs/pipeline.md]",
    "test_train_transformer_lm_short",
    "test_demo_short",
    "test_train_glow_digits_short",
    "test_benchmark_quick[hessian.py",
    "test_benchmark_quick[pipeline.py",
    "test_benchmark_quick[invertible.py",
    "test_docs_code_runs[docs/invertible.md]",
    "test_without_wrappers_dropout_off_equals_the_model",  # tests/test_flax_gemma.py, ~35 CPU s each
    "test_dropout_on_uses_call_time_rngs_with_the_documented_keys",
    "test_memory_benchmark_quick",
    "test_benchmark_quick[schedules.py",
    "test_checkpoint_orbax_short",
    "test_checkpoint_layouts_short",
    "test_benchmark_quick[maxtext_style.py",
    "test_hessian_spectrum_short",
    "test_docs_code_runs[docs/batchnorm.md]",
    "test_train_mlp_pipeline_short",
    "test_hessian_during_training_short",
    "test_docs_code_runs[docs/balance.md]",
    "test_docs_site",
)


def pytest_collection_modifyitems(items):
    """Longest tests first (see `LONGEST_FIRST`), then the other slow ones; a stable sort.

    (The root conftest.py star-imports this module, so pytest may call this twice: sorting again
    changes nothing.)
    """

    def rank(item):
        for i, start in enumerate(LONGEST_FIRST):
            if item.name.startswith(start):
                return i
        return len(LONGEST_FIRST) + (0 if item.get_closest_marker("slow") else 1)

    items.sort(key=rank)
