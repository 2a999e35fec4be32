"""RewardScorer: the pool of reward workers, and one score() call's bookkeeping (`_Call`)."""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import time
import weakref
from collections import deque
from multiprocessing.connection import wait

from megatron_dppo.rewards.spec import absolute_spec, batched_specs, data_source_of, describe_spec
from megatron_dppo.rewards.worker import Task, Worker, protect_forkserver

FAILURE_KINDS = (
    "timeout",
    "raised",
    "non-numeric",
    "non-finite",
    "bad-dict",
    "bad-batch",
    "worker-died",
    "deadline",
)
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
    """One score() call: its results, the tasks not yet started (`pending`), the count of checks
    left, and its time budget. Every check ends here, through `finish` (a worker's results),
    `fail` (a timeout, a dead worker) or `expire` (the budget ran out); nothing else changes the
    count."""

    def __init__(self, scorer: RewardScorer, tasks: list[Task], records):
        n = len(records)
        self.records, self.n = records, n
        self.rewards = [0.0] * n
        self.extras: list[dict] = [{} for _ in range(n)]
        self.pending = deque(tasks)
        self.left = n
        self.by_kind: dict[str, int] = {}
        self.first: list[str] = []
        self._timeout_s, self._fixed_s = scorer.timeout_s, scorer.call_timeout_s
        self._num_workers, self._times = len(scorer._workers), scorer._check_times
        self._routed = len(scorer._specs) > 1
        self._singles = sum(len(t.items) for t in tasks if not t.batched)
        self._batches_s = sum(t.timeout_s for t in tasks if t.batched)
        self.t0 = time.monotonic()
        self._uncharged_s = 0.0  # time in which no worker was ready (all starting)

    def budget_s(self) -> float:
        """Fixed, or room for one round of hung checks plus 4x the measured healthy workload of the
        single checks, plus the batched calls' timeouts (they may run one after another; and so a
        batch's own timeout, which starts when it is sent, comes first)."""
        if self._fixed_s is not None:
            return self._fixed_s
        rounds = math.ceil(self._singles / self._num_workers)
        return 2 * self._timeout_s + 4 * rounds * self._times.mean() + self._batches_s

    def deadline(self) -> float:
        return self.t0 + self._uncharged_s + self.budget_s()

    def uncharge(self, seconds: float) -> None:
        self._uncharged_s += seconds

    def finish(self, task: Task, results: list[tuple], seconds: float | None = None) -> None:
        """The task's checks ended: one (status, value, extras) each, ("ok", reward, extras) or
        (failure kind, message, None). `seconds`: it returned after that long (a single check's
        time feeds the budget's mean; None for a timeout, a dead worker, the deadline)."""
        if seconds is not None and not task.batched:
            self._times.add(seconds)
        for idx, (status, value, extras) in zip(task.items, results, strict=True):
            if status == "ok":
                self.rewards[idx], self.extras[idx] = value, extras
            else:
                self.by_kind[status] = self.by_kind.get(status, 0) + 1
                if len(self.first) < MAX_FIRST_FAILURES:
                    by = f" ({task.spec})" if self._routed else ""  # which function, when there are several
                    self.first.append(f"record {_record_id(self.records[idx], idx)}{by}: {status}: {value}")
        self.left -= len(task.items)

    def fail(self, task: Task, kind: str, why: str) -> None:
        self.finish(task, [(kind, why, None)] * len(task.items))

    def expire(self, running: list[Task], now: float) -> bool:
        """When the budget is spent: every running and pending check fails as "deadline" (the
        caller replaces the workers running them). True if it was spent."""
        if not self.left or now < self.deadline():
            return False
        budget = self.budget_s()
        for task in running:
            self.fail(task, "deadline", f"still running when the call's budget of {budget:.1f}s ran out")
        while self.pending:
            self.fail(self.pending.popleft(), "deadline", f"not started: the call's budget of {budget:.1f}s ran out")
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
            "extras": self.extras,
        }


class RewardScorer:
    """Scores completions against gold answers in `num_workers` reused processes.

    kind: the reward spec of every completion whose record's data_source is not in by_source
    ({data_source: spec}); every worker can run every spec (the package docstring says why).
    batched: the user functions (specs that are not built-in kinds) get the call's completions
    of their kind in one call. timeout_s bounds one check, measured from when it is handed to a
    worker (a batched call: timeout_s * ceil(its completions / num_workers)); call_timeout_s (or
    the adaptive budget in the package docstring) bounds one score() call. max_error_frac: the
    largest fraction of failed checks a call may have; above it score() raises
    RewardFailureError (1.0: never). User code is imported only in the workers, never in the
    caller's process: startup_timeout_s bounds a worker's start (its imports); exceeding it, or a
    worker that dies or raises while importing, raises RuntimeError naming the config key and the
    file or module it was importing: a setup error, not a bad sample. A spec that cannot be had
    (malformed, missing, raising at import, no such function, a signature that cannot take the
    scorer's call) is a ValueError naming its config key ('reward.kind',
    'reward.by_source.<source>'). The constructor returns once every worker is ready, so all of
    this is known before the caller goes on (the trainer: before the engine starts).
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
        by_source: dict[str, str] | None = None,
        batched: bool = False,
    ):
        if not timeout_s > 0 or num_workers < 1:
            raise ValueError(f"reward timeout_s must be > 0 and num_workers >= 1, got {timeout_s}, {num_workers}")
        if not 0.0 <= max_error_frac <= 1.0:
            raise ValueError(f"reward max_error_frac must be in [0, 1], got {max_error_frac}")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"reward call_timeout_s must be > 0 (or None: adaptive), got {call_timeout_s}")
        self.kind = absolute_spec(kind, "reward.kind")
        self.by_source = {
            src: absolute_spec(spec, f"reward.by_source.{src}") for src, spec in (by_source or {}).items()
        }
        self._specs = {self.kind: "reward.kind"}  # spec -> the config key it came from (first)
        for src, spec in self.by_source.items():
            self._specs.setdefault(spec, f"reward.by_source.{src}")
        # No user code is imported in this process (it could hang it, with no timeout): the workers
        # import every function under startup_timeout_s and check its signature before "ready".
        self.batched = batched_specs(self._specs, batched)
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.max_error_frac, self.call_timeout_s = max_error_frac, call_timeout_s
        self._ctx = mp.get_context(start_method)
        protect_forkserver(self._ctx)
        self._workers = [Worker(self._ctx, self._specs, frozenset(self.batched)) for _ in range(num_workers)]
        self.totals = {"checks": 0, "failed": 0, "restarts": 0, "by_kind": {}}
        self._check_times = _CheckTimes()
        self._next_task_id = 0
        self._closed = False
        # Workers ignore SIGTERM (signals.py), so multiprocessing's own exit hook, which terminates
        # daemonic children with SIGTERM and then joins them, would wait forever for a scorer that
        # nobody closed (a trainer that failed during start-up): close it first, at exit.
        atexit.register(_close_at_exit, weakref.ref(self))
        self._wait_ready()

    @classmethod
    def from_config(cls, cfg, **kwargs) -> RewardScorer:
        """From config.RewardConfig (kwargs: the other constructor arguments, e.g. start_method)."""
        return cls(
            cfg.kind,
            timeout_s=cfg.timeout_s,
            num_workers=cfg.num_workers,
            max_error_frac=cfg.max_error_frac,
            by_source=dict(cfg.by_source),
            batched=cfg.batched,
            **kwargs,
        )

    def describe(self) -> str:
        """The scorer's functions, for a message: its kind and its by_source routes."""
        return repr(self.kind) + (f" (by source {self.by_source})" if self.by_source else "")

    def spec_of(self, record) -> str:
        """The spec that scores a completion of this record: by its data_source, else `kind`."""
        return self.by_source.get(data_source_of(record), self.kind) if self.by_source else self.kind

    # ---- the pool ----------------------------------------------------------------------------
    def _handle_startup(self, w: Worker) -> None:
        """A worker's start-up message: ("importing", spec), then ("ready", None) or ("fatal",
        (exception type, why)). A spec that cannot be had (ValueError naming its key) is raised as
        it is; anything else, or the worker's death, as a RuntimeError naming what it was importing."""
        try:
            kind, why = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(1)
            kind, why = "fatal", ("", f"the worker exited with code {w.proc.exitcode}")
        if kind == "importing":
            w.importing = why
            return
        if kind != "ready":
            self.close()
            error_type, message = why
            if error_type == "ValueError":
                raise ValueError(message)
            raise RuntimeError(f"{self._importing(w)}: {(error_type + ': ') if error_type else ''}{message}")
        w.ready, w.importing = True, None

    def _importing(self, w: Worker) -> str:
        """Where a worker's start-up is: the spec it is importing, named by its config key."""
        if w.importing is None:
            return f"reward worker for {self.describe()}, before importing any reward function"
        return f"config key {self._specs[w.importing]!r}: reward worker importing {describe_spec(w.importing)}"

    def _check_startup_time(self) -> None:
        """RuntimeError once a worker has been starting for more than startup_timeout_s."""
        for w in self._workers:
            if w.ready or time.monotonic() - w.started <= self.startup_timeout_s:
                continue
            self.close()
            if w.importing is None:
                raise RuntimeError(
                    f"reward worker for {self.describe()} did not start within {self.startup_timeout_s:g} s "
                    "(before importing any reward function)"
                )
            raise RuntimeError(
                f"{self._importing(w)}: did not import within {self.startup_timeout_s:g} s "
                "(code that runs at import and blocks, e.g. a service called without a timeout?)"
            )

    def _wait_ready(self, need_all: bool = True) -> None:
        """Until every worker (need_all) or at least one is ready."""
        while not (all if need_all else any)(w.ready for w in self._workers):
            self._check_startup_time()
            for conn in wait([w.conn for w in self._workers if not w.ready], timeout=1.0):
                self._handle_startup(next(w for w in self._workers if w.conn is conn))

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = Worker(self._ctx, self._specs, frozenset(self.batched))
        self.totals["restarts"] += 1

    # ---- one call ----------------------------------------------------------------------------
    def score(self, completions: list[str], answers: list[str], records=None):
        """-> (rewards, info). rewards[i] is in the order of completions; a failed check gives 0.0.

        info: n, failed, timeouts (kind "timeout"), errors (every other kind), seconds, budget_s,
        failures_by_kind {kind: count} (kinds that occurred), first_failures (up to 5 strings
        "record <id>: <kind>: <message>"), extras (per completion, the extra numbers of a dict
        its function returned: {} for a number or a failure). Raises RewardFailureError when
        failed / n > max_error_frac.
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
        call = _Call(self, self._plan(records), records)
        while call.left:
            self._dispatch(call, completions, answers)
            self._collect(call, self._wait(call))
            self._enforce_timeouts(call)
        return call.rewards, self._conclude(call)

    def _plan(self, records: list) -> list[Task]:
        """The call's tasks: a batched spec's completions as one task (first: the longest), and
        every other completion as a task of its own."""
        batches: dict[str, list[int]] = {}
        singles = []
        for idx, record in enumerate(records):
            spec = self.spec_of(record)
            (batches.setdefault(spec, []) if spec in self.batched else singles).append((idx, spec))
        tasks = []
        for spec, items in batches.items():
            rounds = math.ceil(len(items) / len(self._workers))
            why = f"the batch's timeout of {self.timeout_s * rounds:.1f}s (timeout_s={self.timeout_s}s x {rounds})"
            tasks.append(self._task(spec, [i for i, _ in items], True, self.timeout_s * rounds, why))
        for idx, spec in singles:
            tasks.append(self._task(spec, [idx], False, self.timeout_s, f"timeout_s={self.timeout_s}s"))
        return tasks

    def _task(self, spec, items, batched, timeout_s, why) -> Task:
        self._next_task_id += 1
        return Task(self._next_task_id, spec, items, batched, timeout_s, why)

    def _dispatch(self, call: _Call, completions, answers) -> None:
        """Hand one task to each idle, ready worker."""
        for i, w in enumerate(self._workers):
            if not (w.ready and w.task is None and call.pending):
                continue
            task = call.pending.popleft()
            try:
                w.conn.send(task.message(completions, answers, call.records))
            except (BrokenPipeError, ConnectionResetError, EOFError):  # died while idle: retry
                call.pending.appendleft(task)
                self._replace(i)
                continue
            except Exception as e:  # pickling: the caller's record, not the verifier
                ids = ", ".join(_record_id(call.records[k], k) for k in task.items[:3])
                raise ValueError(
                    f"record {ids}{' ...' if len(task.items) > 3 else ''} cannot be sent to a reward worker: "
                    f"{type(e).__name__}: {e}"
                ) from None
            w.start_task(task)

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
                _, results = conn.recv()
            except (EOFError, OSError):  # the check took the process down with it
                if w.task is not None:
                    w.proc.join(1)
                    call.fail(
                        w.task, "worker-died", f"the worker process exited (code {w.proc.exitcode}) during the check"
                    )
                self._replace(i)
                continue
            call.finish(w.task, results, seconds=time.monotonic() - w.task_started)
            w.end_task()

    def _enforce_timeouts(self, call: _Call) -> None:
        """Kill checks past timeout_s, and everything still running once the call's budget is spent."""
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if w.task is not None and now >= w.deadline:
                call.fail(w.task, "timeout", f"no result within {w.task.timeout_why} (worker replaced)")
                self._replace(i)
        self._check_startup_time()  # a replacement worker's
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
                f"reward {self.describe()}: {failed} of {n} checks failed ({failed / n:.0%}, over "
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
            if w.ready:  # one still starting may be hung in an import: no grace for it
                w.proc.join(2)
            w.kill()

    def __enter__(self):
        return self

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __exit__(self, *exc):
        self.close()


def _close_at_exit(ref) -> None:
    scorer = ref()
    if scorer is not None:
        scorer.close()
