"""docs/python.md's example, run as written against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT


def test_the_guides_example_runs_as_written_and_prints_accuracy_per_round(server, tmp_path):
    guide = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")
    found = re.search(r"^```python example\n(.*?)^```", guide, re.S | re.M)
    assert found, "docs/python.md has no example block"
    script = tmp_path / "example.py"
    script.write_text(found.group(1), encoding="utf-8")
    env = {**os.environ, "CONFED_URL": server["url"], "CONFED_TOKEN": server["token"],
           "CONFED_TRUST": server["trust"], "CONFED_POPULATION": "python-guide-test"}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    print(run.stdout)
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2", "round 3"], lines
    accuracies = [float(re.search(r"accuracy ([0-9.]+)%", line).group(1)) for line in lines]
    assert all(0 <= a <= 100 for a in accuracies)
    assert all(" 10 devices," in line for line in lines), lines
    # The plot of accuracy per round.
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The progress bar went to stderr and reached the last round.
    assert "3/3" in run.stderr, run.stderr
