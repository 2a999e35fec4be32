"""A reward worker process and the trainer's handle on it.

The worker imports every reward function of the scorer once, saying ("importing", spec) before
each (so that the trainer, which never imports user code itself, can name the one that hangs or
crashes), checks that each can be called as the scorer will call it, says ("ready", None) (or
("fatal", (exception type name, why))), then answers each task (task_id, spec, batched, completions, answers, records)
with (task_id, results): one (status, value, extras) per completion, status "ok" with the reward
and its extra numbers, or a failure kind with a one-line message. A None message, or the
trainer's end of the pipe closing, ends it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_dppo.rewards.spec import resolve_reward_fn
from megatron_dppo.rewards.verifiers import BUILTIN_KINDS, math_reward
from megatron_dppo.run.process import die_with_parent

# Imported by multiprocessing's forkserver before it serves (see `protect_forkserver`).
FORKSERVER_PRELOAD = "megatron_dppo.rewards.forkserver_signals"


def protect_forkserver(ctx) -> None:
    """Have the forkserver ignore SIGTERM, as the workers do. The workers are its children and die
    with it (PR_SET_PDEATHSIG), so a SIGTERM to the trainer's process group (torchrun stopping a
    rank sends one) would otherwise kill the checks in flight through the server. It still exits
    when the trainer does (its lifeline pipe closes); it ignores SIGINT on its own. Takes effect
    only if the forkserver has not been started yet in this process (the scorer starts it)."""
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    modules = list(getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"])
    if FORKSERVER_PRELOAD not in modules:
        ctx.set_forkserver_preload(modules + [FORKSERVER_PRELOAD])


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


FLOAT32_MAX = 3.4028234663852886e38  # rewards and their metrics are float32 tensors from here on


def _check_number(value, what: str = "returned") -> tuple[str, float | str]:
    if not isinstance(value, numbers.Real):  # str "1", None, a tensor, a list: not rewards
        return "non-numeric", f"{what} {type(value).__name__} {str(value)[:60]!r}, expected a real number"
    try:
        value = float(value)
    except OverflowError:  # an int past float64
        return "non-finite", f"{what} {str(value)[:60]}, beyond float32's range (|x| <= {FLOAT32_MAX:.7g})"
    if not math.isfinite(value):
        return "non-finite", f"{what} {value}"
    if abs(value) > FLOAT32_MAX:  # finite here, inf once cast
        return "non-finite", f"{what} {value!r}, beyond float32's range (|x| <= {FLOAT32_MAX:.7g})"
    return "ok", value


def _check_extras(value: Mapping) -> tuple[str, dict | str]:
    """The numbers of a returned dict besides 'score' -> ("ok", {name: float}) or ("bad-dict", why)."""
    extras = {}
    for name, x in value.items():
        if name == "score":
            continue
        if not isinstance(name, str) or not name or name == "mean":
            return "bad-dict", (
                f"extra key {name!r}: expected a non-empty str other than 'mean' (reward/<source>/mean is the reward's)"
            )
        status, number = _check_number(x, f"extra {name!r} is")
        if status != "ok":
            return "bad-dict", number
        extras[name] = number
    return "ok", extras


def check_result(value) -> tuple[str, float | str, dict | None]:
    """A reward function's return value -> ("ok", reward, extras) or (failure kind, message, None).
    A number is a reward; a dict needs a numeric 'score' (the reward) and may add extra numbers."""
    extras: dict | str = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            return "bad-dict", f"returned a dict without 'score' (keys {sorted(map(str, value))[:10]})", None
        status, extras = _check_extras(value)
        if status != "ok":
            return status, extras, None
        status, number = _check_number(value["score"], "'score' is")
    else:
        status, number = _check_number(value)
    return (status, number, extras) if status == "ok" else (status, number, None)


def _call_each(fn, completions, answers, records) -> list[tuple]:
    out = []
    for completion, answer, record in zip(completions, answers, records):
        try:
            out.append(check_result(fn(completion, answer, record)))
        except Exception as e:  # the check failed, the worker is fine
            out.append(("raised", f"{type(e).__name__}: {e}", None))
    return out


def _call_batched(fn, completions, answers, records) -> list[tuple]:
    """fn(completions, answers, records) -> one result per completion, each checked on its own."""
    n = len(completions)
    try:
        values = fn(list(completions), list(answers), list(records))
    except Exception as e:  # every check of the batch failed with it
        return [("raised", f"{type(e).__name__}: {e}", None)] * n
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array or a tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"a list of {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
        return [("bad-batch", f"returned {got} for {n} completions, expected a list of {n} results", None)] * n
    return [check_result(v) for v in values]


def _one_line(status: str, value):
    return value if status == "ok" else " ".join(str(value).split())[:300]


def check_signature(fn, spec: str, key: str, batched: bool) -> None:
    """ValueError naming `key` when fn cannot take the scorer's three positional arguments (a
    function whose signature cannot be read, a C builtin, is trusted)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind([], [], []) if batched else signature.bind("", "", None)
    except TypeError as e:
        call = "fn(completions, answers, records)" if batched else "fn(completion, answer, record)"
        raise ValueError(
            f"config key {key!r}: {spec!r} has the signature {signature}, but is called as {call} ({e})"
        ) from None


def _resolve_all(conn, specs: dict[str, str], batched: frozenset) -> dict:
    fns = {}
    for spec, key in specs.items():
        conn.send(("importing", spec))
        fns[spec] = resolve_reward_fn(spec, key)
        if spec not in BUILTIN_KINDS:
            check_signature(fns[spec], spec, key, spec in batched)
        if spec == "math":  # pay sympy's import and grammar set-up before the first timed check
            math_reward("\\boxed{1}", "1")
    return fns


def worker_main(conn, specs: dict[str, str], batched: frozenset = frozenset()) -> None:
    """specs: {spec: the config key it came from}; batched: the specs called with whole batches."""
    # Stopping is the trainer's business: a Ctrl-C or a SIGTERM to the whole process group must
    # neither print a traceback here nor kill a check; the worker dies with the trainer
    # (PR_SET_PDEATHSIG, the pipe closing) or is killed by it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _drop_forkserver_lifeline()  # (set only in a forkserver child)
    die_with_parent(signal.SIGKILL)
    try:
        fns = _resolve_all(conn, specs, batched)
    except BaseException as e:  # report why instead of dying silently
        conn.send(("fatal", (type(e).__name__, str(e))))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if msg is None:
            return
        task_id, spec, batched, completions, answers, records = msg
        results = (_call_batched if batched else _call_each)(fns[spec], completions, answers, records)
        conn.send((task_id, [(status, _one_line(status, value), extras) for status, value, extras in results]))


@dataclass
class Task:
    """Checks sent to a worker as one message: one completion, or a batched function's share of
    the call (all completions of its kind)."""

    id: int
    spec: str
    items: list[int]  # indices into the call's completions
    batched: bool
    timeout_s: float
    timeout_why: str  # how timeout_s was set, for the failure message

    def message(self, completions, answers, records) -> tuple:
        picked = ([xs[i] for i in self.items] for xs in (completions, answers, records))
        return (self.id, self.spec, self.batched, *picked)


class Worker:
    """The trainer's handle on one worker process and the task it is running."""

    def __init__(self, ctx, specs: dict[str, str], batched: frozenset = frozenset()):
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=worker_main, args=(child, specs, batched), daemon=True, name="megatron-dppo-reward"
        )
        self.proc.start()
        child.close()  # so the parent sees EOF when the worker dies
        self.conn = parent
        self.ready = False
        self.importing: str | None = None  # the spec it said it is importing, during start-up
        self.started = time.monotonic()
        self.task: Task | None = None
        self.task_started = 0.0
        self.deadline = math.inf

    def start_task(self, task: Task) -> None:
        self.task, self.task_started = task, time.monotonic()
        self.deadline = self.task_started + task.timeout_s

    def end_task(self) -> None:
        self.task, self.deadline = None, math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()
