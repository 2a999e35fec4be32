"""RewardScorer: the pool of reward workers, and one score() call's bookkeeping (`_Call`)."""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections import deque
from multiprocessing.connection import wait

from megatron_dppo.rewards.spec import resolve_reward_fn
from megatron_dppo.rewards.worker import Worker

FAILURE_KINDS = ("timeout", "raised", "non-numeric", "non-finite", "worker-died", "deadline")
MAX_FIRST_FAILURES = 5


class RewardFailureError(RuntimeError):
    """Too many reward checks of one call failed; `info` is the call's info dict."""

    def __init__(self, message: str, info: dict):
        super().__init__(message)
        self.info = info


def _record_id(record, idx: int) -> str:
    rid = getattr(record, "id", None)
    if rid is None and isinstance(record, dict):
        rid = record.get("id")
    return str(rid) if rid is not None else f"#{idx}"


class _CheckTimes:
    """How long the checks that returned took, over the scorer's life: the adaptive budget's mean."""

    def __init__(self):
        self.n, self.seconds = 0, 0.0

    def add(self, seconds: float) -> None:
        self.n += 1
        self.seconds += seconds

    def mean(self) -> float:
        return self.seconds / self.n if self.n else 0.0


class _Call:
    """One score() call: its results, the checks not yet started (`pending`), the count of checks
    left, and its time budget. Every check ends here, through `finish` (a result or a failure) or
    `expire` (the budget ran out); nothing else changes the count."""

    def __init__(self, scorer: RewardScorer, records):
        n = len(records)
        self.records, self.n = records, n
        self.rewards = [0.0] * n
        self.pending = deque(range(n))
        self.left = n
        self.by_kind: dict[str, int] = {}
        self.first: list[str] = []
        self._timeout_s, self._fixed_s = scorer.timeout_s, scorer.call_timeout_s
        self._num_workers, self._times = len(scorer._workers), scorer._check_times
        self.t0 = time.monotonic()
        self._uncharged_s = 0.0  # time in which no worker was ready (all starting)

    def budget_s(self) -> float:
        """Fixed, or room for one round of hung checks plus 4x the measured healthy workload."""
        if self._fixed_s is not None:
            return self._fixed_s
        return 2 * self._timeout_s + 4 * math.ceil(self.n / self._num_workers) * self._times.mean()

    def deadline(self) -> float:
        return self.t0 + self._uncharged_s + self.budget_s()

    def uncharge(self, seconds: float) -> None:
        self._uncharged_s += seconds

    def finish(self, idx: int, status: str, value, seconds: float | None = None) -> None:
        """Check idx ended: ("ok", reward) or (failure kind, message). `seconds`: it returned after
        that long (feeds the budget's mean; None for a timeout, a dead worker, the deadline)."""
        if seconds is not None:
            self._times.add(seconds)
        if status == "ok":
            self.rewards[idx] = value
        else:
            self.by_kind[status] = self.by_kind.get(status, 0) + 1
            if len(self.first) < MAX_FIRST_FAILURES:
                self.first.append(f"record {_record_id(self.records[idx], idx)}: {status}: {value}")
        self.left -= 1

    def expire(self, running: list[int], now: float) -> bool:
        """When the budget is spent: every running and pending check fails as "deadline" (the
        caller replaces the workers running them). True if it was spent."""
        if not self.left or now < self.deadline():
            return False
        budget = self.budget_s()
        for idx in running:
            self.finish(idx, "deadline", f"still running when the call's budget of {budget:.1f}s ran out")
        while self.pending:
            self.finish(self.pending.popleft(), "deadline", f"not started: the call's budget of {budget:.1f}s ran out")
        return True

    def info(self) -> dict:
        failed = sum(self.by_kind.values())
        timeouts = self.by_kind.get("timeout", 0)
        return {
            "n": self.n,
            "failed": failed,
            "timeouts": timeouts,
            "errors": failed - timeouts,
            "seconds": time.monotonic() - self.t0,
            "budget_s": self.budget_s(),
            "failures_by_kind": self.by_kind,
            "first_failures": self.first,
        }


class RewardScorer:
    """Scores completions against gold answers in `num_workers` reused processes.

    timeout_s bounds one check, measured from when it is handed to a worker; call_timeout_s (or
    the adaptive budget in the module docstring) bounds one score() call. max_error_frac: the
    largest fraction of failed checks a call may have; above it score() raises
    RewardFailureError (1.0: never). startup_timeout_s bounds a worker's start (imports);
    exceeding it, or a reward function that cannot be imported in the worker, raises
    RuntimeError: that is a setup error, not a bad sample.
    """

    def __init__(
        self,
        kind: str = "exact",
        timeout_s: float = 5.0,
        num_workers: int = 2,
        start_method: str = "forkserver",
        startup_timeout_s: float = 120.0,
        max_error_frac: float = 0.5,
        call_timeout_s: float | None = None,
    ):
        if not timeout_s > 0 or num_workers < 1:
            raise ValueError(f"reward timeout_s must be > 0 and num_workers >= 1, got {timeout_s}, {num_workers}")
        if not 0.0 <= max_error_frac <= 1.0:
            raise ValueError(f"reward max_error_frac must be in [0, 1], got {max_error_frac}")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"reward call_timeout_s must be > 0 (or None: adaptive), got {call_timeout_s}")
        resolve_reward_fn(kind)  # fail fast, with a clear error, in the caller's process
        self.kind, self.timeout_s, self.startup_timeout_s = kind, timeout_s, startup_timeout_s
        self.max_error_frac, self.call_timeout_s = max_error_frac, call_timeout_s
        self._ctx = mp.get_context(start_method)
        self._workers = [Worker(self._ctx, kind) for _ in range(num_workers)]
        self.totals = {"checks": 0, "failed": 0, "restarts": 0, "by_kind": {}}
        self._check_times = _CheckTimes()
        self._closed = False
        self._wait_ready()

    # ---- the pool ----------------------------------------------------------------------------
    def _handle_startup(self, w: Worker) -> None:
        """A worker's first message: ("ready", None) or ("fatal", why)."""
        try:
            kind, why = w.conn.recv()
        except (EOFError, OSError):
            kind, why = "fatal", f"worker exited with code {w.proc.exitcode} during start-up"
        if kind != "ready":
            self.close()
            raise RuntimeError(f"reward worker for {self.kind!r} failed to start: {why}")
        w.ready = True

    def _wait_ready(self, need_all: bool = True) -> None:
        """Until every worker (need_all) or at least one is ready."""
        while not (all if need_all else any)(w.ready for w in self._workers):
            for w in self._workers:
                if not w.ready and time.monotonic() - w.started > self.startup_timeout_s:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s}s")
            for conn in wait([w.conn for w in self._workers if not w.ready], timeout=1.0):
                self._handle_startup(next(w for w in self._workers if w.conn is conn))

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = Worker(self._ctx, self.kind)
        self.totals["restarts"] += 1

    # ---- one call ----------------------------------------------------------------------------
    def score(self, completions: list[str], answers: list[str], records=None):
        """-> (rewards, info). rewards[i] is in the order of completions; a failed check gives 0.0.

        info: n, failed, timeouts (kind "timeout"), errors (every other kind), seconds, budget_s,
        failures_by_kind {kind: count} (kinds that occurred), first_failures (up to 5 strings
        "record <id>: <kind>: <message>"). Raises RewardFailureError when failed / n > max_error_frac.
        """
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        n = len(completions)
        if len(answers) != n or (records is not None and len(records) != n):
            raise ValueError(
                f"score() got {n} completions, {len(answers)} answers, "
                f"{None if records is None else len(records)} records"
            )
        for i, w in enumerate(self._workers):
            if w.task is not None:  # a previous call was interrupted: its late result must not leak in
                self._replace(i)
        if n:
            self._wait_ready(need_all=False)
        records = [None] * n if records is None else list(records)
        call = _Call(self, records)
        while call.left:
            self._dispatch(call, completions, answers)
            self._collect(call, self._wait(call))
            self._enforce_timeouts(call)
        return call.rewards, self._conclude(call)

    def _dispatch(self, call: _Call, completions, answers) -> None:
        """Hand one check to each idle, ready worker."""
        for i, w in enumerate(self._workers):
            if not (w.ready and w.task is None and call.pending):
                continue
            idx = call.pending.popleft()
            msg = (idx, completions[idx], answers[idx], call.records[idx])
            try:
                w.conn.send(msg)
            except (BrokenPipeError, ConnectionResetError, EOFError):  # died while idle: retry
                call.pending.appendleft(idx)
                self._replace(i)
                continue
            except Exception as e:  # pickling: the caller's record, not the verifier
                raise ValueError(
                    f"record {_record_id(msg[3], idx)} cannot be sent to a reward worker: {type(e).__name__}: {e}"
                ) from None
            w.start_task(idx, self.timeout_s)

    def _wait(self, call: _Call) -> list:
        """Until a worker speaks, a check's timeout, the call's deadline, or 1 s."""
        now = time.monotonic()
        none_ready = not any(w.ready for w in self._workers)
        wake = min([w.deadline for w in self._workers if w.task is not None] + [call.deadline(), now + 1.0])
        ready = wait([w.conn for w in self._workers], timeout=max(0.0, wake - now))
        if none_ready:  # all workers were starting: not charged to the call
            call.uncharge(time.monotonic() - now)
        return ready

    def _collect(self, call: _Call, ready: list) -> None:
        """Start-up messages and results from the workers that spoke; a dead worker is replaced."""
        for conn in ready:
            i = next(k for k, w in enumerate(self._workers) if w.conn is conn)
            w = self._workers[i]
            if not w.ready:
                self._handle_startup(w)
                continue
            try:
                idx, status, value = conn.recv()
            except (EOFError, OSError):  # the check took the process down with it
                if w.task is not None:
                    w.proc.join(1)
                    why = f"the worker process exited (code {w.proc.exitcode}) during the check"
                    call.finish(w.task, "worker-died", why)
                self._replace(i)
                continue
            call.finish(idx, status, value, seconds=time.monotonic() - w.task_started)
            w.end_task()

    def _enforce_timeouts(self, call: _Call) -> None:
        """Kill checks past timeout_s, and everything still running once the call's budget is spent."""
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if w.task is not None and now >= w.deadline:
                call.finish(w.task, "timeout", f"no result within timeout_s={self.timeout_s}s (worker replaced)")
                self._replace(i)
            elif not w.ready and now - w.started > self.startup_timeout_s:
                self.close()
                raise RuntimeError(f"replacement reward worker did not start within {self.startup_timeout_s}s")
        if call.expire([w.task for w in self._workers if w.task is not None], now):
            for i, w in enumerate(self._workers):
                if w.task is not None:
                    self._replace(i)

    def _conclude(self, call: _Call) -> dict:
        """The call's info; its failures added to the totals; RewardFailureError if too many."""
        info = call.info()
        by_kind, failed, n = info["failures_by_kind"], info["failed"], info["n"]
        self.totals["checks"] += n
        self.totals["failed"] += failed
        for kind, count in by_kind.items():
            self.totals["by_kind"][kind] = self.totals["by_kind"].get(kind, 0) + count
        if n and failed / n > self.max_error_frac:
            kinds = ", ".join(f"{k} {by_kind[k]}" for k in FAILURE_KINDS if k in by_kind)
            raise RewardFailureError(
                f"reward {self.kind!r}: {failed} of {n} checks failed ({failed / n:.0%}, over "
                f"max_error_frac={self.max_error_frac}): {kinds}; first: " + "; ".join(info["first_failures"]),
                info,
            )
        return info

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(2)
            w.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
