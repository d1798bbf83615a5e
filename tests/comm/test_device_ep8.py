"""scripts/device_ep8.sh --dry-run, on any machine (CI): the first 8-GPU run parses, lists its steps
with their time bounds, finds every file it needs, and each device call's steps fit its budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_device_ep8_dry_run_passes():
    env = dict(os.environ, PYTHON=sys.executable)
    result = subprocess.run(["bash", "scripts/device_ep8.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for step in ("build", "ep_bitwise", "ep_failures", "nvlink", "layer", "throughput"):
        assert f"  {step} " in out, out
    assert "dry run: ok" in out, out


def test_device_ep8_dry_run_names_a_missing_file():
    sys.path.insert(0, str(REPO / "scripts"))
    import device_ep8

    missing = device_ep8.Step("probe", 1, 10, ("true",), ("scripts/no_such_script.py",))
    assert device_ep8.dry_run([missing], budget_s=60) == 1
