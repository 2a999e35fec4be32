"""A reward worker process and the trainer's handle on it.

The worker resolves its reward function once, says ("ready", None) (or ("fatal", why)), then
answers each (idx, completion, answer, record) with (idx, status, value): status "ok" and the
reward, or a failure kind and a one-line message. A None message, or the trainer's end of the
pipe closing, ends it.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import time

from megatron_dppo.process import die_with_parent
from megatron_dppo.rewards.spec import resolve_reward_fn
from megatron_dppo.rewards.verifiers import math_reward


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


def check_result(value) -> tuple[str, float | str]:
    """A reward function's return value -> ("ok", reward) or (failure kind, message)."""
    if not isinstance(value, numbers.Real):  # str "1", None, a tensor, a list: not rewards
        return "non-numeric", f"returned {type(value).__name__} {str(value)[:60]!r}, expected a real number"
    value = float(value)
    if not math.isfinite(value):
        return "non-finite", f"returned {value}"
    return "ok", value


def worker_main(conn, spec: str) -> None:
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
            status, value = check_result(fn(completion, answer, record))
        except Exception as e:  # the check failed, the worker is fine
            status, value = "raised", f"{type(e).__name__}: {e}"
        if status != "ok":
            value = " ".join(str(value).split())[:300]  # one line
        conn.send((idx, status, value))


class Worker:
    """The trainer's handle on one worker process and the check it is running."""

    def __init__(self, ctx, spec: str):
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker_main, args=(child, spec), daemon=True, name="megatron-dppo-reward")
        self.proc.start()
        child.close()  # so the parent sees EOF when the worker dies
        self.conn = parent
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None  # index of the completion being checked
        self.task_started = 0.0
        self.deadline = math.inf

    def start_task(self, idx: int, timeout_s: float) -> None:
        self.task, self.task_started = idx, time.monotonic()
        self.deadline = self.task_started + timeout_s

    def end_task(self) -> None:
        self.task, self.deadline = None, math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()
