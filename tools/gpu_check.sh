#!/usr/bin/env bash
# One device call: environment, bundle verification, GPU tests, benchmark (if asked). Run from the repo root
# on the GPU machine with the bundle carried in build/ (built on the CPU machine).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
python3 -m flint_aot.cli verify build/flint | tail -3
timeout 400 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -${PYTEST_TAIL:-25}
for b in ${BENCH:-}; do python3 "$b" 2>&1 | tee -a "$OUT/bench.log"; done
