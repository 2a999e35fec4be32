"""The policy on Megatron-Core: packed micro-batches through forward_backward with the DPPO loss.

How the DPPO loss enters Megatron's distributed reduction (DPPO.md section 4): each
micro-batch's loss is sum_t coef_t * loss_t, coef_t = (w_q * w_o of t's sequence) / (the
FULL mini-batch denominator) [/ |o| for seq-mean-token-mean], fixed before the step. The
gradient we want is the gradient of the sum of those over every micro-batch of every rank. So:
  * calculate_per_token_loss=True: the schedule neither divides a micro-batch's loss by its
    token count nor by the number of micro-batches;
  * the DDP sums gradients over data-parallel ranks (gradient_scaling_factor 1, no averaging);
  * finalize_model_grads runs WITHOUT its 1/num_tokens scaling (we pass num_tokens=None).
The result is independent of the micro-batch split, PP, TP and DP by construction, and a test
compares it with a single-process reference for each layout.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dppo.algorithms import losses
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.convert import qwen3 as mapping
from megatron_dppo.megatron.attention import packed_seq_params
from megatron_dppo.megatron.cpu_compat import suspend_cpu_compat
from megatron_dppo.megatron.logprobs import token_logprobs
from megatron_dppo.megatron.model import build_gpt_model, resolve_attention_backend


def _finalize_grads_unscaled(model, num_tokens=None, *args, **kwargs):
    """finalize_model_grads without the 1/num_tokens scaling: our coefficients already carry
    the full-batch denominator, so any further normalisation would make the result depend on
    how the batch was split."""
    return finalize_model_grads(model, None, *args, **kwargs)


def _merged_shape(name: str, shape, tp_size: int) -> tuple:
    kind = mapping.tp_split_kind(name)
    shape = list(shape)
    if tp_size > 1 and kind != "replicated":
        shape[1 if kind == "row" else 0] *= tp_size
    return tuple(shape)


def _unit_of(name: str):
    """A decoder layer's index, or 'embedding' / 'head' for the rest."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    return "embedding" if name.startswith("embedding.") else "head"


def _unit_order(unit):
    return -1 if unit == "embedding" else (10**9 if unit == "head" else unit)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
        with_reference: bool = False,
        sequence_parallel: bool = False,
        recompute: str = "none",
        distributed_optimizer: bool | None = None,
    ):
        """algorithm: the loss settings (aggregation, clip ranges, ratio type, KL); temperature: the
        sampling temperature, at which log-probs are taken (the rollouts' distribution)."""
        self.hf_config, self.optim_cfg, self.algorithm, self.temperature = hf_config, optim, algorithm, temperature
        backend = resolve_attention_backend(attention)
        self.attention_backend = backend
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        overrides = dict(calculate_per_token_loss=True)
        if sequence_parallel and self.tp_size > 1:
            if backend != "te":
                raise ValueError(
                    "parallel.sequence_parallel needs the Transformer Engine path (model.attention=te "
                    "on a GPU with transformer_engine): megatron-core's local spec has no "
                    "sequence-parallel norm"
                )
            overrides["sequence_parallel"] = True
        if recompute == "selective":  # recompute attention and MLP internals in backward
            overrides.update(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
        elif recompute == "full":  # keep only each layer's input
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif recompute != "none":
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
        if self.pp_size > 1:
            # Packs differ in length: let the pipeline send each activation's shape first.
            # (TransformerConfig insists on the alltoall MoE dispatcher for that, even for a
            # dense model, where it is unused.)
            overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        model = build_gpt_model(hf_config, params_dtype=params_dtype, attention=backend, **overrides)
        self.layout = mapping.layout_from_hf_config(hf_config, padded_vocab=model.vocab_size, te_names=backend == "te")
        self.vocab_size = hf_config.vocab_size
        model.config.finalize_model_grads_func = _finalize_grads_unscaled
        # None: on with CUDA (optimizer state sharded over DP), off on CPU
        dist_opt = torch.cuda.is_available() if distributed_optimizer is None else distributed_optimizer
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt
        )
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
        self.optimizer = get_megatron_optimizer(
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
                use_distributed_optimizer=dist_opt,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
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
        self.reference = None
        if with_reference:
            self.reference = build_gpt_model(hf_config, params_dtype=params_dtype, attention=backend, **overrides)
            self.reference.requires_grad_(False)
            self.reference.eval()

    # ---- weights ---------------------------------------------------------------------------
    def load_hf_state_dict(self, hf_sd: dict, into_reference: bool = True) -> None:
        """Load HF-named full tensors (every rank passes the same dict) into this rank's shard.
        Holds the whole model on every rank: for small models and tests. From an HF directory,
        megatron_dppo.megatron.hf_load.load_hf_into_policy reads only this rank's slices."""
        full = mapping.hf_to_megatron(hf_sd, self.layout)
        local = mapping.shard_for_rank(
            full,
            self.layout,
            parallel_state.get_tensor_model_parallel_rank(),
            self.tp_size,
            parallel_state.get_pipeline_model_parallel_rank(),
            self.pp_size,
        )
        targets = [self.model.module] + ([self.reference] if self.reference is not None and into_reference else [])
        for module in targets:
            own = {k for k in module.state_dict() if not k.endswith("_extra_state")}
            missing, unexpected = own - local.keys(), local.keys() - own
            if missing or unexpected:
                raise ValueError(
                    f"weights do not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
                )
            with torch.no_grad():
                params = dict(module.named_parameters())
                for name, tensor in local.items():
                    params[name].copy_(tensor)
        self.optimizer.reload_model_params()  # the fp32 main copy of a bf16 model, if any

    def copy_policy_to_reference(self) -> bool:
        """The KL reference := the policy's current weights, shard by shard on every rank (both
        models have the same TP/PP layout, so no communication). For model.init_checkpoint: the
        reference must start where the policy starts, not at the HF weights. Returns False (and
        does nothing) when the policy was built without a reference."""
        if self.reference is None:
            return False
        src = dict(self.model.module.named_parameters())
        dst = dict(self.reference.named_parameters())
        if src.keys() != dst.keys():
            raise ValueError(f"policy and reference differ in their parameters: {sorted(src.keys() ^ dst.keys())[:5]}")
        with torch.no_grad():
            for name, p in dst.items():
                p.copy_(src[name])
        return True

    def _full_units(self, tensors: dict):
        """Local megatron-named tensors -> full (TP-merged) tensors of every PP stage, on every
        rank, one unit (the embedding, one decoder layer, the head) at a time, so a caller can
        stream a large model without holding it whole.

        Yields (unit, {global megatron name: full tensor}). Collective over the world.
        """
        tp_group = parallel_state.get_tensor_model_parallel_group()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        mine = {}
        for local, t in tensors.items():
            name = mapping.to_global_name(local, pp_rank, self.pp_size, self.layout.num_layers)
            if self.layout.tied and self.pp_size > 1 and name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            mine[name] = t
        # Which stage holds which tensor, with its full (TP-merged) shape: small metadata.
        meta = {}
        for stage, src in enumerate(dist.get_process_group_ranks(pp_group)):
            info = [
                [(k, _merged_shape(k, v.shape, self.tp_size), v.dtype) for k, v in mine.items()]
                if stage == pp_rank
                else None
            ]
            if self.pp_size > 1:
                dist.broadcast_object_list(info, src=src, group=pp_group)
            for k, shape, dtype in info[0]:
                meta[k] = (stage, src, shape, dtype)
        units = {}
        for k in meta:
            units.setdefault(_unit_of(k), []).append(k)
        for unit in sorted(units, key=_unit_order):
            out = {}
            for k in sorted(units[unit]):
                stage, src, shape, dtype = meta[k]
                if stage == pp_rank:
                    t = mine[k]
                    if self.tp_size > 1 and mapping.tp_split_kind(k) != "replicated":
                        shards = [torch.empty_like(t) for _ in range(self.tp_size)]
                        dist.all_gather(shards, t.contiguous(), group=tp_group)
                        t = mapping.tp_merge(k, shards)
                    buf = t.contiguous()
                else:
                    buf = torch.empty(shape, dtype=dtype, device=_device())
                if self.pp_size > 1:
                    dist.broadcast(buf, src=src, group=pp_group)
                out[k] = buf
            yield unit, out

    def _units_to_hf(self, unit, full: dict) -> dict:
        if isinstance(unit, int):
            return mapping.megatron_layer_to_hf(unit, full.__getitem__, self.layout)
        out = {}
        if "embedding.word_embeddings.weight" in full:
            out["model.embed_tokens.weight"] = full["embedding.word_embeddings.weight"][: self.layout.vocab]
        if "decoder.final_layernorm.weight" in full:
            out["model.norm.weight"] = full["decoder.final_layernorm.weight"]
        if "output_layer.weight" in full:
            out["lm_head.weight"] = full["output_layer.weight"][: self.layout.vocab]
        return out

    def hf_weight_buckets(self, bucket_bytes: int = 1 << 30):
        """The current weights under HF names, in buckets of about bucket_bytes, on every rank.
        A generator: weight sync streams a large model instead of gathering it whole."""
        local = {k: v.detach() for k, v in self.model.module.named_parameters()}
        bucket, size = [], 0
        for unit, full in self._full_units(local):
            for name, t in self._units_to_hf(unit, full).items():
                bucket.append((name, t))
                size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def hf_state_dict(self) -> dict:
        """The current weights under HF names, on every rank (small models, tests)."""
        return {k: v for bucket in self.hf_weight_buckets() for k, v in bucket}

    def _reduced_main_grads(self) -> dict:
        """{local megatron name: this rank's DP-reduced gradient} after forward_backward, copies.

        Without the distributed optimizer the DDP all-reduces every bucket: main_grad is the
        reduced gradient. With it (on by default on GPUs) the DDP reduce-scatters instead: each
        bucket's grad_data is cut into dp equal shards and rank r holds the reduced sum only in
        shard r; the rest of its main_grad is still its own unreduced gradient. Here each bucket's
        reduced shards are all-gathered (into a copy of the buffer: the optimizer step reads the
        buffer as it is) over the group the DDP reduce-scattered in, and the parameters are cut
        out at the buffer's param_index_map (which includes the optimizer's alignment padding)."""
        ddp, module = self.model, self.model.module
        if not ddp.ddp_config.use_distributed_optimizer:
            return {k: p.main_grad.detach().clone() for k, p in module.named_parameters()}
        group_of = {id(b): g for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups for b in g.buckets}
        reduced = {}
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            full = torch.empty_like(buffer.grad_data)
            for bucket in buffer.buckets:
                group = group_of[id(bucket)]
                size = group.intra_distributed_optimizer_instance_size
                rank = group.intra_distributed_optimizer_instance_rank
                # Megatron pads every bucket to a multiple of dp: equal shards, as it reduce-scattered them.
                shards = list(full[bucket.offset : bucket.offset + bucket.grad_data.numel()].chunk(size))
                n = shards[0].numel()
                dist.all_gather(
                    shards,
                    bucket.grad_data[rank * n : (rank + 1) * n].contiguous(),
                    group=group.intra_distributed_optimizer_instance_group,
                )
            for p, (start, end, _) in buffer.param_index_map.items():
                reduced[p] = full[start:end].view(p.shape)
        return {k: reduced[p] for k, p in module.named_parameters()}

    def hf_grads(self) -> dict:
        """Gradients after forward_backward (DP-reduced), under HF names, on every rank; correct
        with and without the distributed optimizer (see _reduced_main_grads)."""
        local = self._reduced_main_grads()
        out = {}
        for unit, full in self._full_units(local):
            out.update(self._units_to_hf(unit, full))
        return out

    # ---- forward / backward ----------------------------------------------------------------
    def _forward_step(self, data_iterator, model, *, mode: str, denominator: float | None):
        batch = next(data_iterator)
        dev = _device()
        # None for a padded [rows, L] batch; the row layout is read on the host here, once.
        psp = packed_seq_params(batch, dev)
        ids, pos = batch.tokens.to(dev), batch.position_ids.to(dev)
        # On CPU, the shim's device-rewriting mode runs Python on every torch call; the built
        # model's forward allocates nothing on "cuda", so it runs without it (8% of an addition
        # step's forward_backward, tools/bench_packing.py --sections profile). No-op on GPUs.
        with suspend_cpu_compat():
            output = model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp)
        return output, partial(self._loss, batch, mode, denominator)

    def _loss(self, batch, mode, denominator, logits):
        """Last stage: logits [b, s, V/tp] -> the micro-batch's share of the DPPO loss.
        Works for a packed row (b = 1) and for the padded baseline (b = rows) alike."""
        dev = logits.device
        cfg = self.algorithm
        logp = token_logprobs(
            logits, batch.labels.to(dev), vocab_size=self.vocab_size, temperature=self.temperature
        ).flatten()
        mask = batch.loss_mask.to(dev).flatten() > 0
        n_tokens = mask.sum().to(torch.int)
        if mode == "logprob":
            return logp.sum() * 0.0, n_tokens, {"logp": logp.detach().view(batch.labels.shape)}

        def picked(t):
            return t.to(dev).flatten()[mask]

        seq_index = picked(batch.seq_index)
        # No old log-probs: the batch is trained right after it was generated, in one optimizer
        # step, so pi_old = pi_theta exactly and the ratio is 1 (with its gradient): the separate
        # old-log-prob pass would recompute the same numbers. With several mini-batches or epochs
        # the trainer attaches pi_old (the rollout policy's log-probs, taken before any update).
        old_logp = picked(batch.old_logp) if batch.old_logp is not None else logp[mask].detach()
        token_loss, stats = losses.policy_loss(
            logp[mask],
            old_logp,
            picked(batch.advantages),
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            ratio_type=cfg.ratio_type,
            seq_index=seq_index,
            num_seqs=batch.num_seqs,
            ref_logp=picked(batch.ref_logp) if cfg.kl_coef else None,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
        )
        coef = losses.token_coefficients(
            seq_index, batch.seq_weight.to(dev), batch.seq_len.to(dev), cfg.loss_agg, denominator
        )
        loss = losses.aggregate(token_loss, coef)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        with torch.no_grad():
            log_ratio = (logp[mask] - old_logp).double()
            ratio_dev = (stats["ratio"].double() - 1).abs()
        report = {
            "loss": loss.detach().double(),
            "tokens": n_tokens.double(),
            "clip_frac_sum": stats["clip_frac"].sum().double(),
            "kl_sum": stats["kl"].sum().double() if "kl" in stats else zero,
            "ratio_dev_sum": ratio_dev.sum(),
            "ratio_dev_max": ratio_dev.max() if ratio_dev.numel() else zero,
            # k3 estimate of KL(pi_old || pi) from the tokens sampled by pi_old
            "approx_kl_sum": (log_ratio.exp() - 1 - log_ratio).sum(),
        }
        return loss, n_tokens, report

    def _run(self, model, microbatches, mode, denominator=None, forward_only=False):
        fb = get_forward_backward_func()
        return fb(
            forward_step_func=partial(self._forward_step, mode=mode, denominator=denominator),
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=max(int(mb.tokens.shape[1]) for mb in microbatches),
            micro_batch_size=int(microbatches[0].tokens.shape[0]),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def compute_logprobs(self, microbatches, reference: bool = False):
        """Per-position log-probs of the labels for each micro-batch (shaped like its labels) on the last
        pipeline stage; None elsewhere. Reuses the packed micro-batches of the train step."""
        model = self.reference if reference else self.model
        if reference and model is None:
            raise ValueError("compute_logprobs(reference=True) needs MegatronPolicy(with_reference=True)")
        model.eval()
        out = self._run(model, microbatches, "logprob", forward_only=True)
        model.train()
        if not parallel_state.is_pipeline_last_stage():
            return None
        return [o["logp"] for o in out]

    def forward_backward(self, microbatches, denominator: float) -> dict:
        """Accumulate the gradient of sum over micro-batches (and DP ranks) of the DPPO loss."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(self.model, microbatches, "train", denominator=denominator)
        return self._reduce_metrics(out)

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

    def _reduce_metrics(self, out) -> dict:
        """Sum the last stages' reports over DP (TP rank 0 only: TP ranks repeat them); the max
        |ratio - 1| is reduced with a max."""
        keys = ("loss", "tokens", "clip_frac_sum", "kl_sum", "ratio_dev_sum", "approx_kl_sum")
        vec = torch.zeros(len(keys) + 1, dtype=torch.float64, device=_device())
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            for o in out:
                vec[:-1] += torch.stack([o[k].to(vec.device) for k in keys])
                vec[-1] = torch.maximum(vec[-1], o["ratio_dev_max"].to(vec.device))
        dev_max = vec[-1:].clone()
        vec[-1] = 0
        dist.all_reduce(vec)
        dist.all_reduce(dev_max, op=dist.ReduceOp.MAX)
        loss, tokens, clip, kl, ratio_dev, approx_kl, _ = vec.tolist()
        n = max(tokens, 1)
        return {
            "loss": loss,
            "tokens": tokens,
            "clip_frac": clip / n,
            "kl": kl / n,
            "ratio_dev_mean": ratio_dev / n,
            "ratio_dev_max": float(dev_max),
            "approx_kl": approx_kl / n,
        }
