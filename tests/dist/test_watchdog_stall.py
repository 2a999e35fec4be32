"""The stall watchdog in real torchrun workers: a SIGSTOPped rank is named and the job ends."""

import os
import re
import time

from megatron_dppo.run.watchdog import STALL_EXIT_CODE

WORKER = os.path.join(os.path.dirname(__file__), "..", "dist", "workers", "faults", "stall_worker.py")


def test_a_sigstopped_rank_is_named_and_the_job_ends(launch):
    """Rank 1 SIGSTOPs itself at step 4 (threads and all); rank 0 waits in the all-reduce of phase
    sync. Issue 24 saw such a job sit silent for 420 s. Here rank 0's watchdog must name rank 1,
    its last phase and step, SIGKILL rank 1 (stopped, on its host: torchrun's SIGTERM would not
    move it, and torch 2.13's agent waits a fixed 30 s before its own SIGKILL), and exit 124."""
    timeout_s = 3
    t0 = time.monotonic()
    res = launch(WORKER, 2, "--timeout", timeout_s, "--stall", "sigstop", timeout=120, fork=False)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-4000:]
    assert "rank 1 stalls at step 4" in out and "finished all steps" not in out, out[-4000:]
    assert re.search(
        r"stall watchdog: rank 0 made no progress for [3-9] s \(trainer\.stall_timeout_s=3\) in phase sync at step 4",
        out,
    ), out[-4000:]
    assert re.search(
        r"rank 1 last seen in phase train at step 4, \d+ s ago \(no heartbeat for \d+ s: stopped, dead", out
    ), out[-4000:]
    assert re.search(r"rank 0 waits in phase sync at step 4 \(no progress for \d+ s\)", out), out[-4000:]
    assert f"rank 0 exits with status {STALL_EXIT_CODE}" in out and f"exitcode  : {STALL_EXIT_CODE}" in out, out
    # The main thread's place: inside the all-reduce called from megatron_dppo/run/collectives.py.
    assert re.search(r"in phase sync at step 4, at \S+:\d+ \S+ <- collectives\.py:\d+ _all_reduce", out), out
    assert "rank 1 stopped (SIGSTOP) on this host: killed (SIGKILL)" in out, out[-4000:]
    # It ended by itself: start-up + the 3 s timeout, not the test's 120 s.
    assert took < 100, took
