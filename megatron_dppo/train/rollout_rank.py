"""A dedicated rollout rank (parallel.rollout_ranks > 0): a vLLM engine and, on each engine's
leader, the reward workers, serving training rank 0's requests in the order it sends them:

    ("wave", WaveRequest)   generate this engine's slice, score it; reply with an EnginePart
    ("weights", version)    the policy's new weights follow on the weights bridge; reload them
    ("eval", {step, dump})  the eval: sets over the rollout ranks' engines; reply with the metrics
    ("stop", None)          close and exit

The rollout ranks' own world (run/bridge.split_world) is vLLM's: an engine of parallel.rollout_tp
ranks is tensor parallel over them, as colocated engines are over the trainer's world.

A signal (SIGTERM from the launcher or a scheduler) does not stop a rollout rank by itself: the
trainer finishes its step, which needs the rollout in flight, saves, and then says stop. When the
training ranks go away without a word (a crash), the next bridge call fails and the rank exits
with an error, which ends the job.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from megatron_dppo.config import Config
from megatron_dppo.rewards import RewardScorer
from megatron_dppo.run.bridge import Roles
from megatron_dppo.run.process import rank_prefix
from megatron_dppo.run.watchdog import StallWatchdog, default_store
from megatron_dppo.train import startup
from megatron_dppo.train.step_rollout import EnginePlace, EngineWorker


class TrainingRanksGone(RuntimeError):
    """The bridge to training rank 0 broke before it said stop (it crashed or was killed)."""


def serve(cfg: Config, roles: Roles) -> int:
    """Run this rollout rank until training rank 0 says stop. -> the process's exit status: 0, or
    128 + the signal that arrived meanwhile (the run as a whole was interrupted)."""
    signalled = _note_signals()
    inputs = startup.load_inputs(cfg)
    startup.resolve_config(cfg, inputs, world=roles.world)
    rollout_world = roles.rollout_ranks
    watchdog = StallWatchdog(
        cfg.trainer.stall_timeout_s,
        start_timeout_s=cfg.trainer.start_timeout_s,
        rank=roles.local_rank,
        world=rollout_world,
        store=default_store(),
    ).start()
    engine = scorer = None
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
        idle = 0.0  # seconds spent waiting for the trainer since the last reply to a wave
        while True:
            watchdog.phase("wait for the trainer")
            t0 = time.perf_counter()
            kind, payload = _call(control.broadcast_object)
            idle += time.perf_counter() - t0
            if kind == "stop":
                stopped = True
                break
            if kind == "weights":
                watchdog.phase("load weights", payload)
                engine.load_weights(_call_iter(weights.receive_buckets()))
                worker.weights_version = payload
            elif kind == "wave":
                watchdog.phase("rollout", payload.step)
                part = worker.part(payload)
                if place.leader:
                    part.seconds["idle"] = idle
                _call(control.gather_objects, part)
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
                _call(control.gather_objects, metrics)
            else:
                raise RuntimeError(f"rollout rank: unknown request {kind!r} from the trainer")
    finally:
        watchdog.stop()
        for part in (scorer, engine):
            if part is not None:
                part.close()
        if torch.distributed.is_initialized():
            if stopped:  # every rollout rank got the stop: none is still in a collective
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 128 + signalled[0] if signalled else 0


def _call(fn, *args):
    """A bridge call; a broken connection (the training ranks are gone) as TrainingRanksGone."""
    try:
        return fn(*args)
    except RuntimeError as e:
        if "Connection closed by peer" in str(e) or "Connection reset" in str(e):
            raise TrainingRanksGone(
                "the training ranks went away without saying stop (see their output): this rollout rank exits"
            ) from None
        raise


def _call_iter(it):
    while True:
        try:
            item = _call(next, it)
        except StopIteration:
            return
        yield item


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
