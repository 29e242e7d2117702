#!/usr/bin/env bash
# The main job: trains a deep MLP through a 4-stage GPipe pipeline on 4 simulated CPU devices.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec .venv/bin/python examples/train_mlp_pipeline.py "$@"
