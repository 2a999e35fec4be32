"""A dedicated rollout rank (parallel.rollout_ranks > 0): a vLLM engine and, on each engine's
leader, the reward workers, serving training rank 0's requests in the order it sends them:

    ("wave", WaveRequest)   generate this engine's slice, score it; reply with an EnginePart
    ("weights", version)    the policy's new weights follow on the weights bridge; reload them, and
                            check that the engine read the stream to its end marker
    ("adapters", version)   LoRA: the adapters follow, one bucket; load them in place (train/weight_sync.py)
    ("eval", {step, dump})  the eval: sets over the rollout ranks' engines; reply with the metrics
    ("stop", None)          close and exit

Requests are read, and the weights after them staged, by one thread while the engine works on
the earlier ones; replies are sent by another (train/rollout_mail.py), so up to
trainer.max_staleness steps' rounds can be queued and the engine starts the next one at once. The
engine takes them in the order they were sent: a wave samples with the last weights sent before it.

The rollout ranks' own world (run/bridge.split_world) is vLLM's: an engine of parallel.rollout_tp
ranks is tensor parallel over them, as colocated engines are over the trainer's world.

A signal (SIGTERM from the launcher or a scheduler) does not stop a rollout rank by itself: the
trainer finishes its step, which needs the rollout in flight, saves, and then says stop. When the
training ranks go away without a word (a crash), the next bridge call fails and the rank exits
with an error, which ends the job; a rollout rank that goes away is reported by training rank 0
the same way (RolloutRanksGone: which rank, at which step, the checkpoint --resume would use).

A start-up failure of the training ranks cannot say stop over the bridge: the rollout ranks may
still be starting their engines or sending their start-up reports, and a broadcast would wait for
them until a watchdog fired. Training rank 0 leaves the word in the bridge's store instead
(stop_without_waiting), which a thread of each rollout rank looks for (watch_for_stop): the rank
says so and exits at once, status 0 (the training rank's error is the job's).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import torch

from megatron_dppo.config import Config
from megatron_dppo.rewards import RewardScorer
from megatron_dppo.run.bridge import BridgeBroken, Roles
from megatron_dppo.run.process import rank_prefix, set_rank_name
from megatron_dppo.run.watchdog import StallWatchdog, default_store
from megatron_dppo.train import startup
from megatron_dppo.train.partial_rollout import ChunkedRounds
from megatron_dppo.train.rollout_mail import (
    GONE,
    Inbox,
    Outbox,
    TrainingRanksGone,
    load_staged_weights,
)
from megatron_dppo.train.step_rollout import EnginePlace, EngineWorker
from megatron_dppo.train.weight_sync import AdapterSync


class RolloutRanksGone(RuntimeError):
    """Training rank 0's side: the bridge to a rollout rank broke in the middle of the run."""


# Tests of partial rollouts: wait for the next weights at a round's first chunk boundary (newer_weights)
SWITCH_WAIT = "MEGATRON_DPPO_PARTIAL_SWITCH_WAIT"
STOP_KEY = "stop"  # in the control bridge's store: training rank 0's word to stop, when it cannot broadcast it
STOP_POLL_S = 0.5  # how often a rollout rank looks for it (a store request: cheap, even for many ranks)


def serve(cfg: Config, roles: Roles) -> int:
    """Run this rollout rank until training rank 0 says stop. -> the process's exit status: 0, or
    128 + the signal that arrived meanwhile (the run as a whole was interrupted)."""
    set_rank_name(f"rank {roles.rank} (rollout rank {roles.local_rank})")
    signalled = _note_signals()
    watcher = watch_for_stop(roles.control.store, lambda why: _exit_on_stop(why, signalled))
    inputs = startup.load_inputs(cfg)
    startup.resolve_config(cfg, inputs, world=roles.world)
    rollout_world = roles.rollout_ranks
    watchdog = StallWatchdog(
        cfg.trainer.stall_timeout_s,
        start_timeout_s=cfg.trainer.start_timeout_s,
        rank=roles.local_rank,
        world=rollout_world,
        store=default_store(),
        role="rollout",
        first_rank=roles.train_ranks,
    ).start()
    engine = scorer = adapter_sync = None
    stopped = False
    try:
        watchdog.phase("start engine")
        engine, init_s = startup.start_engine(cfg, dedicated=True)
        torch.set_num_threads(cfg.trainer.threads)  # vLLM's start-up changed the thread count
        place = EnginePlace.of_rank(roles.local_rank, rollout_world, cfg.parallel.rollout_tp)
        scorer = RewardScorer.from_config(cfg.reward) if place.leader else None
        worker = EngineWorker(cfg, engine=engine, place=place, tokenizer=inputs.tokenizer, scorer=scorer)
        control, weights = roles.control, roles.weights
        reward = scorer.describe() if scorer is not None else None
        _call(control.gather_objects, {"init_s": init_s, "logprobs_mode": engine.logprobs_mode, "reward": reward})
        # From here requests come in and replies go out on threads of their own (train/rollout_mail.py)
        inbox, outbox = Inbox(control, weights), Outbox(roles.replies)

        def load_sync(kind, payload) -> None:
            """A staged sync into the engine: the weights, or LoRA's adapters (train/weight_sync.py)."""
            nonlocal adapter_sync
            version, staged = payload
            watchdog.phase(f"load {kind}", version)
            if kind == "weights":
                load_staged_weights(engine, staged, version)
            else:
                adapter_sync = adapter_sync or AdapterSync(cfg)
                adapter_sync.load(engine, staged, version)
            inbox.loaded()
            worker.weights_version = version

        def newer_weights(wanted_by: int, started: bool) -> bool:
            """rollout.partial: between chunks of the rounds in flight (the earliest for step
            `wanted_by`), load the weights that arrived meanwhile. Under SWITCH_WAIT (tests: a switch
            where timing would decide) it first waits for them once a round has tokens, when the
            trainer will send newer weights before it needs that round."""
            if os.environ.get(SWITCH_WAIT) and started and worker.weights_version < wanted_by - 1:
                inbox.wait_for_sync()
            sync = inbox.take_sync()
            if sync is not None:
                load_sync(*sync)
            return sync is not None

        rounds = ChunkedRounds(worker, newer_weights) if cfg.rollout.partial else None
        idle = 0.0  # seconds spent waiting for a request since the last reply to a wave
        while True:
            if rounds is not None and not rounds.empty:  # partial rollouts: a chunk of every round in flight
                for req in inbox.take_waves_at_head():
                    rounds.admit(req)
                watchdog.phase("rollout", rounds.rounds[0].req.step)
                rounds.step()
                for part in rounds.finished():
                    part.seconds["idle"], idle = idle, 0.0
                    outbox.put(part)
                continue
            watchdog.phase("wait for the trainer")
            t0 = time.perf_counter()
            kind, payload = inbox.take()
            idle += time.perf_counter() - t0
            if kind == "stop":
                outbox.close()  # the trainer read every reply before it said stop
                stopped = True
                break
            if kind in Inbox.SYNCS:
                load_sync(kind, payload)
                del payload
            elif kind == "wave" and rounds is not None:
                rounds.admit(payload)
            elif kind == "wave":
                watchdog.phase("rollout", payload.step)
                part = worker.part(payload)
                if place.leader:
                    part.seconds["idle"] = idle
                outbox.put(part)
                idle = 0.0
            elif kind == "eval":
                watchdog.phase("eval", payload["step"])
                metrics = worker.evaluate(
                    inputs.eval_sets,
                    renderer=inputs.renderer,
                    step=payload["step"],
                    dump_dir=payload["dump_dir"],
                    is_main=roles.local_rank == 0,
                )
                outbox.put(metrics)
            else:
                raise RuntimeError(f"rollout rank: unknown request {kind!r} from the trainer")
    finally:
        watcher.set()
        watchdog.stop()
        for part in (scorer, engine, adapter_sync):
            if part is not None:
                part.close()
        if torch.distributed.is_initialized():
            if stopped:  # every rollout rank got the stop: none is still in a collective
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 128 + signalled[0] if signalled else 0


def _call(fn, *args):
    """A bridge call; a broken bridge (the training ranks are gone) as TrainingRanksGone."""
    try:
        return fn(*args)
    except BridgeBroken:
        raise TrainingRanksGone(GONE) from None


def _note_signals() -> list[int]:
    """SIGTERM / SIGINT: say so once and carry on (the trainer decides when to stop); -> a list
    that holds the first signal's number once one arrived."""
    seen: list[int] = []

    def handler(signum, frame):
        if not seen:
            seen.append(signum)
            name = signal.Signals(signum).name
            os.write(2, f"{rank_prefix()}{name} received: serving until the trainer stops\n".encode())

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)
    return seen


# ---- a stop that waits for nobody (start-up failures) -------------------------------------------------
def stop_without_waiting(control, why: str) -> None:
    """Training rank 0: tell the rollout ranks to exit through the bridge's store (module docstring),
    `why` being the line they print. A store that is gone too leaves them to find the bridge broken."""
    try:
        control.store.set(STOP_KEY, why)
    except Exception:  # noqa: BLE001 - nothing more to tell them with
        pass


def watch_for_stop(store, on_stop, every_s: float = STOP_POLL_S) -> threading.Event:
    """A daemon thread that calls on_stop(why) once training rank 0 left STOP_KEY in store (through a
    clone of it: its own connection); -> the Event that ends the thread."""
    done = threading.Event()
    own = store.clone()

    def watch():
        while not done.wait(every_s):
            try:
                if own.check([STOP_KEY]):
                    on_stop(own.get(STOP_KEY).decode())
                    return
            except Exception:  # noqa: BLE001 - a store that went away: the bridge calls find the trainer gone
                pass

    threading.Thread(target=watch, name="rollout-stop-watch", daemon=True).start()
    return done


def _exit_on_stop(why: str, signalled: list[int]) -> None:
    """The main thread may be starting the engine or blocked in a bridge call: say why and exit the
    process from here (os._exit, as the stall watchdog does), 0 or 128 + a signal that came meanwhile."""
    os.write(2, f"{rank_prefix()}{why}: this rollout rank exits\n".encode())
    os._exit(128 + signalled[0] if signalled else 0)


# ---- training rank 0's side ---------------------------------------------------------------------------
@contextmanager
def reporting_rollout_ranks_gone(roles, watchdog, ckpt_dir: str):
    """Around training rank 0's loop: a rollout rank that went away (the bridge broke) ends the run
    with one line that names it, the step, and what --resume would continue from."""
    try:
        yield
    except BridgeBroken:
        raise RolloutRanksGone(rollout_ranks_gone_line(roles, watchdog.step, ckpt_dir)) from None


def rollout_ranks_gone_line(roles, step: int | None, ckpt_dir: str) -> str:
    """'rank 1 (rollout rank 0) went away during step 5 ...: no checkpoint saved for step 5; the last
    is step 4 (...)'. Which rollout rank broke the bridge gloo does not say when there are several."""
    first, count = roles.train_ranks, roles.rollout_ranks
    who = (
        f"rank {first} (rollout rank 0)" if count == 1 else f"one of ranks {first}-{first + count - 1} (rollout ranks)"
    )
    when = f"during step {step}" if step is not None else "before the first step"
    unsaved = f"no checkpoint saved for step {step}" if step is not None else "no checkpoint saved"
    return f"{who} went away {when} (killed, or it failed: see its output): {unsaved}; {_last_checkpoint(ckpt_dir)}"


def _last_checkpoint(ckpt_dir: str) -> str:
    from megatron_dppo.megatron.checkpoint import latest_checkpoint

    try:
        path = latest_checkpoint(ckpt_dir)
    except (OSError, ValueError) as e:
        return f"the last checkpoint cannot be read ({e})"
    if path is None:
        return f"none was saved before it either (none under {ckpt_dir}): --resume has nothing to continue from"
    number = os.path.basename(path).removeprefix("step_")
    which = f"step {int(number)}" if number.isdigit() else os.path.basename(path)
    return f"the last is {which}, {path} (--resume continues from it)"
