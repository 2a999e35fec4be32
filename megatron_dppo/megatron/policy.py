"""The policy on Megatron-Core: packed micro-batches through forward_backward with the DPPO loss.

How the DPPO loss enters Megatron's distributed reduction (docs/dppo.md section 4): each micro-batch's
loss is sum_t coef_t * loss_t (megatron/loss.py), fixed before the step. The gradient we want is
the gradient of the sum of those over every micro-batch of every rank. So:
  * calculate_per_token_loss=True: the schedule neither divides a micro-batch's loss by its token
    count nor by the number of micro-batches;
  * the DDP sums gradients over data-parallel ranks (gradient_scaling_factor 1, no averaging);
  * finalize_model_grads runs WITHOUT its 1/num_tokens scaling (megatron/optimizer.py).
The result is independent of the micro-batch split, PP, TP and DP by construction, and a test
compares it with a single-process reference for each layout.

The pieces: megatron/optimizer.py builds DDP, optimizer and schedule; megatron/loss.py is the
loss and its metrics; megatron/weights.py moves weights in and out under HF names.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dppo.algorithms.methods import registry
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import weights
from megatron_dppo.megatron.attention import packed_seq_params
from megatron_dppo.megatron.attention_backend import attention_choice
from megatron_dppo.megatron.cpu_compat import suspend_cpu_compat
from megatron_dppo.megatron.lora import LoraSettings, add_adapters
from megatron_dppo.megatron.lora import gather_over_stages as lora_gather
from megatron_dppo.megatron.loss import micro_batch_loss, reduce_reports
from megatron_dppo.megatron.model import GpuSettings, build_gpt_model, current_device
from megatron_dppo.megatron.moe import is_moe
from megatron_dppo.megatron.optimizer import wrap_for_training
from megatron_dppo.megatron.router_stats import RouterStats, padding_mask, stage_padding_mask
from megatron_dppo.megatron.routing_replay import (
    RoutingAgreement,
    check_layout,
    clear_replay,
    routers,
    set_replay,
)
from megatron_dppo.model import qwen3 as mapping


def _config_overrides(
    backend: str, tp_size: int, pp_size: int, sequence_parallel: bool, recompute: str, gpu: GpuSettings | None = None
) -> dict:
    """TransformerConfig settings that follow from the run's layout and memory options."""
    gpu = gpu or GpuSettings()
    overrides = dict(calculate_per_token_loss=True)
    if sequence_parallel and tp_size > 1:
        if backend != "te":
            raise ValueError(
                "parallel.sequence_parallel needs the Transformer Engine path (model.attention=te on a "
                "GPU with transformer_engine): megatron-core's local spec has no sequence-parallel norm"
            )
        overrides["sequence_parallel"] = True
    if recompute == "selective":  # recompute attention and MLP internals in backward
        overrides.update(recompute_granularity="selective", recompute_modules=list(gpu.recompute_modules))
    elif recompute == "full":  # keep only each layer's input
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute != "none":
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    overrides.update(gpu.transformer_overrides())
    if pp_size > 1:
        # Packs differ in length: let the pipeline send each activation's shape first.
        # (TransformerConfig insists on the alltoall MoE dispatcher for that, even for a dense
        # model, where it is unused.)
        overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    return overrides


def _moe_overrides(hf_config, algorithm: AlgorithmConfig, backend: str, overrides: dict) -> dict:
    """A mixture-of-experts model's router terms (their per-update scale: megatron/router_stats.py)
    and the MoE module of selective recomputation; {} for a dense model."""
    if not is_moe(hf_config):
        return {}
    out = dict(
        moe_aux_loss_coeff=algorithm.moe_aux_loss_coeff,
        # None, not 0: Megatron computes (and logs divided by) any non-None z coefficient.
        moe_z_loss_coeff=algorithm.moe_z_loss_coeff or None,
    )
    if overrides.get("recompute_granularity") == "selective":
        # Megatron's "mlp" skips MoE layers. "moe_act" (TE grouped GEMM only) recomputes each
        # expert's SwiGLU, keeping fc1's output; the local spec's SequentialMLP has no such hook,
        # so there the whole MoE layer is recomputed ("moe": router, all-to-all and experts again).
        out["recompute_modules"] = [*overrides["recompute_modules"], "moe_act" if backend == "te" else "moe"]
    return out


def _on_device(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter and buffer on this rank's device, as Megatron-LM's get_model
    puts it there before wrapping it. Megatron-Core makes most weights on the GPU itself, but
    not all: the MoE router's fp32 weight (moved lazily in its gating) and every torch.nn.RMSNorm
    of the local spec start on the CPU. The distributed optimizer's parameter buffer hides that;
    without it the optimizer's fp32 master copies are made where the parameters are, and the
    reference model (no DDP) would run its forward on the CPU's weights. Not in build_gpt_model:
    the checkpoint converter builds on the meta device and must stay there."""
    return model.to(current_device())


def _experts_apart(model) -> None:
    """Give the experts their own gradient buffers and optimizer at every EP size, as Megatron
    does only for EP > 1 (it marks expert weights allreduce=False there): the optimizer is then
    the same chain (dense, experts) at any EP, so a checkpoint saved at EP=2 resumes at EP=1 and
    back (a single optimizer's state keys and layout differ from a chain's). The experts' gradients
    are then reduced over the expert-data-parallel group, which at EP=1 (and expert-TP 1) is the
    dense data-parallel group times TP: the ranks whose tokens reach a replica of the expert."""
    for name, p in model.named_parameters():
        if mapping.is_expert(name):
            p.allreduce = False


class MegatronPolicy:
    """One rank's share of the policy (and optional frozen reference) model."""

    def __init__(
        self,
        hf_config,
        optim: OptimConfig,
        algorithm: AlgorithmConfig,
        *,
        temperature: float = 1.0,
        params_dtype=torch.float32,
        attention: str = "auto",
        thd_attention: str = "auto",
        with_reference: bool = False,
        sequence_parallel: bool = False,
        recompute: str = "none",
        distributed_optimizer: bool | None = None,
        gpu_settings: GpuSettings | None = None,
        routing_replay: bool = False,
        lora: LoraSettings | None = None,
    ):
        """algorithm: the loss settings (aggregation, clip ranges, ratio type, KL); temperature: the
        sampling temperature, at which log-probs are taken (the rollouts' distribution).
        routing_replay: an MoE model's routers replay each micro-batch's routed_experts in every
        forward (log-probs, training, recompute; megatron/routing_replay.py); no-op when dense.
        lora: adapters on the frozen model (megatron/lora.py); the KL reference is then the model
        with its adapters off, not a second copy."""
        self.hf_config, self.optim_cfg, self.algorithm, self.temperature = hf_config, optim, algorithm, temperature
        self.reweighting = registry.recipe(algorithm).reweighting  # its token loss, looked up once
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        # A pure function of (dtype, TE version, layout): e.g. local for fp32 on TE < 2.11, and a
        # named error for an explicit `te` that cannot work (megatron/attention_backend.py).
        self.attention = attention_choice(
            attention, dtype=params_dtype, sequence_parallel=sequence_parallel and self.tp_size > 1
        )
        self.attention_backend = backend = self.attention.backend
        gpu = gpu_settings or GpuSettings()
        overrides = _config_overrides(backend, self.tp_size, self.pp_size, sequence_parallel, recompute, gpu)
        overrides.update(_moe_overrides(hf_config, algorithm, backend, overrides))
        self.routing_replay = bool(routing_replay) and is_moe(hf_config)
        if self.routing_replay:
            check_layout(self.pp_size, recompute)
            overrides["moe_enable_routing_replay"] = True
        build = dict(params_dtype=params_dtype, attention=backend, thd_attention=thd_attention, **overrides)
        model = _on_device(build_gpt_model(hf_config, **build))
        self.layout = mapping.layout_from_hf_config(hf_config, padded_vocab=model.vocab_size, te_names=backend == "te")
        self.vocab_size = hf_config.vocab_size
        # None: on with CUDA (optimizer state sharded over DP), off on CPU
        dist_opt = torch.cuda.is_available() if distributed_optimizer is None else distributed_optimizer
        # MoE: experts apart from the dense parameters (before DDP sees them), and the router
        # terms' scale and the routing statistics of every update.
        self.router_stats = None
        self.sequence_parallel = bool(overrides.get("sequence_parallel"))
        if is_moe(hf_config):
            _experts_apart(model)
            self.router_stats = RouterStats(
                model, algorithm.moe_aux_loss_coeff, algorithm.moe_z_loss_coeff, self.sequence_parallel
            )
        # LoRA: frozen before DDP is built, so it makes gradient buffers (and the optimizer state) for the adapters only
        self.adapters = add_adapters(model, lora) if lora is not None else None
        self.model, self.optimizer, self.scheduler = wrap_for_training(
            model,
            optim,
            params_dtype=params_dtype,
            distributed_optimizer=dist_opt,
            overlap_grad_reduce=gpu.overlap_grad_reduce,
            bucket_size=gpu.ddp_bucket_size,
        )
        self.reference = None
        self.reference_is_base = with_reference and self.adapters is not None
        if with_reference and not self.reference_is_base:
            self.reference = _on_device(build_gpt_model(hf_config, **build))
            self.reference.requires_grad_(False)
            self.reference.eval()
        # each model's own routers (Megatron's global replay list holds every model's)
        # Each model's own routers (replay only: a policy without it needs nothing of its model here)
        self._routers = (
            {id(m): routers(m) for m in (self.model, self.reference) if m is not None} if self.routing_replay else {}
        )
        self.routing_agreement = RoutingAgreement(self._routers[id(self.model)]) if self.routing_replay else None

    # ---- weights (megatron/weights.py) -----------------------------------------------------------
    def load_hf_state_dict(self, hf_sd: dict, into_reference: bool = True) -> None:
        """Load HF-named full tensors (every rank passes the same dict) into this rank's shard."""
        targets = [self.model.module] + ([self.reference] if self.reference is not None and into_reference else [])
        weights.load_hf_state_dict(targets, self.layout, hf_sd)
        self.optimizer.reload_model_params()  # the fp32 main copy of a bf16 model, if any

    def copy_policy_to_reference(self) -> bool:
        """The KL reference := the policy's current weights (for model.init_checkpoint: the reference
        must start where the policy starts). False (and nothing done) without a reference."""
        if self.reference is None:  # none, or LoRA's: the frozen base, where the policy starts
            return False
        weights.copy_parameters(self.model.module, self.reference)
        return True

    def hf_weight_buckets(self, bucket_bytes: int = 1 << 30):
        """The current weights under HF names, in buckets, on every rank (a generator)."""
        return weights.hf_weight_buckets(self.model.module, self.layout, bucket_bytes)

    def hf_adapters(self) -> dict:
        """LoRA: the adapters under HF names (model.layers.L.self_attn.q_proj.lora_A.weight, ...), whole
        (merged over TP and gathered from every PP stage and EP rank), on every rank, on the CPU."""
        return lora_gather(self.adapters.hf_tensors())

    def hf_adapter_grads(self) -> dict:
        """LoRA: the adapters' DP-reduced gradients after forward_backward, whole, under the names of hf_adapters."""
        reduced = weights.reduced_main_grads_by_param(self.model)
        return lora_gather(self.adapters.hf_tensors(values=reduced))

    def hf_state_dict(self) -> dict:
        """The current weights under HF names, on every rank (small models, tests)."""
        return {k: v for bucket in self.hf_weight_buckets() for k, v in bucket}

    def non_finite(self, grads: bool = False) -> list[str]:
        """This rank's parameters (or gradients) with a NaN or infinity, by global megatron name."""
        return weights.non_finite(self.model.module, self.layout, grads=grads)

    def hf_grads(self) -> dict:
        """Gradients after forward_backward (DP-reduced), under HF names, on every rank."""
        return weights.hf_grads(self.model, self.layout)

    # ---- forward / backward ----------------------------------------------------------------------
    def _forward_step(self, data_iterator, model, *, mode: str, denominator: float | None):
        batch = next(data_iterator)
        dev = current_device()
        # None for a padded [rows, L] batch; the row layout is read on the host here, once.
        psp = packed_seq_params(batch, dev)
        ids, pos = batch.tokens.to(dev), batch.position_ids.to(dev)
        # On CPU, the shim's device-rewriting mode runs Python on every torch call; the built
        # model's forward allocates nothing on "cuda", so it runs without it (8% of an addition
        # step's forward_backward, tools/bench_packing.py --sections profile). No-op on GPUs.
        # An MoE model's routers leave padding out of their auxiliary terms and statistics.
        moe = {"padding_mask": self._padding_mask(batch).to(dev)} if self.router_stats is not None else {}
        if self.routing_replay:
            set_replay(self._routers[id(model)], batch.routed_experts, self.sequence_parallel)
            self.routing_agreement.set_target(batch, self.sequence_parallel)
        with suspend_cpu_compat():
            output = model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp, **moe)
        loss = partial(
            micro_batch_loss,
            batch,
            algorithm=self.algorithm,
            reweighting=self.reweighting,
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            mode=mode,
            denominator=denominator,
        )
        return output, loss

    def _padding_mask(self, batch) -> torch.Tensor:
        """The MoE padding mask as this stage's routers see their tokens (router_stats.stage_padding_mask)."""
        return stage_padding_mask(
            padding_mask(batch),
            first_stage=parallel_state.is_pipeline_first_stage(),
            sequence_parallel=self.sequence_parallel,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=self.tp_size,
        )

    def _run(self, model, microbatches, mode, denominator=None, forward_only=False):
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, mode=mode, denominator=denominator),
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=max(int(mb.tokens.shape[1]) for mb in microbatches),
            micro_batch_size=int(microbatches[0].tokens.shape[0]),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def compute_logprobs(self, microbatches, reference: bool = False, gini: bool = False):
        """Per-position log-probs of the labels for each micro-batch (shaped like its labels) on the last
        pipeline stage; None elsewhere. Reuses the packed micro-batches of the train step. gini: also
        each position's Gini impurity (ReCo), returned as a second list."""
        model = self.model if (not reference or self.reference_is_base) else self.reference
        if reference and model is None:
            raise ValueError("compute_logprobs(reference=True) needs MegatronPolicy(with_reference=True)")
        base = self.adapters.disabled() if reference and self.reference_is_base else contextlib.nullcontext()
        model.eval()
        with base:
            out = self._run(model, microbatches, "logprob+gini" if gini else "logprob", forward_only=True)
        model.train()
        self._end_replay(model)
        if not parallel_state.is_pipeline_last_stage():
            return None
        logp = [o["logp"] for o in out]
        return (logp, [o["gini"] for o in out]) if gini else logp

    def forward_backward(self, microbatches, denominator: float) -> dict:
        """Accumulate the gradient of sum over micro-batches (and DP ranks) of the DPPO loss."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        corrected = self.algorithm.rollout_correction != "none"  # report the correction's shares
        if self.router_stats is None:
            return reduce_reports(
                self._run(self.model, microbatches, "train", denominator=denominator), corrected
            ).as_dict()
        # MoE: the router terms scaled to this update's tokens; their values and the expert load
        # reported beside the policy loss (train/moe_aux_loss, train/moe_z_loss, train/moe_load_imbalance)
        self.router_stats.set_coefficients(microbatches)
        agreement = self.routing_agreement.counting() if self.routing_replay else contextlib.nullcontext()
        with self.router_stats.recording(), agreement:
            reports = self._run(self.model, microbatches, "train", denominator=denominator)
        self._end_replay(self.model)
        out = {**reduce_reports(reports, corrected).as_dict(), **self.router_stats.reduce()}
        if self.routing_replay:  # its routers' own choice vs vLLM's: what replay overrides
            out["routing_agreement"] = self._reduce_agreement()
        return out

    def _end_replay(self, model) -> None:
        """Drop the last micro-batch's replay targets (they would pin its routing tensors)."""
        if self.routing_replay:
            clear_replay(self._routers[id(model)])

    def _reduce_agreement(self) -> float:
        """The update's fraction of (real token, MoE layer) pairs whose own top-k set is vLLM's, over
        every rank (each stage counts its layers; DP ranks their tokens). Collective over the world."""
        a = self.routing_agreement
        sums = torch.stack([a.agree, a.count]).to(current_device())
        torch.distributed.all_reduce(sums)
        a.agree.zero_()
        a.count.zero_()
        agree, count = sums.cpu().tolist()
        return agree / count if count else float("nan")

    def optimizer_step(self) -> dict:
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": self.optimizer.param_groups[0]["lr"],
            "update_ok": bool(ok),
        }

    def train_step(self, microbatches, denominator: float) -> dict:
        metrics = self.forward_backward(microbatches, denominator)
        metrics.update(self.optimizer_step())
        return metrics
