"""The trainer's side of issue 24 (stall watchdog, checkpoint cadence, resume refusals), in real runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import run_cli
from trainer_runs import SMALL as TRAINER_SMALL

from megatron_dppo.run.process import free_port

REPO = Path(__file__).resolve().parents[2]
SMALL = [*TRAINER_SMALL, "data.train_size=8"]  # test_trainer's small runs, one batch of prompts
# trainer.stall_timeout_s of the stall test (start-up has its own start_timeout_s): its run's longest
# phase after start-up took 0.6 s with both cores busy (step 1's checkpoint save), 2.2 s in a 50-step
# run beside three busy processes (a save): 7 s is 3x that
STALL_S = 7


def train_cmd(out, name, *overrides, nproc=1, resume=False):
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                     f"--master_port={free_port()}"]  # fmt: skip
    cmd = launcher + ["-m", "megatron_dppo.cli", "train", "--config", "examples/tiny/addition.yaml",
                      f"trainer.output_dir={out}", f"trainer.run_name={name}", *SMALL, *overrides]  # fmt: skip
    return cmd + (["--resume"] if resume else [])


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def test_a_sigstopped_trainer_rank_ends_the_job_naming_it_and_keeps_the_checkpoint(tmp_path):
    """2 ranks, a checkpoint every step; rank 1 SIGSTOPped after step 2: rank 0's watchdog names rank
    1 and its phase within trainer.stall_timeout_s, the job exits non-zero, `latest` names a step."""
    run_dir = tmp_path / "stall"
    cmd = train_cmd(tmp_path, "stall", "trainer.max_steps=50", "trainer.save_every=1",
                    f"trainer.stall_timeout_s={STALL_S}", nproc=2)  # fmt: skip
    with open(tmp_path / "out.txt", "w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            end = time.monotonic() + 400
            while time.monotonic() < end and proc.poll() is None:
                done = (
                    (run_dir / "metrics.jsonl").read_text().count("\n") if (run_dir / "metrics.jsonl").exists() else 0
                )
                if done >= 2:
                    break
                time.sleep(0.5)
            assert proc.poll() is None, (out.seek(0), out.read()[-5000:])[1]
            rank1 = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if p.environ().get("RANK") == "1" and "megatron_dppo.cli" in " ".join(p.cmdline())]  # fmt: skip
            assert len(rank1) == 1, rank1
            os.kill(rank1[0].pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            proc.wait(timeout=200)
            took = time.monotonic() - stopped_at
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for p in psutil.process_iter():
                try:
                    if p.environ().get("MEGATRON_DPPO_TEST_RUN") is None and str(tmp_path) in " ".join(p.cmdline()):
                        p.kill()
                except psutil.Error:
                    pass
        out.seek(0)
        text = out.read()
    assert proc.returncode != 0, text[-5000:]
    assert "stall watchdog: rank 0 made no progress for" in text, text[-5000:]
    assert "rank 1 last seen in phase" in text and "(no heartbeat for" in text, text[-5000:]
    assert "exitcode  : 124" in text, text[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith("step_") and (run_dir / "checkpoints" / latest / "manifest.json").exists()
    # rank 0's watchdog SIGKILLs the stopped rank before it exits: the job ends within the timeout and
    # torchrun's teardown, not after its 30 s grace for a rank that ignores SIGTERM (>= STALL_S + 30)
    assert "rank 1 stopped (SIGSTOP) on this host: killed (SIGKILL)" in text, text[-5000:]
    assert took < STALL_S + 25, took


def test_resume_refuses_another_group_size_and_logs_the_save_cost(tmp_path):
    run = lambda *a, **k: run_cli(train_cmd(tmp_path, "r", *a, **k), _env())  # noqa: E731
    first = run("trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "checkpoint step_000002 saved in " in first.stdout + first.stderr
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["checkpoint/bytes"] > 0 and rows[-1]["time/checkpoint"] > 0
    res = run("trainer.max_steps=3", "rollout.group_size=8", resume=True)
    assert res.returncode == 1
    assert "rollout.group_size=8, but the run was trained with 4" in res.stderr, res.stderr[-2000:]
    assert "config.yaml" not in res.stderr and "group_size: 4" in (tmp_path / "r" / "config.yaml").read_text()
