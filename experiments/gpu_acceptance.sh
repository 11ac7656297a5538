#!/usr/bin/env bash
# bash experiments/gpu_acceptance.sh --out DIR [--stage full|quick] [--budget S] [--work DIR] [--only LIST]
#
# The one prepared script for a GPU window (about 15 minutes, machine start included): the
# first run (`--stage full`, about 9 minutes) measures the step's speed and determinism, the
# torch ratio and ABFT; a short second run (`--stage quick`, about 4 minutes) the golden full
# workload and the stack fingerprint. Each writes DIR/gpu_acceptance.json and the short table
# DIR/gpu_acceptance.txt. `sdcstudy accept-gpu` does the work (sdcstudy/gpu/, docs/gpu.md);
# this script picks the Python: $PYTHON if set, else this checkout's .venv, else python3 (on
# a machine where jax with CUDA is installed system-wide, sdcstudy runs from this checkout
# without being installed). Exit 0 PASS, 1 FAIL, 2 INCOMPLETE (a check skipped), bad arguments or
# no GPU, 3 COULD NOT RUN (a check's child crashed: never a FAIL).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]]; then
    python="$root/.venv/bin/python"
else
    python="python3"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m sdcstudy accept-gpu "$@"
