"""tools/gradient_cosine.py: the pair bookkeeping on hand-made vectors, and a --quick run's output
(the format, cosines in [-1, 1], and a completion's gradient recomputed from scratch at cosine 1)."""

import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import gradient_cosine  # noqa: E402


def test_pairs_by_class_and_the_bppo_pair():
    e1, e2 = torch.tensor([1.0, 0, 0]), torch.tensor([0, 1.0, 0])
    grads = [e1, 2 * e1, -e1, e2, e2]  # correct, correct, wrong, wrong, wrong (a copy of the last)
    rewards = [True, True, False, False, False]
    completions = [[1] * 5, [2] * 3, [3] * 7, [4] * 7, [4] * 7]
    out = gradient_cosine.group_cosines(grads, rewards, completions)
    assert out["correct-correct"] == pytest.approx([1.0]) and out["correct-correct, distinct"] == pytest.approx([1.0])
    assert sorted(out["incorrect-incorrect"]) == pytest.approx([0.0, 0.0, 1.0])
    assert sorted(out["incorrect-incorrect, distinct"]) == pytest.approx([0.0, 0.0])  # the two copies are left out
    assert sorted(out["correct-incorrect"]) == pytest.approx([-1, -1, 0, 0, 0, 0])
    assert len(out["same class"]) == 4
    # BPPO's pair: shortest correct (index 1) and shortest incorrect (7, 7, 7: lowest index, 2).
    assert out["BPPO pair"] == pytest.approx([-1.0])
    mean, se = gradient_cosine.mean_and_se([0.2, 0.4, 0.9])
    assert mean == pytest.approx(0.5) and se == pytest.approx(math.sqrt(((0.3**2 + 0.1**2 + 0.4**2) / 2) / 3))
    assert math.isnan(gradient_cosine.mean_and_se([0.3])[1])


def test_quick_run_prints_every_row_and_passes_the_self_check():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/gradient_cosine.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("gradient cosine: ") and "4 prompts x G=4" in lines[0]
    for name in gradient_cosine.ROWS:
        row = next(line for line in lines if line.startswith(name))
        mean, se = row[len(name) :].split()[2:]
        assert mean == "n/a" or -1 - 1e-9 <= float(mean) <= 1 + 1e-9
        assert se == "n/a" or float(se) >= 0
    assert re.search(r"^self-cosine check: 1\.000000$", proc.stdout, re.M)
    assert proc.stderr.strip() == ""  # no library chatter on the user's screen
