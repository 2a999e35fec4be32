"""The loss core against straightforward re-implementations of docs/dppo.md section 1."""

import pytest
import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.pruning import PromptStats, get_strategy


def _batch(B=3, G=4, max_len=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(B, G, generator=gen) < 0.5).float()
    rewards[0] = torch.tensor([1.0, 0.0, 0.0, 1.0])[:G]
    lengths = torch.randint(1, max_len + 1, (B, G), generator=gen)
    return rewards, lengths, gen


class TinyPolicy(torch.nn.Module):
    """logp_t = log_softmax(W x_t)[token_t] for random features: a real differentiable policy."""

    def __init__(self, T, vocab=11, dim=5, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(T, dim, generator=gen, dtype=torch.float64)
        self.tokens = torch.randint(0, vocab, (T,), generator=gen)
        self.W = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen, dtype=torch.float64))

    def forward(self):
        return torch.log_softmax(self.x @ self.W.T, dim=-1).gather(1, self.tokens[:, None])[:, 0]


def _reference_grpo_loss(logp, old_logp, ref_logp, adv, lengths, agg, clip_low, clip_high, beta, lmax):
    """docs/dppo.md section 1 written as loops over sequences and tokens."""
    B, G = adv.shape
    total, t0, all_tokens = 0.0, 0, int(lengths.sum())
    for q in range(B):
        for i in range(G):
            n = int(lengths[q, i])
            seq = 0.0
            for t in range(t0, t0 + n):
                rho = torch.exp(logp[t] - old_logp[t])
                a = adv[q, i]
                l_t = -torch.minimum(rho * a, torch.clamp(rho, 1 - clip_low, 1 + clip_high) * a)
                lr = ref_logp[t] - logp[t]
                l_t = l_t + beta * (torch.exp(lr) - lr - 1)
                seq = seq + l_t
            t0 += n
            if agg == "seq-mean-token-mean":
                total = total + seq / n / (B * G)
            elif agg == "token-mean":
                total = total + seq / all_tokens
            else:
                total = total + seq / (B * G * lmax)
    return total


@pytest.mark.parametrize("agg", losses.LOSS_AGGS)
def test_zero_ratio_reproduces_grpo_loss_and_gradient(agg):
    B, G, lmax = 3, 4, 7
    rewards, lengths, gen = _batch(B, G, lmax)
    adv = group_advantages(rewards).double()
    T = int(lengths.sum())
    policy = TinyPolicy(T)
    old_logp = (policy() + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)).detach()
    ref_logp = (policy() + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)).detach()

    ref = _reference_grpo_loss(policy(), old_logp, ref_logp, adv, lengths, agg, 0.2, 0.28, 0.05, lmax)
    (ref_grad,) = torch.autograd.grad(ref, policy.W)

    # The DPPO pipeline with both ratios 0.
    strategy = get_strategy("dppo")
    stats = PromptStats(score=torch.rand(B), zero_var_streak=torch.zeros(B, dtype=torch.long))
    keep_q, w_q = strategy.prune_prompts(stats, 0.0, gen)
    keep_o, w_o = strategy.prune_completions(adv.float(), 0.0, gen)
    assert keep_q.all() and keep_o.all()
    assert torch.equal(w_q, torch.ones(B)) and torch.equal(w_o, torch.ones(B, G))
    seq_len = lengths.flatten()
    seq_index = torch.repeat_interleave(torch.arange(B * G), seq_len)
    denom = losses.full_batch_denominator(
        agg, num_prompts=B, group_size=G, completion_lengths=lengths, prompt_weight=w_q, max_response_length=lmax
    )
    coef = losses.token_coefficients(seq_index, (w_q[:, None] * w_o).flatten(), seq_len, agg, denom).double()
    token_loss, _ = losses.policy_loss(
        policy(),
        old_logp,
        adv.flatten()[seq_index],
        clip_low=0.2,
        clip_high=0.28,
        ref_logp=ref_logp,
        kl_coef=0.05,
        kl_estimator="k3",
    )
    loss = losses.aggregate(token_loss, coef)
    (grad,) = torch.autograd.grad(loss, policy.W)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-9)
    assert torch.allclose(grad, ref_grad, rtol=1e-6, atol=1e-9)


def test_gspo_sequence_ratio_matches_reference():
    lengths = torch.tensor([3, 1, 4])
    seq_index = torch.repeat_interleave(torch.arange(3), lengths)
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(8, generator=gen, dtype=torch.float64)
    old = logp + 0.4 * torch.randn(8, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    loss, _ = losses.policy_loss(
        logp, old, adv[seq_index], ratio_type="sequence", seq_index=seq_index, num_seqs=3, clip_low=0.2, clip_high=0.2
    )
    start = 0
    for s, n in enumerate(lengths.tolist()):
        rho = torch.exp((logp[start : start + n] - old[start : start + n]).mean())
        expect = -torch.minimum(rho * adv[s], torch.clamp(rho, 0.8, 1.2) * adv[s])
        assert torch.allclose(loss[start : start + n], expect.expand(n))
        start += n


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    assert torch.allclose(losses.kl_penalty(logp, ref, "k1"), logp - ref)
    r = torch.exp(ref - logp)
    assert torch.allclose(losses.kl_penalty(logp, ref, "k3"), r - torch.log(r) - 1)
    assert (losses.kl_penalty(logp, ref, "k3") >= 0).all()


def test_token_mean_denominator_estimates_skipped_prompts():
    lengths = torch.tensor([[2, 3], [4, 5]])
    exact = losses.full_batch_denominator("token-mean", num_prompts=2, group_size=2, completion_lengths=lengths)
    assert exact == 14
    # prompt 0 was a retained candidate with weight 2: it also stands for a skipped prompt
    est = losses.full_batch_denominator(
        "token-mean", num_prompts=3, group_size=2, completion_lengths=lengths, prompt_weight=torch.tensor([2.0, 1.0])
    )
    assert est == 2 * 5 + 9
    assert (
        losses.full_batch_denominator("seq-mean-token-sum-norm", num_prompts=3, group_size=2, max_response_length=10)
        == 60
    )


def test_bad_loss_arguments_name_the_field():
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        losses.full_batch_denominator("mean", num_prompts=1, group_size=2)
    with pytest.raises(ValueError, match="needs max_response_length"):
        losses.full_batch_denominator("seq-mean-token-sum-norm", num_prompts=1, group_size=2)
    with pytest.raises(ValueError, match="needs completion_lengths"):
        losses.full_batch_denominator("token-mean", num_prompts=1, group_size=2)
    with pytest.raises(ValueError, match="ratio_type must be one of"):
        losses.policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), ratio_type="seq")
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp"):
        losses.policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), kl_coef=0.1)
    with pytest.raises(ValueError, match="denominator must be > 0"):
        losses.token_coefficients(torch.zeros(2, dtype=torch.long), torch.ones(1), torch.ones(1), "token-mean", 0)
