"""ReCo as the step's reweighting (algorithm.reweighting=reco): each response weighted by its
expected occurrence, each token by a variance-based scale in ReCo's own surrogate."""

from __future__ import annotations

import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.methods.base import Reweighting
from megatron_dppo.algorithms.methods.reco import rules


class ReCo(Reweighting):
    name, section = "reco", "reco"

    @property
    def needs_token_scale(self) -> bool:
        """gini / bernoulli divide by a mean over the whole step, known only after a pi_old pass
        over every trained token (var_ratio is computed in the loss itself)."""
        return self.cfg.token_scale in ("gini", "bernoulli")

    @property
    def needs_impurity(self) -> bool:
        return self.cfg.token_scale == "gini"

    def response_weights(self, method, groups):
        """u [P, G]: 1 / max(1, G pi_b(o|x)) from the engine's sampling log-probs (or 1 / the
        number of exact duplicates, response_weight=count)."""
        if self.cfg.response_weight == "count":
            return rules.response_weights(self.cfg, completion_ids=[g.completions for g in groups])
        if self.cfg.response_weight == "none":
            return rules.response_weights(self.cfg, num_prompts=len(groups), group_size=method.group_size)
        sums = torch.tensor([[sum(lp) for lp in g.sampling_logprobs] for g in groups], dtype=torch.float64)
        return rules.response_weights(self.cfg, sampling_logprob_sums=sums.clamp(max=0.0))

    def metrics(self, response_weights):
        u = response_weights
        return {
            "reco/response_weight_mean": float(u.mean()),
            "reco/frequent_frac": float((u < 1).float().mean()),  # G pi_b(o|x) > 1: u acts
        }

    def token_loss(self, algorithm, logp, old_logp, advantages, batch, picked):
        """ReCo's per-token surrogate -A c_t log pi (rules.surrogate) with the KL term as GRPO's.
        c_t: the pi_old pass's scale (gini, bernoulli) or var_ratio's, computed here; token_scale
        none keeps the clipped surrogate."""
        a = algorithm
        if self.cfg.token_scale == "none":
            return None
        if self.cfg.token_scale == "var_ratio":
            scale, clip_scale = rules.var_ratio_scale(logp.detach(), old_logp), True
        else:
            if batch.token_scale is None:
                raise ValueError("reco token_scale needs the pi_old pass's scale on every micro-batch")
            scale, clip_scale = picked(batch.token_scale), False
        token_loss, stats = rules.surrogate(
            logp, old_logp, advantages, scale, clip_low=a.clip_low, clip_high=a.clip_high, clip_scale=clip_scale
        )
        if a.kl_coef:
            kl = losses.kl_penalty(logp, picked(batch.ref_logp), a.kl_estimator)
            kl_term = a.kl_coef * kl
            token_loss = token_loss + kl_term
            stats["kl"] = kl.detach()
            stats["kl_term"] = kl_term  # as losses.policy_loss gives it: the correction leaves it unweighted
        return token_loss, stats

    def check_engine(self, logprobs_mode, rollout):
        """Its response weight needs the sampled distribution's log-probs."""
        rules.check_logprobs_mode(
            logprobs_mode, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
        )

    def attach_token_scale(self, microbatches, all_reduce_sum):
        """c_t = g_t / mean g over the step's trained tokens with A != 0, every micro-batch and
        rank (all_reduce_sum), each token weighted by its sequence's weight (docs/methods.md
        2.1.3; rules.step_mean_terms says why). g is the Gini impurity from the pi_old pass, or
        pi_old(a)(1 - pi_old(a)) (bernoulli). Returns the mean."""
        last_stage = [mbt for mbt in microbatches if mbt.old_logp is not None]
        num = den = 0.0
        for mbt in last_stage:
            if self.cfg.token_scale == "bernoulli":
                mbt.token_scale = rules.bernoulli_impurity(mbt.old_logp) * mbt.loss_mask
            part = rules.step_mean_terms(mbt.token_scale, mbt.loss_mask, mbt.advantages, mbt.seq_index, mbt.seq_weight)
            num, den = num + part[0], den + part[1]
        num, den = all_reduce_sum([num, den])  # replicas (TP) add to both alike
        mean = num / den if den > 0 else 0.0
        for mbt in last_stage:
            mbt.token_scale = rules.token_scale(mbt.token_scale, mean) * mbt.loss_mask
        return mean
