"""tools/smollm2_claim.py end to end with the tiny model standing in for SmolLM2: GRPO and DPPO, one
seed each, two at a time, 2 steps over an 8-prompt train set (so step 2 draws step 1's prompts again
and DPPO's history prunes); then the same command again skips both runs (~45 s on an idle 2-core
machine). The report's logic and the resume states: tests/unit/test_smollm2_claim.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_claim_script_runs_both_methods_then_skips_them(tmp_path):
    cmd = [sys.executable, str(REPO / "tools" / "smollm2_claim.py"), "--config", "examples/tiny/addition.yaml"]
    cmd += ["--steps", "2", "--visits", "2", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16"]
    cmd += ["--seeds", "1", "--parallel", "2", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "data.train_size=8, each prompt drawn 2.0 times" in res.stdout
    assert "fresh grpo-s0" in res.stdout and "fresh dppo-0.5-0.5-s0" in res.stdout

    result = json.loads((tmp_path / "claim.json").read_text())
    runs = {r["run"]: r for r in result["runs"]}
    assert set(runs) == {"grpo-s0", "dppo-0.5-0.5-s0"} and all(r["finished"] for r in runs.values())
    for r in runs.values():  # held-out avg@4 before training and after each step, with its CPU seconds
        assert [p["step"] for p in r["curve"]] == [0, 1, 2]
        assert r["cpu_sampled_steps"] >= 1 and r["train_cpu_s"] > 0
        assert all(p["cpu_s"] is not None for p in r["curve"])
    with open(tmp_path / "dppo-0.5-0.5-s0" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["eval/accuracy"] == r["val/eval/all/avg@4"] for r in rows] == [True] * 3
    assert runs["dppo-0.5-0.5-s0"]["steps_with_pruning"] == 1  # step 2: its prompts came back
    assert runs["grpo-s0"]["steps_with_pruning"] == 0
    assert result["claim"]["dppo_runs_without_pruning"] == []
    assert result["settings"]["environment"]["packages"]["torch"] and result["settings"]["command"]
    assert result["claim_row"].startswith("| DPPO (0.5, 0.5) reaches GRPO's final accuracy")
    assert (tmp_path / "claim.png").stat().st_size > 0

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 run(s) done, 0 to run" in again.stdout and "fresh " not in again.stdout
