"""The stall watchdog: a rank that makes no progress for trainer.stall_timeout_s ends the job, saying
which rank and phase everyone waits on.

Without it a stopped or hung rank holds the job forever: in a 2-process run with rank 1 SIGSTOPped
nothing happened for 420 s, rank 0 sitting in a gloo collective (NCCL's own watchdog, on GPUs,
would give up after its timeout without naming the rank that stopped). Here:

  * the main thread marks progress, `watchdog.phase("rollout", step)`, a few attribute writes;
  * a daemon thread per rank publishes a heartbeat (phase, step, time of the last progress, time
    of the beat) every few seconds and at each phase change, under a key of its own in
    torch.distributed's c10d store, the store every rank of the job already reaches (across
    nodes too), through a clone of its client (its own connection: a main thread blocked in a
    store call cannot block the beats);
  * another daemon thread checks the rank's own progress: once none was marked for the timeout,
    it reads the other ranks' heartbeats, prints one line per group of ranks (those whose beats
    stopped, i.e. stopped, dead or hung with the GIL held, first; then those stuck in a phase;
    then those still moving), the main thread's innermost frames, and exits the process with
    STALL_EXIT_CODE through os._exit (the main thread is stuck: nothing else would run). torchrun
    then ends the other ranks. A rank on this host whose process is stopped (SIGSTOP, ctrl-Z) is
    killed first (end_stopped_ranks): a stopped process does not act on torchrun's SIGTERM, and
    torch 2.13's torchrun waits a fixed 30 s before its SIGKILL (--shutdown-timeout does not
    shorten that wait), so the job would outlive the report by half a minute. A checkpoint being
    written stays a .tmp- dir: `latest` keeps naming the last complete one, which --resume
    continues from.

A rank whose main thread is stuck inside C code that holds the GIL cannot run its checker; its
heartbeats stop too, so the other ranks' checkers name it when their own waits reach the timeout.
The timeout must exceed the longest healthy phase: `margin_warning` says when a phase took over
half of it, and `timing_line` gives the longest phase for the run's log. Start-up (model build,
checkpoint load, engine start, and the other ranks' start-up it waits for) lasts until the first
phase at a step; its length depends on the model and the machine's load, not on a step's shape, so
it is watched with its own, longer start_timeout_s (trainer.start_timeout_s): a stall timeout
sized to catch a hung step within seconds does not end a job whose engine takes a minute to start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

STALL_EXIT_CODE = 124  # what `timeout(1)` returns: "ran out of time"
_PREFIX = "megatron_dppo/watchdog/"


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process from /proc/<pid>/stat
    (fields 3 and 22), or None where there is no such process or no /proc. The start time tells a
    process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": the command may hold spaces
    return fields[0], int(fields[19])


def _silent(beat: dict, now: float, stale_s: float) -> bool:
    """No heartbeat for over stale_s: the rank's process is not running (stopped, dead, or holding the GIL)."""
    return now - beat["beat"] > stale_s


def end_stopped_ranks(beats: dict, host: str, now: float, stale_s: float, kill=os.kill) -> list[int]:
    """SIGKILL the ranks whose heartbeats stopped because their process, on this host, is stopped
    (state T), and return them. Only the very process that sent the beat (its pid and start time), and
    only a stopped one: a running or hung rank answers torchrun's SIGTERM itself."""
    killed = []
    for rank, beat in sorted(beats.items()):
        if beat.get("host") != host or not _silent(beat, now, stale_s):
            continue
        # a beat with no start time (sent off Linux) matches no process: left be
        if process_state(beat["pid"]) == ("T", beat.get("started")):
            try:
                kill(beat["pid"], signal.SIGKILL)
                killed.append(rank)
            except OSError:  # gone meanwhile: nothing to end
                pass
    return killed


def default_store():
    """A clone of torch.distributed's default c10d store (own connection, short timeout), or None
    when there is no process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store().clone()
    store.set_timeout(timedelta(seconds=30))
    return dist.PrefixStore(_PREFIX, store)


def _ranks(ranks: list[int], role: str | None = None, first: int = 0) -> str:
    """[0, 2, 3, 4, 7] -> 'ranks 0, 2-4, 7'; [1] -> 'rank 1'. role: the ranks are those of one part of
    the launcher's world (dedicated rollout ranks), whose rank 0 is launcher rank `first`: [0] ->
    'rank 1 (rollout rank 0)', the rank the launcher and the other ranks' lines know first."""
    if role:
        return f"{_ranks([first + r for r in ranks])} ({role} {_ranks(ranks)})"
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _where(phase: str, step) -> str:
    return f"phase {phase}" + (f" at step {step}" if step is not None else "")


def describe_ranks(
    beats: dict, world: int, now: float, timeout_s: float, stale_s: float, role: str | None = None, first: int = 0
) -> list[str]:
    """One line per group of ranks with the same state, the likely culprits first. beats: rank ->
    heartbeat dict (phase, step, progress, beat: wall-clock seconds) for the ranks that sent one.
    role, first: the ranks' names (_ranks)."""
    groups: dict[tuple, list] = {}
    for r in range(world):
        b = beats.get(r)
        if b is None:
            key = (0, "never sent a heartbeat", None, None)
        elif _silent(b, now, stale_s):
            key = (1, "stale", b["phase"], b["step"])
        elif now - b["progress"] >= b.get("timeout", timeout_s):  # a rank in start-up: its start timeout
            key = (3, "waits", b["phase"], b["step"])
        else:
            key = (2, "moving", b["phase"], b["step"])
        groups.setdefault(key, []).append((r, now - b["progress"] if b else 0.0, now - b["beat"] if b else 0.0))
    lines = []
    for (_, kind, phase, step), members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        who = _ranks([m[0] for m in members], role, first)
        idle, silent = max(m[1] for m in members), max(m[2] for m in members)
        if kind == "never sent a heartbeat":
            lines.append(f"{who} never sent a heartbeat (did not start, or died before its first beat)")
        elif kind == "stale":
            lines.append(
                f"{who} last seen in {_where(phase, step)}, {idle:.0f} s ago (no heartbeat for {silent:.0f} s: "
                "stopped, dead, or stuck holding the GIL)"
            )
        elif kind == "waits":
            lines.append(
                f"{who} {'waits' if len(members) == 1 else 'wait'} in {_where(phase, step)} "
                f"(no progress for {idle:.0f} s)"
            )
        else:
            lines.append(
                f"{who} {'is' if len(members) == 1 else 'are'} in {_where(phase, step)} "
                f"(last progress {idle:.0f} s ago)"
            )
    return lines


def _main_thread_frames() -> str:
    """Where the main thread is: its innermost frame and the innermost one of this project."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if f"{os.sep}megatron_dppo{os.sep}" in f.filename]
    picked = [stack[-1]] + ([ours[-1]] if ours and ours[-1] is not stack[-1] else [])
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in picked)


class StallWatchdog:
    """See the module docstring. timeout_s <= 0 disables it (start() does nothing). rank and world
    are those of the ranks that share its store; on dedicated rollout ranks, a part of the launcher's
    world: role ("rollout") and first_rank (the launcher rank of their rank 0) name them in the report."""

    def __init__(
        self,
        timeout_s: float,
        *,
        start_timeout_s: float | None = None,
        rank: int = 0,
        world: int = 1,
        store=None,
        exit=os._exit,
        role: str | None = None,
        first_rank: int = 0,
    ):
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(timeout_s if start_timeout_s is None else start_timeout_s)
        self._starting = True  # until the first phase at a step: watched with start_timeout_s
        self.rank, self.world, self.store = rank, world, store
        self.role, self.first_rank = role, first_rank
        self.beat_s = max(0.2, min(5.0, self.timeout_s / 4))
        self.stale_s = 3 * self.beat_s  # three missed beats: that rank's process is not running
        self._exit = exit
        own = process_state(os.getpid())
        self._started = own[1] if own else None  # None off Linux: end_stopped_ranks leaves this rank be
        self._phase, self._step = "start", None
        self._progress_mono = time.monotonic()  # when the current phase began: the last progress
        self._progress_wall = time.time()
        self.longest = (0.0, "start", None)  # (seconds, phase, step) of the longest phase after start-up
        self._warned = False
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- the main thread's side -------------------------------------------------------------------
    def phase(self, name: str, step: int | None = None) -> None:
        """Progress: the previous phase ended, `name` began (at `step`)."""
        now = time.monotonic()
        took = now - self._progress_mono
        if took > self.longest[0] and not self._starting:  # start-up has its own timeout
            self.longest = (took, self._phase, self._step)
        self._phase, self._step = name, step
        self._starting = self._starting and step is None
        self._progress_mono = now
        self._progress_wall = time.time()
        self._changed.set()  # the heartbeat thread publishes it now (no store call on this thread)

    @property
    def step(self) -> int | None:
        """The step of the phase in progress (None in start-up)."""
        return self._step

    def timing_line(self) -> str:
        took, phase, step = self.longest
        return (
            f"stall watchdog: trainer.stall_timeout_s={self.timeout_s:g}; the longest phase so far took "
            f"{took:.1f} s ({_where(phase, step)})"
        )

    def margin_warning(self) -> str | None:
        """Once: a warning when a phase took over half the timeout (a slower one would end the run)."""
        took, phase, step = self.longest
        if self._warned or self.timeout_s <= 0 or took <= self.timeout_s / 2:
            return None
        self._warned = True
        return (
            f"warning: {_where(phase, step)} took {took:.0f} s, over half of trainer.stall_timeout_s="
            f"{self.timeout_s:g}: raise trainer.stall_timeout_s, or a slower phase will be taken for a stall"
        )

    # ---- the threads ---------------------------------------------------------------------------------
    def start(self) -> StallWatchdog:
        if self.timeout_s <= 0 or self._threads:
            return self
        self.phase("start", None)
        for target, name in ((self._beat_loop, "stall-heartbeat"), (self._check_loop, "stall-watchdog")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        for t in self._threads:
            t.join(timeout=2 * self.beat_s + 1)
        self._threads = []

    def _heartbeat(self) -> dict:
        return {
            "phase": self._phase,
            "step": self._step,
            "progress": self._progress_wall,
            "beat": time.time(),
            "timeout": self._timeout()[1],
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self._started,
        }

    def _beat_loop(self) -> None:
        """A beat every beat_s, and one right after each phase change."""
        while self.store is not None and not self._stop.is_set():
            self._changed.clear()
            try:
                self.store.set(f"hb/{self.rank}", json.dumps(self._heartbeat()))
            except Exception:  # noqa: BLE001 - a store that went away: the checker still runs
                pass
            self._changed.wait(self.beat_s)

    def _timeout(self) -> tuple[str, float]:
        """(the option's name, its seconds) that bounds the current phase."""
        if self._starting:
            return "trainer.start_timeout_s", self.start_timeout_s
        return "trainer.stall_timeout_s", self.timeout_s

    def _check_loop(self) -> None:
        while not self._stop.wait(min(self.beat_s, 1.0)):
            idle = time.monotonic() - self._progress_mono
            if idle >= self._timeout()[1]:
                self._report_and_exit(idle)
                return

    def _read_beats(self) -> dict:
        """The other ranks' heartbeats, read within a deadline (a store that hangs cannot hold the exit)."""
        beats: dict = {}
        if self.store is None:
            return beats

        def read():
            for r in range(self.world):
                try:
                    if self.store.check([f"hb/{r}"]):
                        beats[r] = json.loads(self.store.get(f"hb/{r}"))
                except Exception:  # noqa: BLE001 - unreadable: reported as "never sent a heartbeat"
                    pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=10)
        return dict(beats)

    def _name(self) -> str:
        return _ranks([self.rank], self.role, self.first_rank)

    def report_lines(self, idle: float, beats: dict | None = None) -> list[str]:
        beats = self._read_beats() if beats is None else dict(beats)
        beats[self.rank] = self._heartbeat()  # this rank's own state, fresh
        where = _main_thread_frames()
        option, seconds = self._timeout()
        head = (
            f"stall watchdog: {self._name()} made no progress for {idle:.0f} s ({option}={seconds:g}) "
            f"in {_where(self._phase, self._step)}" + (f", at {where}" if where else "")
        )
        described = describe_ranks(
            beats, self.world, time.time(), self.timeout_s, self.stale_s, self.role, self.first_rank
        )
        lines = [head] + ["  " + line for line in described]
        lines.append(
            f"stall watchdog: {self._name()} exits with status {STALL_EXIT_CODE} so that the launcher ends "
            "the job; the last complete checkpoint is kept (--resume continues from it)"
        )
        return lines

    def _report_and_exit(self, idle: float) -> None:
        from megatron_dppo.run.process import rank_prefix

        try:
            beats = self._read_beats()
            lines = self.report_lines(idle, beats)
            others = {r: b for r, b in beats.items() if r != self.rank}
            killed = end_stopped_ranks(others, socket.gethostname(), time.time(), self.stale_s)
            if killed:
                lines.append(
                    f"stall watchdog: {_ranks(killed, self.role, self.first_rank)} stopped (SIGSTOP) on this "
                    "host: killed (SIGKILL), since a stopped process does not act on the launcher's SIGTERM"
                )
            text = "".join(f"{rank_prefix()}{line}\n" for line in lines)
            os.write(2, text.encode())  # not print: the main thread may hold sys.stderr's lock
        finally:
            self._exit(STALL_EXIT_CODE)
