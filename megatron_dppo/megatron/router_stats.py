"""A mixture-of-experts model's router terms and statistics, per optimizer update.

The two auxiliary terms (algorithm.moe_aux_loss_coeff / moe_z_loss_coeff, both 0 = off as RL
recipes run them) are Megatron-Core's own: each MoE layer's router attaches them to its
output through MoEAuxLossAutoScaler. With calculate_per_token_loss=True (ours) Megatron
multiplies a micro-batch's term by the micro-batch's (valid) token count T_mb and expects
finalize_model_grads to divide by the step's token count; ours does not divide (the policy
loss carries its own full-batch denominator, megatron/optimizer.py). So before every update
the routers' coefficients are set to coeff / T_update, T_update = the non-padding tokens of
every micro-batch of the update on every data-parallel rank. The objective then gains, per MoE
layer l:

  load balancing  coeff * sum_mb (T_mb / T_update) * L_mb,l,   L_mb,l = E / (k T_mb^2) *
                  sum_e (sum_t p_t,e)(tokens routed to e): Switch's loss on the micro-batch's
                  tokens, so a token-weighted mean over micro-batches. It is a product of two
                  means over the micro-batch: it depends on how tokens are grouped into
                  micro-batches (the packs, trainer.max_tokens_per_microbatch), not on where the
                  packs run (DP/EP/PP/TP), since the packs are the same for every layout.
  z-loss          coeff * sum_t logsumexp(router logits_t)^2 / T_update: a token mean over the
                  update, independent of the micro-batching too.

Padding tokens are excluded (GPTModel's padding_mask). DPPO's unbiasedness argument covers the
policy loss only: these terms are regularisers on every routed token, prompts included, with
no Horvitz-Thompson weights (docs/algorithm.md, "Mixture of experts").

Under sequence parallelism each TP rank routes T/tp of a micro-batch's tokens and Megatron
multiplies by that local count (and divides the z coefficient by tp); the router's gradient is
summed over TP. The coefficients are multiplied by tp then, so the terms above hold at any TP
(derived from Megatron-Core 0.16.1's code; the CPU tests run TP=1).

RouterStats also counts the tokens each router sends to each expert (forward hooks on the
routers, padding excluded, once per token even when recomputation reruns a router) and reports
per update: moe_load_imbalance = max expert load / mean expert load, per MoE layer, averaged over
the MoE layers; moe_aux_loss and moe_z_loss = the two terms' values in the objective (summed
over layers; 0 when off), read from Megatron's aux-loss tracker, i.e. the values whose
gradient was applied.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megatron_dppo.megatron.model import current_device

TRACKED = {"moe_aux_loss": "load_balancing_loss", "moe_z_loss": "z_loss"}  # ours: Megatron's tracker name


def padding_mask(batch) -> torch.Tensor:
    """[b, s] bool, True on padding (GPTModel's padding_mask): positions of no sequence."""
    return batch.seq_index < 0


def stage_padding_mask(mask: torch.Tensor, *, first_stage: bool, sequence_parallel: bool, tp_rank: int, tp_size: int):
    """The [b, s] padding mask to pass to this pipeline stage's GPTModel, so that its MoE layers
    get one entry per token they route. Under sequence parallelism a TP rank's hidden states hold
    its s/tp consecutive positions (rank r: [r s/tp, (r+1) s/tp)). GPTModel cuts the mask to them
    itself on the first stage only (scatter_to_sequence_parallel_region in _preprocess, under
    `pre_process`); a later stage passes it on whole, and its routers (and RouterStats) would
    pair s mask entries with s/tp tokens. So a later stage gets this rank's slice, cut as that
    scatter cuts it; the first stage, and any stage without sequence parallelism, the whole mask."""
    if first_stage or not sequence_parallel or tp_size == 1:
        return mask
    seq = mask.shape[1]
    if seq % tp_size:
        raise ValueError(f"padding mask of {seq} positions does not split over {tp_size} sequence-parallel ranks")
    n = seq // tp_size
    return mask[:, tp_rank * n : (tp_rank + 1) * n].contiguous()


class RouterStats:
    """One update's router statistics of a model chunk (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, aux_coeff: float, z_coeff: float, sequence_parallel: bool):
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        # Every stage sizes its records by the whole model (PP stages hold different layers).
        self.shape = (model.config.num_layers, model.config.num_moe_experts or 0)
        self.aux_coeff, self.z_coeff = aux_coeff, z_coeff
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        # Ranks that route distinct tokens count; TP ranks without sequence parallelism repeat them.
        self.counts_here = sequence_parallel or parallel_state.get_tensor_model_parallel_rank() == 0
        self.scale = self.tp if sequence_parallel else 1

    def set_coefficients(self, microbatches) -> float:
        """The routers' coefficients for this update: coeff * scale / T_update. Returns T_update.
        Collective over the data-parallel group."""
        tokens = torch.tensor([sum(float((~padding_mask(mb)).sum()) for mb in microbatches)], dtype=torch.float64)
        tokens = tokens.to(current_device())
        dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
        total = max(float(tokens), 1.0)
        for router in self.routers:
            # 0 (not None) keeps the load-balancing term off; None keeps the z-loss off (Megatron
            # computes it for any non-None coefficient, and logs it divided by that coefficient).
            router.config.moe_aux_loss_coeff = self.aux_coeff * self.scale / total
            router.config.moe_z_loss_coeff = self.z_coeff * self.scale / total if self.z_coeff else None
        return total

    @contextmanager
    def recording(self):
        """Count routed tokens and the terms' values while the update's forward passes run
        (on the device, no host synchronisation in the hooks)."""
        dev = current_device()
        self.load = torch.zeros(self.shape, dtype=torch.float64, device=dev)
        self.terms = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in TRACKED}
        # Megatron's tracker adds up each call's term / coefficient (float32, nothing else here
        # reads it): cleared per update, a call's share is the difference to the value before it.
        clear_aux_losses_tracker()
        self._seen = {}
        handles = [r.register_forward_hook(self._record) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _record(self, router, args, output):
        if not torch.is_grad_enabled():  # a recomputed layer's first pass: counted when it reruns
            return
        _, routing_map = output
        pad = args[1] if len(args) > 1 else None  # [s, b], True on padding
        valid = torch.ones_like(routing_map[:, 0]) if pad is None else ~pad.reshape(-1)
        layer = router.layer_number - 1
        self.load[layer] += (routing_map & valid[:, None]).sum(0).double()
        # The coefficients as the router applied them (Megatron divides the z one by TP x CP).
        applied = {
            "moe_aux_loss": router.config.moe_aux_loss_coeff,
            "moe_z_loss": (router.config.moe_z_loss_coeff or 0.0) / self.tp,
        }
        tracker = get_moe_layer_wise_logging_tracker()
        for ours, name in TRACKED.items():
            if name not in tracker:  # the term is off
                continue
            now = tracker[name]["values"][layer].double()
            before = self._seen.get((name, layer), 0.0)
            # The call added its term / coefficient, a mean over its valid tokens; the gradient
            # Megatron applies is that of coefficient * valid tokens * that mean.
            self.terms[ours] += applied[ours] * valid.sum() * (now - before)
            self._seen[(name, layer)] = now

    def reduce(self) -> dict:
        """{moe_load_imbalance, moe_aux_loss, moe_z_loss} over every rank. Collective over the world."""
        packed = torch.cat([self.load.flatten(), torch.stack([self.terms[k] for k in TRACKED])])
        packed = (packed if self.counts_here else torch.zeros_like(packed)).to(current_device())
        dist.all_reduce(packed)
        packed = packed.cpu()  # the update's one host synchronisation
        load = packed[: self.load.numel()].view_as(self.load)
        routed = load[load.sum(1) > 0]
        imbalance = float((routed.max(1).values / routed.mean(1)).mean()) if len(routed) else float("nan")
        terms = packed[self.load.numel() :].tolist()
        return {"moe_load_imbalance": imbalance, **dict(zip(TRACKED, terms))}
