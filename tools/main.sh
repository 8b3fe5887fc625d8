#!/usr/bin/env bash
# Fresh machine -> the main job: build and install deepfuse, then run `python -m deepfuse`
# (decode with the bundled default model; GPU if present, else CPU). Extra args go to it.
set -euo pipefail
source "$(dirname "$0")/build/setup_env.sh"
cd "$root/tests"   # outside the source tree
python -m deepfuse "$@"
