"""The forked launches of run_workers (tests/prefork_server.py) give a rank what torchrun gives it,
and a failing rank ends the launch with its error instead of leaving the other waiting."""

import re
import time
from pathlib import Path

from conftest import run_workers

CHECK = Path(__file__).resolve().parent / "workers" / "harness" / "rank_check.py"


def _ranks(out: str) -> list[str]:
    return sorted(re.findall(r"RANK_CHECK .*|argv=.*", out))


def test_a_forked_launch_gives_each_rank_what_torchrun_does():
    forked = run_workers(CHECK, 2, fork=True, timeout=120)
    real = run_workers(CHECK, 2, fork=False, timeout=120)
    assert forked.returncode == real.returncode == 0, forked.stdout + forked.stderr + real.stderr
    assert len(_ranks(real.stdout)) == 4 and "sum=3.0" in real.stdout
    assert _ranks(forked.stdout) == _ranks(real.stdout)


def test_a_failing_forked_rank_ends_the_launch_with_its_error():
    t0 = time.time()
    res = run_workers(CHECK, 2, "--fail-rank", "1", fork=True, timeout=120)
    assert res.returncode != 0 and "rank 1 fails on purpose" in res.stderr, res.stderr[-3000:]
    assert "timed out" not in res.stderr and time.time() - t0 < 60
