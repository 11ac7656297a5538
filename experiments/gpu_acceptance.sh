#!/usr/bin/env bash
# bash experiments/gpu_acceptance.sh --out DIR [--quick] [--budget SECONDS] [--work DIR]
#
# Acceptance of one NVIDIA GPU for sdcstudy, held to the project's targets, in at most 10
# minutes: doctor, golden record + check, bench train MFU floors (medium bfloat16 35%;
# llama3.2-1b bfloat16 40%, float32 35% of TF32) with the kernel census of the compiled step
# and the determinism flags' cost (at most 10%), ABFT false alarms (none) and recall on injected
# exponent-bit flips (at least 90%), and the device's clocks, power, temperatures and ECC
# counters before and after; results in DIR/gpu_acceptance.json. Exit 0 every check passes,
# 1 one fails or is skipped, 2 bad arguments or no usable GPU (no nvidia-smi, or a JAX
# without its CUDA backend).
# experiments/gpu_acceptance.py does the work; this script picks the Python: $PYTHON if set,
# else this checkout's .venv, else python3 (on a machine where jax with CUDA is installed
# system-wide, sdcstudy runs from this checkout without being installed).
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
exec "$python" "$root/experiments/gpu_acceptance.py" "$@"
