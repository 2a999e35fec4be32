"""tools/compare_methods.py --quick trains a subset end to end (5 subprocesses, 2 at a time: ~1.5 min
on an idle 2-core machine, several times that when other jobs share it), the report and its rerun."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shared_helpers import load_tool

REPO = Path(__file__).resolve().parents[2]
CONFIG = "examples/tiny/addition.yaml"
cm = load_tool("compare_methods")
QUICK_SUBSET = ["grpo", "dppo-0.5-0.5-padded", "cppo-0.5", "greso-0.5", "dapo-dppo-0.5-0.5"]


@pytest.mark.slow
def test_quick_pipeline_end_to_end(tmp_path):
    """--quick on one run per code path, 2 at a time; then the same command reuses every run."""
    cmd = [
        sys.executable,
        str(REPO / "tools" / "compare_methods.py"),
        "--config",
        CONFIG,
        "--quick",
        "--seeds",
        "1",
        "--methods",
        ",".join(QUICK_SUBSET),
        "--parallel",
        "2",
        "--out-dir",
        str(tmp_path),
    ]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    print(f"--quick with {len(QUICK_SUBSET)} methods took {time.time() - t0:.0f}s")
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(QUICK_SUBSET) and not result["partial"]

    # The speedup is GRPO's train time from THIS comparison's own metrics over the method's.
    def train_time(name):
        with open(tmp_path / f"{name}-s0" / "metrics.jsonl") as f:
            return sum(r.get("time/step", 0.0) for r in map(json.loads, f))

    for name, r in rows.items():
        assert r["train_time_s"] == pytest.approx(train_time(name))
        assert r["speedup"] == pytest.approx(train_time("grpo") / train_time(name))
        assert r["tokens_generated"] > 0 and 0 <= r["acc_final"] <= 1 and r["acc_initial"] is not None
    assert rows["grpo"]["speedup"] == pytest.approx(1.0)
    # Each run records what besides the code sets its numbers: this interpreter's packages, the processor.
    import torch

    envs = [r["environment"] for r in result["runs"]]
    assert all(e == envs[0] for e in envs) and envs[0]["packages"]["torch"] == torch.__version__
    assert envs[0]["cpu"] and envs[0]["cpus"] == os.cpu_count()
    # Pruning fractions: the report's against the runs' own metrics. A method that draws one round a
    # step skips nothing at step 1 (no prompt has a history yet); refilling methods (GRESO, DAPO) may,
    # since their later rounds of step 1 revisit the first round's prompts of --quick's small set.
    for name, r in rows.items():
        with open(tmp_path / f"{name}-s0" / "metrics.jsonl") as f:
            steps = [row for row in map(json.loads, f) if "time/step" in row]
        kept = [row["prune/prompts_kept_frac"] for row in steps]
        assert r["prompts_kept_frac"] == pytest.approx(sum(kept) / len(kept)), name
        if name in ("grpo", "dppo-0.5-0.5-padded", "cppo-0.5"):
            assert kept[0] == 1.0, name
    # CPPO's allocation: B / (1 - P) = 16 prompts rolled out a step, every one of them.
    with open(tmp_path / "cppo-0.5-s0" / "metrics.jsonl") as f:
        cppo = [row for row in map(json.loads, f) if "time/step" in row]
    assert [row["rollout/prompts_drawn"] for row in cppo] == [16, 16]
    assert rows["cppo-0.5"]["prompts_kept_frac"] == 1.0 and 0 < rows["cppo-0.5"]["completions_kept_frac"] <= 0.5
    assert rows["dppo-0.5-0.5-padded"]["prompts_kept_frac"] < 1.0  # step 2 saw step 1's prompts, skipped some
    md = (tmp_path / "results.md").read_text()
    for m in QUICK_SUBSET:
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {cm.METHOD_BY_NAME[m]['label']} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert all(c not in ("", "-") for c in cells[:9]), line  # time, speedup, tokens, accuracy: numbers
    assert (tmp_path / "results.png").stat().st_size > 0
    assert not (tmp_path / "grpo-s0" / "checkpoints").exists()

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"reusing {len(QUICK_SUBSET)} finished run(s)" in again.stdout and "] start " not in again.stdout
