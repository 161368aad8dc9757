"""The examples run as users run them: a subprocess with an embedded Ray of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_kafka_python_style_program_runs_on_logbus(tmp_path):
    env = dict(os.environ, RAY_ENABLE_AUTO_CONNECT="0", PYTHONPATH=str(REPO_ROOT))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "kafka_python_style.py"), "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=360, cwd=str(tmp_path), env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^sent 300 orders; the first went to orders-\d at offset 0$", done.stdout, re.M), done.stdout
    billed = re.search(r"^billed (\d+) orders, total (\d+); partition 0 committed up to offset (\d+)$", done.stdout, re.M)
    assert billed, done.stdout
    assert int(billed.group(1)) == 300
    assert int(billed.group(2)) == sum(i % 50 for i in range(300))  # every order once, values deserialized
    assert int(billed.group(3)) >= 1  # commits with OffsetAndMetadata reached the group
