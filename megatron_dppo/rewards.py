"""Rewards: verifiers run in a pool of worker processes, each check under a timeout, every
failure counted by kind, and a call that fails too often stops the run.

    scorer = RewardScorer("math", timeout_s=5.0, num_workers=4, max_error_frac=0.5)
    rewards, info = scorer.score(completions, answers, records)
    # info: n, failed, timeouts, errors, seconds, budget_s,
    #       failures_by_kind {kind: count}, first_failures ["record <id>: <kind>: <message>", ...]
    scorer.close()

Kinds:
  "exact"       the synthetic tasks' verifier (tasks.exact_match): stripped string equality.
  "math"        math-verify equivalence of the completion's final answer with the gold answer:
                the last \\boxed{...} if there is one, else the text after the last "####" (GSM8K
                style), else whatever math-verify extracts from the whole completion.
  "pkg.mod:fn"  a user function fn(completion_text: str, answer: str, record) -> float, where
                record is what the caller passed for that completion (the trainer passes the
                data.PromptRecord: id, prompt, messages, answer, extra; None if nothing was passed).
                It must be importable by module path in a fresh process, and records picklable.

Failures. A failed check gets reward 0.0 and is counted under one kind (FAILURE_KINDS):
  timeout       the check ran past timeout_s: its worker is killed and replaced
  raised        the function raised (the message is the exception)
  non-numeric   it returned something that is not a real number: a string, even "1", is an
                error, not a reward (a verifier returning text is a bug to show, not to coerce)
  non-finite    it returned NaN or +-inf
  worker-died   the worker process exited during the check (os._exit, a segfault in a native
                parser, the OOM killer): it is replaced and the pool keeps working
  deadline      the call's time budget ran out before the check finished (or started)
info["failures_by_kind"] has a count for each kind that occurred, info["first_failures"] the first
five as "record <id>: <kind>: <message>". If more than max_error_frac of a call's checks failed,
score() raises RewardFailureError with the counts and those messages: a run must not train for
hours on rewards that are all zeros because the verifier is broken.

Bounding a whole call. timeout_s bounds one check, but a verifier that hangs on every input would
still cost timeout_s per completion (ceil(n / num_workers) rounds of it). So each score() call also
has one deadline across the pool: call_timeout_s if given, else
    2 * timeout_s + 4 * ceil(n / num_workers) * (mean time of the checks that returned so far)
i.e. room for one round of hung checks plus four times the pool's measured healthy workload (the
mean is over this scorer's life and updated as the call runs, so a slow but healthy verifier gets
its time; time in which no worker is ready, all of them starting, is not charged). When the
deadline passes, the checks still running are killed (their workers replaced) and the checks not
yet started are not run: all are counted as "deadline". A verifier that always hangs therefore
costs about 2 * timeout_s per call, not timeout_s * n / num_workers, and fails the call loudly
through max_error_frac.

Why processes: math parsing (sympy) can hang or blow up on adversarial model output, and a user
function can crash its interpreter. Model-generated text is only ever parsed, never executed.

Start method: "forkserver" by default. The trainer process runs OpenMP/gloo/vLLM threads, and
fork()ing a multi-threaded process can leave a lock held forever in the child. "spawn" would also
be safe, but forkserver forks each worker from a small single-threaded server, so replacing a
killed worker costs a fork instead of a fresh interpreter. As with spawn, a script that builds a
scorer needs the `if __name__ == "__main__":` guard. This module imports nothing heavy at top level
so that workers start fast.

No worker outlives the trainer: an idle worker exits when its pipe to the trainer closes, and
every worker asks the kernel (PR_SET_PDEATHSIG) to be killed when its parent dies: the
forkserver, which exits when the trainer's end of its lifeline pipe closes (workers close the
copy of that end they inherit, or a hung worker would keep the forkserver alive and the
forkserver the worker). So a check hung even in native code does not survive a SIGKILL of the
trainer, and multiprocessing's resource tracker exits once they are all gone.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import numbers
import os
import signal
import time
from collections import deque
from multiprocessing.connection import wait

from megatron_dppo.process import die_with_parent
from megatron_dppo.tasks import exact_match

BUILTIN_KINDS = {
    "exact": "megatron_dppo.rewards:exact_reward",
    "math": "megatron_dppo.rewards:math_reward",
}
FAILURE_KINDS = ("timeout", "raised", "non-numeric", "non-finite", "worker-died", "deadline")
MAX_FIRST_FAILURES = 5


class RewardFailureError(RuntimeError):
    """Too many reward checks of one call failed; `info` is the call's info dict."""

    def __init__(self, message: str, info: dict):
        super().__init__(message)
        self.info = info


# ---------------------------------------------------------------------------- answer extraction


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, braces matched; None if none.

    Brace matching rather than a regex because answers nest braces: \\boxed{\\frac{1}{2}}.
    Also accepts the brace-less form "\\boxed 5" (up to the next space or $).
    """
    best = None
    for cmd in ("\\boxed", "\\fbox"):
        i = text.rfind(cmd)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, cmd)
    if best is None:
        return None
    j = best[0] + len(best[1])
    if text.startswith(" ", j) and not text.startswith(" {", j):  # "\boxed 5"
        rest = text[j + 1 :]
        end = min([k for k in (rest.find("$"), rest.find(" "), rest.find("\n")) if k >= 0] or [len(rest)])
        return rest[:end].strip() or None
    while j < len(text) and text[j] == " ":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
    return None  # unbalanced: the model stopped mid-answer


def gsm8k_final(text: str) -> str | None:
    """The text after the last "####" (first line of it), GSM8K's answer convention; None if none."""
    i = text.rfind("####")
    if i < 0:
        return None
    ans = text[i + 4 :].strip().split("\n", 1)[0].strip()
    return ans or None


# ---------------------------------------------------------------------------- built-in verifiers


def exact_reward(completion: str, answer: str, record=None) -> float:
    return exact_match(completion, answer)


def math_reward(completion: str, answer: str, record=None) -> float:
    """1.0 iff math-verify finds the completion's final answer equivalent to the gold answer."""
    from math_verify import parse, verify  # lazily: only math workers pay for sympy

    gold_text = str(answer)
    gold = parse(gold_text if "\\boxed" in gold_text else "\\boxed{" + gold_text + "}")
    if not gold:
        raise ValueError(f"gold answer {gold_text[:80]!r} could not be parsed")
    # Take the final answer only: math-verify reads several \boxed{} as a set, so "\boxed{41} ...
    # wait, \boxed{42}" would never equal 42, and a list of guesses must not be rewarded.
    final = last_boxed(completion)
    if final is None:
        final = gsm8k_final(completion)
    pred = parse("\\boxed{" + final + "}") if final is not None else parse(completion)
    return 1.0 if pred and verify(gold, pred) else 0.0


def resolve_reward_fn(spec: str):
    """'pkg.module:function' (or a built-in kind) -> the callable. Imports user code, never model text."""
    spec = BUILTIN_KINDS.get(spec, spec)
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"reward kind must be one of {sorted(BUILTIN_KINDS)} or an import path 'pkg.module:function', got {spec!r}"
        )
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj


# ---------------------------------------------------------------------------- worker process


def _drop_forkserver_lifeline() -> None:
    """A forkserver child inherits the write end of the pipe by which the forkserver watches the
    trainer (so that the child could start processes of its own). Holding it, a hung worker would
    keep the forkserver alive after the trainer dies, and the forkserver (its parent, for
    PR_SET_PDEATHSIG) would keep the worker alive: close it; workers start no processes."""
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        forkserver._forkserver._forkserver_alive_fd = None


def _check_result(value) -> tuple[str, float | str]:
    """A reward function's return value -> ("ok", reward) or (failure kind, message)."""
    if not isinstance(value, numbers.Real):  # str "1", None, a tensor, a list: not rewards
        return "non-numeric", f"returned {type(value).__name__} {str(value)[:60]!r}, expected a real number"
    value = float(value)
    if not math.isfinite(value):
        return "non-finite", f"returned {value}"
    return "ok", value


def _worker_main(conn, spec: str) -> None:
    _drop_forkserver_lifeline()  # (set only in a forkserver child)
    die_with_parent(signal.SIGKILL)
    try:
        fn = resolve_reward_fn(spec)
        if spec == "math":  # pay sympy's import and grammar set-up before the first timed check
            math_reward("\\boxed{1}", "1")
    except BaseException as e:  # report why instead of dying silently
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if msg is None:
            return
        idx, completion, answer, record = msg
        try:
            status, value = _check_result(fn(completion, answer, record))
        except Exception as e:  # the check failed, the worker is fine
            status, value = "raised", f"{type(e).__name__}: {e}"
        if status != "ok":
            value = " ".join(str(value).split())[:300]  # one line
        conn.send((idx, status, value))


class _Worker:
    def __init__(self, ctx, spec: str):
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True, name="megatron-dppo-reward")
        self.proc.start()
        child.close()  # so the parent sees EOF when the worker dies
        self.conn = parent
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None  # index of the completion being checked
        self.task_started = 0.0
        self.deadline = math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _record_id(record, idx: int) -> str:
    rid = getattr(record, "id", None)
    if rid is None and isinstance(record, dict):
        rid = record.get("id")
    return str(rid) if rid is not None else f"#{idx}"


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
        self._workers = [_Worker(self._ctx, kind) for _ in range(num_workers)]
        self.totals = {"checks": 0, "failed": 0, "restarts": 0, "by_kind": {}}
        self._returned_n, self._returned_s = 0, 0.0  # checks that returned, and their time
        self._closed = False
        self._wait_ready()

    # A worker's first message is ("ready", None) or ("fatal", why).
    def _handle_startup(self, w: _Worker) -> None:
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
        self._workers[i] = _Worker(self._ctx, self.kind)
        self.totals["restarts"] += 1

    def _budget_s(self, n: int) -> float:
        """The call's time budget (module docstring): fixed, or room for one round of hung
        checks plus 4x the measured healthy workload."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        mean = self._returned_s / self._returned_n if self._returned_n else 0.0
        return 2 * self.timeout_s + 4 * math.ceil(n / len(self._workers)) * mean

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
        t0 = time.monotonic()
        rewards = [0.0] * n
        pending = deque(range(n))
        by_kind: dict[str, int] = {}
        first: list[str] = []

        def fail(idx: int, kind: str, why: str) -> None:
            by_kind[kind] = by_kind.get(kind, 0) + 1
            if len(first) < MAX_FIRST_FAILURES:
                rec = None if records is None else records[idx]
                first.append(f"record {_record_id(rec, idx)}: {kind}: {why}")

        remaining = n
        starting_s = 0.0  # time in which no worker was ready (all starting): not charged to the call
        while remaining:
            call_deadline = t0 + starting_s + self._budget_s(n)
            # Hand one check to each idle, ready worker.
            for i, w in enumerate(self._workers):
                if w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    msg = (idx, completions[idx], answers[idx], None if records is None else records[idx])
                    try:
                        w.conn.send(msg)
                    except (BrokenPipeError, ConnectionResetError, EOFError):  # died while idle: retry
                        pending.appendleft(idx)
                        self._replace(i)
                        continue
                    except Exception as e:  # pickling: the caller's record, not the verifier
                        raise ValueError(
                            f"record {_record_id(msg[3], idx)} cannot be sent to a reward "
                            f"worker: {type(e).__name__}: {e}"
                        ) from None
                    now = time.monotonic()
                    w.task, w.task_started, w.deadline = idx, now, now + self.timeout_s
            now = time.monotonic()
            none_ready = not any(w.ready for w in self._workers)
            wake = min([w.deadline for w in self._workers if w.task is not None] + [call_deadline, now + 1.0])
            ready = wait([w.conn for w in self._workers], timeout=max(0.0, wake - now))
            if none_ready:
                starting_s += time.monotonic() - now
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
                        fail(
                            w.task,
                            "worker-died",
                            f"the worker process exited (code {w.proc.exitcode}) during the check",
                        )
                        remaining -= 1
                    self._replace(i)
                    continue
                self._returned_n += 1
                self._returned_s += time.monotonic() - w.task_started
                if status == "ok":
                    rewards[idx] = value
                else:
                    fail(idx, status, value)
                w.task, w.deadline = None, math.inf
                remaining -= 1
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.task is not None and now >= w.deadline:
                    fail(w.task, "timeout", f"no result within timeout_s={self.timeout_s}s (worker replaced)")
                    remaining -= 1
                    self._replace(i)
                elif not w.ready and now - w.started > self.startup_timeout_s:
                    self.close()
                    raise RuntimeError(f"replacement reward worker did not start within {self.startup_timeout_s}s")
            if remaining and now >= t0 + starting_s + self._budget_s(n):  # the call's budget is spent
                budget = self._budget_s(n)
                for i, w in enumerate(self._workers):
                    if w.task is not None:
                        fail(w.task, "deadline", f"still running when the call's budget of {budget:.1f}s ran out")
                        remaining -= 1
                        self._replace(i)
                for idx in pending:
                    fail(idx, "deadline", f"not started: the call's budget of {budget:.1f}s ran out")
                remaining -= len(pending)
                pending.clear()

        failed = sum(by_kind.values())
        self.totals["checks"] += n
        self.totals["failed"] += failed
        for kind, count in by_kind.items():
            self.totals["by_kind"][kind] = self.totals["by_kind"].get(kind, 0) + count
        timeouts = by_kind.get("timeout", 0)
        info = {
            "n": n,
            "failed": failed,
            "timeouts": timeouts,
            "errors": failed - timeouts,
            "seconds": time.monotonic() - t0,
            "budget_s": self._budget_s(n),
            "failures_by_kind": by_kind,
            "first_failures": first,
        }
        if n and failed / n > self.max_error_frac:
            kinds = ", ".join(f"{k} {by_kind[k]}" for k in FAILURE_KINDS if k in by_kind)
            raise RewardFailureError(
                f"reward {self.kind!r}: {failed} of {n} checks failed ({failed / n:.0%}, over "
                f"max_error_frac={self.max_error_frac}): {kinds}; first: " + "; ".join(first),
                info,
            )
        return rewards, info

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
