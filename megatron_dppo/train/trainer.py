"""The DPPO training loop. One step, top to bottom, is `Trainer.step`:

    prompts -> prune prompts (history) -> rollout (vLLM) -> rewards -> [refill] -> group advantages
    -> prune completions -> pack (THD) -> old/ref log-probs -> optimizer step(s) -> weight sync -> log

Everything distributed is decided identically on every rank: the prompt batch (same sampler
seed), the pruning masks (a generator seeded by (seed, step)), the packs, and each completion's
sampling seed (from its prompt's place in the step, never from a rank). The prompts of a round
are split over the vLLM engines (one per `parallel.rollout_tp` ranks); every rank of an engine
generates the same slice, its first rank scores it, and the groups are gathered once. Each
data-parallel rank then trains on its share of the packs. Megatron details live in
megatron_dppo/megatron/, host-side collectives in megatron_dppo/run/collectives.py.

With dedicated rollout ranks (parallel.rollout_ranks) the engines run on other processes
(train/rollout_rank.py) and the same step sends them its requests; at trainer.max_staleness = k >= 1
the step also keeps the next k steps' first rounds drawn and sent before its own update, so that
rollout runs while this step trains (docs/algorithm.md section 10).

Beside it: start-up in startup.py, checkpoints, resume and HF exports in checkpointing.py, the
held-out evaluation in evaluation.py, the step's metrics and log notes in metrics.py.

megatron_dppo.megatron (megatron.core) is imported inside the functions that use it, here and in
the files beside it: importing the trainer (the CLI, the unit tests) then costs no Megatron import.
"""

from __future__ import annotations

import gc
import math
import os
import time

import torch

from megatron_dppo.algorithms import batch
from megatron_dppo.algorithms.batch import Method
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.pruning import get_strategy
from megatron_dppo.algorithms.records import (
    Group,
    RolloutCounts,
    policy_lags,
    rollout_metrics,
    size_runs,
    stack_rewards,
)
from megatron_dppo.config import Config, save_config
from megatron_dppo.rewards import RewardScorer, reward_metrics_by_source
from megatron_dppo.run import collectives as mdist
from megatron_dppo.run.log import RunLogger, phase_summary
from megatron_dppo.run.process import malloc_trim
from megatron_dppo.run.profiling import PHASES
from megatron_dppo.train import microbatches, startup
from megatron_dppo.train.checkpointing import Checkpoints
from megatron_dppo.train.evaluation import Evaluation
from megatron_dppo.train.metrics import PhaseTimer, RolloutPolicyNotes, train_metrics, write_rollouts
from megatron_dppo.train.rollout_rank import reporting_rollout_ranks_gone, stop_without_waiting
from megatron_dppo.train.signals import StopNow, StopRequested, stop_on_signals
from megatron_dppo.train.step_rollout import PendingRound, StepRollout
from megatron_dppo.train.weight_sync import WeightSync

__all__ = ["NonFiniteError", "StopNow", "StopRequested", "Trainer"]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The pruning masks' generator: the same on every rank, a new stream every step."""
    from megatron_dppo.rollout.vllm_engine import request_seed

    return torch.Generator().manual_seed(request_seed("masks", seed, step))


class NonFiniteError(RuntimeError):
    """A weight, loss or gradient became NaN or infinite: the run stops, naming the tensor."""


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, overwrite: bool = False, roles=None):
        """Start-up in the order its parts depend on each other: inputs checked before anything
        slow; the config resolved before it is read; the parallel state before the policy; the
        vLLM engine after the policy and BEFORE any weights are loaded (it starts with dummy
        weights and reseeds the global RNGs, so the RNG is seeded or restored after it), then the
        policy's weights (HF, model.init_checkpoint or the run's checkpoint) synced into it. A
        failure on the way closes what was started (reward workers, the engine, process groups).

        roles: this training rank's run/bridge.Roles when parallel.rollout_ranks > 0 (the engines
        live on the rollout ranks, train/rollout_rank.py); None: colocated, an engine per rank."""
        self.roles = roles
        try:
            self._start(cfg, resume, overwrite)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: Config, resume: bool, overwrite: bool) -> None:
        from megatron_dppo.megatron import data_parallel_rank_and_size, initialize_parallel

        inputs = startup.load_inputs(cfg)
        self.config_warnings, self.model_dir, self.tokenizer = inputs.warnings, inputs.model_dir, inputs.tokenizer
        self.hf_config, self.renderer, self.data = inputs.hf_config, inputs.renderer, inputs.data
        startup.resolve_config(cfg, inputs)
        self.cfg = cfg
        paths = startup.plan_run(cfg, resume, overwrite)
        self.run_dir, self.ckpt_dir = paths.run_dir, paths.ckpt_dir
        pc = cfg.parallel
        initialize_parallel(
            pc.tp, pc.pp, seed=cfg.trainer.seed, ep=pc.ep, etp=pc.etp, timeout_minutes=pc.timeout_minutes
        )
        self.rank, self.world = startup.claim_run_dir(paths.plan)
        self.is_main = self.rank == 0
        self.watchdog = startup.start_watchdog(cfg, self.rank, self.world)
        self.dp_rank, self.dp_size = data_parallel_rank_and_size()
        self.policy = startup.build_policy(cfg, self.hf_config)
        self.strategy = get_strategy(cfg.pruning.strategy)
        self.method = Method.from_config(cfg, self.strategy)
        self.curriculum = self.method.curriculum.build(  # AdaPrefix's per-problem prefixes, or None
            cfg, records=inputs.data.records, tokenizer=inputs.tokenizer, renderer=inputs.renderer
        )
        self.aux_tokens = self.method.aux.tokens(self.tokenizer, self.renderer)  # SSOPD's teacher-prompt ids
        self.history = PromptHistory(ema=cfg.pruning.history_ema)
        self.pending: list[PendingRound] = []  # the next steps' first rounds, in flight (max_staleness=k)
        self.scorer = None if self.roles else RewardScorer.from_config(cfg.reward)
        self.pack_layout = startup.pack_layout(cfg, self.tokenizer, self.policy, self.dp_rank, self.dp_size)
        started = startup.start_step_engines(
            cfg, self.roles, tokenizer=self.tokenizer, scorer=self.scorer, watchdog=self.watchdog
        )
        self.engine, self.engines = started.engine, started.engines
        self.weight_sync = WeightSync(cfg, self.policy, engine=self.engine, engines=self.engines, roles=self.roles)
        self.engine_init_s, self.reward_description = started.init_s, started.reward_description
        self.method.reweighting.check_engine(started.logprobs_mode, cfg.rollout)  # ReCo's: processed log-probs
        torch.manual_seed(cfg.trainer.seed)  # vLLM reseeded the global generators; a resume restores its own
        torch.set_num_threads(cfg.trainer.threads)  # vLLM's start-up changed the thread count
        self.first_step = 1
        self.checkpoints = Checkpoints(
            cfg,
            paths,
            policy=self.policy,
            data=self.data,
            strategy=self.strategy,
            curriculum=self.curriculum,
            is_main=self.is_main,
            watchdog=self.watchdog,
        )
        self.watchdog.phase("load weights")
        # A resumed run without a KL term reads neither HF weights nor init_checkpoint: the
        # checkpoint (policy, optimizer, RNG, history) overwrites the policy anyway. LoRA's checkpoint
        # holds the adapters only: the frozen base is always read.
        if not (resume and self.policy.reference is None and self.policy.adapters is None):
            startup.load_starting_weights(cfg, self.policy, self.model_dir)
        if resume:
            restored = self.checkpoints.restore(
                paths.resume_path, rolls_ahead=cfg.trainer.max_staleness if self.roles else 0
            )
            self.first_step, self.history, self.pending = restored.step + 1, restored.history, restored.pending
        self.rollout = StepRollout(  # after the resume: it reads the restored prompt history
            cfg,
            self.method,
            engines=self.engines,
            renderer=self.renderer,
            history=self.history,
            curriculum=self.curriculum,
            watchdog=self.watchdog,
        )
        self.evaluation = Evaluation(
            cfg.trainer.eval_every,
            inputs.eval_sets,
            engines=self.engines,
            renderer=self.renderer,
            run_dir=self.run_dir,
            is_main=self.is_main,
            watchdog=self.watchdog,
        )
        self._check_finite("the starting weights", grads=False)
        self.weight_sync.push(self.first_step - 1, start=True)
        if self.is_main:
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.logger = RunLogger(self.run_dir, cfg, cfg.trainer.max_steps, self.first_step, enabled=self.is_main)
        # Everything built so far lives as long as the run: keep the garbage collector from walking
        # it again and again (its pauses of 0.3-0.7 s landed inside train steps: docs/packing.md).
        gc.collect()
        gc.freeze()

    # ---- the step ------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, tc = self.cfg, self.cfg.trainer
        timer = PhaseTimer(self.watchdog, step)
        self.watchdog.phase("prompts", step)
        t_step = time.perf_counter()
        pending = self.pending.pop(0) if self.pending else None  # round 0, drawn and sent in an earlier step
        if pending is not None and pending.step != step:
            raise RuntimeError(f"step {step} found step {pending.step}'s rollout in flight")
        gen = pending.generator if pending else step_generator(tc.seed, step)
        counts = pending.counts if pending else RolloutCounts()
        first_parts = pending.take_parts(self.engines, timer) if pending else None

        collected = batch.collect(  # prompts -> prune prompts -> rollout -> rewards [-> refill]
            self.method,
            self.strategy,
            next_batch=self.data.next_batch,
            stats_of=self.history.stats,
            rollout=lambda rnd, items: self.rollout(
                step, rnd, items, counts, timer, first_parts=first_parts if rnd == 0 else None
            ),
            generator=gen,
            first_round=pending.round if pending else None,
        )
        counts.prompts_drawn = collected.drawn
        if collected.rolled:
            for run in size_runs(collected.rolled):  # one run unless BPPO's waves
                self.strategy.observe([g.record.id for g in run], stack_rewards(run))
        curriculum_metrics = self.curriculum.observe(collected.rolled, step) if self.curriculum else {}
        lag_metrics = self._check_staleness(collected.trained, step)
        if tc.max_staleness and self.roles:
            # The next k steps' first rounds roll out on the rollout ranks while this step trains:
            # the one drawn now after this step's rollout reached the history (k = 1: as the
            # colocated run draws it), each sampled by the last weights sent before it.
            self._keep_rounds_in_flight(step)
        if self.engine is not None:
            # GPU: give the KV cache (and weights) back to training. LoRA: level 1 at most, since level 2
            # drops the base weights and its sync sends the adapters alone (a no-op on the CPU)
            level = min(cfg.rollout.sleep_level, 1) if self.policy.adapters is not None else cfg.rollout.sleep_level
            self.engine.sleep(level)
        # advantages on the FULL group, then completion pruning
        plan_metrics = batch.weigh_completions(self.method, self.strategy, collected.trained, gen)
        minibatches = batch.plan_minibatches(self.method, collected.trained, collected.drawn)
        for mb in minibatches:  # pack (THD)
            mb.microbatches, mb.density = microbatches.pack_samples(mb.samples, self.pack_layout)
        plan_metrics.update(  # + an aux loss's micro-batches (SSOPD's pairs), packed on their own
            self.method.aux.pack(
                minibatches, tokens=self.aux_tokens, layout=self.pack_layout, max_context=cfg.rollout.max_model_len
            )
        )
        needs_old = batch.needs_old_logprobs(self.method, minibatches)
        if minibatches and (needs_old or self.method.needs_reference):
            with timer("logprob"):  # pi_old = the weights before the first update (colocated: the rollout policy)
                for mb in minibatches:
                    microbatches.attach_logprobs(
                        self.policy, self.method, mb.microbatches, old=needs_old, ref=self.method.needs_reference
                    )
                if self.method.reweighting.needs_token_scale:  # ReCo's c_t = g_t / the step's mean g
                    last_stage = [mbt for mb in minibatches for mbt in mb.microbatches]
                    mean = self.method.reweighting.attach_token_scale(last_stage, mdist.all_reduce_sum)
                    plan_metrics["reco/impurity_mean"] = mean
        train = []
        with timer("train"):
            for _ in range(tc.epochs_per_step):  # update
                for mb in minibatches:
                    train.append(self.policy.train_step(mb.microbatches + mb.aux_microbatches, mb.denominator))
                    if not (math.isfinite(train[-1]["loss"]) and math.isfinite(train[-1]["grad_norm"])):
                        self._check_finite(f"step {step}'s update", grads=True)
        with timer("sync"):
            self.weight_sync.push(step)  # the new weights (LoRA: adapters) to vLLM

        metrics = {"step": step, **rollout_metrics(collected.trained, collected.rolled, counts), **plan_metrics}
        metrics.update(curriculum_metrics)
        metrics.update(lag_metrics)
        metrics["sync/bytes"] = self.weight_sync.bytes  # what this rank sent or loaded (LoRA: the adapters alone)
        rolled = collected.rolled
        metrics.update(
            reward_metrics_by_source(
                [r for g in rolled for r in g.rewards],
                [g.record for g in rolled for _ in g.rewards],
                [e for g in rolled for e in g.reward_extras],
            )
        )
        metrics.update(train_metrics(train, minibatches))
        metrics.update({f"time/{name}": timer.times.get(name, 0.0) for name in PHASES})
        if self.roles:  # the engines' own time (on the rollout ranks), and the trainer's wait for them
            metrics.update({f"time/{name}": counts.engine_seconds.get(name, 0.0) for name in ("rollout", "reward")})
            metrics["time/rollout_wait"] = timer.times.get("rollout_wait", 0.0)
            metrics["time/engine_idle"] = counts.engine_seconds.get("idle", 0.0)
        metrics["time/step"] = time.perf_counter() - t_step
        if counts.first_failures and self.is_main:
            self.logger.message(
                f"step {step}: {sum(counts.reward_failures.values())} reward checks failed "
                f"{counts.reward_failures} (reward {self.reward_description}); first: "
                + " | ".join(counts.first_failures)
            )
        if cfg.logging.rollouts and self.is_main:
            write_rollouts(self.run_dir, step, collected.rolled, self.tokenizer)
        return metrics

    # ---- the parts of a step ---------------------------------------------------------------------
    def _check_finite(self, what: str, grads: bool) -> None:
        """Stop (on every rank) when any rank holds a non-finite weight, or gradient, naming it.
        Called on the starting weights and whenever an update's loss or grad norm is not finite."""
        for kind, of_grads in [("gradients", True), ("weights", False)][0 if grads else 1 :]:
            names = sorted({n for part in mdist.all_gather_objects(self.policy.non_finite(of_grads)) for n in part})
            if names:
                where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                raise NonFiniteError(f"{what}: non-finite (NaN or inf) {kind} in {where}")
        if grads:
            raise NonFiniteError(f"{what}: the loss or the gradient norm is not finite (weights and gradients are)")

    def _keep_rounds_in_flight(self, step: int) -> None:
        """Draw and send the first rounds of steps step+1 .. step+k not yet sent (k =
        trainer.max_staleness; none past trainer.max_steps), each with its own generator
        (continued by its step), without waiting."""
        tc = self.cfg.trainer
        nxt = self.pending[-1].step + 1 if self.pending else step + 1
        for later in range(nxt, min(step + tc.max_staleness, tc.max_steps) + 1):
            gen = step_generator(tc.seed, later)
            first = batch.draw_round(self.method, self.strategy, self.data.next_batch, self.history.stats, gen)
            ticket = self.rollout.submit_first(later, 0, first.kept())
            self.pending.append(PendingRound(later, first, gen, RolloutCounts(), ticket=ticket))

    def _check_staleness(self, trained: list[Group], step: int) -> dict:
        """With dedicated rollout ranks: how many updates behind the trained weights (step - 1)
        each trained group's sampling weights were; more than trainer.max_staleness is a bug."""
        if not self.roles:
            return {}
        lags = policy_lags(trained, step - 1)  # completion by completion (BPPO's later waves may be newer)
        if lags and max(lags) > self.cfg.trainer.max_staleness:
            raise RuntimeError(
                f"step {step} would train on completions sampled {max(lags)} updates behind, more than "
                f"trainer.max_staleness={self.cfg.trainer.max_staleness}"
            )
        k = self.cfg.trainer.max_staleness
        return {
            "rollout/policy_lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/policy_lag_max": max(lags, default=0),
            # the histogram, as one scalar per lag 0..k (what every logger plots): completions' fractions
            **{f"rollout/policy_lag_frac_{j}": lags.count(j) / len(lags) if lags else 0.0 for j in range(k + 1)},
        }

    # ---- the loop --------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        tc = self.cfg.trainer
        rows = []
        t0 = time.perf_counter()
        self._log_start()
        row = self.evaluation.before_training() if self.first_step == 1 else None
        if row:
            self.logger.log(row)
            rows.append(row)
        self.last_step = self.first_step - 1
        notes = RolloutPolicyNotes(self.cfg.algorithm, self.first_step)
        self.checkpoints.start_clock()
        with stop_on_signals() as stop, reporting_rollout_ranks_gone(self.roles, self.watchdog, self.ckpt_dir):
            for step in range(self.first_step, tc.max_steps + 1):
                m = self.step(step)
                for line in notes.lines(step, m):
                    self.logger.message(line)
                self.last_step = step
                out_of_time = bool(tc.max_time_s and time.perf_counter() - t0 > tc.max_time_s)
                signalled = mdist.all_reduce_max([stop.requested])[0] > 0  # any rank's signal stops all
                final = step == tc.max_steps or mdist.agree(out_of_time) or signalled
                if not signalled:
                    m.update(self.evaluation.after_step(step, final))
                self.watchdog.phase("log", step)
                if step % 10 == 0:
                    malloc_trim()
                if self.checkpoints.save_due(step, final):
                    for p in self.pending:  # a checkpoint holds the rounds in flight with their completions
                        p.take_parts(self.engines)
                    m.update(self.checkpoints.save(step, m, self.history, self.pending, self.logger))
                self.logger.log(m)  # after the checkpoint, its row staged before it (Checkpoints.save)
                rows.append(m)
                if self.checkpoints.export_due(step, final):
                    # last: its failure loses neither the step's checkpoint nor its row
                    self.checkpoints.export_hf(step)
                margin = self.watchdog.margin_warning()
                if margin:
                    self.logger.message(margin)
                if signalled:
                    self.logger.message(
                        f"stopping after step {step} on {stop.name}: checkpoint saved; continue with --resume"
                    )
                    raise StopRequested(stop.name)
                if final:
                    if step < tc.max_steps:
                        self.logger.message(f"stopping after step {step}: trainer.max_time_s={tc.max_time_s} reached")
                    break
        if self.is_main:
            self.logger.message(phase_summary(rows))
            self.logger.message(self.watchdog.timing_line())
        self.logger.close()
        return rows

    def _log_start(self) -> None:
        """The run's first lines: where it writes, its processes, the engine's start, its attention,
        and the config's warnings."""
        if not self.is_main:
            return
        tc = self.cfg.trainer
        skipped = f"; {self.data.skipped_long} prompts over the length limit skipped" if self.data.skipped_long else ""
        ranks = f"{self.world} process(es)"
        if self.roles:
            ranks = (
                f"{self.world} training + {self.roles.rollout_ranks} rollout process(es), "
                f"trainer.max_staleness={tc.max_staleness}"
            )
        self.logger.message(
            f"run dir {self.run_dir}; {ranks}; "
            f"rollout engine started in {self.engine_init_s:.1f}s{skipped}; {self.policy.attention.describe()}"
            f"{self.weight_sync.describe()}"
        )
        for line in self.config_warnings:
            self.logger.message(line)

    def close(self, stop_rollout_ranks: bool = True) -> None:
        """Safe on a trainer whose start-up failed half-way: closes whatever was started.
        stop_rollout_ranks=False (a second signal: stop at once): the rollout ranks are not waited
        for; they exit when they find this rank gone."""
        from megatron_dppo.megatron import destroy_parallel

        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        if stop_rollout_ranks:
            self._stop_rollout_ranks()
        for part in ("scorer", "weight_sync", "engine", "logger"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
        destroy_parallel()

    def _stop_rollout_ranks(self) -> None:
        """Training rank 0 tells the rollout ranks to stop, after taking the reply to any request in
        flight (they finish it first). They may be gone already (a crash): nothing to tell then."""
        control = self.roles.control if self.roles is not None else None
        if control is None or getattr(self, "_rollout_stopped", False):
            return
        self._rollout_stopped = True
        try:
            engines = getattr(self, "engines", None)
            if engines is None:  # start-up failed before their reports were taken: they may be sending them
                stop_without_waiting(control, "training rank 0 stopped during start-up (its error says why)")
                return
            engines.drain()  # the replies still owed: a rollout rank sends each one before it reads the stop
            control.broadcast_object(("stop", None))
        except RuntimeError:
            pass
