"""What a step reports about itself besides its data: the phases' seconds, the optimizer steps'
metrics folded into one row, the rollouts file, and the log's notes on the rollout policy (a gap
without a correction, a correction mask that could not bind)."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager

from megatron_dppo.algorithms import batch, losses
from megatron_dppo.algorithms.records import Group


class PhaseTimer:
    """Seconds per phase of a step; entering a phase is progress for the stall watchdog."""

    def __init__(self, watchdog=None, step=None):
        self.times = {}
        self.watchdog, self.step = watchdog, step

    @contextmanager
    def __call__(self, name):
        if self.watchdog is not None:
            self.watchdog.phase(name, self.step)
        t0 = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def train_metrics(train: list[dict], minibatches: list[batch.MiniBatch]) -> dict:
    """Optimizer-step metrics averaged over the step's updates (max for a max, min for a min), and the packing."""
    out = {"train/optimizer_steps": len(train)}
    if not train:  # nothing was trained this step (every group uninformative)
        return {**out, "train/loss": 0.0, "train/grad_norm": 0.0, "pack/density": 0.0, "tokens/trained": 0}
    for key in train[0]:
        vals = [m[key] for m in train]
        out[f"train/{key}"] = (
            max(vals) if key.endswith("_max") else min(vals) if key.endswith("_min") else sum(vals) / len(vals)
        )
    out["train/first_update_ratio_dev_max"] = train[0]["ratio_dev_max"]
    out["train/logprob_gap_vllm"] = train[0]["logprob_gap_vllm"]  # at the first update: the rollout policy
    if "routing_agreement" in train[0]:  # rollout.routing_replay: routers' own top-k vs vLLM's, at the first update
        del out["train/routing_agreement"]
        out["moe/routing_agreement"] = train[0]["routing_agreement"]
    out["pack/density"] = sum(mb.density for mb in minibatches) / len(minibatches)
    out["tokens/trained"] = sum(mb.tokens for mb in minibatches)
    out["tokens/trained_completion"] = sum(mb.completion_tokens for mb in minibatches)
    return out


def write_rollouts(run_dir: str, step: int, rolled: list[Group], tokenizer) -> None:
    """<run dir>/rollouts/step_N.jsonl (logging.rollouts): one row per generated completion, its
    decoded text, reward, advantage, the weight it trained with (0 when pruned or not selected),
    length, truncation."""
    path = os.path.join(run_dir, "rollouts", f"step_{step:06d}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)

    with open(path, "w") as f:
        for g in rolled:
            for row in g.rollout_rows(decode):
                f.write(json.dumps({"step": step, **row}) + "\n")


# KL(rollout || trained) per token above which a run without a rollout correction is told about
# it: fp32 vLLM against fp32 Megatron measured ~3e-13; a bf16 rollout of the tiny model ~1e-4
# (docs/algorithm.md section 8, docs/gpus.md "bf16 and MoE runs").
ROLLOUT_KL_WARN = 1e-6


def rollout_gap_warning(metrics: dict, correction: str) -> str | None:
    """The line for the first step's log when the rollout policy is measurably not the trained one
    and algorithm.rollout_correction is off; None otherwise."""
    kl = metrics.get("train/rollout_kl_k3", math.nan)
    if correction != "none" or not kl > ROLLOUT_KL_WARN:
        return None
    return (
        f"warning: the rollout policy is not the trained one: KL(rollout || trained) = {kl:.3g} a token "
        f"(k3; > {ROLLOUT_KL_WARN:g}), max ratio {metrics.get('train/rollout_ratio_max', math.nan):.3g}, mean "
        f"|log-prob gap| {metrics.get('train/logprob_gap_vllm', math.nan):.3g}, and algorithm.rollout_correction=none: "
        f"consider algorithm.rollout_correction={losses.recommended_correction(0)}, the lowest-MSE correction "
        "for a numerics gap (docs/algorithm.md section 8)"
    )


def idle_mask_line(metrics: dict, a) -> str | None:
    """The log's note for a rollout-correction mask that could not bind at this step's measured ratios."""
    nan = math.nan
    ranges = {
        "token": (metrics.get("train/rollout_ratio_min", nan), metrics.get("train/rollout_ratio_max", nan)),
        "seq": (metrics.get("train/rollout_seq_geo_min", nan), metrics.get("train/rollout_seq_geo_max", nan)),
    }
    bounds = dict(
        low=a.rollout_correction_low,
        high=a.rollout_correction_high,
        seq_low=a.rollout_correction_seq_low,
        seq_high=a.rollout_correction_seq_high,
    )
    return losses.idle_mask_note(a.rollout_correction, bounds, ranges)


class RolloutPolicyNotes:
    """The log's notes on the rollout policy, each once a run: the gap warning after the run's
    first step, and the first rollout-correction mask found idle."""

    def __init__(self, algorithm, first_step: int):
        self.algorithm, self.first_step, self.mask_named = algorithm, first_step, False

    def lines(self, step: int, metrics: dict) -> list[str]:
        out = []
        if step == self.first_step:
            out.append(rollout_gap_warning(metrics, self.algorithm.rollout_correction))
        if not self.mask_named:
            out.append(idle_mask_line(metrics, self.algorithm))
            self.mask_named = out[-1] is not None
        return [line for line in out if line]
