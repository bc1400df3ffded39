#!/usr/bin/env bash
# One device call: environment, bundle verification, GPU tests, the serving wheel's self-check, benchmark (if
# asked). Run from the repo root on the GPU machine with the bundle carried in build/ (built on the CPU
# machine).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# The slow-producer test (tests/test_qkv_gpu.py::test_slow_producer) needs the debug bundle, carried in
# build/debug (`flint-aot build configs/debug_slow_producer.yaml -o build/debug`): here its absence fails
# the test instead of skipping it.
export FLINT_REQUIRE_DEBUG_BUNDLE=1
# The Qwen3 example's cases (tests/test_qwen3_example.py, the GPU one at M = 64) need transformers, which the
# GPU machine's image has: here its absence fails them instead of skipping them.
export FLINT_REQUIRE_TRANSFORMERS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A failed check (the bundle's verification, the tests, the serving wheel's pack, install or doctor, the
# custom kernel's run) does not stop the script: the rest still runs, and it exits 1 naming each failure.
failed=""
fail() { failed="$failed $1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
python3 -m flint_aot.cli verify build/flint | tail -3 || fail verify
timeout ${PYTEST_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -${PYTEST_TAIL:-25} || fail pytest
if [ "${AXES_CHECK:-1}" = 1 ]; then
  # The axes beyond Flint's matrix (hidden 1024 and 1536, q/k norm off): their GPU tests, the fuzz and the
  # doctor on the bundle of configs/axes.yaml, carried in build/axes (`flint-aot build configs/axes.yaml -o
  # build/axes`); its absence is a failure.
  axes=${AXES_BUNDLE:-build/axes}
  if [ -d "$axes" ]; then
    FLINT_AOT_BUNDLE=$axes timeout ${PYTEST_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider \
      -o faulthandler_timeout=90 ${AXES_ARGS:-tests/test_axes_gpu.py tests/test_fuzz_gpu.py} 2>&1 \
      | tee "$OUT/pytest_axes.log" | tail -${PYTEST_TAIL:-25} || fail pytest_axes
    python3 -m loader.doctor "$axes" 2>&1 | tee "$OUT/doctor_axes.log" | tail -3 || fail doctor_axes
  else
    echo "$axes: missing" && fail axes_bundle_missing
  fi
fi
if [ "${WHEEL_CHECK:-1}" = 1 ]; then
  # The serving wheel as a serving image gets it: packed from build/flint, installed with --no-deps into a
  # plain venv that sees only this machine's torch and cuda-bindings (their site directories through a .pth
  # file, after the venv's own: no network needed), run outside the checkout with no PYTHONPATH:
  # `python -m loader.doctor` must pass every variant.
  w=$(mktemp -d)
  if python3 -m flint_aot.cli pack build/flint -o "$w/dist" >/dev/null && python3 -m venv "$w/venv" \
     && "$w/venv/bin/python" -m pip install -q --no-deps --no-index "$w"/dist/*.whl; then
    python3 -c "import os, torch, cuda.bindings as c; d = os.path.dirname
print('\n'.join(sorted({d(d(torch.__file__)), d(d(d(c.__file__)))})))" \
      > "$("$w/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/device_torch.pth"
    (cd "$w" && env -u PYTHONPATH "$w/venv/bin/python" -c \
       "import loader; assert loader.__file__.startswith('$w/venv'), loader.__file__; print('wheel:', loader.__file__)" \
     && env -u PYTHONPATH "$w/venv/bin/python" -m loader.doctor) 2>&1 | tee "$OUT/wheel_doctor.log" | tail -4 \
     || fail wheel_doctor
  else
    echo "serving wheel: pack or install failed" | tee "$OUT/wheel_doctor.log"
    fail wheel_pack_or_install
  fi
  rm -rf "$w"
fi
if [ -d build/flint_plus ]; then  # your own kernel beside Flint's (examples/custom_kernel)
  python3 examples/custom_kernel/run.py --bundle build/flint_plus 2>&1 | tee "$OUT/custom_kernel.log" | tail -25 \
    || fail custom_kernel
fi
for b in ${BENCH:-}; do python3 "$b" 2>&1 | tee -a "$OUT/bench.log"; done
if [ -n "$failed" ]; then
  echo "gpu_check: FAILED:$failed" >&2
  exit 1
fi
