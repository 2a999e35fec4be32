"""Run configuration: plain dataclasses, loaded from YAML with dotted command-line overrides.

    megatron-dppo train --config examples/tiny/addition.yaml trainer.max_steps=5 pruning.r_q=0.5

An unknown key or a value of the wrong type is a ValueError naming the key; the resolved config
is saved with the run (runs/<name>/config.yaml).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field

import yaml

from megatron_dppo.algorithms.choices import (
    AdvantageKind,
    AttentionBackend,
    AuxLoss,
    Curriculum,
    DecayStyle,
    Dtype,
    KlEstimator,
    LossAgg,
    PackingKind,
    PromptMode,
    RatioType,
    Recompute,
    Reweighting,
    Selection,
    ThdAttention,
    WandbMode,
)
from megatron_dppo.algorithms.methods.configs import AdaPrefixConfig, BPPOConfig, ReCoConfig, SSOPDConfig


@dataclass
class ModelConfig:
    hf_dir: str = ""  # HF model dir (config.json, tokenizer, safetensors)
    init_checkpoint: str = ""  # optional: a Megatron checkpoint (converted or a run's step_*) to start from
    dtype: Dtype = "float32"
    # auto: Transformer Engine where it can run this model (a GPU, TE importing, not float32 on
    # TE < 2.11: megatron/attention_backend.py), else local
    attention: AttentionBackend = "auto"
    thd_attention: ThdAttention = "auto"  # the local path's packed kernel: auto | varlen | bucketed | loop


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    rollout_tp: int = 1  # ranks per vLLM engine (its tensor_parallel_size); 1 = an engine per rank
    ep: int = 1  # expert parallel (MoE models): each rank of an EP group holds num_experts / ep experts
    etp: int = 1  # expert tensor parallel: each expert split over etp ranks (1 = whole experts, the usual choice)
    distributed_optimizer: bool | None = None  # resolved: on with CUDA, off on CPU
    recompute: Recompute = "none"  # activation recomputation
    # parallel.recompute=selective's Megatron recompute_modules (an MoE layer's module is added:
    # megatron/policy.py); None: ["core_attn", "mlp"]
    recompute_modules: list[str] | None = None
    # GPU performance settings (docs/scaling.md, "GPU defaults"). None: resolved at start-up to what
    # Megatron-LM's large-model recipes run where it can run (CUDA; the fusions also need the
    # Transformer Engine path), and to what runs on this CPU otherwise (all off, as before).
    overlap_grad_reduce: bool | None = None  # DDP reduces each bucket during the backward; None: CUDA
    # Parameters per DDP bucket, 0 = one bucket; None: Megatron's max(40M, 1M x DP) when
    # overlapping, else 0 (nothing to overlap: one collective is cheapest).
    ddp_bucket_size: int | None = None
    # The distributed optimizer's all-gather hidden behind the next forward. Off: this trainer's
    # weight sync reads the parameters right after the step, before any next forward.
    overlap_param_gather: bool = False
    gradient_accumulation_fusion: bool | None = None  # TE's wgrad GEMM adds into main_grad; None: TE path
    moe_permute_fusion: bool | None = None  # TE's fused token (un)permutation; None: TE path, MoE model
    moe_router_fusion: bool | None = None  # TE's fused router top-k / scores; None: TE path, MoE model
    # Every process group's timeout (torch.distributed, Megatron's and vLLM's groups): torch's
    # defaults (NCCL 10, gloo 30 minutes) are shorter than waits that are long by design.
    timeout_minutes: float = 60.0
    # The cluster, for `megatron-dppo plan`, the launch scripts and the layout check.
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0


@dataclass
class DataConfig:
    # Prompt files: .jsonl, .parquet, or a datasets save_to_disk dir (data.py's layouts). Several:
    # a YAML list or one comma-separated string; records are concatenated and sampled together.
    train: str | list[str] = ""
    eval: str = ""  # optional held-out prompts: validation set "eval" (see the eval section)
    train_size: int = 0  # use the first N training prompts (of the concatenation); resolved: 0 = all of them
    prompt_mode: PromptMode = "raw"  # raw text, or the tokenizer's chat template
    system_prompt: str = ""  # optional, chat mode
    skip_long_prompts: bool = False  # prompts that cannot fit rollout.max_model_len: error (False) or skip and count
    prompt_key: str = ""  # optional: the prompt's field, a dotted path ("question.text"); default: by layout
    answer_key: str = ""  # optional: the answer's field, e.g. "reward_model.ground_truth"; default: by layout
    # Chat mode: variables of the chat template in training, validation and `evaluate` alike,
    # e.g. {enable_thinking: false} for Qwen3. Given again (an override), keys are merged.
    chat_template_kwargs: dict[str, typing.Any] = field(default_factory=dict)
    # A worked reference solution per record (algorithm.curriculum=adaprefix): a dotted path in the
    # record's other fields or extra_info; records without one get no prefix.
    solution_key: str = "solution"


@dataclass
class RolloutConfig:
    group_size: int = 8  # G completions per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # sample from the k most likely tokens; 0 = all of them (vLLM's "off")
    # Stop strings: generation ends once one is produced; the completion's token ids keep the
    # tokens that produced it (what was sampled is what trains; vllm_engine.generate says more).
    stop: list[str] = field(default_factory=list)
    max_model_len: int = 1024
    kv_cache_gb: float = 0.25  # CPU KV cache (vLLM reserves ~90% of RAM otherwise)
    gpu_memory_utilization: float = 0.5
    dtype: Dtype | None = None  # vLLM's dtype; resolved: the model's dtype
    # GPU: what vLLM frees while Megatron trains. 2 drops the weights too: every step reloads all of
    # them anyway, and level 1 would first copy them back from pinned host memory (~16 GB a GPU for
    # 32B at TP 4) only to overwrite them. No-op on CPU.
    sleep_level: int = 2


@dataclass
class AlgorithmConfig:
    advantage: AdvantageKind = "grpo"  # grpo: (r - mean) / std; drgrpo: r - mean
    loss_agg: LossAgg = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO clip-higher: 0.28
    ratio_type: RatioType = "token"  # sequence = GSPO
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups, draw more prompts to refill B
    overlong_filter: bool = False  # DAPO: truncated completions (max_new_tokens reached) get no loss
    max_resample_rounds: int = 3
    # The four other methods (docs/methods.md); docs/algorithm.md section 6 says which details are ours.
    selection: Selection = "all"  # bppo: shortest correct + shortest incorrect, prefixes only
    bppo: BPPOConfig = field(default_factory=BPPOConfig)
    reweighting: Reweighting = "none"  # reco: ReCo's response weight and token scale
    reco: ReCoConfig = field(default_factory=ReCoConfig)
    curriculum: Curriculum = "none"  # adaprefix: a prefix of the reference solution (data.solution_key)
    adaprefix: AdaPrefixConfig = field(default_factory=AdaPrefixConfig)
    aux: AuxLoss = "none"  # ssopd: + coef * the self-distillation loss
    ssopd: SSOPDConfig = field(default_factory=SSOPDConfig)
    # Mixture-of-experts router terms (Megatron's), 0 = off as RL recipes run them; each is a mean
    # over the update's tokens, outside DPPO's reweighting (docs/algorithm.md, "Mixture of experts").
    moe_aux_loss_coeff: float = 0.0  # Switch load-balancing loss per micro-batch, summed over MoE layers
    moe_z_loss_coeff: float = 0.0  # router z-loss (logsumexp of the router logits, squared)


@dataclass
class PruningConfig:
    strategy: str = "none"  # algorithms/pruning.STRATEGIES: none | dppo | reverse | cppo | greso ...
    r_q: float = 0.0  # prompt-level ratio (before rollout)
    r_o: float = 0.0  # completion-level ratio (after rollout)
    drop_zero_variance: bool | None = None  # resolved: on when algorithm.kl_coef == 0 (exact then)
    history_ema: float = 0.0


@dataclass
class RewardConfig:
    """What scores a completion (megatron_dppo/rewards/__init__.py documents kinds and failures)."""

    # exact | math | "pkg.module:function" | "path/to/reward.py:function": the reward of every record
    # whose data_source is not in by_source (a relative file path is stored absolute)
    kind: str = "exact"
    by_source: dict[str, str] = field(default_factory=dict)  # {data_source: kind}, e.g. {openai/gsm8k: math}
    # user functions get one call per step (per wave with BPPO's waves): fn(completions, answers, records) -> list
    batched: bool = False
    timeout_s: float = 5.0  # one check (a batched call of m completions: timeout_s * ceil(m / num_workers))
    num_workers: int = 2  # worker processes, shared by all kinds
    max_error_frac: float = 0.5  # stop the run when more checks of a step fail (raise, NaN, timeout...)
    # DAPO's soft overlong penalty: 0 up to rollout.max_new_tokens - overlong_buffer tokens, then
    # linear down to -overlong_penalty at rollout.max_new_tokens (rewards/shaping.py); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclass
class EvalConfig:
    """Validation (every trainer.eval_every steps, on the first trainer.eval_size prompts of each
    set) and `megatron-dppo evaluate`: avg@n, pass@k and maj@n per set and data_source."""

    # name -> path, in any of data.train's formats and layouts; data.eval joins as the set "eval".
    sets: dict[str, str] = field(default_factory=dict)
    n: int = 1  # samples per prompt
    temperature: float = 0.0  # 0 = greedy (then n must be 1)
    top_p: float = 1.0
    pass_k: list[int] = field(default_factory=lambda: [1])  # the k of pass@k, each in [1, n]


@dataclass
class OptimConfig:
    """Adam + LR schedule of the policy (megatron_dppo.megatron.optimizer uses it as is)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 0  # resolved: 0 = the run's optimizer steps
    decay_style: DecayStyle = "constant"


@dataclass
class TrainerConfig:
    run_name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    max_steps: int = 100
    max_time_s: float = 0.0  # wall-clock budget; 0 = none
    prompts_per_step: int = 32  # B
    minibatches_per_step: int = 1  # optimizer steps per pass over the rollout batch (whole prompt groups)
    epochs_per_step: int = 1  # passes over the rollout batch (verl's ppo_epochs)
    max_tokens_per_microbatch: int = 4096
    packing: PackingKind = "window"
    pack_window: int = 16
    eval_every: int = 10  # 0 = no evaluation
    eval_size: int = 200
    save_every: int = 50  # steps between checkpoints (and one at the end, and on SIGTERM); 0 = by time only
    # Minutes between checkpoints, whichever of this and save_every comes first; 0 = by steps only.
    # Bounds what a hard kill (kill -9, a lost node) loses to about this long plus one step.
    save_every_minutes: float = 10.0
    save_hf_every: int = 0  # steps between HF model dirs written to <run dir>/hf/step_N/ (and one at the end); 0 = none
    keep_checkpoints: int = 2
    # Seconds a rank may make no progress (in a step's phase or a collective) before the stall
    # watchdog names the rank and phase it waits on and ends the job (exit 124); 0 = no watchdog.
    # Resolved: 600 on CPU, 1800 on GPUs (megatron_dppo/run/watchdog.py says why).
    stall_timeout_s: float | None = None
    threads: int = 0  # torch threads; resolved: 0 = what torch chose


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: WandbMode = "offline"
    wandb_project: str = "megatron-dppo"
    progress: bool = True
    rollouts: bool = False  # write every step's completions to runs/<name>/rollouts/step_N.jsonl
    verbose: bool = False  # show the libraries' own warnings (vLLM, Megatron, wandb); off: only ours


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# Optional paths: an empty string means "not given"; the saved config leaves them out.
OPTIONAL_KEYS = ("model.init_checkpoint", "data.eval", "data.system_prompt", "data.prompt_key", "data.answer_key")
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _coerce(key: str, value, typ):
    """Check value against the dataclass field type; ints are accepted for floats, and so are
    strings like "1e-5" (YAML 1.1 reads a float without a dot as a string)."""
    origin = typing.get_origin(typ)
    if typ is typing.Any:
        return value
    if origin is list:
        (item_type,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ValueError(f"config key {key!r}: expected a list, got {value!r} ({type(value).__name__})")
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if origin is typing.Literal:
        choices = typing.get_args(typ)
        if value in choices:
            return value
        raise ValueError(f"config key {key!r}: expected one of {choices}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ValueError as e:
                error = e
        raise error
    if origin is dict and isinstance(value, dict):  # {name: value}: each entry checked, named key.name
        key_type, value_type = typing.get_args(typ)
        return {_coerce(f"{key}.{k}", k, key_type): _coerce(f"{key}.{k}", v, value_type) for k, v in value.items()}
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    if typ in (int, str, bool) and type(value) is typ:
        return value
    raise ValueError(
        f"config key {key!r}: expected {getattr(typ, '__name__', typ)}, got {value!r} ({type(value).__name__})"
    )


def _apply(obj, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ValueError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            raise ValueError(f"unknown config key {key!r}; valid keys here: {sorted(names)}")
        current = getattr(obj, k)
        if dataclasses.is_dataclass(current):
            _apply(current, v, key + ".")
        elif isinstance(current, dict) and isinstance(v, dict):  # a mapping key: entries merge (overrides add)
            setattr(obj, k, {**current, **_coerce(key, v, hints[k])})
        else:
            setattr(obj, k, _coerce(key, v, hints[k]))


def validate(cfg: Config) -> Config:
    """Every check that needs only the config itself, each naming its key(s). Checks that need the
    model or the world size are in `check_layout` and `resolve`. (Long because it is one table,
    a row per key, kept together so that every key's rule is found in one place.)"""
    from megatron_dppo.algorithms.pruning import STRATEGIES  # the strategy registry
    from megatron_dppo.run.run_dir import run_name_problem

    c, t, r, a, o = cfg, cfg.trainer, cfg.rollout, cfg.algorithm, cfg.optim
    checks = [
        ("model.hf_dir", bool(c.model.hf_dir), "a path to a HF model directory"),
        ("data.train", bool(c.data.train), "a path (or a list of paths) to .jsonl / .parquet files or datasets dirs"),
        ("data.train_size", c.data.train_size >= 0, "an integer >= 0 (0 = all)"),
        (
            "data.chat_template_kwargs",
            not c.data.chat_template_kwargs or c.data.prompt_mode == "chat",
            "no entries unless data.prompt_mode=chat (raw mode applies no template)",
        ),
        ("pruning.strategy", c.pruning.strategy in STRATEGIES, f"one of {sorted(STRATEGIES)}"),
        ("pruning.r_q", 0 <= c.pruning.r_q < 1, "a number in [0, 1)"),
        ("pruning.r_o", 0 <= c.pruning.r_o < 1, "a number in [0, 1)"),
        ("pruning.history_ema", 0 <= c.pruning.history_ema < 1, "a number in [0, 1) (0 = last value)"),
        ("rollout.group_size", r.group_size >= 2, "an integer >= 2"),
        ("rollout.max_new_tokens", r.max_new_tokens >= 1, "an integer >= 1"),
        (
            "rollout.max_model_len",
            r.max_model_len > r.max_new_tokens,
            f"an integer > rollout.max_new_tokens ({r.max_new_tokens}): prompt + completion must fit",
        ),
        ("rollout.temperature", r.temperature > 0, "a number > 0 (RL samples)"),
        ("rollout.top_p", 0 < r.top_p <= 1, "a number in (0, 1]"),
        ("rollout.top_k", r.top_k >= 0, "an integer >= 0 (0 = all tokens)"),
        ("rollout.stop", all(r.stop), "a list of non-empty strings"),
        ("rollout.kv_cache_gb", r.kv_cache_gb > 0, "a number > 0"),
        ("rollout.gpu_memory_utilization", 0 < r.gpu_memory_utilization <= 1, "a number in (0, 1]"),
        ("rollout.sleep_level", r.sleep_level in (1, 2), "1 or 2"),
        ("algorithm.clip_low", 0 <= a.clip_low < 1, "a number in [0, 1)"),
        ("algorithm.clip_high", a.clip_high >= 0, "a number >= 0"),
        ("algorithm.kl_coef", a.kl_coef >= 0, "a number >= 0"),
        ("algorithm.max_resample_rounds", a.max_resample_rounds >= 0, "an integer >= 0"),
        ("algorithm.moe_aux_loss_coeff", a.moe_aux_loss_coeff >= 0, "a number >= 0 (0 = off)"),
        ("algorithm.moe_z_loss_coeff", a.moe_z_loss_coeff >= 0, "a number >= 0 (0 = off)"),
        ("reward.timeout_s", c.reward.timeout_s > 0, "a number of seconds > 0"),
        ("reward.num_workers", c.reward.num_workers >= 1, "an integer >= 1"),
        ("reward.max_error_frac", 0 <= c.reward.max_error_frac <= 1, "a fraction in [0, 1]"),
        (
            "reward.overlong_buffer",
            0 <= c.reward.overlong_buffer < r.max_new_tokens,
            f"an integer in [0, rollout.max_new_tokens={r.max_new_tokens}) (0 = off): the penalty's ramp is "
            "the last overlong_buffer tokens of the generation budget",
        ),
        ("reward.overlong_penalty", c.reward.overlong_penalty >= 0, "a number >= 0"),
        *_eval_checks(c),
        ("optim.lr", o.lr > 0, "a number > 0"),
        ("optim.min_lr", 0 <= o.min_lr <= o.lr, f"a number in [0, optim.lr={o.lr}]"),
        ("optim.weight_decay", o.weight_decay >= 0, "a number >= 0"),
        ("optim.adam_beta1", 0 <= o.adam_beta1 < 1, "a number in [0, 1)"),
        ("optim.adam_beta2", 0 <= o.adam_beta2 < 1, "a number in [0, 1)"),
        ("optim.adam_eps", o.adam_eps > 0, "a number > 0"),
        ("optim.clip_grad", o.clip_grad >= 0, "a number >= 0 (0 = no clipping)"),
        ("optim.warmup_steps", o.warmup_steps >= 0, "an integer >= 0"),
        ("optim.decay_steps", o.decay_steps >= 0, "an integer >= 0 (0 = the run's optimizer steps)"),
        ("trainer.max_steps", t.max_steps >= 1, "an integer >= 1"),
        ("trainer.max_time_s", t.max_time_s >= 0, "a number of seconds >= 0 (0 = no budget)"),
        ("trainer.prompts_per_step", t.prompts_per_step >= 1, "an integer >= 1"),
        (
            "trainer.minibatches_per_step",
            t.minibatches_per_step >= 1 and t.prompts_per_step % t.minibatches_per_step == 0,
            f"an integer >= 1 that divides trainer.prompts_per_step ({t.prompts_per_step})",
        ),
        ("trainer.epochs_per_step", t.epochs_per_step >= 1, "an integer >= 1"),
        (
            "trainer.max_tokens_per_microbatch",
            t.max_tokens_per_microbatch >= r.max_model_len,
            f"an integer >= rollout.max_model_len ({r.max_model_len}), the longest sequence a rollout can "
            "produce: raise it or lower rollout.max_model_len",
        ),
        ("trainer.pack_window", t.pack_window >= 1, "an integer >= 1"),
        ("trainer.eval_every", t.eval_every >= 0, "an integer >= 0 (0 = no evaluation)"),
        ("trainer.eval_size", t.eval_size >= 1, "an integer >= 1"),
        ("trainer.save_every", t.save_every >= 0, "an integer >= 0 (0 = by time only)"),
        ("trainer.save_every_minutes", t.save_every_minutes >= 0, "a number of minutes >= 0 (0 = by steps only)"),
        ("trainer.save_hf_every", t.save_hf_every >= 0, "an integer >= 0 (0 = no HF model dirs)"),
        ("trainer.keep_checkpoints", t.keep_checkpoints >= 1, "an integer >= 1"),
        (
            "trainer.stall_timeout_s",
            t.stall_timeout_s is None or t.stall_timeout_s == 0 or t.stall_timeout_s >= 1,
            "a number of seconds >= 1, or 0 for no stall watchdog",
        ),
        ("trainer.run_name", run_name_problem(t.run_name) is None, "one plain directory name (no '/', not . or ..)"),
        ("trainer.output_dir", bool(t.output_dir), "a directory path (the run dir is <output_dir>/<run_name>)"),
        ("trainer.threads", t.threads >= 0, "an integer >= 0 (0 = torch's choice)"),
        ("parallel.tp", c.parallel.tp >= 1, "an integer >= 1"),
        ("parallel.pp", c.parallel.pp >= 1, "an integer >= 1"),
        ("parallel.rollout_tp", c.parallel.rollout_tp >= 1, "an integer >= 1"),
        ("parallel.ep", c.parallel.ep >= 1, "an integer >= 1"),
        ("parallel.etp", c.parallel.etp >= 1, "an integer >= 1"),
        ("parallel.timeout_minutes", c.parallel.timeout_minutes > 0, "a number of minutes > 0"),
        (
            "parallel.recompute_modules",
            c.parallel.recompute_modules is None or set(c.parallel.recompute_modules) <= RECOMPUTE_MODULES,
            f"a list of Megatron recompute modules, among {sorted(RECOMPUTE_MODULES)}",
        ),
        ("parallel.nodes", c.parallel.nodes >= 1, "an integer >= 1"),
        ("parallel.gpus_per_node", c.parallel.gpus_per_node >= 1, "an integer >= 1"),
    ]
    for key, ok, expected in checks:
        if not ok:
            section, name = key.split(".")
            raise ValueError(f"config key {key!r}: expected {expected}, got {getattr(getattr(cfg, section), name)!r}")
    _check_reward_specs(c.reward)
    _check_methods(cfg)
    return cfg


def _check_bppo_waves(cfg: Config, strategy) -> None:
    """BPPO's waves give each prompt its own group size: what reads a group's size as G cannot run."""
    a, g_max = cfg.algorithm, cfg.algorithm.bppo.max_group_size or cfg.rollout.group_size
    if a.selection != "bppo":
        raise ValueError(
            "config keys 'algorithm.bppo.schedule' and 'algorithm.selection': waves schedule BPPO's completions, "
            f"so they need algorithm.selection=bppo, got {a.selection!r}"
        )
    if a.bppo.wave_size > g_max:
        raise ValueError(
            f"config key 'algorithm.bppo.wave_size': a wave of {a.bppo.wave_size} is more than the group's most "
            f"completions (algorithm.bppo.max_group_size, or rollout.group_size={cfg.rollout.group_size})"
        )
    if a.bppo.max_group_size > cfg.rollout.group_size:
        raise ValueError(
            f"config key 'algorithm.bppo.max_group_size': {a.bppo.max_group_size} is more than "
            f"rollout.group_size={cfg.rollout.group_size} (the engine's KV cache and the plan are sized by it)"
        )
    for key, value, why in [
        ("algorithm.aux", a.aux != "none", "ssopd's pairs"),
        ("pruning.strategy", strategy.name == "greso", "greso's per-step probabilities"),
        ("algorithm.curriculum", a.curriculum != "none", "the curriculum's success rate per visit"),
    ]:
        if value:
            raise ValueError(
                f"config keys 'algorithm.bppo.schedule' and '{key}': waves give each prompt its own group size, "
                f"which {why} do not take yet"
            )


def _check_methods(cfg: Config) -> None:
    """The four other methods' options (docs/methods.md): their sections, and the combinations that cannot work."""
    from megatron_dppo.algorithms.pruning import get_strategy

    a = cfg.algorithm
    a.bppo.validate("algorithm.bppo")
    a.reco.validate("algorithm.reco")
    a.adaprefix.validate("algorithm.adaprefix")
    a.ssopd.validate("algorithm.ssopd")
    strategy = get_strategy(cfg.pruning.strategy)
    if a.selection == "bppo":
        if "r_o" in strategy.ratios and cfg.pruning.r_o > 0:
            raise ValueError(
                f"config keys 'algorithm.selection' and 'pruning.r_o': bppo selects the completions itself "
                f"(completion pruning cannot compose with it), so pruning.r_o must be 0, got {cfg.pruning.r_o}"
            )
        if strategy.denominator == "kept":
            raise ValueError(f"config key 'algorithm.selection': bppo cannot run with pruning.strategy={strategy.name}")
        if a.reweighting != "none":
            raise ValueError(
                "config keys 'algorithm.selection' and 'algorithm.reweighting': bppo trains two completions "
                "per group, reco reweights all of them: choose one"
            )
    if a.bppo.schedule == "waves":
        _check_bppo_waves(cfg, strategy)
    if a.aux == "ssopd" and cfg.parallel.pp > 1:
        raise ValueError(
            "config keys 'algorithm.aux' and 'parallel.pp': ssopd's teacher and student share a micro-batch on "
            f"the last stage; pipeline parallelism is not supported with it yet (parallel.pp={cfg.parallel.pp})"
        )
    if a.curriculum == "adaprefix" and not cfg.data.solution_key:
        raise ValueError("config key 'data.solution_key': algorithm.curriculum=adaprefix needs a reference solution")


def _check_reward_specs(rc: RewardConfig) -> None:
    """reward.kind and reward.by_source.<source>: each spec's form, its file if it names one (made
    absolute against the current directory, so a resumed run or a worker loads the same file);
    reward.batched needs a user function. Importing the functions is RewardScorer's workers' (under a timeout)."""
    from megatron_dppo.rewards.spec import absolute_spec, batched_specs

    rc.kind = absolute_spec(rc.kind, "reward.kind")
    rc.by_source = {src: absolute_spec(spec, f"reward.by_source.{src}") for src, spec in rc.by_source.items()}
    batched_specs([rc.kind, *rc.by_source.values()], rc.batched)


def _eval_checks(c: Config) -> list[tuple[str, bool, str]]:
    """validate()'s lines for the eval section (a set name becomes part of metric names)."""
    e = c.eval
    return [
        ("eval.n", e.n >= 1, "an integer >= 1"),
        (
            "eval.temperature",
            e.temperature > 0 or (e.temperature == 0 and e.n == 1),
            f"a number > 0, or 0 (greedy) with eval.n=1 (eval.n is {e.n})",
        ),
        ("eval.top_p", 0 < e.top_p <= 1, "a number in (0, 1]"),
        (
            "eval.pass_k",
            bool(e.pass_k) and all(1 <= k <= e.n for k in e.pass_k),
            f"a non-empty list of integers in [1, eval.n={e.n}]",
        ),
        (
            "eval.sets",
            all(name and "/" not in name and name != "all" and path for name, path in e.sets.items()),
            "a mapping of set names (no '/', not 'all') to non-empty paths",
        ),
        (
            "eval.sets",
            not (c.data.eval and "eval" in e.sets),
            f"no set named 'eval' when data.eval is given (data.eval={c.data.eval!r} is the set 'eval')",
        ),
    ]


def check_layout(
    cfg: Config,
    *,
    world_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_layers: int,
    ffn_hidden_size: int | None = None,
    num_experts: int = 0,
    moe_ffn_hidden_size: int | None = None,
    cuda: bool = True,
) -> None:
    """The parallel layout against the world and the model: ValueError naming every key to change.
    Shared by the trainer (world = torchrun's) and `megatron-dppo plan` (world = nodes x gpus_per_node);
    its model rules (model_layout_problems) by the conversion tools and megatron/parallel.py.
    num_experts / moe_ffn_hidden_size: a mixture-of-experts model's (0 / None for a dense one);
    cuda: NCCL's collectives (False: gloo's, on CPU)."""
    par = cfg.parallel
    tp, rtp = par.tp, par.rollout_tp
    problems = model_layout_problems(
        tp=tp,
        pp=par.pp,
        ep=par.ep,
        etp=par.etp,
        world_size=world_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_layers=num_layers,
        ffn_hidden_size=ffn_hidden_size,
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        cuda=cuda,
    )
    if par.gpus_per_node % tp:
        problems.append(
            f"parallel.tp={tp} must divide parallel.gpus_per_node={par.gpus_per_node}: a tensor-parallel "
            "group stays inside a node"
        )
    if num_experts and par.gpus_per_node % par.etp:
        problems.append(
            f"parallel.etp={par.etp} must divide parallel.gpus_per_node={par.gpus_per_node}: an "
            "expert-tensor-parallel group stays inside a node"
        )
    if num_experts and tp > 1 and not par.sequence_parallel:
        problems.append(
            f"parallel.tp={tp} with a mixture-of-experts model needs parallel.sequence_parallel=true "
            "(Megatron-Core's MoE layer refuses to train under TP without it)"
        )
    # vLLM shards query heads evenly, and KV heads evenly or replicated (tp a multiple of them).
    kv_ok = num_kv_heads % rtp == 0 if num_kv_heads >= rtp else rtp % num_kv_heads == 0
    if rtp < 1 or world_size % rtp or num_heads % rtp or not kv_ok:
        problems.append(
            f"parallel.rollout_tp={rtp} must divide the world size {world_size} and "
            f"num_attention_heads {num_heads}, and divide (or be a multiple of) "
            f"num_key_value_heads {num_kv_heads}"
        )
    if ffn_hidden_size is not None and ffn_hidden_size % rtp:
        problems.append(f"parallel.rollout_tp={rtp} must divide intermediate_size {ffn_hidden_size}")
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % rtp:  # vLLM splits each expert over its TP ranks
        problems.append(f"parallel.rollout_tp={rtp} must divide moe_intermediate_size {moe_ffn_hidden_size}")
    if par.gpus_per_node % rtp:
        problems.append(
            f"parallel.rollout_tp={rtp} must divide parallel.gpus_per_node={par.gpus_per_node}: one vLLM "
            "engine stays inside a node"
        )
    if problems:
        raise ValueError("invalid parallel layout: " + "; ".join(problems))


def config_key(name: str, value) -> str:
    """How model_layout_problems names a parallel size by default: the config key and its value."""
    return f"parallel.{name}={value}"


def model_layout_problems(
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    etp: int = 1,
    world_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_layers: int,
    ffn_hidden_size: int | None = None,
    num_experts: int = 0,
    moe_ffn_hidden_size: int | None = None,
    cuda: bool = True,
    show=config_key,
) -> list[str]:
    """What Megatron-Core needs of a TP x PP (x EP x expert-TP) layout on this world and model, one
    problem per rule broken; show(name, value) names a size ("parallel.tp=3", or a tool's "--tp 3").

    Megatron-Core's initialize_model_parallel lays the expert groups (EP x expert-TP x expert-DP x
    PP) over the same world as the dense ones (TP x DP x PP), pipeline stages shared: ep x etp x pp
    must divide the world as tp x pp does; expert DP is what is left. Its alltoall token dispatcher
    all-gathers the tokens of an expert-TP group's ranks in each rank's own count (ranks of different
    data-parallel replicas hold different packs), which NCCL's all_gather does and gloo's refuses
    ("ProcessGroupGloo::allgather: invalid tensor size"): on CPU, etp is 1."""
    problems = []
    if min(tp, pp, ep, etp) < 1:
        return [f"{show('tp', tp)}, {show('pp', pp)}, {show('ep', ep)} and {show('etp', etp)} must be >= 1"]
    if world_size % (tp * pp):
        problems.append(f"{show('tp', tp)} x {show('pp', pp)} must divide the world size {world_size}")
    if num_heads % tp or num_kv_heads % tp:
        problems.append(
            f"{show('tp', tp)} must divide num_attention_heads {num_heads} and num_key_value_heads {num_kv_heads}"
        )
    if ffn_hidden_size is not None and ffn_hidden_size % tp:
        problems.append(f"{show('tp', tp)} must divide intermediate_size {ffn_hidden_size}")
    if num_layers % pp:
        problems.append(f"{show('pp', pp)} must divide num_hidden_layers {num_layers}")
    if (ep > 1 or etp > 1) and not num_experts:
        sizes = " and ".join(show(k, v) for k, v in (("ep", ep), ("etp", etp)) if v > 1)
        problems.append(
            f"{sizes} need{'s' if ' and ' not in sizes else ''} a mixture-of-experts model (this one is dense)"
        )
        return problems
    if not num_experts:
        return problems
    if world_size % (ep * etp * pp):
        problems.append(
            f"{show('ep', ep)} x {show('etp', etp)} x {show('pp', pp)} must divide the world size {world_size}"
        )
    if num_experts % ep:
        problems.append(f"{show('ep', ep)} must divide num_experts {num_experts}")
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % etp:
        problems.append(f"{show('etp', etp)} must divide moe_intermediate_size {moe_ffn_hidden_size}")
    if etp > 1 and not cuda:
        problems.append(
            f"{show('etp', etp)} cannot run on CPU: Megatron-Core's token dispatcher all-gathers the "
            "expert-TP group's tokens in each rank's own count, which gloo's all_gather refuses (split "
            "the experts with parallel.ep instead, and keep parallel.etp=1)"
        )
    return problems


def resolve(
    cfg: Config,
    *,
    world_size: int,
    local_world_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_layers: int,
    ffn_hidden_size: int,
    num_train_records: int,
    cuda: bool,
    threads: int,
    num_experts: int = 0,
    moe_ffn_hidden_size: int | None = None,
    te: bool = False,
    wgrad_kernel: bool | None = None,
) -> Config:
    """Fill in every value that depends on the model, the machine or the data, in one place, before
    the config is saved or read by anything else: after this no key is None or means "decide later".
    The cluster shape is the launch's (torchrun's world and processes per node), not the config's.
    te: the model runs on the Transformer Engine path (megatron/attention_backend.py's choice);
    wgrad_kernel: APEX's fused wgrad extension imports (None: look; resolve_gpu_settings)."""
    cfg.parallel.gpus_per_node = local_world_size
    cfg.parallel.nodes = max(world_size // local_world_size, 1)
    check_layout(
        cfg,
        world_size=world_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_layers=num_layers,
        ffn_hidden_size=ffn_hidden_size,
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        cuda=cuda,
    )
    if cfg.data.train_size == 0 or cfg.data.train_size > num_train_records:
        cfg.data.train_size = num_train_records
    if cfg.rollout.dtype is None:
        cfg.rollout.dtype = cfg.model.dtype
    if cfg.pruning.drop_zero_variance is None:  # exact only without a KL term
        cfg.pruning.drop_zero_variance = cfg.algorithm.kl_coef == 0
    if cfg.parallel.distributed_optimizer is None:  # shards Adam state over DP; pointless on CPU
        cfg.parallel.distributed_optimizer = cuda
    resolve_gpu_settings(
        cfg.parallel, cuda=cuda, te=te, moe=num_experts > 0, world_size=world_size, wgrad_kernel=wgrad_kernel
    )
    if cfg.optim.decay_steps == 0:
        t = cfg.trainer
        cfg.optim.decay_steps = t.max_steps * t.minibatches_per_step * t.epochs_per_step
    if cfg.trainer.threads == 0:
        cfg.trainer.threads = threads
    if cfg.trainer.stall_timeout_s is None:  # the longest healthy phase is minutes on GPUs (watchdog.py)
        cfg.trainer.stall_timeout_s = 1800.0 if cuda else 600.0
    return cfg


SELECTIVE_RECOMPUTE_MODULES = ["core_attn", "mlp"]
# Megatron-Core 0.16's recompute_modules choices (TransformerConfig); layernorm and moe_act need TE.
RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}
DDP_BUCKET_MIN, DDP_BUCKET_PER_RANK = 40_000_000, 1_000_000  # Megatron DDP's default bucket size rule


def resolve_gpu_settings(
    par: ParallelConfig, *, cuda: bool, te: bool, moe: bool, world_size: int, wgrad_kernel: bool | None = None
) -> None:
    """parallel's GPU performance keys: None -> on where they can run (overlap: CUDA; the fusions:
    the TE path, the MoE ones for an MoE model), off otherwise; a fusion asked for where TE does not
    run, or overlap_param_gather, is refused naming the key. wgrad_kernel: APEX's
    fused_weight_gradient_mlp_cuda is importable (None: look here), which gradient_accumulation_fusion
    needs beside TE: Megatron's own output layer refuses to build without it."""
    if wgrad_kernel is None:
        import importlib.util

        wgrad_kernel = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    if par.overlap_param_gather:
        raise ValueError(
            "config key 'parallel.overlap_param_gather': expected false; the weight sync reads the parameters "
            "right after the optimizer step, before the next forward that would finish the overlapped all-gather"
        )
    if par.overlap_grad_reduce is None:
        par.overlap_grad_reduce = cuda
    if par.ddp_bucket_size is None:
        dp = max(world_size // (par.tp * par.pp), 1)
        par.ddp_bucket_size = max(DDP_BUCKET_MIN, DDP_BUCKET_PER_RANK * dp) if par.overlap_grad_reduce else 0
    if par.ddp_bucket_size < 0:
        raise ValueError(f"config key 'parallel.ddp_bucket_size': expected an integer >= 0, got {par.ddp_bucket_size}")
    for key, wanted in (
        ("gradient_accumulation_fusion", te and wgrad_kernel),
        ("moe_permute_fusion", te and moe),
        ("moe_router_fusion", te and moe),
    ):
        if getattr(par, key) is None:
            setattr(par, key, wanted)
        elif getattr(par, key) and not te:
            raise ValueError(
                f"config key 'parallel.{key}': expected false (or unset) here; it needs the Transformer Engine "
                "path (model.attention resolving to te: a GPU with transformer_engine)"
            )
    if par.gradient_accumulation_fusion and not wgrad_kernel:
        raise ValueError(
            "config key 'parallel.gradient_accumulation_fusion': expected false (or unset) here; it needs APEX's "
            "fused_weight_gradient_mlp_cuda extension (NVIDIA's containers ship it), which does not import"
        )
    if par.recompute_modules is None and par.recompute == "selective":  # else unused (not saved)
        # On the TE path flash attention keeps no s x s scores and the norms are fused into their
        # linears, so Megatron's own default, core_attn (+ the MoE layer's unfused pre-MLP norm),
        # is the recompute that costs nothing; "mlp" would rerun two thirds of each dense layer's
        # forward to save its 3f activations per token (docs/scaling.md 5b: every preset fits
        # without it). The local path keeps the CPU's ["core_attn", "mlp"].
        if te:
            par.recompute_modules = ["core_attn", "layernorm"] if moe else ["core_attn"]
        else:
            par.recompute_modules = list(SELECTIVE_RECOMPUTE_MODULES)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in the same "
                    f"section (first at line {seen[key]}); merge them"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse_override(text: str):
    """'a.b=value' -> (['a', 'b'], value parsed as YAML)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(
            f"override {key.strip()!r}: the value {raw!r} is not valid YAML ({' '.join(str(e).split())[:120]}); "
            "quote it, e.g. key=\"'value'\""
        ) from None


def _override_path(cfg: Config, key: str) -> list[str]:
    """An override's key split into its sections and field; below a mapping field the rest is one
    entry's name, dots and all (reward.by_source.my.source=math: the data_source 'my.source')."""
    parts, obj = key.split("."), cfg
    for i, part in enumerate(parts):
        value = getattr(obj, part, None) if dataclasses.is_dataclass(obj) else None
        if isinstance(value, dict) and i + 2 < len(parts):
            return parts[: i + 1] + [".".join(parts[i + 1 :])]
        obj = value
    return parts


def load_config(path: str | None = None, overrides=(), check: bool = True) -> Config:
    cfg = Config()
    if path:
        with open(path) as f:
            try:
                data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        try:
            _apply(cfg, data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    for text in overrides:
        key, value = parse_override(text)
        nested: dict = value
        for part in reversed(_override_path(cfg, key)):
            nested = {part: nested}
        _apply(cfg, nested)
    return validate(cfg) if check else cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def inert_keys(cfg: Config) -> dict[str, str]:
    """Keys (or whole sections) that this config's method does not read -> why, the one rule of
    "does this key matter here": the saved config leaves them out (so it shows what ran: a GRPO
    run has no pruning ratios; no KL, no KL estimator), and preflight.config_warnings names each
    one that is set to other than its default. Rules that need the model, tokenizer or data are
    preflight.input_warnings'."""
    from megatron_dppo.algorithms.pruning import STRATEGIES, get_strategy

    a, p = cfg.algorithm, cfg.pruning
    strategy, out = get_strategy(p.strategy), {}
    what = {"r_q": "prunes no prompts", "r_o": "prunes no completions"}
    for r in ("r_q", "r_o"):
        if r not in strategy.ratios:
            users = sorted(n for n, make in STRATEGIES.items() if r in make().ratios)
            out[f"pruning.{r}"] = (
                f"pruning.strategy={p.strategy} {what[r]} (strategies that use pruning.{r}: {', '.join(users)})"
            )
    if p.strategy == "none":
        out["pruning.history_ema"] = "pruning.strategy=none keeps no prompt history"
    if not (a.dynamic_sampling or strategy.refills):
        out["algorithm.max_resample_rounds"] = (
            f"nothing refills the batch (algorithm.dynamic_sampling=false, pruning.strategy={p.strategy})"
        )
    if a.kl_coef == 0:
        out["algorithm.kl_estimator"] = "algorithm.kl_coef=0 (no KL term)"
    for section, switch, method in _METHOD_SWITCHES:
        chosen = getattr(a, switch)
        if chosen != method:
            out[f"algorithm.{section}"] = (
                f"algorithm.{switch}={chosen} (algorithm.{section}.* act with algorithm.{switch}={method})"
            )
    if a.selection == "bppo":
        bc = a.bppo
        for name, mode in (("prefix_ratio", "ratio"), ("prefix_fixed", "fixed")):
            if bc.prefix_mode != mode:
                out[f"algorithm.bppo.{name}"] = (
                    f"algorithm.bppo.prefix_mode={bc.prefix_mode} (it acts with prefix_mode={mode})"
                )
        if bc.schedule != "waves":
            for name in ("wave_size", "max_group_size"):
                out[f"algorithm.bppo.{name}"] = f"algorithm.bppo.schedule={bc.schedule} (it acts with schedule=waves)"
    if a.aux == "ssopd":
        for name, div in (("tau", "fkl_clip"), ("jsd_beta", "jsd")):
            if a.ssopd.div != div:
                out[f"algorithm.ssopd.{name}"] = f"algorithm.ssopd.div={a.ssopd.div} (it acts with div={div})"
    if a.curriculum != "adaprefix":
        out["data.solution_key"] = f"algorithm.curriculum={a.curriculum} shows no reference solution"
    if cfg.data.prompt_mode == "raw":
        out["data.system_prompt"] = "data.prompt_mode=raw applies no chat template, so no system turn"
    if cfg.parallel.recompute != "selective":
        out["parallel.recompute_modules"] = (
            f"parallel.recompute={cfg.parallel.recompute} (it acts with parallel.recompute=selective)"
        )
    return out


# (section of AlgorithmConfig, the key that selects it, the value that selects it)
_METHOD_SWITCHES = (
    ("bppo", "selection", "bppo"),
    ("reco", "reweighting", "reco"),
    ("adaprefix", "curriculum", "adaprefix"),
    ("ssopd", "aux", "ssopd"),
)


def unused_keys(cfg: Config) -> list[str]:
    """The keys of inert_keys (dotted; a section stands for all its fields)."""
    return list(inert_keys(cfg))


def _drop_key(data: dict, key: str) -> None:
    *sections, name = key.split(".")
    for s in sections:
        data = data[s]
    data.pop(name, None)


def save_config(cfg: Config, path: str) -> None:
    """The resolved config, as it ran. Unset optional paths are left out (loading the file back
    gives them their empty default); any other None means `resolve` was skipped: an error."""
    data = to_dict(cfg)
    for key in OPTIONAL_KEYS:
        section, name = key.split(".")
        if not data[section][name]:
            del data[section][name]
    for key in unused_keys(cfg):
        _drop_key(data, key)
    unresolved = [f"{s}.{k}" for s, sec in data.items() for k, v in sec.items() if v is None]
    if unresolved:
        raise ValueError(f"config keys {unresolved} are unresolved: call config.resolve() before saving")
    with open(path, "w") as f:
        f.write(
            "# The resolved config of this run. Left out: optional paths that were not given, and keys "
            "the method does not read.\n"
        )
        yaml.safe_dump(data, f, sort_keys=False)
