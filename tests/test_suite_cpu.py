"""The suite's own promises about where its tests run: what CI (a clean clone with `.[dev]` only) and the GPU
check (tools/gpu_check.sh) must not skip."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from tests.conftest import ROOT


def _outcomes(tmp_path, args, prelude=""):
    """Run pytest on args in a subprocess (after the Python statements of prelude); {test id: (outcome,
    message)} from its JUnit XML, outcome one of passed / skipped / failed / error."""
    xml = tmp_path / "report.xml"
    argv = [*args, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    code = f"{prelude}\nimport pytest, sys\nsys.exit(pytest.main({argv!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
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
    it): its torch-only cases pass, every other case is skipped naming what it needs."""
    got, r = _outcomes(
        tmp_path, ["tests/test_qwen3_example.py"], "import sys; sys.modules['transformers'] = None"
    )
    log = r.stdout[-3000:] + r.stderr[-3000:]
    torch_only = {n: o for n, o in got.items() if n.startswith("test_torch_op_")}
    assert len(torch_only) >= 4, (got, log)
    assert all(o == "passed" for o, _ in torch_only.values()), (torch_only, log)
    for name, (outcome, why) in got.items():
        if name not in torch_only:
            assert outcome == "skipped" and ("transformers" in why or "GPU" in why), (name, outcome, why)


def test_gpu_check_requires_the_debug_bundle(tmp_path):
    """tools/gpu_check.sh (the GPU machine's one call) runs pytest with FLINT_REQUIRE_DEBUG_BUNDLE=1, so that
    test_slow_producer fails rather than skips where build/debug is missing. Run here with stand-ins for
    nvidia-smi and python3 that only record what pytest would have been given."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'a GPU'\n")
    (stubs / "python3").write_text(
        '#!/bin/sh\ncase " $* " in *" pytest "*) '
        'echo "${FLINT_REQUIRE_DEBUG_BUNDLE-unset} $*" >> "$STUB_LOG";; esac\nexit 0\n'
    )
    for f in stubs.iterdir():
        f.chmod(0o755)
    log = tmp_path / "pytest_calls"
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "STUB_LOG": str(log), "WHEEL_CHECK": "0", "BENCH": ""}  # fmt: skip
    env.pop("FLINT_REQUIRE_DEBUG_BUNDLE", None)
    env.pop("PYTEST_ARGS", None)
    r = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 1, calls
    required, args = calls[0].split(" ", 1)
    assert required == "1" and args.split()[-1] == "tests", calls
