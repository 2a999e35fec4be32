"""Megatron DDP, the Adam optimizer and the LR schedule around a built GPTModel."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _finalize_grads_unscaled(model, num_tokens=None, *args, **kwargs):
    """finalize_model_grads without the 1/num_tokens scaling: our coefficients already carry the
    full-batch denominator, so any further normalisation would make the result depend on how the
    batch was split."""
    return finalize_model_grads(model, None, *args, **kwargs)


def wrap_for_training(
    model, optim, *, params_dtype, distributed_optimizer: bool, overlap_grad_reduce: bool = False, bucket_size: int = 0
):
    """-> (DDP-wrapped model, optimizer, LR scheduler). Gradients are summed over DP ranks
    (gradient_scaling_factor 1, no averaging) and finalized unscaled: the loss's coefficients
    carry the whole normalisation (megatron/loss.py).

    overlap_grad_reduce: each bucket of `bucket_size` parameters (0 = one bucket) is reduced as
    soon as the last micro-batch's backward has produced its gradients; the schedule then runs
    the other micro-batches under DDP's no_sync, as Megatron-LM's training loop sets it up."""
    model.config.finalize_model_grads_func = _finalize_grads_unscaled
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size or None,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
    if overlap_grad_reduce:
        model.config.no_sync_func = ddp.no_sync
        model.config.grad_sync_func = ddp.start_grad_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(optim.decay_steps or 1000, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler
