#!/usr/bin/env bash
# Every test: pytest (every tier, with the doctests of the package, README.md and the docs),
# and the GPU kernels in numba's CUDA simulator, which needs a process of its own (the
# simulator and real PTX compilation cannot share one).
#
# The two runs are independent, and each keeps about one core busy, so they run side by side:
# on 2 cores the whole suite takes about the longer run's time instead of their sum. The
# simulator's report is printed after the main run's; the exit status is the first failure's.
#
# usage: bash tests/run_all.sh [python]   (default: .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

NUMBA_ENABLE_CUDASIM=1 "$python" -m pytest -p no:cacheprovider tests/gpu/simulator >"$log" 2>&1 &
simulator=$!
"$python" -m pytest
main=$?
wait "$simulator"
sim=$?

echo
echo "=== GPU kernels in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, tests/gpu/simulator)"
cat "$log"
if [ "$main" -ne 0 ]; then
    exit "$main"
fi
exit "$sim"
