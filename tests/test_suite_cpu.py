"""The suite's own promises about where its tests run: what CI (a clean clone with `.[dev]` only) must not
skip."""

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
