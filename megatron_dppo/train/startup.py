"""The trainer's start-up parts, each checked with a one-line error before anything slow: the
inputs (model dir, tokenizer, prompts), the resolved config and run dir, the ranks' places, the
stall watchdog, the policy and its packing layout, the vLLM engines (this rank's, or the dedicated
rollout ranks' reports) and the starting weights. `Trainer.__init__` calls them in the order they
depend on each other."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from megatron_dppo.algorithms import packing
from megatron_dppo.config import Config, resolve
from megatron_dppo.data.prompts import PromptDataset, PromptRenderer
from megatron_dppo.model import hf_dir
from megatron_dppo.model.arch import Arch
from megatron_dppo.rollout.validation import load_eval_sets
from megatron_dppo.run import collectives as mdist
from megatron_dppo.run.identity import check_resume_compatible, resume_metadata
from megatron_dppo.run.run_dir import CHECKPOINTS, RunDirPlan, make_run_dir, plan_run_dir
from megatron_dppo.run.watchdog import StallWatchdog, default_store
from megatron_dppo.train import preflight
from megatron_dppo.train.step_rollout import EnginePlace, EngineWorker, LocalEngines, RemoteEngines

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Inputs:
    """What the run reads before anything is built, each part checked."""

    model_dir: object  # model.hf_dir.HFModelDir
    tokenizer: object
    renderer: PromptRenderer
    data: PromptDataset
    eval_sets: list
    warnings: list[str]  # start-up lines for the screen (inert keys, data warnings)

    @property
    def hf_config(self):
        return self.model_dir.config


def load_inputs(cfg: Config) -> Inputs:
    """The model dir, tokenizer and prompts, each checked with a one-line error; prompts that
    cannot fit next to max_new_tokens are found now, naming the record."""
    tc, rc = cfg.trainer, cfg.rollout
    preflight.check_config(cfg)
    warnings = preflight.config_warnings(cfg)
    if tc.threads:  # loading and the policy's build run with the configured threads too
        torch.set_num_threads(tc.threads)
    model_dir, tokenizer = hf_dir.check_model(cfg.model.hf_dir)
    hf_dir.check_context(rc.max_model_len, cfg.model.hf_dir)
    renderer = PromptRenderer(
        tokenizer, cfg.data.prompt_mode, cfg.data.system_prompt or None, cfg.data.chat_template_kwargs
    )
    limit = dict(
        max_prompt_tokens=rc.max_model_len - rc.max_new_tokens,
        skip=cfg.data.skip_long_prompts,
        limit_desc=f"rollout.max_model_len {rc.max_model_len} - rollout.max_new_tokens "
        f"{rc.max_new_tokens}; data.skip_long_prompts=true skips them",
    )
    data = PromptDataset(
        cfg.data.train,
        tc.prompts_per_step,
        seed=tc.seed,
        limit=cfg.data.train_size,
        renderer=renderer,
        max_prompt_tokens=limit["max_prompt_tokens"],
        skip_long_prompts=limit["skip"],
        limit_desc=limit["limit_desc"],
        prompt_key=cfg.data.prompt_key,
        answer_key=cfg.data.answer_key,
    )
    eval_warnings: list[str] = []
    eval_sets = load_eval_sets(cfg, renderer, **limit, warnings=eval_warnings)
    sets = [data.records, *(s.records for s in eval_sets)]
    sources = [r.data_source for records in sets for r in records]
    warnings += data.warnings + eval_warnings
    warnings += preflight.input_warnings(cfg, tokenizer, model_dir.config, sources)
    return Inputs(model_dir, tokenizer, renderer, data, eval_sets, warnings)


def attention_backend(cfg: Config) -> str:
    """The policy's backend (te or local) for this config: the fusions' resolution needs it."""
    from megatron_dppo.megatron.attention_backend import attention_choice

    sp = cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
    return attention_choice(cfg.model.attention, dtype=DTYPES[cfg.model.dtype], sequence_parallel=sp).backend


def resolve_config(cfg: Config, inputs: Inputs, world: int | None = None) -> None:
    """One resolution step: from here on the config is complete and is what runs. world: the
    launcher's world size (default WORLD_SIZE; a rollout rank's WORLD_SIZE is its half's)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    resolve(
        cfg,
        Arch.from_hf_config(inputs.hf_config),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        num_train_records=len(inputs.data),
        cuda=torch.cuda.is_available(),
        threads=torch.get_num_threads(),
        te=attention_backend(cfg) == "te",
    )


@dataclass
class RunPaths:
    """The run dir as planned (every rank looks before rank 0 writes), its checkpoints, the
    identity a resume must match, and the checkpoint a resume loads."""

    plan: RunDirPlan
    ckpt_dir: str
    resume_meta: dict
    resume_path: str | None = None

    @property
    def run_dir(self) -> str:
        return self.plan.path


def plan_run(cfg: Config, resume: bool, overwrite: bool) -> RunPaths:
    """The run dir's plan and, for --resume, the checked checkpoint to load (before anything slow)."""
    plan = plan_run_dir(cfg.trainer.output_dir, cfg.trainer.run_name, resume=resume, overwrite=overwrite)
    check_hf_export_dir(cfg, plan)
    paths = RunPaths(plan, os.path.join(plan.path, CHECKPOINTS), resume_metadata(cfg))
    if resume:
        paths.resume_path = check_resumable(cfg, paths.ckpt_dir, paths.resume_meta)
    return paths


def check_hf_export_dir(cfg: Config, plan: RunDirPlan) -> None:
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


def check_resumable(cfg: Config, ckpt_dir: str, resume_meta: dict) -> str:
    """Before anything slow: the checkpoint exists, is intact (its pending rollout readable too), is
    not past trainer.max_steps, and was trained with this run's model and fixed settings -> its path."""
    from megatron_dppo.megatron.checkpoint import check_checkpoint, latest_checkpoint, read_pending_rollout

    path = latest_checkpoint(ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {ckpt_dir} (no 'latest' file)")
    state = check_checkpoint(path)
    read_pending_rollout(path)  # read again after the model loads: damaged bytes are found now
    check_resume_compatible(state, cfg, path, current=resume_meta)
    if state["step"] >= cfg.trainer.max_steps:
        raise ValueError(
            f"--resume: {path} is at step {state['step']} and trainer.max_steps is "
            f"{cfg.trainer.max_steps}: nothing left to run (raise trainer.max_steps to continue)"
        )
    return path


def claim_run_dir(plan: RunDirPlan) -> tuple[int, int]:
    """Rank 0 creates (or replaces) the run dir after the ranks meet -> (rank, world)."""
    rank, world = mdist.world()
    make_run_dir(plan, rank == 0)
    mdist.all_reduce_sum([0])  # a barrier: no rank writes into the dir before rank 0 made it
    return rank, world


def start_watchdog(cfg: Config, rank: int, world: int) -> StallWatchdog:
    """The stall watchdog, started: from here on a phase that hangs is named, not waited out."""
    return StallWatchdog(
        cfg.trainer.stall_timeout_s,
        start_timeout_s=cfg.trainer.start_timeout_s,
        rank=rank,
        world=world,
        store=default_store(),
    ).start()


def build_policy(cfg: Config, hf_config):
    from megatron_dppo.megatron.lora import LoraSettings
    from megatron_dppo.megatron.model import GpuSettings
    from megatron_dppo.megatron.policy import MegatronPolicy

    pc = cfg.parallel
    lora = LoraSettings.from_config(cfg.model.lora, seed=cfg.trainer.seed)
    return MegatronPolicy(
        hf_config,
        cfg.optim,
        cfg.algorithm,
        temperature=cfg.rollout.temperature,
        params_dtype=DTYPES[cfg.model.dtype],
        # the adapters sit on Megatron-Core's own linears: the local spec (config/checks.py refuses `te`)
        attention="local" if lora else cfg.model.attention,
        thd_attention=cfg.model.thd_attention,
        with_reference=cfg.algorithm.kl_coef > 0,
        sequence_parallel=pc.sequence_parallel,
        recompute=pc.recompute,
        distributed_optimizer=pc.distributed_optimizer,
        gpu_settings=GpuSettings.from_config(pc),
        routing_replay=cfg.rollout.routing_replay,
        lora=lora,
    )


def pack_layout(cfg: Config, tokenizer, policy, dp_rank: int, dp_size: int) -> packing.PackLayout:
    """How the step packs its completions into micro-batches for this policy and data-parallel rank."""
    tc, pc = cfg.trainer, cfg.parallel
    return packing.PackLayout(
        kind=tc.packing,
        capacity=tc.max_tokens_per_microbatch,
        window=tc.pack_window,
        pad_multiple=packing.thd_pad_multiple(pc.tp, 1, pc.sequence_parallel),
        pad_id=tokenizer.pad_token_id or 0,
        dp_rank=dp_rank,
        dp_size=dp_size,
        local_attention=policy.attention_backend == "local",
    )


@dataclass
class StepEngines:
    """Where the step's rollouts run, as the trainer sees them."""

    engine: object | None  # this rank's RolloutEngine when colocated; None with dedicated rollout ranks
    engines: LocalEngines | RemoteEngines
    logprobs_mode: str  # what the engines' log-probs are (ReCo checks it)
    init_s: float  # the (slowest) engine's start-up seconds, for the run's first line
    reward_description: str


def start_step_engines(cfg: Config, roles, *, tokenizer, scorer, watchdog) -> StepEngines:
    """Colocated (roles None): this rank's vLLM engine and the worker that generates and scores its
    slice. Dedicated rollout ranks (roles: run/bridge.Roles): their engines start on their own ranks
    meanwhile; training rank 0 waits for each one's report (start time, log-prob mode, reward)."""
    if roles is None:
        engine, init_s = start_engine(cfg)
        place = EnginePlace.of_rank(*mdist.world(), cfg.parallel.rollout_tp)
        worker = EngineWorker(cfg, engine=engine, place=place, tokenizer=tokenizer, scorer=scorer)
        return StepEngines(engine, LocalEngines(worker), engine.logprobs_mode, init_s, scorer.describe())
    watchdog.phase("wait for the rollout ranks")
    reports = roles.control.gather_objects() if roles.control is not None else None
    reports = mdist.broadcast_object(reports)
    return StepEngines(
        engine=None,
        engines=RemoteEngines(roles.control, roles.replies, watchdog),
        logprobs_mode=reports[0]["logprobs_mode"],
        init_s=max(r["init_s"] for r in reports),
        reward_description=next(r["reward"] for r in reports if r["reward"] is not None),
    )


def start_engine(cfg: Config, dedicated: bool = False):
    """vLLM with dummy weights: the policy's weights are synced into it right after loading,
    so the HF files are read once, by the policy's sharded loader, not again by every engine.
    dedicated: on a rollout rank (parallel.rollout_ranks), where the engine shares its device with
    no trainer and never sleeps. -> (engine, seconds its start took)."""
    from megatron_dppo.megatron import suspend_cpu_compat
    from megatron_dppo.megatron.parallel import vllm_timeout_kwargs
    from megatron_dppo.rollout import RolloutEngine

    rc = cfg.rollout
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
        routing_replay=rc.routing_replay,
        enable_sleep_mode=False if dedicated else None,
        # a LoRA slot for the adapters sync (model.lora.sync=adapters); merged weights need none
        lora_rank=cfg.model.lora.rank if cfg.model.lora.sync == "adapters" else 0,
    )
    return engine, time.perf_counter() - t0


def load_starting_weights(cfg: Config, policy, model_dir) -> None:
    """The policy (and the KL reference) start from model.init_checkpoint when given, else from
    the HF safetensors; each rank reads only its own shard."""
    from megatron_dppo.megatron.hf_load import load_hf_into_policy

    if cfg.model.init_checkpoint:
        from megatron_dppo.megatron.checkpoint import load_checkpoint

        load_checkpoint(cfg.model.init_checkpoint, policy, load_optimizer=False)
        policy.copy_policy_to_reference()  # the KL reference is where the policy starts
    else:
        load_hf_into_policy(policy, model_dir)
