"""The profiling tools run end to end on the CPU: tools/profile_throughput.py (GRPO against DPPO);
tools/device_bench.py's bench section (what --tiny runs alone) in tests/e2e/test_device_bench.py's
--smoke run; the formulas themselves: tests/unit/test_profiling.py."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, timeout):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def test_profile_throughput_tiny_grpo_vs_dppo(tmp_path):
    out = tmp_path / "prof"
    res = _run(
        [
            sys.executable,
            str(REPO / "tools" / "profile_throughput.py"),
            "--config",
            str(REPO / "examples" / "tiny" / "addition.yaml"),
            "--steps",
            "2",
            "--warmup",
            "0",
            "--peak-tflops",
            "0.05",
            "--out",
            str(out),
            "--trace",
            str(out / "trace"),
            "--trace-steps",
            "1",
            "trainer.prompts_per_step=8",
            "rollout.group_size=4",
            "data.train_size=8",
            "trainer.threads=1",
        ],
        timeout=600,
    )
    r = json.loads((out / "profile.json").read_text())
    assert (out / "profile.png").stat().st_size > 0
    assert sorted(r["methods"]) == ["dppo", "grpo"] and r["peak_flops"] == 0.05e12
    for name, m in r["methods"].items():
        assert m["steps"] == 2 and len(r["per_step"][name]) == 3  # + the traced step
        ph = m["phases_s"]
        assert ph["step"] >= ph["rollout"] + ph["train"] > 0
        assert m["model_flops_per_step"]["train"] > 0 and m["model_flops_per_step"]["rollout"] > 0
        assert 0 < m["mfu"]["train"] < 1 and m["tokens_per_s_per_gpu"]["train"] > 0
        assert 0 < m["pack_density"] <= 1
        assert (out / "trace" / f"{name}-rank0.json").stat().st_size > 0
    grpo, dppo = r["methods"]["grpo"], r["methods"]["dppo"]
    assert grpo["completions_pruned_frac"] == 0 and grpo["prompts_kept_frac"] == 1
    assert dppo["completions_pruned_frac"] > 0
    # every prompt comes back from step 2 on (train_size = prompts_per_step): DPPO prunes prompts then
    assert min(s["prune/prompts_kept_frac"] for s in r["per_step"]["dppo"][1:]) < 1
    # The speedups from the per-step records (warm-up 0, the traced step left out), independently.
    measured = {n: [s["time/step"] for s in r["per_step"][n] if not s["traced"]] for n in ("grpo", "dppo")}
    assert len(measured["grpo"]) == len(measured["dppo"]) == 2
    mean = {n: sum(t) / len(t) for n, t in measured.items()}
    assert r["speedup"] == pytest.approx(mean["grpo"] / mean["dppo"])
    assert r["speedup_median"] == pytest.approx(
        statistics.median(measured["grpo"]) / statistics.median(measured["dppo"])
    )
    pairs = [a / b for a, b in zip(measured["grpo"], measured["dppo"])]
    assert r["speedup_paired_median"] == pytest.approx(statistics.median(pairs))
    assert f"GRPO/DPPO step time: {r['speedup']:.2f}x mean" in res.stdout
