"""The suite's own promises about where its tests run: what CI (a clean clone with `.[dev]` only) and the GPU
check (tools/gpu_check.sh) must not skip."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.conftest import ROOT


def _outcomes(tmp_path, args, prelude="", env=None):
    """Run pytest on args in a subprocess (after the Python statements of prelude, with the variables of env
    set, or unset where their value is None); {test id: (outcome, message)} from its JUnit XML, outcome one
    of passed / skipped / failed / error."""
    xml = tmp_path / "report.xml"
    argv = [*args, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    code = f"{prelude}\nimport pytest, sys\nsys.exit(pytest.main({argv!r}))"
    full = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}.items() if v is not None}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=full)  # fmt: skip
    assert xml.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name")
        child = next((c for c in case if c.tag in ("skipped", "failure", "error")), None)
        if child is None:
            out[name] = ("passed", "")
        else:
            outcome = {"skipped": "skipped", "failure": "failed", "error": "error"}[child.tag]
            out[name] = (outcome, child.get("message") or "")
    return out, r


def test_qwen3_example_torch_cases_run_without_transformers(tmp_path):
    """tests/test_qwen3_example.py without `transformers` (hidden from the subprocess, as CI does not install
    it, and not required, as CI does not require it even where gpu_check.sh runs this test): its torch-only
    cases pass, every other case is skipped naming what it needs."""
    hide = "import sys; sys.modules['transformers'] = None"
    got, r = _outcomes(tmp_path, ["tests/test_qwen3_example.py"], hide, {"FLINT_REQUIRE_TRANSFORMERS": None})
    log = r.stdout[-3000:] + r.stderr[-3000:]
    torch_only = {n: o for n, o in got.items() if n.startswith("test_torch_op_")}
    assert len(torch_only) >= 4, (got, log)
    assert all(o == "passed" for o, _ in torch_only.values()), (torch_only, log)
    for name, (outcome, why) in got.items():
        if name not in torch_only:
            assert outcome == "skipped" and ("transformers" in why or "GPU" in why), (name, outcome, why)


# tools/gpu_check.sh run here with stand-ins for nvidia-smi and python3: the python3 stub records every call
# (STUB_CALLS) and, for pytest, the two FLINT_REQUIRE_* variables it saw and its arguments (STUB_LOG), and
# the FLINT_AOT_BUNDLE it saw (STUB_BUNDLES); it exits with STUB_RC_<STEP> for the steps verify, pytest,
# pack, doctor and custom (default 0). `-m venv DIR` makes DIR/bin/python a copy of the stub (the wheel
# check's venv); `-c` prints STUB_SITE (its site dir).
_PYTHON_STUB = """#!/bin/sh
echo "$*" >> "$STUB_CALLS"
case " $* " in
  *" flint_aot.cli verify "*) exit "${STUB_RC_VERIFY:-0}";;
  *" pytest "*)
    echo "${FLINT_REQUIRE_DEBUG_BUNDLE-unset} ${FLINT_REQUIRE_TRANSFORMERS-unset} $*" >> "$STUB_LOG"
    echo "${FLINT_AOT_BUNDLE-unset}" >> "$STUB_BUNDLES"
    exit "${STUB_RC_PYTEST:-0}";;
  *" flint_aot.cli pack "*) exit "${STUB_RC_PACK:-0}";;
  *" loader.doctor "*) exit "${STUB_RC_DOCTOR:-0}";;
  *" custom_kernel/run.py "*) exit "${STUB_RC_CUSTOM:-0}";;
  *" -m venv "*) mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0;;
  *" -c "*) echo "$STUB_SITE"; exit 0;;
esac
exit 0
"""


def _gpu_check(tmp_path, **env):
    """Run tools/gpu_check.sh with the stubs (env: extra variables, None: unset; the axes check is off unless
    asked for); (result, pytest calls, all calls)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'a GPU'\n")
    (stubs / "python3").write_text(_PYTHON_STUB)
    for f in stubs.iterdir():
        f.chmod(0o755)
    log, calls, site = tmp_path / "pytest_calls", tmp_path / "calls", tmp_path / "site"
    site.mkdir(exist_ok=True)
    for f in (log, calls, tmp_path / "bundles"):
        f.write_text("")
    full = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
            "STUB_LOG": str(log), "STUB_CALLS": str(calls), "STUB_SITE": str(site),
            "STUB_BUNDLES": str(tmp_path / "bundles"), "WHEEL_CHECK": "0", "AXES_CHECK": "0", "BENCH": "",
            **env}  # fmt: skip
    for name in ("FLINT_REQUIRE_DEBUG_BUNDLE", "FLINT_REQUIRE_TRANSFORMERS", "PYTEST_ARGS", "AXES_BUNDLE",
                 "AXES_ARGS", "FLINT_AOT_BUNDLE"):  # fmt: skip
        if name not in env:
            full.pop(name, None)
    full = {k: v for k, v in full.items() if v is not None}
    r = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    return r, log.read_text().splitlines(), calls.read_text().splitlines()


def test_qwen3_example_cases_fail_without_transformers_where_it_is_required(tmp_path):
    """With FLINT_REQUIRE_TRANSFORMERS=1 (what tools/gpu_check.sh sets on the GPU machine) and transformers
    missing, the example's model-building cases fail naming it instead of skipping (the GPU case at M = 64
    would otherwise skip unnoticed there); the torch-only cases still pass."""
    env = {"FLINT_REQUIRE_TRANSFORMERS": "1"}
    got, r = _outcomes(
        tmp_path, ["tests/test_qwen3_example.py"], "import sys; sys.modules['transformers'] = None", env
    )
    log = r.stdout[-3000:] + r.stderr[-3000:]
    needing = {n: o for n, o in got.items() if not n.startswith("test_torch_op_")}
    assert len(needing) >= 4, (got, log)
    for name, (outcome, why) in needing.items():
        if "GPU" in why:  # (no GPU here: skipped before the requirement is looked at)
            assert outcome == "skipped", (name, outcome, why)
        else:
            assert outcome in ("failed", "error") and "transformers" in why, (name, outcome, why)
    assert all(o == "passed" for n, (o, _) in got.items() if n.startswith("test_torch_op_")), (got, log)


def test_gpu_check_requires_the_debug_bundle(tmp_path):
    """tools/gpu_check.sh (the GPU machine's one call) runs pytest with FLINT_REQUIRE_DEBUG_BUNDLE=1, so that
    test_slow_producer fails rather than skips where build/debug is missing. Run here with stand-ins for
    nvidia-smi and python3 that only record what pytest would have been given."""
    r, calls, _ = _gpu_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(calls) == 1, calls
    required, _, args = calls[0].split(" ", 2)
    assert required == "1" and args.split()[-1] == "tests", calls


def test_gpu_check_requires_transformers(tmp_path):
    """... and with FLINT_REQUIRE_TRANSFORMERS=1: the Qwen3 example's GPU case (M = 64) fails there when
    transformers is missing, as the debug bundle's test does without build/debug."""
    r, calls, _ = _gpu_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [c.split(" ", 2)[1] for c in calls] == ["1"], calls


def test_gpu_check_runs_the_wheel_doctor_and_passes_when_everything_does(tmp_path):
    """With the wheel check on and every step succeeding: the wheel is packed, installed into a venv, its
    doctor run, the benchmarks run, and the script exits 0."""
    r, _, calls = _gpu_check(tmp_path, WHEEL_CHECK="1", BENCH="bench_a.py")
    assert r.returncode == 0, r.stdout + r.stderr
    ran = " | ".join(calls)
    for step in ("flint_aot.cli verify", "pytest", "flint_aot.cli pack", "-m venv", "-m loader.doctor",
                 "bench_a.py"):  # fmt: skip
        assert step in ran, (step, calls)


@pytest.mark.parametrize("failing, wheel", [("verify", "0"), ("pytest", "0"), ("pytest", "1"), ("pack", "1"),
                                            ("doctor", "1")])  # fmt: skip
def test_gpu_check_fails_when_a_check_fails(tmp_path, failing, wheel):
    """A failing step (the bundle's verification, the test suite, packing the wheel, the wheel's doctor)
    makes the script exit non-zero, naming it on its last line, after running the rest as before (the
    later steps and the benchmarks still run: one device call collects everything)."""
    fail = {f"STUB_RC_{failing.upper()}": "1"}
    r, _, calls = _gpu_check(tmp_path, WHEEL_CHECK=wheel, BENCH="bench_a.py", **fail)
    assert r.returncode != 0, (failing, r.stdout + r.stderr)
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert last.startswith("gpu_check: FAILED") and failing in last, last
    assert calls[-1] == "bench_a.py", calls  # the rest ran: the benchmarks come last
    assert any(" pytest " in f" {c} " for c in calls), calls


def test_gpu_check_runs_the_axes_bundle_and_fails_without_it(tmp_path):
    """The axes check (on by default): with the bundle of configs/axes.yaml (AXES_BUNDLE, default build/axes)
    present, a second pytest runs tests/test_axes_gpu.py and the fuzz against it (FLINT_AOT_BUNDLE set to it,
    the first run sees none) and its doctor runs on it; a failing doctor there is named doctor_axes. Without
    the bundle the script fails naming axes_bundle_missing, after running the rest."""
    axes = tmp_path / "axes"
    axes.mkdir()
    r, calls, ran = _gpu_check(tmp_path, AXES_CHECK=None, AXES_BUNDLE=str(axes))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(calls) == 2, calls
    assert calls[0].split()[-1] == "tests", calls
    assert calls[1].split()[-2:] == ["tests/test_axes_gpu.py", "tests/test_fuzz_gpu.py"], calls
    assert all(c.split()[:2] == ["1", "1"] for c in calls), calls  # both runs require what they need
    assert (tmp_path / "bundles").read_text().splitlines() == ["unset", str(axes)]
    assert f"-m loader.doctor {axes}" in ran, ran

    r, _, ran = _gpu_check(tmp_path, AXES_CHECK="1", AXES_BUNDLE=str(axes), STUB_RC_DOCTOR="1")
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 1 and last == "gpu_check: FAILED: doctor_axes", last

    r, calls, ran = _gpu_check(tmp_path, AXES_CHECK=None, AXES_BUNDLE=str(tmp_path / "none"),
                               BENCH="bench_a.py")  # fmt: skip
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 1 and last == "gpu_check: FAILED: axes_bundle_missing", last
    assert f"{tmp_path / 'none'}: missing" in r.stdout
    assert len(calls) == 1 and ran[-1] == "bench_a.py", (calls, ran)
