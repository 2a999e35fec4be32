import json
import math

import pytest
import torch

from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.pruning import (
    CPPO,
    GRESO,
    STRATEGIES,
    CPPOGroup,
    GRESOSimple,
    PromptStats,
    completion_candidates,
    get_strategy,
    prompt_candidates,
    prune_completions,
    prune_prompts,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_completion_candidates_are_low_abs_advantage():
    adv = torch.tensor([[3.0, -1.0, 0.5, -0.5], [1.0, 2.0, -4.0, 0.0]])
    # group means of |A|: 1.25 and 1.75
    expect_low = torch.tensor([[False, True, True, True], [True, False, False, True]])
    assert torch.equal(completion_candidates(adv, "low"), expect_low)
    assert torch.equal(completion_candidates(adv, "high"), ~expect_low)


def test_exactly_floor_r_times_candidates_dropped_and_weights():
    gen = _gen(1)
    adv = torch.randn(200, 8, generator=gen)
    for r in (0.0, 0.3, 0.5, 0.7, 0.9):
        keep, w = prune_completions(adv, r, _gen(2))
        cand = completion_candidates(adv)
        n_c = cand.sum(1)
        m = torch.floor(r * n_c.double() + 1e-9).long()
        assert torch.equal((~keep).sum(1), m)
        assert not (~keep & ~cand).any(), "a non-candidate was dropped"
        assert torch.all(w[~keep] == 0)
        assert torch.all(w[keep & ~cand] == 1)
        expect = (n_c.double() / (n_c - m).double())[:, None].expand_as(w)
        assert torch.allclose(w[keep & cand].double(), expect[keep & cand])


def test_ties_at_half_success_are_all_candidates():
    # Binary rewards at success rate 1/2: every |A| is equal.
    rewards = torch.tensor([[1.0, 0, 1, 0, 1, 0, 1, 0]] * 3)
    adv = group_advantages(rewards)
    assert completion_candidates(adv).all()
    keep, w = prune_completions(adv, 0.5, _gen())
    assert torch.equal((~keep).sum(1), torch.full((3,), 4))
    assert torch.allclose(w[keep], torch.full_like(w[keep], 2.0))


def test_zero_variance_and_equal_rewards_do_not_divide_by_zero():
    rewards = torch.ones(4, 8)
    adv = group_advantages(rewards)
    assert torch.equal(adv, torch.zeros(4, 8))
    adv_dr = group_advantages(rewards, "drgrpo")
    for a in (adv, adv_dr):
        keep, w = prune_completions(a, 0.5, _gen())
        assert torch.isfinite(w).all()
        assert torch.equal((~keep).sum(1), torch.full((4,), 4))
    keep, w = prune_prompts(torch.zeros(5), 0.5, _gen())
    assert torch.isfinite(w).all() and (~keep).sum() == 2


def test_ratio_close_to_one_keeps_a_candidate():
    keep, w = prune_completions(torch.randn(10, 4, generator=_gen()), 0.999999, _gen())
    assert (keep.sum(1) >= 1).all() and torch.isfinite(w).all()


def test_horvitz_thompson_each_completion_has_expected_weight_one():
    """Independent of the gradient machinery: E[w * 1{kept}] = 1 for every completion."""
    adv = torch.randn(6, 8, generator=_gen(3))
    gen = _gen(4)
    n = 20000
    total = torch.zeros(6, 8, dtype=torch.float64)
    for _ in range(n):
        _, w = prune_completions(adv, 0.6, gen)
        total += w.double()
    mean = total / n
    # Per-entry standard error: a kept candidate's weight is at most 4 here (|C|<=8, m<=4)
    assert torch.allclose(mean, torch.ones_like(mean), atol=5 * 4 / math.sqrt(n))


def test_prompt_pruning_candidates_and_no_history():
    scores = torch.tensor([0.1, math.nan, 0.5, 0.0, 0.45, math.nan])
    cand = prompt_candidates(scores)
    # mean over seen = 0.2625 -> 0.1 and 0.0 are candidates
    assert cand.tolist() == [True, False, False, True, False, False]
    keep, w = prune_prompts(scores, 0.5, _gen())
    assert (~keep).sum() == 1 and not (~keep & ~cand).any()
    assert torch.equal(w[keep & cand], torch.tensor([2.0]))
    keep, w = prune_prompts(torch.full((4,), math.nan), 0.9, _gen())
    assert keep.all() and torch.equal(w, torch.ones(4))


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan, "0.5", True])
def test_bad_ratio_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"ratio must be a number in \[0, 1\)"):
        prune_completions(torch.randn(2, 4), bad)
    with pytest.raises(ValueError, match=r"ratio must be a number in \[0, 1\)"):
        prune_prompts(torch.randn(3), bad)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match=r"advantages must have shape \[num_prompts, G\]"):
        prune_completions(torch.randn(8), 0.5)
    with pytest.raises(ValueError, match=r"advantages must have G >= 2"):
        prune_completions(torch.randn(3, 1), 0.5)
    with pytest.raises(ValueError, match=r"advantages must be finite"):
        prune_completions(torch.tensor([[1.0, math.nan]]), 0.5)
    with pytest.raises(ValueError, match=r"rewards must be finite"):
        group_advantages(torch.tensor([[1.0, math.inf]]))
    with pytest.raises(ValueError, match=r"rewards must have G >= 2"):
        group_advantages(torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"scores must be a 1-D tensor"):
        prune_prompts(torch.ones(2, 2), 0.5)
    with pytest.raises(ValueError, match=r"scores must be finite or NaN"):
        prune_prompts(torch.tensor([math.inf, 0.0]), 0.5)
    with pytest.raises(ValueError, match=r"rule must be 'low' or 'high'"):
        prune_completions(torch.randn(2, 4), 0.5, rule="middle")
    with pytest.raises(ValueError, match=r"pruning strategy must be one of"):
        get_strategy("dpo")


# ---- the strategies' interface --------------------------------------------------------------


def test_every_strategy_declares_its_pipeline():
    # name: (unbiased, refills, filters_zero_variance, denominator, prompts per round for B=8, P=0.5)
    expect = {
        "none": (True, False, False, "full", 8),
        "dppo": (True, False, False, "full", 8),
        "reverse": (True, False, False, "full", 8),
        "cppo": (False, False, False, "kept", 16),
        "cppo-group": (False, False, False, "full", 8),
        "greso": (False, True, True, "full", 12),
        "greso-simple": (False, False, False, "full", 8),
    }
    assert sorted(STRATEGIES) == sorted(expect)
    for name, (unbiased, refills, filters, denominator, draw) in expect.items():
        s = get_strategy(name)
        assert s.name == name
        assert (s.unbiased, s.refills, s.filters_zero_variance, s.denominator) == (
            unbiased,
            refills,
            filters,
            denominator,
        )
        assert s.prompts_to_draw(8, 0.5, 0.5) == draw, name
        assert json.loads(json.dumps(s.state_dict())) == s.state_dict()  # JSON-able


def test_stateless_strategies_refuse_foreign_state():
    s = get_strategy("dppo")
    s.load_state_dict({})
    with pytest.raises(ValueError, match="pruning strategy 'dppo' keeps no state"):
        s.load_state_dict({"p_easy": 0.5})
    with pytest.raises(ValueError, match="prompt_ids has 1 entries but rewards has 2 rows"):
        s.observe(["a"], torch.zeros(2, 4))


# ---- CPPO: the verl recipe (metric=smallest, allocation=True) -------------------------------


def test_cppo_allocation_draws_b_over_one_minus_p():
    # cppo_ray_trainer: train_batch_size = int(train_batch_size / (1.0 - pruning_rate))
    cppo = CPPO()
    assert [cppo.prompts_to_draw(8, 0.0, p) for p in (0.0, 0.5, 0.7, 0.75, 0.9)] == [8, 16, 26, 32, 80]
    assert cppo.prompts_to_draw(256, 0.0, 0.9) == 2560
    with pytest.raises(ValueError, match=r"r_o must be a number in \[0, 1\)"):
        cppo.prompts_to_draw(8, 0.0, 1.0)


def test_cppo_keeps_largest_abs_advantage_across_the_whole_batch():
    adv = torch.tensor([[0.1, -3.0, 2.0, 0.05], [1.5, -0.2, 0.3, -0.4], [0.0, 0.0, 0.0, 0.0]])
    keep, w = CPPO().prune_completions(adv, 0.5, _gen())
    # N = 12, keep int(12 * 0.5) = 6: |A| = 3, 2, 1.5, 0.4, 0.3, 0.2. Group 1 keeps all four, group 0
    # two, the zero-variance group none: the selection is over the batch, not per group.
    expect = torch.tensor([[False, True, True, False], [True, True, True, True], [False, False, False, False]])
    assert torch.equal(keep, expect)
    assert torch.equal(w, keep.float())
    # With allocation the trained batch is B*G again: 16 prompts x 8 -> 64 = 8 x 8 completions.
    keep, _ = CPPO().prune_completions(torch.randn(16, 8, generator=_gen(1)), 0.5, _gen())
    assert keep.sum() == 64


def test_cppo_breaks_ties_at_random():
    # Binary rewards at success rate 1/2: every |A| is equal, so each completion is kept with
    # probability k/N = 1/2 (a fixed tie order would keep the same 6 of 12 every time).
    adv = group_advantages(torch.tensor([[1.0, 0, 1, 0]] * 3))
    n, counts = 4000, torch.zeros(3, 4)
    gen = _gen(5)
    for _ in range(n):
        keep, _ = CPPO().prune_completions(adv, 0.5, gen)
        assert keep.sum() == 6
        counts += keep.float()
    assert torch.allclose(counts / n, torch.full((3, 4), 0.5), atol=5 * 0.5 / math.sqrt(n))


def test_cppo_group_variant_keeps_top_abs_advantage_per_group():
    adv = torch.tensor([[0.1, -3.0, 2.0, 0.0, -0.5, 1.0, 0.2, 0.3]])
    keep, w = CPPOGroup().prune_completions(adv, 0.5)
    assert keep.sum() == 4
    assert set(keep[0].nonzero().flatten().tolist()) == {1, 2, 4, 5}
    assert torch.equal(w, keep.float())


# ---- GRESO: the authors' all_probabilistic filter with dynamic sampling ----------------------


def _streak_stats(easy, hard):
    n = len(easy)
    return PromptStats(
        score=torch.zeros(n),
        zero_var_streak=torch.tensor(easy) + torch.tensor(hard),
        easy_streak=torch.tensor(easy),
        hard_streak=torch.tensor(hard),
    )


def test_greso_skip_probability_is_one_minus_max_p_to_the_streak():
    greso = GRESO()
    greso.prune_prompts(_streak_stats([0], [0]), 0.5, _gen())  # r_q = 0.5: p_easy = p_hard = 0.5
    greso.p_hard = 0.8
    stats = _streak_stats([0, 1, 2, 7, 0, 0, 0], [0, 0, 0, 0, 1, 3, 30])
    # easy: 1 - 0.5^1, 1 - 0.5^2, 1 - max(0.5^7, 0.01); hard (p = 0.8): 1 - 0.8, 1 - 0.8^3, 1 - 0.01
    expect = [0.0, 0.5, 0.75, 0.99, 0.2, 1 - 0.512, 0.99]
    assert greso.skip_probability(stats).tolist() == pytest.approx(expect, abs=1e-12)
    # The draws follow it (and never-seen prompts are always kept).
    n = 20000
    big = _streak_stats([0, 1, 2, 7, 0, 0, 0] * n, [0, 0, 0, 0, 1, 3, 30] * n)
    keep, w = greso.prune_prompts(big, 0.5, _gen(2))
    freq = (~keep).double().view(n, 7).mean(0)
    assert freq[0] == 0
    assert torch.allclose(freq, torch.tensor(expect, dtype=torch.float64), atol=5 * 0.5 / math.sqrt(n))
    assert torch.equal(w, keep.float())


def test_greso_adapts_p_toward_target_shares_once_prompts_return():
    greso = GRESO()  # target 0.25: easy share target 1/12, hard share target 1/6
    greso.prune_prompts(_streak_stats([0], [0]), 0.5, _gen())
    four = torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]])
    greso.observe(["a", "b", "c", "d"], four)  # first epoch: nothing comes back yet, p stays
    assert (greso.p_easy, greso.p_hard, greso.adapting) == (0.5, 0.5, False)
    greso.observe(["e", "f", "g", "h"], four)
    assert (greso.p_easy, greso.p_hard) == (0.5, 0.5)
    # "a" returns: from now on every step adapts. Shares here: all correct 1/4 >= 1/12 -> p_easy
    # 0.49 (skip more); all wrong 0/4 < 1/6 -> p_hard 0.51 (skip less).
    no_wrong = torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1]])
    greso.observe(["a", "x", "y", "z"], no_wrong)
    assert greso.adapting and greso.p_easy == pytest.approx(0.49) and greso.p_hard == pytest.approx(0.51)
    for _ in range(100):
        greso.observe(["a", "x", "y", "z"], no_wrong)
    assert greso.p_easy == pytest.approx(0.05) and greso.p_hard == pytest.approx(0.95)  # clamped
    # The state survives JSON (checkpoints) and a malformed one is refused by name.
    again = GRESO()
    again.load_state_dict(json.loads(json.dumps(greso.state_dict())))
    assert (again.p_easy, again.p_hard, again.adapting) == (greso.p_easy, greso.p_hard, True)
    with pytest.raises(ValueError, match="greso strategy state is malformed"):
        again.load_state_dict({"p_easy": 0.5, "p_hard": None, "adapting": True, "seen": []})
    with pytest.raises(ValueError, match="greso strategy state is malformed"):
        again.load_state_dict({"p_easy": 0.5})


def test_greso_simple_variant_skip_probability_grows_with_streak():
    stats = PromptStats(score=torch.zeros(30000), zero_var_streak=torch.tensor([0, 1, 2] * 10000))
    keep, w = GRESOSimple().prune_prompts(stats, 0.5, _gen())
    skip = (~keep).float().view(-1, 3).mean(0)
    assert skip[0] == 0
    assert abs(skip[1] - 0.5) < 0.02 and abs(skip[2] - 0.75) < 0.02
    assert torch.equal(w, keep.float())


# ---- the history ------------------------------------------------------------------------------


def test_history_scores_streaks_and_roundtrip(tmp_path):
    h = PromptHistory()
    h.update(["a", "b"], torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    h.update(["b"], torch.zeros(1, 4))
    s = h.stats(["a", "b", "c"])
    assert s.score[0] > 0 and s.score[1] == 0 and math.isnan(s.score[2])
    assert s.zero_var_streak.tolist() == [0, 2, 0]
    path = tmp_path / "history.json"
    h.save(str(path))
    h2 = PromptHistory.load(str(path))
    s2 = h2.stats(["a", "b", "c"])
    assert torch.equal(s.zero_var_streak, s2.zero_var_streak) and torch.equal(s.hard_streak, s2.hard_streak)
    assert torch.allclose(s.score, s2.score, equal_nan=True)
    path.write_text('{"ema": 0.0, "prompts": {"a": [1.0]}}')
    with pytest.raises(ValueError, match="prompt history state is malformed: prompt 'a' has"):
        PromptHistory.load(str(path))
    path.write_text('{"version": 7, "ema": 0.0, "prompts": {}}')
    with pytest.raises(ValueError, match="history.json: prompt history state has version 7"):
        PromptHistory.load(str(path))
    with pytest.raises(ValueError, match="prompt_ids has 1 entries but rewards has 2 rows"):
        h.update(["a"], torch.zeros(2, 4))


def test_history_easy_and_hard_streaks_follow_gresos_thresholds():
    h = PromptHistory()
    ones, zeros = torch.ones(1, 16), torch.zeros(1, 16)
    one_right = torch.zeros(1, 16)
    one_right[0, 3] = 1.0  # mean 1/16 = 0.0625 <= 0.11: "hard", but not zero-variance
    half = torch.tensor([[1.0, 0.0] * 8])
    for rewards in (ones, ones, ones):
        h.update(["easy"], rewards)
    for rewards in (zeros, one_right, zeros):
        h.update(["hard"], rewards)
    for rewards in (ones, half):
        h.update(["mixed"], rewards)
    s = h.stats(["easy", "hard", "mixed", "new"])
    assert s.easy_streak.tolist() == [3, 0, 0, 0]
    assert s.hard_streak.tolist() == [0, 3, 0, 0]
    assert s.zero_var_streak.tolist() == [3, 1, 0, 0]  # the one-right rollout broke the zero-variance streak


def test_history_loads_the_version_1_format(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"ema": 0.5, "prompts": {"a": [0.25, 2, 5], "b": [0.0, 0, 1]}}))
    h = PromptHistory.load(str(path))
    s = h.stats(["a", "b"])
    assert h.ema == 0.5 and s.score.tolist() == [0.25, 0.0] and s.zero_var_streak.tolist() == [2, 0]
    assert s.easy_streak.tolist() == [0, 0] and s.hard_streak.tolist() == [0, 0]  # not in version 1
    h.update(["a"], torch.ones(1, 4))  # streaks resume from the new rollout on
    assert h.stats(["a"]).easy_streak.tolist() == [1] and h.state_dict()["version"] == 2
    assert h.state_dict()["prompts"]["a"] == [pytest.approx(0.125), 3, 6, 1, 0]
