"""`megatron-dppo train` with dedicated rollout ranks (parallel.rollout_ranks=1: 1 training and 1
rollout process under torchrun), against the colocated 1-process run of the same config.

* trainer.max_staleness=0: the same run token for token (rollouts, rewards, held-out accuracy from
  the rollout rank's engine, losses): the rollout waits for each step's weights, as colocated.
* trainer.max_staleness=1: step t+1 rolls out while step t trains, so from step 2 on a step trains
  on completions sampled with the weights before the previous update. The rollout rows' log-probs
  are checked against transformers: those of the starting weights at step 2, not step 1's. A
  launcher killed mid-run leaves a checkpoint that holds the step in flight; the resumed run
  repeats the uninterrupted one exactly.
* A rollout rank that stalls or dies ends the job, and no process outlives it; a killed one is
  named by the trainer, with the checkpoint --resume would continue from.
* A start-up failure of the training rank (a damaged pending_rollout.json on --resume) ends the
  job within seconds with its error, at the default timeouts: it used to wait for the rollout
  rank's start-up watchdog (600 s on CPU), the two blocked in the bridge.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
from conftest import run_cli
from trainer_runs import (
    TINY,
    assert_same_rollouts,
    kill_launcher_alone,
    metrics,
    rel_close,
    rollouts,
    run,
    run_env,
    start_logged,
    train_cmd,
    wait_for_first_row,
)

pytestmark = pytest.mark.slow  # training runs in subprocesses: minutes in all

MODEL = TINY / "model"
DEDICATED = ["parallel.rollout_ranks=1"]
STALE = [*DEDICATED, "trainer.max_staleness=1", "algorithm.rollout_correction=tis"]


def _compare(ref: dict, got: dict, steps, exact=True):
    keys = ("train/loss", "train/grad_norm", "reward/mean", "tokens/trained", "prune/prompts_kept_frac")
    for s in steps:
        for key in keys:
            assert rel_close(got[s][key], ref[s][key], rel=1e-6 if exact else 1e-5), (s, key, got[s][key], ref[s][key])


def test_staleness_0_equals_the_colocated_run(tmp_path):
    """Every step's completions token for token, rewards, losses and the held-out accuracy (eval
    on the rollout rank) as the colocated run's; the start line names both kinds of rank."""
    evals = ["trainer.eval_every=2", "trainer.eval_size=16"]
    run(train_cmd(tmp_path, "colocated", MODEL, 1, *evals))
    res = run(train_cmd(tmp_path, "dedicated", MODEL, 2, *evals, *DEDICATED))
    assert "1 training + 1 rollout process(es), trainer.max_staleness=0" in res.stdout + res.stderr
    ref, got = metrics(tmp_path / "colocated"), metrics(tmp_path / "dedicated")
    assert sorted(got) == sorted(ref) == [0, 1, 2]
    for step in (1, 2):
        assert_same_rollouts(rollouts(tmp_path / "dedicated", step), rollouts(tmp_path / "colocated", step))
        assert got[step]["rollout/policy_lag_max"] == 0
    _compare(ref, got, (1, 2))
    assert got[0]["eval/accuracy"] == ref[0]["eval/accuracy"] and got[2]["eval/accuracy"] == ref[2]["eval/accuracy"]
    assert (tmp_path / "dedicated" / "val" / "step_000002.jsonl").exists()


def _hf_logprob_sums(model_dir, rows):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dppo.rollout.vllm_engine import hf_completion_logprobs

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    assert [tok.decode(p, skip_special_tokens=False) for p in prompts] == [r["prompt"] for r in rows]
    return [float(lp.sum()) for lp in hf_completion_logprobs(model, prompts, [r["completion_ids"] for r in rows])]


def _job(proc) -> list:
    return [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)


def test_staleness_1_trains_one_update_behind_and_a_killed_launcher_resumes_exactly(tmp_path):
    """Uninterrupted run: step 1 trains on fresh completions, steps 2-4 on completions one update
    behind (rollout/policy_lag_max); step 2's completions have the starting weights' log-probs
    (transformers on examples/tiny/model) and not those of step 1's update (its HF export).
    Killed run: SIGKILL reaches torchrun alone after step 1; each rank gets SIGTERM, the trainer
    finishes its step (with the next step's rollout), saves, stops the rollout rank; nothing is
    left running. --resume then repeats the uninterrupted run's later steps exactly."""
    steps = ["trainer.max_steps=4", "trainer.save_hf_every=1"]
    run(train_cmd(tmp_path, "stale", MODEL, 2, *STALE, *steps))
    ref = metrics(tmp_path / "stale")
    assert [ref[s]["rollout/policy_lag_max"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert ref[2]["train/rollout_kl_k3"] > 1e3 * ref[1]["train/rollout_kl_k3"]  # off-policy from step 2 on

    rows1, rows2 = rollouts(tmp_path / "stale", 1), rollouts(tmp_path / "stale", 2)
    start1 = _hf_logprob_sums(MODEL, rows1)
    assert all(abs(a - r["rollout_logprob_sum"]) < 1e-4 for a, r in zip(start1, rows1))  # the check's reference
    start2 = _hf_logprob_sums(MODEL, rows2)
    after1 = _hf_logprob_sums(tmp_path / "stale" / "hf" / "step_000001", rows2)
    assert all(abs(a - r["rollout_logprob_sum"]) < 1e-4 for a, r in zip(start2, rows2))
    assert max(abs(a - r["rollout_logprob_sum"]) for a, r in zip(after1, rows2)) > 1e-3

    log = tmp_path / "killed.log"
    proc = start_logged(train_cmd(tmp_path, "killed", MODEL, 2, *STALE, *steps, "trainer.save_every=0"), log)
    wait_for_first_row(tmp_path / "killed", proc)
    alive = kill_launcher_alone(proc, psutil.Process(proc.pid).children(recursive=True))
    screen = log.read_text()[-4000:]
    assert not alive, f"{len(alive)} process(es) of the run outlived its launcher\n{screen}"
    latest = (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip()
    saved = int(latest.split("_")[1])
    assert 1 <= saved < 4, screen
    assert (tmp_path / "killed" / "checkpoints" / latest / "pending_rollout.json").exists()
    assert "serving until the trainer stops" in screen and "stopping after step" in screen, screen
    run(train_cmd(tmp_path, "killed", MODEL, 2, *STALE, *steps, "trainer.save_every=0", resume=True))
    got = metrics(tmp_path / "killed")
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert_same_rollouts(rollouts(tmp_path / "killed", step), rollouts(tmp_path / "stale", step))
        assert got[step]["rollout/policy_lag_max"] == ref[step]["rollout/policy_lag_max"]
    _compare(ref, got, range(1, 5))


@pytest.mark.parametrize("fault", ["stalled", "killed"])
def test_a_rollout_rank_that_stalls_or_dies_ends_the_job(tmp_path, fault):
    """The rollout rank is frozen (SIGSTOP: the trainer's stall watchdog names the wait and ends
    the job) or killed (SIGKILL: torchrun ends the job) after step 1: the job exits non-zero
    within a minute or two and no process of it is left."""
    over = ["trainer.max_steps=200", "trainer.save_every_minutes=0"]
    if fault == "stalled":
        over += ["trainer.save_every=0", "trainer.stall_timeout_s=10"]  # start-up has its own start_timeout_s
    else:
        over.append("trainer.save_every=1")  # the trainer's line names the last checkpoint
    log = tmp_path / "run.log"
    proc = start_logged(train_cmd(tmp_path, fault, MODEL, 2, *STALE, *over), log)
    try:
        wait_for_first_row(tmp_path / fault, proc)
        job = _job(proc)
        (rollout_rank,) = [p for p in job if _launcher_rank(p) == 1]
        rollout_rank.send_signal(signal.SIGSTOP if fault == "stalled" else signal.SIGKILL)
        code = proc.wait(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    gone, alive = psutil.wait_procs([p for p in job if p.pid != proc.pid], timeout=60)
    screen = log.read_text()[-4000:]
    assert code != 0 and not alive, screen
    if fault == "stalled":
        # the training rank is waiting on the bridge to the frozen rollout rank: for its rollout
        # (phase rollout_wait) or, when the signal lands between steps, to hand it the next wave
        # request (phase prompts, a broadcast); which one is timing
        assert re.search(r"stall watchdog: rank 0 made no progress .* at bridge\.py:\d+ ", screen), screen
    else:
        # was gloo's "Connection closed by peer ... GLHF!", or nothing at all: torchrun's SIGTERM (sent
        # when the rollout rank ended) killed the trainer before its error was shown
        gone = re.search(
            r"error: rank 1 \(rollout rank 0\) went away during step (\d+) \(killed, or it failed: see its output\): "
            r"no checkpoint saved for step \1; the last is step (\d+), \S+ \(--resume continues from it\)",
            screen,
        )
        assert gone and int(gone[2]) == int(gone[1]) - 1, screen  # every step before it was saved


def _launcher_rank(p: psutil.Process):
    try:
        env = p.environ()
    except psutil.Error:
        return None
    return int(env["RANK"]) if "RANK" in env and "megatron_dppo.cli" in " ".join(p.cmdline()) else None


@pytest.fixture(scope="module")
def stale_checkpoint(tmp_path_factory):
    """A 2-step run at trainer.max_staleness=1 whose step 1 checkpoint holds step 2's rollout
    (pending_rollout.json): the run dir, its `latest` naming step 1."""
    out = tmp_path_factory.mktemp("stale-checkpoint")
    run(train_cmd(out, "saved", MODEL, 2, *STALE, "trainer.save_every=1"))
    ckpt = out / "saved" / "checkpoints"
    assert (ckpt / "step_000001" / "pending_rollout.json").exists()
    (ckpt / "latest").write_text("step_000001\n")
    return out / "saved"


def _damage(pending, how: str) -> str:
    """-> what the error must say about the file."""
    if how == "missing":
        pending.unlink()
        return "is missing (the next step's rollout, saved at trainer.max_staleness=1): the checkpoint's manifest"
    raw = pending.read_bytes()
    if how == "truncated":
        pending.write_bytes(raw[:1000])
        return f"is 1000 bytes, but {len(raw)} were written (the next step's rollout"
    pending.write_bytes(raw[:4997] + b"#garb#" + raw[5003:])  # the size the manifest says
    return "is not valid JSON (Expecting "  # json's words: which, and where, depends on the bytes replaced


@pytest.mark.parametrize("how", ["truncated", "missing", "garbled"])
def test_a_damaged_pending_rollout_ends_the_resumed_job_in_seconds(stale_checkpoint, tmp_path, how):
    """--resume from a checkpoint whose pending_rollout.json is damaged: the training rank's start-up
    check fails while the rollout rank starts its engine. The default timeouts (start_timeout_s 600 s
    on CPU): truncated or missing, the job waited for the rollout rank's start-up watchdog, the
    training rank blocked saying stop to a rollout rank still sending its start-up report; garbled,
    it failed after the model loaded with json's words and no file named."""
    run_dir = tmp_path / "saved"
    shutil.copytree(stale_checkpoint, run_dir)
    pending = run_dir / "checkpoints" / "step_000001" / "pending_rollout.json"
    said = _damage(pending, how)
    t0 = time.monotonic()
    try:
        res = run_cli(train_cmd(tmp_path, "saved", MODEL, 2, *STALE, resume=True), run_env(), timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after 60 s:\n{(e.stderr or '')[-3000:]}")
    took = time.monotonic() - t0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 1 and errors, res.stderr[-3000:]
    assert errors[0].startswith(f"error: {pending} {said}"), errors
    assert how != "garbled" or "): the file is damaged (the next step's rollout" in errors[0], errors
    assert took < 60, took
