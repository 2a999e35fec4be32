"""Rewards: verifiers run in a fixed pool of worker processes, each check under a timeout.

    scorer = RewardScorer("math", timeout_s=5.0, num_workers=4)   # or "exact", or "pkg.mod:fn"
    rewards, info = scorer.score(completions, answers, records)   # info: timeouts, errors, ...
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

Why processes: math parsing (sympy) can hang or blow up on adversarial model output, and a user
function can crash its interpreter. A check that outlives `timeout_s` gets reward 0, counts as a
timeout, and its worker is killed and replaced; a check that raises, returns a non-finite value,
or kills its process gets 0 and counts as an error. The training step never stalls on a verifier.
Model-generated text is only ever parsed, never executed.

Start method: "forkserver" by default. The trainer process runs OpenMP/gloo/vLLM threads, and
fork()ing a multi-threaded process can leave a lock held forever in the child. "spawn" would also
be safe, but forkserver forks each worker from a small single-threaded server, so replacing a
killed worker costs a fork instead of a fresh interpreter. As with spawn, a script that builds a
scorer needs the `if __name__ == "__main__":` guard. This module imports nothing heavy at top level
so that workers start fast.
"""
from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import time
from collections import deque
from multiprocessing.connection import wait

from megatron_dppo.tasks import exact_match

BUILTIN_KINDS = {
    "exact": "megatron_dppo.rewards:exact_reward",
    "math": "megatron_dppo.rewards:math_reward",
}


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
        rest = text[j + 1:]
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
                return text[j + 1:k]
    return None  # unbalanced: the model stopped mid-answer


def gsm8k_final(text: str) -> str | None:
    """The text after the last "####" (first line of it), GSM8K's answer convention; None if none."""
    i = text.rfind("####")
    if i < 0:
        return None
    ans = text[i + 4:].strip().split("\n", 1)[0].strip()
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
        raise ValueError(f"reward kind must be one of {sorted(BUILTIN_KINDS)} or an import path "
                         f"'pkg.module:function', got {spec!r}")
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj


# ---------------------------------------------------------------------------- worker process

def _worker_main(conn, spec: str) -> None:
    try:
        fn = resolve_reward_fn(spec)
        if spec == "math":  # pay sympy's import and grammar set-up before the first timed check
            math_reward("\\boxed{1}", "1")
    except BaseException as e:  # report why instead of dying silently
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, completion, answer, record = msg
        try:
            r = float(fn(completion, answer, record))
            if not math.isfinite(r):
                raise ValueError(f"reward is not finite: {r}")
            conn.send((idx, "ok", r))
        except Exception as e:  # the check failed, the worker is fine
            conn.send((idx, "error", f"{type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self, ctx, spec: str):
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True,
                                name="megatron-dppo-reward")
        self.proc.start()
        child.close()  # so the parent sees EOF when the worker dies
        self.conn = parent
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None  # index of the completion being checked
        self.deadline = math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardScorer:
    """Scores completions against gold answers in `num_workers` reused processes.

    timeout_s bounds one check, measured from when it is handed to a worker.
    startup_timeout_s bounds a worker's start (imports); exceeding it, or a reward function that
    cannot be imported in the worker, raises RuntimeError: that is a setup error, not a bad sample.
    """

    def __init__(self, kind: str = "exact", timeout_s: float = 5.0, num_workers: int = 2,
                 start_method: str = "forkserver", startup_timeout_s: float = 120.0):
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"need timeout_s > 0 and num_workers >= 1, got {timeout_s}, {num_workers}")
        resolve_reward_fn(kind)  # fail fast, with a clear error, in the caller's process
        self.kind, self.timeout_s, self.startup_timeout_s = kind, timeout_s, startup_timeout_s
        self._ctx = mp.get_context(start_method)
        self._workers = [_Worker(self._ctx, kind) for _ in range(num_workers)]
        self.totals = {"checks": 0, "timeouts": 0, "errors": 0, "restarts": 0}
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

    def _wait_ready(self) -> None:
        while not all(w.ready for w in self._workers):
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

    def score(self, completions: list[str], answers: list[str], records=None):
        """-> (rewards, info). rewards[i] is in the order of completions; a failed check gives 0.0.

        info: n, timeouts, errors, seconds, and `failures`: the first few (index, kind, message).
        """
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        n = len(completions)
        if len(answers) != n or (records is not None and len(records) != n):
            raise ValueError(f"score() got {n} completions, {len(answers)} answers, "
                             f"{None if records is None else len(records)} records")
        t0 = time.monotonic()
        for i, w in enumerate(self._workers):
            if w.task is not None:  # a previous call was interrupted: its late result must not leak in
                self._replace(i)
        rewards = [0.0] * n
        pending = deque(range(n))
        counts = {"timeouts": 0, "errors": 0}
        failures: list[tuple[int, str, str]] = []
        remaining = n

        def fail(idx: int, kind: str, why: str) -> None:
            counts[kind + "s"] += 1
            if len(failures) < 5:
                failures.append((idx, kind, why))

        while remaining:
            # Hand one check to each idle, ready worker.
            for i, w in enumerate(self._workers):
                if w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    msg = (idx, completions[idx], answers[idx], None if records is None else records[idx])
                    try:
                        w.conn.send(msg)
                    except (BrokenPipeError, OSError):  # died while idle: replace, retry the check
                        pending.appendleft(idx)
                        self._replace(i)
                        continue
                    w.task, w.deadline = idx, time.monotonic() + self.timeout_s
            now = time.monotonic()
            deadline = min([w.deadline for w in self._workers if w.task is not None] or [now + 1.0])
            ready = wait([w.conn for w in self._workers], timeout=max(0.0, deadline - now))
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
                        fail(w.task, "error", f"worker died (exit code {w.proc.exitcode})")
                        remaining -= 1
                    self._replace(i)
                    continue
                if status == "ok":
                    rewards[idx] = value
                else:
                    fail(idx, "error", value)
                w.task, w.deadline = None, math.inf
                remaining -= 1
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.task is not None and now >= w.deadline:
                    fail(w.task, "timeout", f"no result within {self.timeout_s}s")
                    remaining -= 1
                    self._replace(i)
                elif not w.ready and now - w.started > self.startup_timeout_s:
                    self.close()
                    raise RuntimeError(f"replacement reward worker did not start within {self.startup_timeout_s}s")

        self.totals["checks"] += n
        self.totals["timeouts"] += counts["timeouts"]
        self.totals["errors"] += counts["errors"]
        info = {"n": n, **counts, "seconds": time.monotonic() - t0, "failures": failures}
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
