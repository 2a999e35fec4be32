"""ReCo's rules (docs/methods.md sections 2 and 5): the response weight, the token scale (Gini impurity
vocab-parallel over a real 2-process gloo group), the surrogate's trust region and KL, and the
check that the sampling log-probs are the processed distribution. References: direct formulas,
full-vocabulary softmax, PPO's own gradient (losses.policy_loss), and vLLM's sampler code."""

import math

import pytest
import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.methods.reco import rules as reco
from megatron_dppo.algorithms.methods.reco.rules import ReCoConfig

VOCAB, PADDED = 50, 64  # real vocabulary, and Megatron's padded head (32 columns per rank at TP 2)


def _logits(seed, n=37, v=PADDED, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def _gini_reference(logits, temperature):
    p = torch.softmax(logits[:, :VOCAB].double() / temperature, dim=-1)
    return 1 - (p * p).sum(dim=-1)


def test_expected_weight_is_one_when_rare_and_one_over_expected_count_otherwise():
    g = 8
    s = torch.tensor([[-50.0, -math.log(g) - 1e-3, -math.log(g) + 0.5, math.log(3 / g), -0.0, -3.0, -1.0, -2.0]])
    u = reco.expected_occurrence_weights(s)
    want = 1 / torch.clamp(g * torch.exp(s.double()), min=1)  # 1 / max(1, G pi_b)
    torch.testing.assert_close(u.double(), want, rtol=1e-6, atol=0)
    assert u[0, 0] == 1 and u[0, 1] == 1  # G pi_b < 1: weight exactly 1
    assert u[0, 3].item() == pytest.approx(1 / 3, rel=1e-6)  # expected 3 times: 1/3 per copy
    assert reco.frequent_fraction(s) == pytest.approx(5 / 8)  # G pi_b > 1 at entries 2, 3, 4, 6, 7
    with pytest.raises(ValueError, match="log-probabilities"):
        reco.expected_occurrence_weights(torch.tensor([[0.5, -1.0]]))


def test_expected_weight_gives_each_distinct_response_total_weight_min_one_expected_count():
    """Monte Carlo: responses drawn i.i.d. from a small distribution; a response r's summed
    weight over the group has mean G pi_r * min(1, 1 / (G pi_r)) = min(1, G pi_r)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.04, 0.01])
    g, groups = 8, 20000
    draws = torch.multinomial(probs.expand(groups, -1), g, replacement=True, generator=gen)
    u = reco.expected_occurrence_weights(torch.log(probs)[draws])
    total = torch.zeros(groups, len(probs)).scatter_add(1, draws, u)
    mean, se = total.mean(0), total.std(0) / math.sqrt(groups)
    want = torch.clamp(g * probs, max=1)
    assert ((mean - want).abs() <= 4 * se + 1e-6).all(), (mean, want, se)


def test_count_mode_gives_one_over_n_for_n_fold_duplicates():
    a, b, c = [5, 6, 7], [5, 6], [9]
    ids = [[a, a, a, b, c, c], [a, b, c, [1], [2], [3]]]
    u = reco.duplicate_count_weights(ids)
    torch.testing.assert_close(u, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 1, 1 / 2, 1 / 2], [1] * 6]))
    r = reco.response_weights(ReCoConfig(response_weight="count", renorm=True), completion_ids=ids)
    torch.testing.assert_close(r.sum(dim=1), torch.full((2,), 6.0))
    assert (
        reco.response_weights(ReCoConfig(response_weight="none"), num_prompts=2, group_size=3).tolist()
        == [[1.0] * 3] * 2
    )
    with pytest.raises(ValueError, match="sampling log-probs"):
        reco.response_weights(ReCoConfig())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gini_matches_the_full_vocabulary_formula_chunked_and_padded(temperature):
    logits = _logits(1)
    logits[3, :VOCAB] = -30.0
    logits[3, 7] = 30.0  # a saturated position: g = 0
    g = reco.gini_impurity(logits, vocab_size=VOCAB, temperature=temperature, chunk_size=5)
    torch.testing.assert_close(g.double(), _gini_reference(logits, temperature), rtol=0, atol=2e-6)
    assert g[3] < 1e-6
    old_logp = torch.log_softmax(logits[:, :VOCAB], -1)[:, 0]
    p = torch.exp(old_logp)
    torch.testing.assert_close(reco.bernoulli_impurity(old_logp), p * (1 - p))


def test_token_scale_has_mean_one_over_the_step_whatever_the_microbatches():
    logits = _logits(2, n=60)
    micro = [logits[:13], logits[13:40], logits[40:]]
    gs = [reco.gini_impurity(m, vocab_size=VOCAB) for m in micro]
    step_mean = sum(float(g.sum()) for g in gs) / sum(g.numel() for g in gs)  # all-reduced over the step
    c = torch.cat([reco.token_scale(g, step_mean) for g in gs])
    assert float(c.double().mean()) == pytest.approx(1.0, abs=1e-6)
    # Weighted by DPPO's w (Horvitz-Thompson mean): sum w c / sum w = 1.
    w = torch.rand(60, generator=torch.Generator().manual_seed(3)) * 2
    g_all = torch.cat(gs)
    cw = reco.token_scale(g_all, float((w * g_all).sum() / w.sum()))
    assert float((w * cw).sum() / w.sum()) == pytest.approx(1.0, abs=1e-6)
    # The guard: every position saturated gives c = 0, not NaN.
    assert torch.equal(reco.token_scale(torch.zeros(4), 0.0), torch.zeros(4))


def test_surrogate_gradient_is_ppo_gradient_over_rho_inside_the_trust_region_and_zero_outside():
    gen = torch.Generator().manual_seed(4)
    n = 400
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 4
    logp = (old + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    scale = torch.rand(n, generator=gen, dtype=torch.float64) * 2
    loss, stats = reco.surrogate(logp, old, adv, scale, clip_low=0.2, clip_high=0.28)
    (g_reco,) = torch.autograd.grad(loss.sum(), logp)
    ppo, _ = losses.policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    rho = torch.exp(logp.detach() - old)
    zeroed = g_ppo == 0  # where PPO's clip removes the token
    assert 0 < int(zeroed.sum()) < n
    assert torch.equal(g_reco == 0, zeroed | (scale == 0))
    torch.testing.assert_close(g_reco[~zeroed], (scale * g_ppo / rho)[~zeroed])  # -A c, PPO: -A rho
    assert torch.equal(stats["clip_frac"].bool(), zeroed)


def test_var_ratio_is_one_at_the_old_policy_and_clipped_like_rho():
    old = torch.log(torch.tensor([0.2, 0.5, 0.9, 0.3, 0.9], dtype=torch.float64))
    torch.testing.assert_close(reco.var_ratio_scale(old, old), torch.ones(5, dtype=torch.float64))
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.31, 0.95], dtype=torch.float64)).requires_grad_()
    c = reco.var_ratio_scale(logp, old)
    want = torch.tensor([0.25 / 0.16, 1, 0.25 / 0.09, 0.31 * 0.69 / 0.21, 0.95 * 0.05 / 0.09], dtype=torch.float64)
    torch.testing.assert_close(c, want)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    loss, _ = reco.surrogate(logp, old, adv, c, clip_low=0.2, clip_high=0.2, clip_scale=True)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # c in place of rho inside the clip: token 2's c = 2.8 gives 1.2 A, token 4's c = 0.53 (A < 0) gives 0.8 A.
    coef = torch.minimum(c * adv, c.clamp(0.8, 1.2) * adv)
    assert coef[2] == pytest.approx(1.2) and coef[4] == pytest.approx(-0.8)
    rho = torch.exp(logp.detach() - old)
    inside = ~(((adv > 0) & (rho > 1.2)) | ((adv < 0) & (rho < 0.8)))
    assert inside.tolist() == [False, True, True, True, True]  # token 0: rho = 2.5 > 1.2, A > 0
    torch.testing.assert_close(grad[inside], -coef[inside])
    assert grad[0] == 0


def test_processed_logprob_reference_matches_vllms_sampler_and_the_check_catches_raw():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = _logits(5, n=6, v=VOCAB)
    for temperature, top_p, top_k in [(0.7, 0.9, 0), (1.0, 1.0, 5), (0.6, 0.8, 12)]:
        z = logits / temperature
        k = torch.full((6,), top_k) if top_k else None
        p = torch.full((6,), top_p) if top_p < 1 else None
        want = torch.log_softmax(apply_top_k_top_p_pytorch(z.clone(), k, p), dim=-1)
        got = reco.processed_logprobs(logits, temperature=temperature, top_p=top_p, top_k=top_k)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite])
    kw = dict(temperature=0.7, top_p=0.95)
    processed = reco.processed_logprobs(logits, **kw)
    tokens = processed.argmax(-1)  # sampled tokens are always inside the top-p set
    reco.check_processed_logprobs(processed[torch.arange(6), tokens], logits, tokens, **kw)
    raw = torch.log_softmax(logits, -1)[torch.arange(6), tokens]
    with pytest.raises(ValueError, match="RAW.*processed_logprobs"):
        reco.check_processed_logprobs(raw, logits, tokens, **kw)
    reco.check_logprobs_mode("raw_logprobs", temperature=1.0, top_p=1.0)
    reco.check_logprobs_mode("processed_logprobs", temperature=0.7, top_p=0.9)
    with pytest.raises(ValueError, match="processed_logprobs"):
        reco.check_logprobs_mode("raw_logprobs", temperature=0.7, top_p=1.0)


def test_config_validate_names_the_key():
    ReCoConfig().validate("algorithm.reco")
    with pytest.raises(ValueError, match=r"config key 'algorithm\.reco\.token_scale': expected one of"):
        ReCoConfig(token_scale="entropy").validate("algorithm.reco")


def _token_scales(drop_zero_variance: bool) -> dict:
    """ReCo's c_t of one rollout through the trainer's planning and ReCo.attach_token_scale:
    {(completion row, position): c_t} for every trained token with A != 0. g is a fixed function
    of the token (what the pi_old pass would give for this rollout)."""
    from megatron_dppo.algorithms import batch, packing
    from megatron_dppo.algorithms.pruning import get_strategy
    from megatron_dppo.algorithms.records import Group
    from megatron_dppo.config import Config
    from megatron_dppo.data.prompts import PromptRecord
    from megatron_dppo.run import collectives as mdist

    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 16
    cfg.algorithm.reweighting, cfg.pruning.drop_zero_variance = "reco", drop_zero_variance
    method = batch.Method.from_config(cfg, get_strategy("none"))
    gen = torch.Generator().manual_seed(4)
    groups = []
    for slot, rewards in enumerate([[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0]]):  # the middle one: A = 0
        lengths = torch.randint(3, 9, (4,), generator=gen).tolist()
        completions = [torch.randint(4, 21, (n,), generator=gen).tolist() for n in lengths]
        rec = PromptRecord(id=f"q{slot}", prompt="x", messages=None, answer="1")
        g = Group(rec, 0, slot, [1, 2], completions, [float(r) for r in rewards], prompt_weight=1.0)
        g.truncated, g.sampling_logprobs = [False] * 4, [[-2.0] * n for n in lengths]
        groups.append(g)
    trained, _ = batch.select_groups(method, groups, num_drawn=3, filled=0.0)
    batch.weigh_completions(method, get_strategy("none"), trained, gen)
    (plan,) = batch.plan_minibatches(method, trained, num_drawn=3)
    mbt = packing.build_thd_batch(plan.samples)
    starts = mbt.cu_seqlens_padded[mbt.seq_index.clamp(min=0)]
    position = torch.arange(mbt.tokens.shape[1]) - starts  # within its sequence: not the packed layout's
    mbt.old_logp = torch.zeros_like(mbt.loss_mask)
    mbt.token_scale = (0.1 + (mbt.labels % 7) / 10.0 + position / 100.0).float() * mbt.loss_mask
    assert method.reweighting.cfg.token_scale == "gini"
    method.reweighting.attach_token_scale([mbt], mdist.all_reduce_sum)
    out = {}
    for t in range(mbt.tokens.shape[1]):
        s = int(mbt.seq_index[0, t])
        if s >= 0 and mbt.loss_mask[0, t] > 0 and mbt.advantages[0, t] != 0:
            start = int(mbt.cu_seqlens_padded[s])
            out[(int(mbt.seq_ids[s]), t - start)] = float(mbt.token_scale[0, t])
    return out


def test_token_scale_is_the_same_with_and_without_drop_zero_variance():
    """c_t's normaliser counts the tokens that carry a policy-gradient term: a zero-variance group
    (A = 0) leaves it alone whether drop_zero_variance removed it before the pi_old pass or not."""
    on, off = _token_scales(True), _token_scales(False)
    assert on.keys() == off.keys() and len(on) > 10
    for k in on:
        assert on[k] == pytest.approx(off[k], rel=1e-6), k
    assert len({round(v, 6) for v in on.values()}) > 3  # c varies over tokens: the comparison can fail
