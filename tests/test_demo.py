"""The README's main job: ``python -m softorder`` runs end to end on the real digits data."""

import subprocess
import sys

from softorder.__main__ import main


def test_demo_runs_quick(capsys):
    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "soft_topk(logits, k=3" in out
    assert "max |soft_rank - rankdata| = 0.00e+00" in out  # exact at the smallest alpha
    assert "1e+05" in out and "1e+06" not in out


def test_demo_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "softorder", "--quick"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Done in" in result.stdout
