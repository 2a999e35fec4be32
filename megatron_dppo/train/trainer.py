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
"""

from __future__ import annotations

import errno
import gc
import itertools
import json
import math
import os
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megatron_dppo.algorithms import batch, packing
from megatron_dppo.algorithms.batch import Method
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.methods import bppo, reco
from megatron_dppo.algorithms.pruning import get_strategy
from megatron_dppo.algorithms.records import Group, RolloutCounts, rollout_metrics, size_runs, stack_rewards
from megatron_dppo.config import Config, resolve, save_config
from megatron_dppo.data.prompts import PromptDataset, PromptRenderer
from megatron_dppo.model import hf_dir
from megatron_dppo.model.arch import Arch
from megatron_dppo.rewards import RewardScorer, overlong_penalty, reward_metrics_by_source
from megatron_dppo.rollout.validation import engine_generate, load_eval_sets, run_validation
from megatron_dppo.run import collectives as mdist
from megatron_dppo.run.cadence import save_cost_line, should_save
from megatron_dppo.run.identity import check_resume_compatible, resume_metadata
from megatron_dppo.run.log import RunLogger, phase_summary
from megatron_dppo.run.process import malloc_trim, rank_prefix
from megatron_dppo.run.profiling import PHASES
from megatron_dppo.run.run_dir import CHECKPOINTS, make_run_dir, plan_run_dir
from megatron_dppo.run.watchdog import StallWatchdog, default_store
from megatron_dppo.train import preflight

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def step_generator(seed: int, step: int) -> torch.Generator:
    """The pruning masks' generator: the same on every rank, a new stream every step."""
    from megatron_dppo.rollout.vllm_engine import request_seed

    return torch.Generator().manual_seed(request_seed("masks", seed, step))


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived: the loop saves a checkpoint and exits non-zero."""


class StopNow(StopRequested):
    """The signal came again: stop at once, without saving the step in progress."""


class NonFiniteError(RuntimeError):
    """A weight, loss or gradient became NaN or infinite: the run stops, naming the tensor."""


@dataclass
class EnginePart:
    """What one engine's leader sends to every rank after a rollout: its slice's scored groups and
    its counts (other ranks send an empty part)."""

    groups: list[Group] = field(default_factory=list)
    generated_tokens: int = 0
    checks: int = 0
    failures: dict = field(default_factory=dict)  # reward failure kind -> count
    first_failures: list = field(default_factory=list)
    error: str | None = None  # the scorer's error, raised on every rank


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, overwrite: bool = False):
        """Start-up in the order its parts depend on each other: inputs checked before anything
        slow; the config resolved before it is read; the parallel state before the policy; the
        vLLM engine after the policy and BEFORE any weights are loaded (it starts with dummy
        weights and reseeds the global RNGs, so the RNG is seeded or restored after it), then the
        policy's weights (HF, model.init_checkpoint or the run's checkpoint) synced into it. A
        failure on the way closes what was started (reward workers, the engine, process groups)."""
        try:
            self._start(cfg, resume, overwrite)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: Config, resume: bool, overwrite: bool) -> None:
        from megatron_dppo.megatron import initialize_parallel

        self._load_inputs(cfg)
        self._resolve(cfg, resume, overwrite)
        pc = cfg.parallel
        initialize_parallel(
            pc.tp, pc.pp, seed=cfg.trainer.seed, ep=pc.ep, etp=pc.etp, timeout_minutes=pc.timeout_minutes
        )
        self._claim_run_dir()
        self.watchdog = StallWatchdog(
            cfg.trainer.stall_timeout_s, rank=self.rank, world=self.world, store=default_store()
        ).start()
        self._place_ranks()
        self.policy = self._build_policy()
        self.strategy = get_strategy(cfg.pruning.strategy)
        self.method = Method.from_config(cfg, self.strategy)
        self.curriculum = self._curriculum()
        self.history = PromptHistory(ema=cfg.pruning.history_ema)
        self.scorer = RewardScorer.from_config(cfg.reward)
        self.pad_multiple = packing.thd_pad_multiple(cfg.parallel.tp, 1, cfg.parallel.sequence_parallel)
        self.engine = self._start_engine()
        if self.method.reweighting == "reco":  # its response weight needs the sampled distribution's log-probs
            rc = cfg.rollout
            reco.check_logprobs_mode(
                self.engine.logprobs_mode, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k
            )
        torch.manual_seed(cfg.trainer.seed)  # vLLM reseeded the global generators; a resume restores its own
        torch.set_num_threads(cfg.trainer.threads)  # vLLM's start-up changed the thread count
        self.first_step = 1
        self.ckpt_run_id = None  # the run_id its checkpoints carry: the resumed one's, else new at the first save
        self._save_cost_logged = False
        self.watchdog.phase("load weights")
        self._load_weights(resume)
        self._check_finite("the starting weights", grads=False)
        self._sync_weights()
        if self.is_main:
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.logger = RunLogger(self.run_dir, cfg, cfg.trainer.max_steps, self.first_step, enabled=self.is_main)
        # Everything built so far lives as long as the run: keep the garbage collector from walking
        # it again and again (its pauses of 0.3-0.7 s landed inside train steps: docs/packing.md).
        gc.collect()
        gc.freeze()

    # ---- start-up --------------------------------------------------------------------------------
    def _load_inputs(self, cfg: Config) -> None:
        """The model dir, tokenizer and prompts, each checked with a one-line error; prompts that
        cannot fit next to max_new_tokens are found now, naming the record."""
        tc, rc = cfg.trainer, cfg.rollout
        preflight.check_config(cfg)
        self.config_warnings = preflight.config_warnings(cfg)
        if tc.threads:  # loading and the policy's build run with the configured threads too
            torch.set_num_threads(tc.threads)
        self.model_dir, self.tokenizer = hf_dir.check_model(cfg.model.hf_dir)
        self.hf_config = self.model_dir.config
        hf_dir.check_context(rc.max_model_len, cfg.model.hf_dir)
        self.renderer = PromptRenderer(
            self.tokenizer, cfg.data.prompt_mode, cfg.data.system_prompt or None, cfg.data.chat_template_kwargs
        )
        limit = dict(
            max_prompt_tokens=rc.max_model_len - rc.max_new_tokens,
            skip=cfg.data.skip_long_prompts,
            limit_desc=f"rollout.max_model_len {rc.max_model_len} - rollout.max_new_tokens "
            f"{rc.max_new_tokens}; data.skip_long_prompts=true skips them",
        )
        self.data = PromptDataset(
            cfg.data.train,
            tc.prompts_per_step,
            seed=tc.seed,
            limit=cfg.data.train_size,
            renderer=self.renderer,
            max_prompt_tokens=limit["max_prompt_tokens"],
            skip_long_prompts=limit["skip"],
            limit_desc=limit["limit_desc"],
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
        )
        eval_warnings: list[str] = []
        self.eval_sets = load_eval_sets(cfg, self.renderer, **limit, warnings=eval_warnings)
        sets = [self.data.records, *(s.records for s in self.eval_sets)]
        sources = [r.data_source for records in sets for r in records]
        self.config_warnings += self.data.warnings + eval_warnings
        self.config_warnings += preflight.input_warnings(cfg, self.tokenizer, self.hf_config, sources)

    @staticmethod
    def _attention_backend(cfg: Config) -> str:
        """The policy's backend (te or local) for this config: the fusions' resolution needs it."""
        from megatron_dppo.megatron.attention_backend import attention_choice

        sp = cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
        return attention_choice(cfg.model.attention, dtype=_DTYPES[cfg.model.dtype], sequence_parallel=sp).backend

    def _resolve(self, cfg: Config, resume: bool, overwrite: bool) -> None:
        """One resolution step: from here on the config is complete and is what runs."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        hf = self.hf_config
        resolve(
            cfg,
            Arch.from_hf_config(hf),
            world_size=world,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            num_train_records=len(self.data),
            cuda=torch.cuda.is_available(),
            threads=torch.get_num_threads(),
            te=self._attention_backend(cfg) == "te",
        )
        self.cfg = cfg
        # Every rank looks before any rank writes (rank 0 creates or replaces the dir after the ranks meet).
        self._run_dir_plan = plan_run_dir(
            cfg.trainer.output_dir, cfg.trainer.run_name, resume=resume, overwrite=overwrite
        )
        self.run_dir = self._run_dir_plan.path
        self._check_hf_export_dir(cfg, self._run_dir_plan)
        self.ckpt_dir = os.path.join(self.run_dir, CHECKPOINTS)
        self.resume_meta = resume_metadata(cfg)
        if resume:
            self._check_resumable()

    @staticmethod
    def _check_hf_export_dir(cfg: Config, plan) -> None:
        """trainer.save_hf_every writes <run dir>/hf/step_N: refused now, not at the first export, when
        hf is there and not a directory (a run dir that --overwrite replaces is not kept)."""
        hf_exports = os.path.join(plan.path, "hf")
        if not cfg.trainer.save_hf_every or plan.action == "replace":
            return
        if os.path.lexists(hf_exports) and not os.path.isdir(hf_exports):
            raise ValueError(
                f"config key 'trainer.save_hf_every': HF exports go to {hf_exports}, which exists and is not a "
                "directory: move it away, or set trainer.save_hf_every=0"
            )

    def _check_resumable(self) -> None:
        """Before anything slow: the checkpoint exists, is intact, is not past trainer.max_steps,
        and was trained with this run's model and fixed settings."""
        from megatron_dppo.megatron.checkpoint import check_checkpoint, latest_checkpoint

        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_dir} (no 'latest' file)")
        self.resume_path = path  # what _resume loads, once the policy is built
        state = check_checkpoint(path)
        check_resume_compatible(state, self.cfg, path, current=self.resume_meta)
        if state["step"] >= self.cfg.trainer.max_steps:
            raise ValueError(
                f"--resume: {path} is at step {state['step']} and trainer.max_steps is "
                f"{self.cfg.trainer.max_steps}: nothing left to run (raise trainer.max_steps to continue)"
            )

    def _claim_run_dir(self) -> None:
        self.rank, self.world = mdist.world()
        self.is_main = self.rank == 0
        make_run_dir(self._run_dir_plan, self.is_main)
        mdist.all_reduce_sum([0])  # a barrier: no rank writes into the dir before rank 0 made it

    def _curriculum(self):
        """AdaPrefix's per-problem prefixes (algorithm.curriculum=adaprefix), else None."""
        if self.cfg.algorithm.curriculum != "adaprefix":
            return None
        from megatron_dppo.algorithms.curriculum import PrefixCurriculum, reference_text

        key = self.cfg.data.solution_key
        if not any(reference_text(r, key) for r in self.data.records):
            raise ValueError(
                f"config key 'data.solution_key': algorithm.curriculum=adaprefix needs a reference solution per "
                f"problem, and no record of {self.cfg.data.train} has {key!r}"
            )
        opening = self.renderer.assistant_opening()  # a thinking template's opener precedes the prefix
        return PrefixCurriculum(self.cfg, self.tokenizer, self.cfg.trainer.max_steps, assistant_opening=opening)

    def _place_ranks(self) -> None:
        """This rank's data-parallel place and its vLLM engine: ranks [kR, (k+1)R) share engine k
        (vLLM tensor parallel over them); the first rank of each engine scores its completions."""
        from megatron_dppo.megatron import data_parallel_rank_and_size

        rtp = self.cfg.parallel.rollout_tp
        self.dp_rank, self.dp_size = data_parallel_rank_and_size()
        self.engine_index, self.num_engines = self.rank // rtp, self.world // rtp
        self.engine_leader = self.rank % rtp == 0

    def _build_policy(self):
        from megatron_dppo.megatron.model import GpuSettings
        from megatron_dppo.megatron.policy import MegatronPolicy

        cfg, pc = self.cfg, self.cfg.parallel
        return MegatronPolicy(
            self.hf_config,
            cfg.optim,
            cfg.algorithm,
            temperature=cfg.rollout.temperature,
            params_dtype=_DTYPES[cfg.model.dtype],
            attention=cfg.model.attention,
            thd_attention=cfg.model.thd_attention,
            with_reference=cfg.algorithm.kl_coef > 0,
            sequence_parallel=pc.sequence_parallel,
            recompute=pc.recompute,
            distributed_optimizer=pc.distributed_optimizer,
            gpu_settings=GpuSettings.from_config(pc),
        )

    def _start_engine(self):
        """vLLM with dummy weights: the policy's weights are synced into it right after loading,
        so the HF files are read once, by the policy's sharded loader, not again by every engine."""
        from megatron_dppo.megatron import suspend_cpu_compat
        from megatron_dppo.megatron.parallel import vllm_timeout_kwargs
        from megatron_dppo.rollout import RolloutEngine

        cfg, rc = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        engine = RolloutEngine(
            cfg.model.hf_dir,
            dtype=rc.dtype,
            max_model_len=rc.max_model_len,
            seed=cfg.trainer.seed,
            kv_cache_memory_bytes=int(rc.kv_cache_gb * (1 << 30)) if not torch.cuda.is_available() else None,
            gpu_memory_utilization=rc.gpu_memory_utilization,
            tensor_parallel_size=cfg.parallel.rollout_tp,
            context=suspend_cpu_compat,
            load_format="dummy",
            **vllm_timeout_kwargs(cfg.parallel.timeout_minutes),
            # log-probs of the distribution actually sampled (temperature, top-p/top-k applied): what
            # the Megatron policy's log-probs at the sampling temperature are compared with
            logprobs_mode="processed_logprobs",
        )
        self.engine_init_s = time.perf_counter() - t0
        return engine

    def _load_weights(self, resume: bool) -> None:
        """The policy (and the KL reference) start from model.init_checkpoint when given, else from
        the HF safetensors; each rank reads only its own shard. A resumed run then loads its
        checkpoint (policy, optimizer, RNG, history) over them; without a KL term it reads neither
        of the first two, since the checkpoint overwrites the policy anyway."""
        from megatron_dppo.megatron.hf_load import load_hf_into_policy

        if not (resume and self.policy.reference is None):
            if self.cfg.model.init_checkpoint:
                from megatron_dppo.megatron.checkpoint import load_checkpoint

                load_checkpoint(self.cfg.model.init_checkpoint, self.policy, load_optimizer=False)
                self.policy.copy_policy_to_reference()  # the KL reference is where the policy starts
            else:
                load_hf_into_policy(self.policy, self.model_dir)
        if resume:
            self._resume()

    # ---- the step ------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, tc = self.cfg, self.cfg.trainer
        timer = PhaseTimer(self.watchdog, step)
        self.watchdog.phase("prompts", step)
        t_step = time.perf_counter()
        gen = step_generator(tc.seed, step)
        counts = RolloutCounts()

        collected = batch.collect(  # prompts -> prune prompts -> rollout -> rewards [-> refill]
            self.method,
            self.strategy,
            next_batch=self.data.next_batch,
            stats_of=self.history.stats,
            rollout=lambda rnd, items: self._rollout(step, rnd, items, counts, timer),
            generator=gen,
        )
        counts.prompts_drawn = collected.drawn
        if collected.rolled:
            for run in size_runs(collected.rolled):  # one run unless BPPO's waves
                self.strategy.observe([g.record.id for g in run], stack_rewards(run))
        curriculum_metrics = self.curriculum.observe(collected.rolled, step) if self.curriculum else {}
        self.engine.sleep(cfg.rollout.sleep_level)  # GPU: give the KV cache (and weights) back to training
        # advantages on the FULL group, then completion pruning
        plan_metrics = batch.weigh_completions(self.method, self.strategy, collected.trained, gen)
        minibatches = batch.plan_minibatches(self.method, collected.trained, collected.drawn)
        for mb in minibatches:  # pack (THD)
            mb.microbatches, mb.density = self._pack(mb.samples)
        if self.method.aux == "ssopd":  # + the self-distillation pairs, packed on their own
            plan_metrics.update(self._pack_aux(minibatches))
        needs_old = batch.needs_old_logprobs(self.method, minibatches)
        if minibatches and (needs_old or self.method.needs_reference):
            with timer("logprob"):  # pi_old = the rollout policy: BEFORE the first update
                for mb in minibatches:
                    self._attach_logprobs(mb.microbatches, old=needs_old, ref=self.method.needs_reference)
                if batch.needs_token_scale(self.method):
                    plan_metrics["reco/impurity_mean"] = self._attach_token_scale(minibatches)
        train = []
        with timer("train"):
            for _ in range(tc.epochs_per_step):  # update
                for mb in minibatches:
                    train.append(self.policy.train_step(mb.microbatches + mb.aux_microbatches, mb.denominator))
                    if not (math.isfinite(train[-1]["loss"]) and math.isfinite(train[-1]["grad_norm"])):
                        self._check_finite(f"step {step}'s update", grads=True)
        with timer("sync"):
            self._sync_weights()  # push weights to vLLM

        metrics = {"step": step, **rollout_metrics(collected.trained, collected.rolled, counts), **plan_metrics}
        metrics.update(curriculum_metrics)
        rolled = collected.rolled
        metrics.update(
            reward_metrics_by_source(
                [r for g in rolled for r in g.rewards],
                [g.record for g in rolled for _ in g.rewards],
                [e for g in rolled for e in g.reward_extras],
            )
        )
        metrics.update(_train_metrics(train, minibatches))
        metrics.update({f"time/{name}": timer.times.get(name, 0.0) for name in PHASES})
        metrics["time/step"] = time.perf_counter() - t_step
        if counts.first_failures and self.is_main:
            self.logger.message(
                f"step {step}: {sum(counts.reward_failures.values())} reward checks failed "
                f"{counts.reward_failures} (reward {self.scorer.describe()}); first: "
                + " | ".join(counts.first_failures)
            )
        if cfg.logging.rollouts and self.is_main:
            self._write_rollouts(step, collected.rolled)
        return metrics

    # ---- the parts of a step ---------------------------------------------------------------------
    def _rollout(self, step, rnd, items, counts: RolloutCounts, timer) -> list[Group]:
        """items: (record, slot, w_q) of the prompts to roll out. Each engine generates a contiguous
        slice (every rank of an engine the same slice, with the same seeds), its leader scores it,
        the groups are gathered in slot order and every one is recorded in the prompt history.
        With BPPO's waves (algorithm.bppo.schedule=waves) a prompt gets g0 completions at a time
        until its group is mixed or full (bppo.next_wave); every rank sees every group after each
        wave's gather, so all decide the next wave alike."""
        counts.prompts_rolled += len(items)
        per = math.ceil(len(items) / self.num_engines)
        mine = items[self.engine_index * per : (self.engine_index + 1) * per]
        prompt_ids = [self.renderer.token_ids(rec) for rec, _, _ in mine]
        prefix_lens = [0] * len(mine)
        if self.curriculum:  # AdaPrefix: the reference's prefix opens the completion (as prompt tokens)
            assisted = [self.curriculum.assisted(rec, ids, step) for (rec, _, _), ids in zip(mine, prompt_ids)]
            prompt_ids, prefix_lens = [ids for ids, _ in assisted], [n for _, n in assisted]
        by_slot: dict[int, Group] = {}
        while True:
            drawn = {slot: by_slot[slot].group_size if slot in by_slot else 0 for _, slot, _ in items}
            want = self._completions_wanted(by_slot, drawn)
            if not any(want.values()):
                break
            todo = [i for i, (_, slot, _) in enumerate(mine) if want[slot] > 0]
            for g in self._roll_wave(step, rnd, mine, prompt_ids, prefix_lens, todo, want, drawn, counts, timer):
                if g.slot in by_slot:
                    by_slot[g.slot].extend(g)
                else:
                    by_slot[g.slot] = g
        groups = sorted(by_slot.values(), key=lambda g: g.slot)
        for run in size_runs(groups):
            self.history.update([g.record.id for g in run], stack_rewards(run))
        return groups

    def _completions_wanted(self, by_slot: dict[int, Group], drawn: dict[int, int]) -> dict[int, int]:
        """How many more completions each prompt (slot) gets: its whole group in one call, or
        BPPO's next wave, decided on BPPO's own verdicts (before reward shaping) as its pair is."""
        bc, group_size = self.method.bppo, self.cfg.rollout.group_size
        if not (self.method.selection == "bppo" and bc.schedule == "waves"):
            return {slot: group_size if n == 0 else 0 for slot, n in drawn.items()}
        return {
            slot: bppo.next_wave(
                [float(c) for c in by_slot[slot].correct()] if slot in by_slot else [],
                bc.wave_size,
                bc.max_group_size or group_size,
            )
            for slot in drawn
        }

    def _roll_wave(self, step, rnd, mine, prompt_ids, prefix_lens, todo, want, drawn, counts, timer) -> list[Group]:
        """One engine call for this engine's prompts `todo` (indices into mine), want[slot]
        completions each, continuing their seeds' streams after drawn[slot]; scored by the
        engine's leader and gathered from every engine."""
        sub = [mine[i] for i in todo]
        with timer("rollout"):
            outs = self._generate(step, rnd, sub, [prompt_ids[i] for i in todo], want, drawn)
        part = EnginePart()
        if self.engine_leader and sub:
            with timer("reward"):
                part = self._score(rnd, sub, [prompt_ids[i] for i in todo], outs, [prefix_lens[i] for i in todo])
        self.watchdog.phase("gather rollouts", step)
        parts = mdist.all_gather_objects(part)
        errors = [p.error for p in parts if p.error]
        if errors:
            raise RuntimeError(errors[0])
        groups = []
        for p in parts:
            counts.generated_tokens += p.generated_tokens
            counts.reward_checks += p.checks
            counts.add_failures(p.failures, p.first_failures)
            groups += p.groups
        return groups

    def _generate(self, step, rnd, mine, prompt_ids, want, drawn) -> list:
        """want[slot] completions (rollout.vllm_engine.Completion) for each of this engine's
        prompts. vLLM gives completion k of a request seed s the seed s + k, so starting a prompt's
        later wave at s + drawn[slot] continues the stream: its completions are the ones a single
        call for all of them would have drawn."""
        rc = self.cfg.rollout
        if not mine:
            return []
        return self.engine.generate(
            prompt_ids,
            n=[want[slot] for _, slot, _ in mine],
            max_new_tokens=rc.max_new_tokens,
            temperature=rc.temperature,
            top_p=rc.top_p,
            top_k=rc.top_k,
            stop=rc.stop or None,
            seeds=[_rollout_seed(self.cfg.trainer.seed, step, rnd, slot) + drawn[slot] for _, slot, _ in mine],
        )

    def _score(self, rnd, mine, prompt_ids, outs, prefix_lens) -> EnginePart:
        """The engine leader's groups for its slice, scored (and shaped: DAPO's soft overlong
        penalty). The verifier reads an AdaPrefix prefix and its continuation as one answer. A
        scorer error travels to every rank (or the others would hang in the gather)."""
        rc, wc = self.cfg.rollout, self.cfg.reward
        sizes = [len(group) for group in outs]
        starts = [0, *itertools.accumulate(sizes)]
        flat = [c for group in outs for c in group]
        prefixes = [p[len(p) - n :] if n else [] for p, n, k in zip(prompt_ids, prefix_lens, sizes) for _ in range(k)]
        texts = [self.tokenizer.decode(pre + c.token_ids, skip_special_tokens=True) for pre, c in zip(prefixes, flat)]
        recs = [rec for (rec, _, _), k in zip(mine, sizes) for _ in range(k)]
        error = None
        try:
            rewards, info = self.scorer.score(texts, [r.answer for r in recs], recs)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank after the gather
            rewards, info, error = [0.0] * len(texts), {}, str(e)
        extras = info.get("extras") or [{} for _ in texts]
        if wc.overlong_buffer:
            for i, c in enumerate(flat):
                penalty = overlong_penalty(len(c.token_ids), rc.max_new_tokens, wc.overlong_buffer, wc.overlong_penalty)
                rewards[i] += penalty
                extras[i] = {**extras[i], "overlong_penalty": penalty}
        groups = [
            Group(
                rec,
                rnd,
                slot,
                p,
                [c.token_ids for c in group],
                [float(x) for x in rewards[starts[q] : starts[q + 1]]],
                prompt_weight=w_q,
                truncated=[c.finish_reason == "length" for c in group],
                sampling_logprobs=[list(c.logprobs) for c in group],
                reward_extras=extras[starts[q] : starts[q + 1]],
                prefix_len=prefix_lens[q],
            )
            for q, ((rec, slot, w_q), p, group) in enumerate(zip(mine, prompt_ids, outs))
        ]
        return EnginePart(
            groups=groups,
            generated_tokens=sum(len(c.token_ids) for c in flat),
            checks=len(texts),
            failures=info.get("failures_by_kind", {}),
            first_failures=info.get("first_failures", []),
            error=error,
        )

    def _pack(self, samples):
        """Pack the mini-batch's sequences, spread the packs over DP ranks, build this rank's THD batches."""
        tc = self.cfg.trainer
        lengths = [packing.round_up(len(s.tokens), self.pad_multiple) for s in samples]
        capacity = tc.max_tokens_per_microbatch
        if tc.packing == "padded":
            packs = packing.pack_padded(lengths, capacity)
        elif tc.packing == "ffd":
            packs = packing.pack_ffd(lengths, capacity)
        else:
            packs = packing.pack(lengths, capacity, tc.pack_window)
        density = packing.density(lengths, packs, capacity)
        mine = packing.balance_packs(packs, lengths, self.dp_size)[self.dp_rank]
        pad_id = self.tokenizer.pad_token_id or 0
        # An empty slot (fewer sequences than slots) still runs: every rank must step together.
        filler = packing.Sample(tokens=[pad_id, pad_id], prompt_len=2, weight=0.0)
        build = packing.build_padded_batch if self._as_padded_rows(packs, lengths) else packing.build_thd_batch
        batches = [
            build([samples[i] for i in p] if p else [filler], pad_multiple=self.pad_multiple, pad_id=pad_id)
            for p in mine
        ]
        return batches, density

    def _pack_aux(self, minibatches) -> dict:
        """SSOPD's teacher/student micro-batches of each mini-batch (megatron_dppo/algorithms/distill.py)."""
        from megatron_dppo.algorithms.distill import aux_microbatches

        cfg, tc = self.cfg.algorithm.ssopd, self.cfg.trainer

        def ids(text):
            return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

        tokens = {"header": ids(cfg.solution_header), "instruction": ids(cfg.instruction)}
        tokens["suffix"] = ids(self.renderer.generation_suffix())  # the block goes before it
        tokens["strip"] = [t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if t is not None]
        layout = dict(
            max_context=self.cfg.rollout.max_model_len,
            capacity=tc.max_tokens_per_microbatch,
            window=tc.pack_window,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            pad_multiple=self.pad_multiple,
            pad_id=self.tokenizer.pad_token_id or 0,
        )
        pairs = skipped = positions = 0
        for mb in minibatches:
            mb.aux_microbatches, stats = aux_microbatches(
                mb.aux_pairs, cfg=cfg, num_prompts=mb.num_prompts, tokens=tokens, layout=layout
            )
            pairs, skipped, positions = pairs + stats.pairs, skipped + stats.skipped, positions + stats.positions
        return {"ssopd/pairs": pairs, "ssopd/skipped": skipped, "ssopd/positions": positions}

    def _as_padded_rows(self, packs, lengths) -> bool:
        """Lay the packs out as padded rows instead of THD rows? Always for trainer.packing=padded.
        For packed micro-batches only on the local (non-TE) attention and when every pack's
        sequences are so close in length that padding them to their longest wastes under 5%: that
        path's THD row has a fixed per-sequence cost (length buckets, Megatron's per-sequence RoPE)
        that such little padding beats (docs/packing.md: THD rows ran 0.95x of padded ones on the
        addition task's near-uniform lengths). The packs, and so the density, stay the packer's;
        the decision is the same on every rank (it reads all packs)."""
        if self.cfg.trainer.packing == "padded":
            return True
        if self.policy.attention_backend != "local":
            return False
        return all(len(p) * max(lengths[i] for i in p) <= 1.05 * sum(lengths[i] for i in p) for p in packs if p)

    def _attach_logprobs(self, microbatches, old: bool, ref: bool) -> None:
        """Old (and reference) log-probs with the same packed micro-batches, no gradients; with
        ReCo's gini token scale the pi_old pass also gives each position's impurity."""
        gini = self.method.reweighting == "reco" and self.method.reco.token_scale == "gini"
        for attr, wanted, reference in (("old_logp", old, False), ("ref_logp", ref, True)):
            if not wanted:
                continue
            out = self.policy.compute_logprobs(microbatches, reference=reference, gini=gini and not reference)
            if out is None:  # not the last pipeline stage: the loss is computed elsewhere
                continue
            logps, impurities = out if gini and not reference else (out, None)
            for i, (mb, lp) in enumerate(zip(microbatches, logps)):
                setattr(mb, attr, (lp.float().cpu() * mb.loss_mask).view_as(mb.loss_mask))
                if impurities is not None:
                    mb.token_scale = impurities[i].float().cpu() * mb.loss_mask  # the impurity until scaled

    def _attach_token_scale(self, minibatches) -> float:
        """ReCo's c_t = g_t / mean g over the step's trained tokens with A != 0, every micro-batch
        and rank, each token weighted by its sequence's weight (docs/methods.md 2.1.3;
        reco.step_mean_terms says why). g is the Gini impurity from the pi_old pass, or
        pi_old(a)(1 - pi_old(a)) (bernoulli)."""
        last_stage = [mbt for mb in minibatches for mbt in mb.microbatches if mbt.old_logp is not None]
        num = den = 0.0
        for mbt in last_stage:
            if self.method.reco.token_scale == "bernoulli":
                mbt.token_scale = reco.bernoulli_impurity(mbt.old_logp) * mbt.loss_mask
            part = reco.step_mean_terms(mbt.token_scale, mbt.loss_mask, mbt.advantages, mbt.seq_index, mbt.seq_weight)
            num, den = num + part[0], den + part[1]
        num, den = mdist.all_reduce_sum([num, den])  # replicas (TP) add to both alike
        mean = num / den if den > 0 else 0.0
        for mbt in last_stage:
            mbt.token_scale = reco.token_scale(mbt.token_scale, mean) * mbt.loss_mask
        return mean

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

    def _sync_weights(self) -> None:
        """Stream the policy's weights into vLLM. On GPU the engine wakes its weights first and
        its KV cache only after the load, so the peak stays near training's (no-ops on CPU)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand training's cached activations back before vLLM wakes
        self.engine.wake_up(["weights"])
        self.engine.load_weights(self.policy.hf_weight_buckets())
        self.engine.wake_up(["kv_cache"])

    def _write_rollouts(self, step: int, rolled: list[Group]) -> None:
        """One row per generated completion: decoded text, reward, advantage, the weight it trained
        with (0 when pruned or not selected), length, truncation."""
        path = os.path.join(self.run_dir, "rollouts", f"step_{step:06d}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False)

        with open(path, "w") as f:
            for g in rolled:
                for row in g.rollout_rows(decode):
                    f.write(json.dumps({"step": step, **row}) + "\n")

    def evaluate(self, step: int) -> dict:
        """The eval: sets (megatron_dppo/rollout/validation.py), split over the engines like a rollout;
        collective. {val/<set>/<source>/<metric>, eval/accuracy} on every rank; {} without sets.
        Rewards are the scorer's own (no overlong shaping: it is not a verdict)."""
        if not self.eval_sets:
            return {}
        rc = self.cfg.rollout
        return run_validation(
            self.eval_sets,
            generate=engine_generate(self.engine, rc.max_new_tokens, rc.stop),
            scorer=self.scorer,
            renderer=self.renderer,
            cfg=self.cfg.eval,
            step=step,
            dump_dir=os.path.join(self.run_dir, "val"),
            seed=self.cfg.trainer.seed,
            engine_index=self.engine_index,
            num_engines=self.num_engines,
            engine_leader=self.engine_leader,
            is_main=self.is_main,
        )

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, step: int, row: dict) -> dict:
        """Collective. -> the save's cost, as metrics. The step's metrics `row` (without the save's
        cost, not known yet) is staged in the run dir first (RunLogger.stage): the loop logs it only
        after the save, and a run killed in between resumes after this step with the staged row
        restored, so no step that a checkpoint claims lacks its row."""
        from megatron_dppo.megatron.checkpoint import checkpoint_bytes, new_run_id, save_checkpoint

        self.watchdog.phase("save", step)
        self.logger.stage(row)
        self.ckpt_run_id = self.ckpt_run_id or new_run_id()
        t0 = time.perf_counter()
        path = save_checkpoint(
            self.ckpt_dir,
            step,
            self.policy,
            {
                "data": self.data.state_dict(),
                "strategy": self.strategy.state_dict(),
                "adaprefix": self.curriculum.state_dict() if self.curriculum else None,
                "resume": self.resume_meta,
            },
            self.history,
            keep_last=self.cfg.trainer.keep_checkpoints,
            extra_files={"hf_config.json": os.path.join(self.cfg.model.hf_dir, "config.json")},
            run_id=self.ckpt_run_id,
        )
        seconds = time.perf_counter() - t0
        size = checkpoint_bytes(path) if self.is_main else 0
        if self.is_main and not self._save_cost_logged:  # once: what a save costs
            self.logger.message(save_cost_line(os.path.basename(path), seconds, size))
            self._save_cost_logged = True
        return {"time/checkpoint": seconds, "checkpoint/bytes": size}

    def save_hf(self, step: int) -> str:
        """<run dir>/hf/step_N/: the policy as an HF model directory (gathered from every TP/PP rank),
        loadable by transformers and vLLM with no other tool. Collective. A step repeated after a
        resume replaces its earlier export (as save_checkpoint replaces a re-saved step); a failure is
        an OSError naming trainer.save_hf_every and the path (the step's row is already written)."""
        from megatron_dppo.megatron.checkpoint import step_dir_name
        from megatron_dppo.megatron.weights import save_hf_checkpoint

        out = os.path.join(self.run_dir, "hf", step_dir_name(step))
        error = None
        try:  # rank 0 writes; every rank agrees on its outcome, so none is left in a collective
            if self.is_main and os.path.lexists(out):
                if not os.path.isdir(out) or os.path.islink(out):
                    raise FileExistsError(errno.EEXIST, "exists and is not a directory", out)
                shutil.rmtree(out)
        except OSError as e:
            error = e
        if mdist.agree(error is None):
            try:
                save_hf_checkpoint(self.policy.hf_weight_buckets(), out, self.cfg.model.hf_dir, self.is_main)
            except OSError as e:
                error = e
        if not mdist.agree(error is None):
            why = "on rank 0"
            if error is not None:
                why = f"{error.strerror or error}{': ' + str(error.filename) if error.filename else ''}"
            raise OSError(
                f"config key 'trainer.save_hf_every': exporting step {step} as an HF model to {out} failed "
                f"({why}); step {step}'s metrics are written and --resume continues after the latest checkpoint"
            )
        return out

    def _resume(self) -> None:
        from megatron_dppo.megatron.checkpoint import load_checkpoint

        state = load_checkpoint(self.resume_path, self.policy)
        self.data.load_state_dict(state["data"])
        self.strategy.load_state_dict(state.get("strategy", {}))
        if self.curriculum and state.get("adaprefix") is not None:
            self.curriculum.load_state_dict(state["adaprefix"])
        self.history = PromptHistory.load(state["history_path"])
        self.first_step = state["step"] + 1
        self.ckpt_run_id = state["run_id"]

    # ---- the loop --------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        tc = self.cfg.trainer
        rows = []
        t0 = time.perf_counter()
        if self.is_main:
            skipped = (
                f"; {self.data.skipped_long} prompts over the length limit skipped" if self.data.skipped_long else ""
            )
            self.logger.message(
                f"run dir {self.run_dir}; {self.world} process(es); "
                f"rollout engine started in {self.engine_init_s:.1f}s{skipped}; {self.policy.attention.describe()}"
            )
            for line in self.config_warnings:
                self.logger.message(line)
        if self.first_step == 1 and tc.eval_every:
            row = {"step": 0, **self.evaluate(0)}
            if len(row) > 1:
                self.logger.log(row)
                rows.append(row)
        self.last_step = self.first_step - 1
        last_save = time.monotonic()
        with _stop_on_signals() as stop:
            for step in range(self.first_step, tc.max_steps + 1):
                m = self.step(step)
                self.last_step = step
                out_of_time = bool(tc.max_time_s and time.perf_counter() - t0 > tc.max_time_s)
                signalled = mdist.all_reduce_max([stop.requested])[0] > 0  # any rank's signal stops all
                final = step == tc.max_steps or mdist.agree(out_of_time) or signalled
                if tc.eval_every and (step % tc.eval_every == 0 or final) and not signalled:
                    self.watchdog.phase("eval", step)
                    t_eval = time.perf_counter()
                    m.update(self.evaluate(step))
                    m["time/eval"] = time.perf_counter() - t_eval
                self.watchdog.phase("log", step)
                if step % 10 == 0:
                    malloc_trim()
                # Rank 0's clock decides (the ranks' clocks differ); save_every and final agree anyway.
                if mdist.agree(should_save(step, time.monotonic(), last_save, tc, final)):
                    m.update(self.save(step, m))
                    last_save = time.monotonic()
                self.logger.log(m)  # after the checkpoint, its row staged before it (save's docstring)
                rows.append(m)
                if tc.save_hf_every and (step % tc.save_hf_every == 0 or final):
                    self.save_hf(step)  # last: its failure loses neither the step's checkpoint nor its row
                margin = self.watchdog.margin_warning()
                if margin and self.is_main:
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

    def close(self) -> None:
        """Safe on a trainer whose start-up failed half-way: closes whatever was started."""
        from megatron_dppo.megatron import destroy_parallel

        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        for part in ("scorer", "engine", "logger"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
        destroy_parallel()


class _SignalFlag:
    def __init__(self):
        self.requested, self.name, self.at = False, "", 0.0


# A repeat within this many seconds is the same event: when a launcher dies, the kernel sends the
# parent-death signal again each time it hands the rank to another of the dying launcher's threads
# (seen here: a second SIGTERM right after the first, and rank 0 stopped without saving): that
# must not count as "send it again".
_REPEAT_WINDOW_S = 2.0


@contextmanager
def _stop_on_signals():
    """SIGTERM (what SLURM and torchrun send before a kill) and SIGINT set a flag; the loop finishes
    the step in progress, saves a checkpoint and exits non-zero. A second signal (later than
    _REPEAT_WINDOW_S) stops at once."""
    flag = _SignalFlag()

    def handler(signum, frame):
        now = time.monotonic()
        if flag.requested:
            if now - flag.at > _REPEAT_WINDOW_S:
                os.write(2, f"{rank_prefix()}{flag.name} again: stopping now, without saving this step\n".encode())
                raise StopNow(flag.name)
            return
        flag.requested, flag.name, flag.at = True, signal.Signals(signum).name, now
        # os.write, not print: a handler that prints while the main code is printing raises
        # "reentrant call" inside whatever the step was doing.
        msg = f"{rank_prefix()}{flag.name} received: finishing the current step, then saving a checkpoint"
        os.write(2, (msg + " (send it again to stop at once)\n").encode())

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _rollout_seed(seed: int, step: int, rnd: int, slot: int) -> int:
    """A prompt's sampling seed: from (trainer.seed, step, round, its slot in the draw) only, so a
    completion is the same whatever rank or engine generates it (completion k adds k in vLLM)."""
    from megatron_dppo.rollout.vllm_engine import request_seed

    return request_seed("rollout", seed, step, rnd, slot)


def _train_metrics(train: list[dict], minibatches: list[batch.MiniBatch]) -> dict:
    """Optimizer-step metrics averaged over the step's updates (max for the max), and the packing."""
    out = {"train/optimizer_steps": len(train)}
    if not train:  # nothing was trained this step (every group uninformative)
        return {**out, "train/loss": 0.0, "train/grad_norm": 0.0, "pack/density": 0.0, "tokens/trained": 0}
    for key in train[0]:
        vals = [m[key] for m in train]
        out[f"train/{key}"] = max(vals) if key.endswith("_max") else sum(vals) / len(vals)
    out["train/first_update_ratio_dev_max"] = train[0]["ratio_dev_max"]
    out["train/logprob_gap_vllm"] = train[0]["logprob_gap_vllm"]  # at the first update: the rollout policy
    out["pack/density"] = sum(mb.density for mb in minibatches) / len(minibatches)
    out["tokens/trained"] = sum(mb.tokens for mb in minibatches)
    out["tokens/trained_completion"] = sum(mb.completion_tokens for mb in minibatches)
    return out
