"""`megatron-dppo train` with dedicated rollout ranks (parallel.rollout_ranks=1: 1 training and 1
rollout process under torchrun), against the colocated 1-process run of the same config.

* trainer.max_staleness=0: the same run token for token (rollouts, rewards, held-out accuracy from
  the rollout rank's engine, losses): the rollout waits for each step's weights, as colocated.
* trainer.max_staleness=1: step t+1 rolls out while step t trains, so from step 2 on a step trains
  on completions sampled with the weights before the previous update. A launcher killed mid-run
  leaves a checkpoint that holds the step in flight; the resumed run repeats the uninterrupted one
  exactly.
* Which weights sampled, at both staleness settings and every step from 2 on of a 5-step run: the
  rollout rows' log-probs are those of the weights the run's rollout/policy_lag_* says (transformers
  on the starting model or the run's HF export of that step), and not those of the versions either
  side (a rollout rank that lags a step more, or never reloads after start-up, fails here).
* A rollout rank that stalls or dies ends the job, and no process outlives it; a killed one is
  named by the trainer, with the checkpoint --resume would continue from.
* A start-up failure of the training rank (a damaged pending_rollout.json on --resume) ends the
  job within seconds with its error, at the default timeouts: it used to wait for the rollout
  rank's start-up watchdog (600 s on CPU), the two blocked in the bridge.
"""

import contextlib
import json
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
LONG = 5  # steps of the runs whose every step >= 2 is checked for the weights that sampled it


def _compare(ref: dict, got: dict, steps, exact=True):
    keys = ("train/loss", "train/grad_norm", "reward/mean", "tokens/trained", "prune/prompts_kept_frac")
    for s in steps:
        for key in keys:
            assert rel_close(got[s][key], ref[s][key], rel=1e-6 if exact else 1e-5), (s, key, got[s][key], ref[s][key])


def test_staleness_0_equals_the_colocated_run(tmp_path):
    """Every step's completions token for token, rewards, losses and the held-out accuracy (eval
    on the rollout rank) as the colocated run's; the start line names both kinds of rank. Each
    step s >= 2 was sampled by step s-1's weights (lag 0), as its log-probs show."""
    evals = ["trainer.eval_every=2", "trainer.eval_size=16", f"trainer.max_steps={LONG}"]
    run(train_cmd(tmp_path, "colocated", MODEL, 1, *evals))
    res = run(train_cmd(tmp_path, "dedicated", MODEL, 2, *evals, *DEDICATED, "trainer.save_hf_every=1"))
    assert "1 training + 1 rollout process(es), trainer.max_staleness=0" in res.stdout + res.stderr
    ref, got = metrics(tmp_path / "colocated"), metrics(tmp_path / "dedicated")
    assert sorted(got) == sorted(ref) == [0, *range(1, LONG + 1)]
    for step in range(1, LONG + 1):
        assert_same_rollouts(rollouts(tmp_path / "dedicated", step), rollouts(tmp_path / "colocated", step))
    assert [got[s]["rollout/policy_lag_max"] for s in range(1, LONG + 1)] == [0] * LONG
    _compare(ref, got, range(1, LONG + 1))
    assert all(got[s]["eval/accuracy"] == ref[s]["eval/accuracy"] for s in (0, 2, 4))
    assert (tmp_path / "dedicated" / "val" / "step_000002.jsonl").exists()
    _assert_each_step_sampled_by_the_weights_it_says(tmp_path / "dedicated", got)


def _hf_logprob_sums(model_dir, rows):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dppo.rollout.vllm_engine import hf_completion_logprobs

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    assert [tok.decode(p, skip_special_tokens=False) for p in prompts] == [r["prompt"] for r in rows]
    return [float(lp.sum()) for lp in hf_completion_logprobs(model, prompts, [r["completion_ids"] for r in rows])]


SAME, APART = 1e-4, 1e-3  # log-prob sums of the sampling weights agree within SAME; other versions' differ by > APART


def _weights_of(run_dir, version: int):
    """The HF model dir of the weights after step `version`'s update (0: the starting model)."""
    return MODEL if version == 0 else run_dir / "hf" / f"step_{version:06d}"


def _logprob_gap(run_dir, version: int, rows) -> float:
    """The largest |engine's log-prob sum - transformers' under `version`'s weights| over the rows."""
    sums = _hf_logprob_sums(_weights_of(run_dir, version), rows)
    return max(abs(a - r["rollout_logprob_sum"]) for a, r in zip(sums, rows))


def _assert_each_step_sampled_by_the_weights_it_says(run_dir, ref: dict) -> None:
    """Steps 2 to the last: the version the run says sampled step s (s - 1 - rollout/policy_lag_max,
    every completion at that lag) gives the engine's log-probs within SAME; the versions either side
    of it (those exported) are more than APART off: the negative control, which shows that the check
    tells one update from the next (a rollout rank one step behind, or never reloaded, fails)."""
    last = max(ref)
    for step in range(2, last + 1):
        lag = ref[step]["rollout/policy_lag_max"]
        assert ref[step]["rollout/policy_lag_mean"] == lag, (step, ref[step])  # one version per step here
        said = step - 1 - lag
        rows = rollouts(run_dir, step)
        assert {r["policy_version"] for r in rows} == {said}, (step, said)  # what each row says sampled it
        assert _logprob_gap(run_dir, said, rows) < SAME, f"step {step}: not sampled by step {said}'s weights"
        for other in (said - 1, said + 1):
            if 0 <= other <= last:
                gap = _logprob_gap(run_dir, other, rows)
                assert gap > APART, f"step {step}: step {other}'s weights give the same log-probs ({gap})"


def _job(proc) -> list:
    return [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    """The uninterrupted LONG-step run at trainer.max_staleness=1, an HF export and a checkpoint after
    every step, all kept: test_staleness_1's reference, and its step 1 checkpoint, whose
    pending_rollout.json holds step 2's rollout, the one the damaged-file tests resume from (one
    2-process run for what were two)."""
    out = tmp_path_factory.mktemp("stale-run")
    every_step = ["trainer.save_hf_every=1", "trainer.save_every=1", f"trainer.keep_checkpoints={LONG}"]
    run(train_cmd(out, "stale", MODEL, 2, *STALE, f"trainer.max_steps={LONG}", *every_step))
    assert (out / "stale" / "checkpoints" / "step_000001" / "pending_rollout.json").exists()
    return out / "stale"


def test_staleness_1_trains_one_update_behind_and_a_killed_launcher_resumes_exactly(stale_run, tmp_path):
    """Uninterrupted run: step 1 trains on fresh completions, steps 2-5 on completions one update
    behind (rollout/policy_lag_max); step 1's completions have the starting weights' log-probs
    (transformers on examples/tiny/model), and each later step s's those of step s-2's update (its
    HF export), not step s-1's or s-3's. Killed run: SIGKILL reaches torchrun alone after step 1;
    each rank gets SIGTERM, the trainer finishes its step (with the next step's rollout), saves,
    stops the rollout rank; nothing is left running. --resume then repeats the uninterrupted run's
    later steps exactly."""
    steps = [f"trainer.max_steps={LONG}", "trainer.save_hf_every=1"]
    ref = metrics(stale_run)
    assert [ref[s]["rollout/policy_lag_max"] for s in range(1, LONG + 1)] == [0] + [1] * (LONG - 1)
    assert ref[2]["train/rollout_kl_k3"] > 1e3 * ref[1]["train/rollout_kl_k3"]  # off-policy from step 2 on
    assert _logprob_gap(stale_run, 0, rollouts(stale_run, 1)) < SAME  # the check's reference
    _assert_each_step_sampled_by_the_weights_it_says(stale_run, ref)

    log = tmp_path / "killed.log"
    proc = start_logged(train_cmd(tmp_path, "killed", MODEL, 2, *STALE, *steps, "trainer.save_every=0"), log)
    wait_for_first_row(tmp_path / "killed", proc)
    alive = kill_launcher_alone(proc, psutil.Process(proc.pid).children(recursive=True))
    screen = log.read_text()[-4000:]
    assert not alive, f"{len(alive)} process(es) of the run outlived its launcher\n{screen}"
    latest = (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip()
    saved = int(latest.split("_")[1])
    assert 1 <= saved < LONG, screen
    assert (tmp_path / "killed" / "checkpoints" / latest / "pending_rollout.json").exists()
    assert "serving until the trainer stops" in screen and "stopping after step" in screen, screen
    run(train_cmd(tmp_path, "killed", MODEL, 2, *STALE, *steps, "trainer.save_every=0", resume=True))
    got = metrics(tmp_path / "killed")
    assert sorted(got) == list(range(1, LONG + 1))
    for step in range(1, LONG + 1):
        assert_same_rollouts(rollouts(tmp_path / "killed", step), rollouts(stale_run, step))
        assert got[step]["rollout/policy_lag_max"] == ref[step]["rollout/policy_lag_max"]
    _compare(ref, got, range(1, LONG + 1))


def test_staleness_2_queues_two_rounds_and_resumes_from_both(tmp_path):
    """trainer.max_staleness=2: steps 2 and 3 are sent during step 1 (both sampled by the starting
    weights), then each step sends the one two steps on, so step s >= 3 trains on step s-3's update's
    completions: policy_lag_max 0, 1, 2, 2, 2, each step's log-probs those of the weights it says
    (the check fails for the versions either side). A checkpoint holds both rounds in flight with
    their completions; --resume from step 2's repeats the uninterrupted run's steps 3-5 exactly."""
    k2 = [*DEDICATED, "trainer.max_staleness=2", "algorithm.rollout_correction=tis", f"trainer.max_steps={LONG}"]
    run(
        train_cmd(
            tmp_path,
            "k2",
            MODEL,
            2,
            *k2,
            "trainer.save_hf_every=1",
            "trainer.save_every=1",
            "trainer.keep_checkpoints=5",
        )
    )
    ref = metrics(tmp_path / "k2")
    assert [ref[s]["rollout/policy_lag_max"] for s in range(1, LONG + 1)] == [0, 1, 2, 2, 2]
    _assert_each_step_sampled_by_the_weights_it_says(tmp_path / "k2", ref)
    saved = tmp_path / "k2" / "checkpoints" / "step_000002" / "pending_rollout.json"
    assert [r["step"] for r in json.loads(saved.read_text())["rounds"]] == [3, 4]

    resumed = tmp_path / "resumed"  # the run as if killed after step 2's save
    shutil.copytree(tmp_path / "k2", resumed)
    (resumed / "checkpoints" / "latest").write_text("step_000002\n")
    for step in range(3, LONG + 1):
        (resumed / "rollouts" / f"step_{step:06d}.jsonl").unlink()
    run(train_cmd(tmp_path, "resumed", MODEL, 2, *k2, resume=True))
    got = metrics(resumed)
    for step in range(3, LONG + 1):
        assert_same_rollouts(rollouts(resumed, step), rollouts(tmp_path / "k2", step))
        assert got[step]["rollout/policy_lag_max"] == ref[step]["rollout/policy_lag_max"]
    _compare(ref, got, range(3, LONG + 1))


def _stretch_gap(run_dir, version: int, rows, part: str) -> float:
    """The largest |engine's log-prob sum - transformers'| under `version`'s weights over the rows'
    tokens before ("first") or from ("rest") each row's weight switch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dppo.rollout.vllm_engine import hf_completion_logprobs

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(_weights_of(run_dir, version), dtype=torch.float32).eval()
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    hf = hf_completion_logprobs(model, prompts, [r["completion_ids"] for r in rows])
    gaps = []
    for lp, r in zip(hf, rows):
        (at, _), engine = r["version_switches"][0], r["rollout_logprobs"]
        cut = slice(0, at) if part == "first" else slice(at, None)
        gaps.append(abs(float(lp[cut].sum()) - sum(engine[cut])))
    return max(gaps)


def test_partial_rollouts_continue_unfinished_completions_under_the_new_weights(tmp_path):
    """rollout.partial at trainer.max_staleness=1, 2-token chunks, the rollout rank made to wait for
    the next weights at a round's first chunk boundary (SWITCH_WAIT: where timing would decide): from
    step 2 on, the completions still going after 2 tokens finish under the weights of the update that
    arrived meanwhile. Each such row's first tokens have the log-probs of step s-2's weights and the
    rest those of step s-1's (and not s-2's: the negative control); the lag counts from the first
    tokens (policy_lag_max 1)."""
    from conftest import run_cli

    from megatron_dppo.train.rollout_rank import SWITCH_WAIT

    partial = [*STALE, "rollout.partial=true", "rollout.partial_chunk=2", "trainer.save_hf_every=1"]
    cmd = train_cmd(tmp_path, "partial", MODEL, 2, *partial, "trainer.max_steps=3")
    res = run_cli(cmd, {**run_env(), SWITCH_WAIT: "1"}, 600)
    assert res.returncode == 0, res.stderr[-4000:]
    ref = metrics(tmp_path / "partial")
    assert [ref[s]["rollout/policy_lag_max"] for s in (1, 2, 3)] == [0, 1, 1]
    for step in (2, 3):
        assert ref[step]["rollout/weight_switched_frac"] > 0, ref[step]
        rows = [r for r in rollouts(tmp_path / "partial", step) if "version_switches" in r]
        assert rows and all(r["version_switches"] == [[2, step - 1]] for r in rows), rows[:2]
        assert _stretch_gap(tmp_path / "partial", step - 2, rows, "first") < SAME
        assert _stretch_gap(tmp_path / "partial", step - 1, rows, "rest") < SAME
        assert _stretch_gap(tmp_path / "partial", step - 2, rows, "rest") > APART


@pytest.mark.parametrize("fault", ["stalled", "killed"])
def test_a_rollout_rank_that_stalls_or_dies_ends_the_job(tmp_path, fault):
    """The rollout rank is frozen (SIGSTOP: the trainer's stall watchdog names the wait and ends
    the job) or killed (SIGKILL: torchrun ends the job) after step 1: the job exits non-zero
    within a minute or two and no process of it is left."""
    over = ["trainer.max_steps=200", "trainer.save_every_minutes=0"]
    if fault == "stalled":
        # start-up has its own start_timeout_s; this config's longest phase after it took 1.5 s with both
        # cores busy (measured: a step's train phase, the rollout rank's wait for the next weights): 6 s is 4x
        over += ["trainer.save_every=0", "trainer.stall_timeout_s=6"]
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
def test_a_damaged_pending_rollout_ends_the_resumed_job_in_seconds(stale_run, tmp_path, how):
    """--resume from a checkpoint whose pending_rollout.json is damaged: the training rank's start-up
    check fails while the rollout rank starts its engine. The default timeouts (start_timeout_s 600 s
    on CPU): truncated or missing, the job waited for the rollout rank's start-up watchdog, the
    training rank blocked saying stop to a rollout rank still sending its start-up report; garbled,
    it failed after the model loaded with json's words and no file named."""
    run_dir = tmp_path / "saved"  # stale_run as if killed after step 1's save
    shutil.copytree(stale_run, run_dir, ignore=shutil.ignore_patterns("hf"))
    (run_dir / "checkpoints" / "latest").write_text("step_000001\n")
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
