"""Strict JAX for every test, configured before JAX initialises its backend.

4 fake CPU devices (so meshes of up to 4 stages run on any machine), float64 available,
and numpy rank/dtype promotion that raises instead of silently broadcasting or upcasting.
"""

import atexit
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

# Most of the suite's time is XLA compiling. One persistent compilation cache serves the whole run:
# the pytest process makes a fresh folder and removes it at exit, and everything it starts inherits
# the variables below (the xdist workers, and through `os.environ` every script a test runs:
# examples, docs pages, benchmarks, multi-process workers). A program that two tests, or a test and
# a script, compile alike (the key is the program, the compile options, the XLA flags and the jax
# version) is compiled once. A hit loads the very executable that the first compile made, so
# results stay bitwise the same; compile counters see a hit too (jax records its
# `backend_compile_duration` event around the cache lookup). Set JAX_COMPILATION_CACHE_DIR to keep a
# cache between runs instead; PIPEJAX_TEST_NO_CACHE=1 turns the cache off.
if not os.environ.get("PIPEJAX_TEST_NO_CACHE") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="pipejax-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")  # of any size


def without_compilation_cache(env):
    """``env`` without the cache, for a script that must really compile: one that reads XLA's
    compile log (a cache hit logs nothing), times its compiles (benchmarks), or runs several
    processes at once (they would write the same entries together)."""
    return {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}


import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Where a test's time goes, on request: with PIPEJAX_TEST_TIMINGS=<folder> every test process
# writes <folder>/<pid>.json at exit, the seconds jax spent in this process per test (tracing,
# lowering to MLIR, XLA compiling or loading from the persistent cache, and the compile time the
# cache saved) and its cache hits and misses. `benchmarks/suite_time.py` reads them beside the
# JUnit report. Scripts a test starts are not counted (their time is the test's "rest").
TIMINGS = os.environ.get("PIPEJAX_TEST_TIMINGS")
if TIMINGS:
    import collections
    import json

    import pytest

    _current = ["(outside a test)"]
    _spent = collections.defaultdict(collections.Counter)

    def _add_seconds(event, duration_secs, **_):
        _spent[_current[0]][event] += duration_secs

    def _add_one(event, **_):
        _spent[_current[0]][event] += 1

    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_add_seconds)
    jax.monitoring.register_event_listener(_add_one)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current[0] = item.nodeid
        try:
            return (yield)
        finally:
            _current[0] = "(outside a test)"

    def _write_timings():
        os.makedirs(TIMINGS, exist_ok=True)
        with open(os.path.join(TIMINGS, f"{os.getpid()}.json"), "w") as file:
            json.dump(_spent, file)

    atexit.register(_write_timings)

# A script that the multi-host test starts in launched processes, not a test module: importing it
# (pytest's --doctest-modules imports every module) would call pipejax.launch.initialize().
collect_ignore = ["multihost_worker.py", "hessian_sharding_worker.py", "layers_worker.py"]

# The longest tests, longest first (by their seconds in a full `--durations=0` run on the loaded
# 2-core VM, November 2026); each entry is the start of a test's name. scripts/test.sh runs
# `pytest -n 2 --maxschedchunk=1`: the two workers take tests one at a time in collection order, so
# these go first and the many short tests fill in at the end, instead of one worker finishing a
# long test alone while the other idles. Other tests marked `slow` come next. An entry that matches
# no test only changes the order.
LONGEST_FIRST = (
    "test_docs_code_runs[docs/pipeline.md]",  # ~230 s (the fresh-clone run at f7d7d93)
    "test_docs_code_runs[docs/flax.md]",  # ~185 s
    "test_demo_short",
    "test_train_glow_digits_short",
    "test_benchmark_quick[hessian.py",
    "test_benchmark_quick[pipeline.py",
    "test_train_transformer_lm_short",
    "test_planner_chooses_the_fastest_plan_that_fits",  # tests/test_planner.py, ~20-30 s each
    "test_docs_code_runs[docs/invertible.md]",
    "test_without_wrappers_dropout_off_equals_the_model",  # tests/test_flax_gemma.py
    "test_per_example_keys_under_every_schedule",  # tests/test_schedule_grid.py, ~45-60 s each
    "test_stateful_stages",  # tests/test_schedule_grid.py, ~40-55 s each
    "test_3d_mesh_pipeline_on_two_processes_equals_one",
    "test_memory_benchmark_quick",
    "test_dropout_on_uses_call_time_rngs_with_the_documented_keys",
    "test_docs_site",
    "test_pipeline_across_two_processes",
    "test_without_a_mesh_the_training_schedules_accumulate_gradients",
    "test_loss_and_grads_equal_one_table[mesh-",  # tests/test_tied.py
    "test_checkpoint_layouts_short",
    "test_lanczos_on_a_pipelined_model_does_not_reshard_its_basis",
    "test_benchmark_quick[schedules.py",
    "test_benchmark_quick[invertible.py",
    "test_checkpoint_orbax_short",
    "test_value_and_grad_equals_composition_under_every_schedule",
    "test_benchmark_quick[maxtext_style.py",
    "test_hessian_spectrum_short",
    "test_linen_lm_mask_as_side_input_matches_the_plain_model",
    "test_train_mlp_pipeline_short",
    "test_per_stage_curvature_through_the_pipeline",
    "test_training_schedules_with_param_specs_match_gpipe[fsdp]",
    "test_masks_and_outputs_do_not_depend_on_chunks[3-",
    "test_without_a_mesh_every_slot_is_kept_apart",
    "test_optimizer_keeps_copies_bitwise_equal",
    "test_per_example_keys_make_dropout_independent_of_chunks",
    "test_higher_order_float64",
    "test_checkpoint_modes_bitwise_and_the_documented_keys",
    "test_pipeline_equals_composition",
    "test_nnx_training_eval_and_an_optimizer_step",
    "test_docs_code_runs[docs/batchnorm.md]",
    "test_hessian_during_training_short",
    "test_docs_code_runs[docs/balance.md]",
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
