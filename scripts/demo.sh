#!/usr/bin/env bash
# The main job: `python -m pipejax.demo` (pipelined Flax training with checks, Hessian spectrum,
# a constant-memory flow, and a report folder), after creating .venv and installing pipejax.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec .venv/bin/python -m pipejax.demo "$@"
