import math

import pytest
import torch

from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.pruning import (CPPO, GRESO, PromptStats, completion_candidates, get_strategy,
                                              prompt_candidates, prune_completions, prune_prompts)


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


def test_cppo_keeps_top_abs_advantage_without_reweighting():
    adv = torch.tensor([[0.1, -3.0, 2.0, 0.0, -0.5, 1.0, 0.2, 0.3]])
    keep, w = CPPO().prune_completions(adv, 0.5)
    assert keep.sum() == 4
    assert set(keep[0].nonzero().flatten().tolist()) == {1, 2, 4, 5}
    assert torch.equal(w, keep.float())


def test_greso_skip_probability_grows_with_streak():
    stats = PromptStats(score=torch.zeros(30000), zero_var_streak=torch.tensor([0, 1, 2] * 10000))
    keep, w = GRESO().prune_prompts(stats, 0.5, _gen())
    skip = (~keep).float().view(-1, 3).mean(0)
    assert skip[0] == 0
    assert abs(skip[1] - 0.5) < 0.02 and abs(skip[2] - 0.75) < 0.02
    assert torch.equal(w, keep.float())


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
    assert torch.equal(s.zero_var_streak, s2.zero_var_streak)
    assert torch.allclose(s.score, s2.score, equal_nan=True)
    path.write_text('{"ema": 0.0, "prompts": {"a": [1.0]}}')
    with pytest.raises(ValueError, match="prompt history state is malformed"):
        PromptHistory.load(str(path))
    with pytest.raises(ValueError, match="prompt_ids has 1 entries but rewards has 2 rows"):
        h.update(["a"], torch.zeros(2, 4))
