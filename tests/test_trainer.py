"""The whole step end to end: weight sync, pruning before rollout, resume after a kill,
a hanging verifier, and the tiny run's accuracy rising. Each run is a subprocess (the
Megatron CPU shim and vLLM change process-wide state)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny" / "addition.yaml"
SMALL = ["trainer.prompts_per_step=8", "rollout.group_size=4", "data.train_size=16", "trainer.eval_every=0",
         "logging.wandb=disabled", "logging.progress=false", "logging.tensorboard=false", "trainer.threads=1",
         "trainer.max_time_s=0"]  # step budgets, not wall-clock ones: a loaded machine must not cut runs short


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))


def train_cmd(tmp_path, name, *overrides, resume=False):
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "train", "--config", str(CONFIG),
           f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", *SMALL, *overrides]
    return cmd + (["--resume"] if resume else [])


def run(cmd, timeout=600):
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def metrics(tmp_path, name):
    with open(tmp_path / name / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


def test_vllm_logprobs_equal_megatron_after_weight_sync():
    res = run([sys.executable, str(REPO / "tests" / "dist_train" / "sync_check.py")])
    result = json.loads(res.stdout.split("RESULT ")[1].splitlines()[0])
    assert result["initial"] < 1e-4, result
    assert result["before_sync"] > 1e-2, result  # the check can fail: stale engine weights are seen
    assert result["after_sync"] < 1e-4, result


def test_killed_run_resumes_and_prompt_pruning_removes_generation(tmp_path):
    # Two mini-batches (optimizer steps) per rollout batch: exercises the old-log-prob pass too.
    base = ["trainer.max_steps=6", "trainer.save_every=2", "pruning.r_q=0.5", "pruning.r_o=0.5",
            "trainer.minibatches_per_step=2"]
    run(train_cmd(tmp_path, "full", *base))
    full = metrics(tmp_path, "full")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert max(full[s]["train/optimizer_steps"] for s in full) == 2
    assert any(full[s]["time/logprob"] > 0 for s in full)
    for key in ("step", "reward/mean", "reward/accuracy", "prune/prompts_kept_frac",
                "prune/completions_kept_frac", "pack/density", "time/rollout", "time/logprob", "time/train",
                "time/sync", "time/step", "tokens/generated", "tokens/trained"):
        assert key in full[6], key

    # Kill the same run as soon as its step-2 checkpoint exists, then resume.
    proc = subprocess.Popen(train_cmd(tmp_path, "killed", *base), cwd=REPO, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = int(latest.read_text().strip().split("_")[1])
    assert saved in (2, 4), saved
    run(train_cmd(tmp_path, "killed", *base, resume=True))
    resumed = metrics(tmp_path, "killed")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(saved + 1, 7):  # the continued steps repeat the uninterrupted run exactly
        for key in ("reward/mean", "train/loss", "train/grad_norm", "tokens/generated", "prune/prompts_kept_frac"):
            assert resumed[step][key] == full[step][key], (step, key, resumed[step][key], full[step][key])

    # Prompt pruning: 16 prompts, 8 per step, so from step 3 on every prompt has a history.
    run(train_cmd(tmp_path, "grpo", "trainer.max_steps=6", "pruning.r_q=0.0", "pruning.r_o=0.5"))
    grpo = metrics(tmp_path, "grpo")
    assert all(grpo[s]["prune/prompts_kept_frac"] == 1.0 for s in grpo)
    assert full[1]["prune/prompts_kept_frac"] == 1.0  # no history yet: nothing is a candidate
    late = range(3, 7)
    kept = sum(full[s]["prune/prompts_kept_frac"] for s in late) / len(late)
    assert kept < 0.9, kept
    gen_ratio = sum(full[s]["tokens/generated"] for s in late) / sum(grpo[s]["tokens/generated"] for s in late)
    assert abs(gen_ratio - kept) < 0.15, (gen_ratio, kept)


def test_hanging_verifier_times_out_without_stalling(tmp_path):
    t0 = time.time()
    run(train_cmd(tmp_path, "hang", "trainer.max_steps=2", "reward.kind=reward_fixtures:hang_on_leading_one",
                  "reward.timeout_s=0.5", "reward.num_workers=2"))
    m = metrics(tmp_path, "hang")
    assert sum(m[s]["reward/timeouts"] for s in m) > 0
    assert time.time() - t0 < 240


def test_dapo_dynamic_sampling_refills_with_informative_groups(tmp_path):
    run(train_cmd(tmp_path, "dapo", "trainer.max_steps=2", "algorithm.dynamic_sampling=true",
                  "algorithm.clip_high=0.28", "data.train_size=64"))
    m = metrics(tmp_path, "dapo")
    for s in (1, 2):
        assert m[s]["groups/zero_variance_frac"] == 0.0  # every kept group is informative
        assert m[s]["prune/prompts_kept_frac"] == 1.0


def test_tiny_run_accuracy_rises(tmp_path):
    """The main job's config with a small budget: held-out greedy accuracy clearly rises."""
    run(train_cmd(tmp_path, "rise", "trainer.max_steps=80", "trainer.eval_every=80", "trainer.eval_size=300",
                  "trainer.prompts_per_step=32", "rollout.group_size=8", "data.train_size=1024",
                  "trainer.threads=2"), timeout=900)
    m = metrics(tmp_path, "rise")
    before, after = m[0]["eval/accuracy"], m[80]["eval/accuracy"]
    assert after > before + 0.03, (before, after)


@pytest.mark.parametrize("override,message", [
    ("parallel.tp=3", "world size 1 is not a multiple of tp\\*pp"),
    ("trainer.max_tokens_per_microbatch=16", "trainer.max_tokens_per_microbatch \\(16\\) is below rollout.max_model_len"),
    ("pruning.r_o=1.0", "pruning.r_o"),
    ("trainer.prompt_per_step=3", "unknown config key 'trainer.prompt_per_step'"),
])
def test_bad_config_or_layout_fails_at_start_up_naming_what_to_change(tmp_path, override, message):
    res = subprocess.run(train_cmd(tmp_path, "bad", override), cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0
    import re
    assert re.search(message, res.stderr), res.stderr[-2000:]
