"""The stall watchdog (issue 24, item 3): a rank that makes no progress for trainer.stall_timeout_s
names the rank and phase everyone waits on and ends the job non-zero. A real 2-process torchrun
job with a SIGSTOPped rank, and the watchdog's pieces on their own."""

import os
import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_dppo.run.watchdog import STALL_EXIT_CODE, StallWatchdog, _ranks, describe_ranks

WORKER = os.path.join(os.path.dirname(__file__), "..", "dist", "workers", "faults", "stall_worker.py")


def _store_pair():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    return server, dist.PrefixStore("wd/", server.clone()), dist.PrefixStore("wd/", server.clone())


def test_the_checker_reports_a_silent_rank_and_exits_124(capfd):
    """Two watchdogs on one c10d store: rank 1's threads stop (its heartbeats end, as under SIGSTOP);
    rank 0's main thread marks no progress: after the timeout it prints the report and exits."""
    server, s0, s1 = _store_pair()
    exits = []
    done = threading.Event()

    def fake_exit(code):  # os._exit in real life: record it instead of ending pytest
        exits.append(code)
        done.set()

    w0 = StallWatchdog(1.2, rank=0, world=2, store=s0, exit=fake_exit)
    w1 = StallWatchdog(1.2, rank=1, world=2, store=s1, exit=lambda code: None)
    w0.start()
    w1.start()
    w1.phase("rollout", 7)
    time.sleep(0.5)  # a few beats of rank 1
    w1.stop()  # rank 1 goes silent in phase rollout at step 7
    w0.phase("sync", 7)
    assert done.wait(10), "the checker never fired"
    w0.stop()
    err = capfd.readouterr().err
    assert exits == [STALL_EXIT_CODE], exits
    head = r"stall watchdog: rank 0 made no progress for 1 s \(trainer.stall_timeout_s=1.2\) in phase sync at step 7"
    assert re.search(head, err), err
    assert re.search(r"rank 1 last seen in phase rollout at step 7, \d+ s ago \(no heartbeat for \d+ s", err), err
    assert "rank 0 exits with status 124" in err, err


def test_describe_ranks_groups_ranks_culprits_first():
    now, timeout, stale = 1000.0, 600.0, 15.0

    def beat(phase, step, progress_ago, beat_ago):
        return {"phase": phase, "step": step, "progress": now - progress_ago, "beat": now - beat_ago}

    beats = {
        0: beat("sync", 5, 601, 1),
        1: beat("train", 5, 612, 612),  # stopped: no beat since its last progress
        2: beat("sync", 5, 603, 2),
        3: beat("sync", 5, 600, 0),
        5: beat("train", 6, 2, 1),  # still moving (it is ahead)
    }
    lines = describe_ranks(beats, 6, now, timeout, stale)
    assert lines == [
        "rank 4 never sent a heartbeat (did not start, or died before its first beat)",
        "rank 1 last seen in phase train at step 5, 612 s ago (no heartbeat for 612 s: stopped, dead, or stuck "
        "holding the GIL)",
        "rank 5 is in phase train at step 6 (last progress 2 s ago)",
        "ranks 0, 2-3 wait in phase sync at step 5 (no progress for 603 s)",
    ], lines
    assert _ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8" and _ranks([3]) == "rank 3"


def test_longest_phase_is_logged_and_a_thin_margin_warned():
    w = StallWatchdog(1.0)
    w.phase("rollout", 1)
    time.sleep(0.6)
    w.phase("train", 1)
    assert re.fullmatch(
        r"stall watchdog: trainer.stall_timeout_s=1; the longest phase so far took 0\.\d s \(phase rollout at step 1\)",
        w.timing_line(),
    ), w.timing_line()
    assert re.fullmatch(
        r"warning: phase rollout at step 1 took \d s, over half of trainer.stall_timeout_s=1: raise "
        r"trainer.stall_timeout_s, or a slower phase will be taken for a stall",
        w.margin_warning(),
    )
    assert w.margin_warning() is None  # once
    assert StallWatchdog(0).start()._threads == []  # 0 = off


@pytest.mark.parametrize("cuda, expected", [(False, 600.0), (True, 1800.0)])
def test_stall_timeout_default_depends_on_the_device(cuda, expected):
    from tiny_config import FACTS, TINY

    from megatron_dppo.config import load_config, resolve

    cfg = resolve(load_config(TINY), **dict(FACTS, cuda=cuda))
    assert cfg.trainer.stall_timeout_s == expected


def test_start_up_is_watched_with_its_own_timeout():
    """Start-up (phases before the first step) runs under start_timeout_s: a slow engine start does
    not end a job whose stall timeout is short; once a step began, the stall timeout applies, and the
    report names the option that fired."""
    exits = []
    w = StallWatchdog(0.6, start_timeout_s=30, exit=exits.append).start()
    w.phase("load weights")
    time.sleep(1.5)  # over the stall timeout, in start-up
    assert exits == []
    w.phase("prompts", 1)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    w.stop()
    assert exits == [STALL_EXIT_CODE]
    assert w.timing_line().endswith("(phase start)")  # start-up's phases are not the longest step phase
    starting = StallWatchdog(5, start_timeout_s=1)
    assert "(trainer.start_timeout_s=1) in phase start" in starting.report_lines(1.0)[0]
    starting.phase("rollout", 3)
    assert "(trainer.stall_timeout_s=5) in phase rollout at step 3" in starting.report_lines(5.0)[0]


def test_start_timeout_resolves_to_at_least_the_platform_default():
    from tiny_config import FACTS, TINY

    from megatron_dppo.config import load_config, resolve

    short = resolve(load_config(TINY, ["trainer.stall_timeout_s=20"]), **FACTS)
    assert (short.trainer.stall_timeout_s, short.trainer.start_timeout_s) == (20, 600)
    long = resolve(load_config(TINY, ["trainer.stall_timeout_s=900"]), **FACTS)
    assert long.trainer.start_timeout_s == 900
    mine = resolve(load_config(TINY, ["trainer.stall_timeout_s=20", "trainer.start_timeout_s=45"]), **FACTS)
    assert mine.trainer.start_timeout_s == 45


def test_a_rollout_ranks_report_names_its_launcher_rank_and_role():
    """On dedicated rollout ranks the watchdog's ranks are the rollout ranks' own (RANK rewritten by
    run/bridge.split_world): its lines said "rank 0" on launcher rank 1 (issue 43); they name both."""
    w = StallWatchdog(5, start_timeout_s=600, rank=0, world=2, role="rollout", first_rank=1)
    w.phase("start engine")
    lines = w.report_lines(600.0)
    assert lines[0].startswith(
        "stall watchdog: rank 1 (rollout rank 0) made no progress for 600 s (trainer.start_timeout_s=600) in "
        "phase start engine"
    ), lines
    assert "  rank 2 (rollout rank 1) never sent a heartbeat (did not start, or died before its first beat)" in lines
    assert lines[-1].startswith("stall watchdog: rank 1 (rollout rank 0) exits with status 124"), lines
    assert _ranks([0, 1, 3], "rollout", 4) == "ranks 4-5, 7 (rollout ranks 0-1, 3)"


def test_end_stopped_ranks_kills_only_the_stopped_process_that_sent_the_beat():
    """A stopped process on this host whose beats stopped is SIGKILLed (torchrun's SIGTERM would wait
    on it 30 s); not a running process, not a later process reusing the pid (another start time),
    not a rank on another host, not a rank still beating."""
    import signal
    import socket
    import subprocess

    from megatron_dppo.run.watchdog import end_stopped_ranks, process_state

    stopped = subprocess.Popen(["sleep", "60"])
    running = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        for _ in range(100):  # the stop lands asynchronously
            if process_state(stopped.pid)[0] == "T":
                break
            time.sleep(0.01)
        now, host = time.time(), socket.gethostname()

        def beat(proc, **over):
            return {"beat": now - 60, "host": host, "pid": proc.pid, "started": process_state(proc.pid)[1], **over}

        beats = {
            1: beat(running),
            2: beat(stopped, started=process_state(stopped.pid)[1] + 1),  # the pid reused by a later process
            3: beat(stopped, host="another-host"),
            4: beat(stopped, beat=now - 1),  # still beating
            5: beat(stopped, started=None),  # a rank off Linux: no start time to tell it by
        }
        sent = []
        assert end_stopped_ranks(beats, host, now, stale_s=15, kill=lambda *a: sent.append(a)) == []
        assert sent == []
        beats[6] = beat(stopped)
        assert end_stopped_ranks(beats, host, now, stale_s=15) == [6]
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert running.poll() is None
    finally:
        for proc in (stopped, running):
            proc.kill()
            proc.wait()
