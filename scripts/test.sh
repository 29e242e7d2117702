#!/usr/bin/env bash
# Runs lint and the whole test suite (unit, property, doctests, examples in short mode, and the
# docs build with warnings as errors: tests/test_docs.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
.venv/bin/ruff check pipejax tests examples benchmarks
exec .venv/bin/python -m pytest -n 2 -q "$@"
