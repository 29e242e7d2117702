#!/usr/bin/env bash
# Runs lint and the whole test suite (unit, property, doctests, examples in short mode, and the
# docs build with warnings as errors: tests/test_docs.py). `--durations=25` lists the slowest tests;
# `--maxschedchunk=1` hands tests to the 2 workers one at a time, longest first (tests/conftest.py
# orders them), so neither worker is left with a queue of long tests at the end.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
.venv/bin/ruff check pipejax tests examples benchmarks
exec .venv/bin/python -m pytest -n 2 --maxschedchunk=1 --durations=25 -q "$@"
