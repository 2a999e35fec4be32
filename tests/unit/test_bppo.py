"""BPPO's rules (docs/methods.md sections 1 and 5): the pair, the prefixes, the weights, the denominator
computed once per step, the config checks and the waves decision. References are brute-force
Python over (length, index) and direct formulas of the loss, never the module's own output."""

import math
import random
from pathlib import Path

import pytest
import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.methods.bppo import rules as bppo
from megatron_dppo.algorithms.methods.bppo.rules import BPPOConfig


def _random_step(seed, num_prompts=12, g=6, max_len=20):
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(num_prompts, g, generator=gen) < 0.5).float()
    rewards[0] = 1.0  # an all-correct group
    rewards[1] = 0.0  # an all-wrong group
    lengths = torch.randint(1, max_len + 1, (num_prompts, g), generator=gen)
    lengths[2] = 5  # every length tied
    return rewards, lengths


def _brute_pair(rewards_row, lengths_row):
    correct = [(int(lengths_row[i]), i) for i in range(len(rewards_row)) if rewards_row[i] >= 0.5]
    wrong = [(int(lengths_row[i]), i) for i in range(len(rewards_row)) if rewards_row[i] < 0.5]
    if not correct or not wrong:
        return -1, -1
    return min(correct)[1], min(wrong)[1]


def test_selects_shortest_correct_and_shortest_incorrect_lowest_index_on_ties():
    rewards = torch.tensor([[1, 0, 1, 0, 1, 0.0]])
    lengths = torch.tensor([[5, 7, 3, 3, 3, 9]])
    sel = bppo.select_pairs(rewards, lengths)
    assert (int(sel.correct[0]), int(sel.wrong[0])) == (2, 3)
    for seed in range(5):
        rewards, lengths = _random_step(seed)
        sel = bppo.select_pairs(rewards, lengths)
        for q in range(rewards.shape[0]):
            assert (int(sel.correct[q]), int(sel.wrong[q])) == _brute_pair(rewards[q].tolist(), lengths[q].tolist())


def test_non_mixed_groups_select_nothing():
    rewards, lengths = _random_step(0)
    p = bppo.plan(rewards, lengths, BPPOConfig(), loss_agg="token-mean")
    for q in (0, 1):
        assert int(p.selection.correct[q]) == -1 and int(p.selection.wrong[q]) == -1
        assert p.prefix_len[q].sum() == 0 and p.seq_weight[q].sum() == 0


def _reference_prefix(lc, lw, length, cfg, is_pick):
    if not is_pick:
        return 0
    if cfg.prefix_mode == "pair_min":
        p = min(lc, lw)
    elif cfg.prefix_mode == "ratio":
        p = math.ceil(cfg.prefix_ratio * length)
    else:
        p = min(cfg.prefix_fixed, length)
    p = min(max(p, 1), length)
    return min(p, math.ceil(cfg.max_ratio * length))


@pytest.mark.parametrize(
    "cfg",
    [
        BPPOConfig(),
        BPPOConfig(prefix_mode="ratio", prefix_ratio=0.3),
        BPPOConfig(prefix_mode="fixed", prefix_fixed=4),
        BPPOConfig(prefix_mode="pair_min", max_ratio=0.5),
    ],
)
def test_prefix_lengths_and_token_masks(cfg):
    rewards, lengths = _random_step(1)
    sel = bppo.select_pairs(rewards, lengths)
    prefix = bppo.prefix_lengths(sel, lengths, cfg)
    for q in range(rewards.shape[0]):
        c, w = int(sel.correct[q]), int(sel.wrong[q])
        for i in range(rewards.shape[1]):
            lc, lw = (int(lengths[q, c]), int(lengths[q, w])) if c >= 0 else (0, 0)
            want = _reference_prefix(lc, lw, int(lengths[q, i]), cfg, i in (c, w) and c >= 0)
            assert int(prefix[q, i]) == want, (q, i)
    # pair_min: both members of a pair train exactly the shorter one's length.
    if cfg.prefix_mode == "pair_min" and cfg.max_ratio == 1:
        mixed = sel.selected
        lm = lengths[mixed]
        shorter = torch.minimum(lm.gather(1, sel.correct[mixed, None]), lm.gather(1, sel.wrong[mixed, None]))
        assert torch.equal(prefix[mixed].gather(1, sel.correct[mixed, None]), shorter)
        assert torch.equal(prefix[mixed].gather(1, sel.wrong[mixed, None]), shorter)
    # The flat token mask: position < P_i within each completion.
    flat_len, flat_prefix = lengths.flatten(), prefix.flatten()
    seq_index = torch.repeat_interleave(torch.arange(flat_len.numel()), flat_len)
    position = torch.cat([torch.arange(int(n)) for n in flat_len])
    mask = bppo.prefix_token_mask(flat_prefix, seq_index, position)
    sums = torch.zeros(flat_len.numel(), dtype=torch.long).index_add(0, seq_index, mask.long())
    assert torch.equal(sums, flat_prefix)
    starts = torch.cumsum(flat_len, 0) - flat_len
    for s in range(flat_len.numel()):  # the trained tokens are the FIRST P_i of the completion
        assert mask[starts[s] : starts[s] + flat_prefix[s]].all()


def test_class_weight_count_and_denominators():
    rewards = torch.tensor([[1, 1, 1, 0.0], [1, 0, 0, 0], [1, 1, 1, 1]])
    lengths = torch.tensor([[4, 2, 6, 5], [3, 9, 8, 7], [1, 1, 1, 1]])
    w_q = torch.tensor([2.0, 1.0, 3.0])
    p = bppo.plan(rewards, lengths, BPPOConfig(), loss_agg="token-mean", prompt_weight=w_q)
    # pair_min: group 0 c=1 (2), w=3 (5) -> P = 2, 2; group 1 c=0 (3), w=3 (7) -> 3, 3.
    assert p.denominator_terms == pytest.approx(2.0 * (2 + 2) + 1.0 * (3 + 3))
    seq = bppo.plan(rewards, lengths, BPPOConfig(), loss_agg="seq-mean-token-mean", prompt_weight=w_q)
    assert seq.denominator_terms == pytest.approx(2 * (2.0 + 1.0))  # 2 x weighted mixed prompts
    assert seq.seq_weight[0].tolist() == [0, 2.0, 0, 2.0]
    cnt = bppo.plan(rewards, lengths, BPPOConfig(class_weight="count"), loss_agg="token-mean")
    assert cnt.seq_weight[0].tolist() == [0, 3.0, 0, 1.0]  # k = 3 correct, G - k = 1 incorrect
    assert cnt.seq_weight[1].tolist() == [1.0, 0, 0, 3.0]
    assert cnt.denominator_terms == pytest.approx(3 * 2 + 1 * 2 + 1 * 3 + 3 * 3)
    nm = bppo.plan(rewards, lengths, BPPOConfig(), loss_agg="seq-mean-token-sum-norm", max_response_length=10)
    assert nm.denominator_terms == pytest.approx(2 * 2 * 10)
    none = bppo.plan(rewards[2:], lengths[2:], BPPOConfig(), loss_agg="token-mean")
    assert none.denominator_terms == 0.0  # nothing to train


def _step_tensors(rewards, lengths, seed):
    """Flat per-token tensors over every completion of the step, as the packed layout has them."""
    gen = torch.Generator().manual_seed(seed)
    adv = group_advantages(rewards)
    flat_len = lengths.flatten()
    n = int(flat_len.sum())
    seq_index = torch.repeat_interleave(torch.arange(flat_len.numel()), flat_len)
    position = torch.cat([torch.arange(int(k)) for k in flat_len])
    logp = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    return adv, seq_index, position, logp, old


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_is_the_same_for_one_or_several_microbatches_and_dp_ranks(loss_agg):
    rewards, lengths = _random_step(2, num_prompts=10, g=5)
    p = bppo.plan(rewards, lengths, BPPOConfig(), loss_agg=loss_agg)
    adv, seq_index, position, logp, old = _step_tensors(rewards, lengths, 3)
    token_adv = adv.flatten().double()[seq_index]
    tok_loss, _ = losses.policy_loss(logp, old, token_adv, clip_low=0.2, clip_high=0.28)
    prefix, weight = p.prefix_len.flatten(), p.seq_weight.flatten()
    trained = bppo.prefix_token_mask(prefix, seq_index, position)
    # Independent reference: the mean over selected prefix tokens (token-mean) or the mean over
    # selected sequences of their prefix-token mean (seq-mean-token-mean).
    if loss_agg == "token-mean":
        reference = tok_loss[trained].sum() / prefix.sum()
    else:
        per_seq = torch.zeros(prefix.numel(), dtype=torch.float64).index_add(0, seq_index[trained], tok_loss[trained])
        picked = prefix > 0
        reference = (per_seq[picked] / prefix[picked]).mean()
    (ref_grad,) = torch.autograd.grad(reference, logp, retain_graph=True)

    def chunked(boundaries):  # micro-batches of whole groups, all with the step's one D
        g = rewards.shape[1]
        total = 0.0
        for lo, hi in zip(boundaries, boundaries[1:]):
            tok = trained & (seq_index >= lo * g) & (seq_index < hi * g)
            coef = losses.token_coefficients(seq_index[tok], weight, prefix, loss_agg, p.denominator_terms)
            total = total + losses.aggregate(tok_loss[tok], coef)
        return total

    for boundaries in ([0, 10], [0, 3, 7, 10], [0, 1, 2, 5, 6, 9, 10]):
        value = chunked(boundaries)
        (grad,) = torch.autograd.grad(value, logp, retain_graph=True)
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    # DP=2: each rank computes its groups' terms; their sum is the one-rank denominator.
    halves = [bppo.plan(rewards[s], lengths[s], BPPOConfig(), loss_agg=loss_agg) for s in (slice(0, 4), slice(4, 10))]
    assert sum(h.denominator_terms for h in halves) == pytest.approx(p.denominator_terms, rel=1e-15)


def test_non_mixed_groups_give_zero_loss_and_gradient():
    rewards, lengths = _random_step(4, num_prompts=6, g=4)
    p = bppo.plan(rewards, lengths, BPPOConfig(), loss_agg="token-mean")
    adv, seq_index, position, logp, old = _step_tensors(rewards, lengths, 5)
    tok_loss, _ = losses.policy_loss(logp, old, adv.flatten().double()[seq_index])
    trained = bppo.prefix_token_mask(p.prefix_len.flatten(), seq_index, position)
    coef = losses.token_coefficients(
        seq_index, p.seq_weight.flatten(), p.prefix_len.flatten(), "token-mean", p.denominator_terms
    )
    loss = losses.aggregate(tok_loss * trained, coef)
    (grad,) = torch.autograd.grad(loss, logp)
    non_mixed_tokens = seq_index < 2 * 4  # groups 0 (all correct) and 1 (all wrong)
    assert grad[non_mixed_tokens].abs().max() == 0
    assert grad[~non_mixed_tokens].abs().max() > 0  # the mixed groups do train
    # Advantages come from the full group: the pair's signs are + and -.
    sel = p.selection
    mixed = sel.selected
    assert (adv[mixed].gather(1, sel.correct[mixed, None]) > 0).all()
    assert (adv[mixed].gather(1, sel.wrong[mixed, None]) < 0).all()


def test_completion_pruning_with_bppo_is_a_config_error():
    bppo.check_no_completion_pruning(0.0)
    with pytest.raises(ValueError, match=r"'algorithm\.selection'=bppo and 'pruning\.r_o'=0\.5") as e:
        bppo.check_no_completion_pruning(0.5)
    assert "\n" not in str(e.value)


def test_next_wave_reference_rule():
    assert bppo.next_wave([], 4, 8) == 4
    assert bppo.next_wave([1, 1, 1, 1], 4, 8) == 4  # not mixed yet
    assert bppo.next_wave([1, 0, 1, 1], 4, 8) == 0  # mixed with g0 samples: stop
    assert bppo.next_wave([1, 1, 1, 1, 1, 1, 1, 1], 4, 8) == 0  # G_max reached
    assert bppo.next_wave([0] * 6, 4, 8) == 2  # never past G_max
    assert bppo.next_wave([1, 0], 4, 8) == 2  # mixed but fewer than g0: finish the wave
    # Simulated prompts: every stopped group is mixed or full, and none exceeds G_max.
    rng = random.Random(0)
    for _ in range(200):
        p, drawn = rng.random(), []
        while (k := bppo.next_wave(drawn, 4, 12)) > 0:
            drawn += [float(rng.random() < p) for _ in range(k)]
        assert len(drawn) <= 12 and (0 < sum(drawn) < len(drawn) or len(drawn) == 12)


def test_config_validate_names_the_key():
    BPPOConfig().validate("algorithm.bppo")
    with pytest.raises(ValueError, match=r"config key 'algorithm\.bppo\.prefix_mode': expected one of"):
        BPPOConfig(prefix_mode="suffix").validate("algorithm.bppo")
    with pytest.raises(ValueError, match=r"'algorithm\.bppo\.max_ratio'"):
        BPPOConfig(max_ratio=0).validate("algorithm.bppo")
    with pytest.raises(ValueError, match=r"'algorithm\.bppo\.wave_size'"):
        BPPOConfig(wave_size=1).validate("algorithm.bppo")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.bppo.wave_size=16"], r"'algorithm\.bppo\.wave_size': a wave of 16 is more than"),
        (["algorithm.bppo.max_group_size=12"], r"'algorithm\.bppo\.max_group_size': 12 is more than rollout"),
        (["algorithm.aux=ssopd"], r"'algorithm\.bppo\.schedule' and 'algorithm\.aux': waves give each prompt"),
        (["pruning.strategy=greso"], r"'algorithm\.bppo\.schedule' and 'pruning\.strategy'"),
        (["algorithm.curriculum=adaprefix", "data.solution_key=answer"], r"and 'algorithm\.curriculum'"),
        (["algorithm.selection=all"], r"'algorithm\.bppo\.schedule' and 'algorithm\.selection': waves"),
    ],
)
def test_waves_refuse_what_reads_one_group_size(overrides, needle):
    from megatron_dppo.config import load_config

    config = str(Path(__file__).resolve().parents[2] / "examples" / "tiny" / "addition.yaml")
    waves = ["algorithm.selection=bppo", "pruning.r_o=0", "algorithm.bppo.schedule=waves"]
    load_config(config, waves)  # g0 = 4, G_max = G = 8: valid
    with pytest.raises(ValueError, match=needle) as e:
        load_config(config, waves + overrides)
    assert "\n" not in str(e.value)


def test_histogram_counts_every_trained_prefix():
    prefix = torch.tensor([[0, 1, 3], [0, 200, 16]])
    h = bppo.prefix_length_histogram(prefix)
    assert sum(h.values()) == 4 and h["1-1"] == 1 and h["2-3"] == 1 and h["16-31"] == 1 and h["128-"] == 1


def test_step_logs_prefix_histogram_and_advantage_magnitudes():
    """docs/methods.md section 1 asks to log the prefix lengths and the advantage magnitudes: through the
    trainer's planning (batch.weigh_completions), against values computed by hand from the groups."""
    from megatron_dppo.algorithms import batch
    from megatron_dppo.algorithms.pruning import get_strategy
    from megatron_dppo.algorithms.records import Group
    from megatron_dppo.config import Config
    from megatron_dppo.data.prompts import PromptRecord

    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 64
    cfg.algorithm.selection = "bppo"
    method = batch.Method.from_config(cfg, get_strategy("none"))
    rec = PromptRecord(id="q", prompt="x", messages=None, answer="1")
    rows = [  # (rewards, lengths): two mixed groups, one all-correct
        ([1, 0, 0, 0], [20, 3, 9, 40]),  # pair (0, 1): P = min(20, 3) = 3
        ([1, 1, 0, 0], [6, 2, 17, 30]),  # pair (1, 2): P = 2
        ([1, 1, 1, 1], [5, 5, 5, 5]),
    ]
    groups = []
    for slot, (r, lengths) in enumerate(rows):
        g = Group(rec, 0, slot, [1, 2], [[5] * n for n in lengths], [float(x) for x in r], prompt_weight=1.0)
        g.truncated = [False] * 4
        groups.append(g)
    trained, _ = batch.select_groups(method, groups, num_drawn=3, filled=0.0)
    m = batch.weigh_completions(method, get_strategy("none"), trained, torch.Generator())
    assert m["bppo/pairs"] == 2
    assert m["bppo/prefix_len/2-3"] == 4 and sum(v for k, v in m.items() if k.startswith("bppo/prefix_len/")) == 4
    adv = [torch.tensor(g.rewards) for g in groups[:2]]
    adv = [(a - a.mean()) / (a.std() + 1e-6) for a in adv]  # GRPO's, std with Bessel's correction
    pair = [adv[0][0], adv[0][1], adv[1][1], adv[1][2]]
    assert m["bppo/pair_abs_adv"] == pytest.approx(float(torch.stack(pair).abs().mean()), rel=1e-5)
    assert m["bppo/group_abs_adv"] == pytest.approx(float(torch.cat(adv).abs().mean()), rel=1e-5)
