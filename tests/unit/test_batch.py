"""The step's planning rules (algorithms/batch.py), which the trainer and verify-unbiased share."""

import inspect
import math

import pytest
import torch

from megatron_dppo.algorithms import batch, losses
from megatron_dppo.algorithms.pruning import PromptStats, get_strategy
from megatron_dppo.algorithms.records import Group
from megatron_dppo.config import Config
from megatron_dppo.jobs import verify_unbiased as unbiased_check
from megatron_dppo.jobs.verify_unbiased import CheckConfig, run_check, run_dynamic_check
from megatron_dppo.train import trainer


class _Prompt:
    def __init__(self, i):
        self.id, self.index = f"q{i}", i


def _config(**over):
    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 4, 8
    cfg.pruning.drop_zero_variance = True
    for key, value in over.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _stream(n):
    prompts, pos = [_Prompt(i) for i in range(n)], 0

    def next_batch(k):
        nonlocal pos
        out = prompts[pos : pos + k]
        pos += k
        return out

    return next_batch


def _no_history(ids):
    return PromptStats(score=torch.full((len(ids),), math.nan), zero_var_streak=torch.zeros(len(ids), dtype=torch.long))


def _rollout(rewards_of, lengths_of=lambda i: [1, 2, 3, 4]):
    def rollout(rnd, items):
        return [
            Group(rec, rnd, slot, [0], [[0] * n for n in lengths_of(rec.index)], rewards_of(rec.index), prompt_weight=w)
            for rec, slot, w in items
        ]

    return rollout


def _group(rewards, lengths, w_q=1.0, slot=0):
    return Group(_Prompt(slot), 0, slot, [0], [[0] * n for n in lengths], list(rewards), prompt_weight=w_q)


def test_method_resolves_each_strategy_once():
    none = batch.Method.from_config(_config(), get_strategy("none"))
    assert (none.refill, none.redraw_skipped, none.drop_uninformative, none.denominator) == (
        False,
        False,
        False,
        "full",
    )
    dapo = batch.Method.from_config(_config(algorithm__dynamic_sampling=True), get_strategy("dppo"))
    assert dapo.refill and dapo.drop_uninformative and dapo.denominator == "refill" and dapo.rounds == 4
    greso = batch.Method.from_config(_config(pruning__r_q=0.5), get_strategy("greso"))
    assert greso.refill and greso.redraw_skipped and greso.drop_uninformative and greso.prompts_per_round == 6
    cppo = batch.Method.from_config(_config(pruning__r_o=0.5), get_strategy("cppo"))
    assert cppo.denominator == "kept" and cppo.prompts_per_round == 8 and not cppo.refill
    kl = batch.Method.from_config(_config(algorithm__kl_coef=0.1), get_strategy("none"))
    assert kl.needs_reference and not none.needs_reference


def test_minibatch_assignment_and_denominator_share_one_rule():
    """Every drawn slot lands in exactly one mini-batch, and the count used for a mini-batch's
    denominator is the number of slots assigned to it."""
    for drawn in (1, 5, 7, 32, 33):
        for n in (1, 2, 3, 4):
            assigned = [batch.minibatch_of(slot, drawn, n) for slot in range(drawn)]
            assert assigned == sorted(assigned) and set(assigned) <= set(range(n))
            assert [batch.prompts_in_minibatch(k, drawn, n) for k in range(n)] == [assigned.count(k) for k in range(n)]


def test_select_without_refill_keeps_w_q_and_slot_order():
    method = batch.Method.from_config(_config(trainer__minibatches_per_step=2), get_strategy("dppo"))
    groups = [_group([1, 0, 0, 0], [1] * 4, w_q=w, slot=s) for s, w in [(0, 2.0), (1, 1.0), (3, 1.0)]]
    trained, _ = batch.select_groups(method, groups, num_drawn=4, filled=0.0)
    assert [g.train_weight for g in trained] == [2.0, 1.0, 1.0] and [g.minibatch for g in trained] == [0, 0, 1]
    assert [g.prompt_weight for g in trained] == [2.0, 1.0, 1.0]  # never changed by planning


def test_refill_collects_weight_b_and_leaves_prompt_weights_as_drawn():
    """DAPO + DPPO: zero-variance groups dropped, rounds until the weight reaches B, the last group
    trains with the remainder; w_q stays what pruning drew."""
    method = batch.Method.from_config(_config(algorithm__dynamic_sampling=True, pruning__r_q=0.0), get_strategy("dppo"))
    informative = {0, 2, 3, 5, 6, 7, 9}
    rewards = lambda i: [1, 0, 0, 0] if i in informative else [0, 0, 0, 0]  # noqa: E731
    out = batch.collect(
        method,
        get_strategy("dppo"),
        next_batch=_stream(40),
        stats_of=_no_history,
        rollout=_rollout(rewards),
        generator=torch.Generator().manual_seed(0),
    )
    assert [g.record.index for g in out.trained] == [0, 2, 3, 5] and out.drawn == 8 and len(out.rolled) == 8
    assert sum(g.train_weight for g in out.trained) == 4.0
    # weights larger than 1 (a pruned prompt's representative) get the remainder at the end
    groups = [_group([1, 0, 0, 0], [1] * 4, w_q=w, slot=s) for s, w in enumerate([1.5, 1.5, 1.5])]
    trained, filled = batch.select_groups(method, groups, num_drawn=3, filled=0.0)
    assert [g.train_weight for g in trained] == [1.5, 1.5, 1.0] and filled == 4.0
    assert [g.prompt_weight for g in groups] == [1.5, 1.5, 1.5]


def test_redraw_is_bounded_when_everything_is_skipped():
    class SkipAll:
        name, refills = "skip-all", True

        def prune_prompts(self, stats, ratio, generator=None):
            n = stats.score.shape[0]
            return torch.zeros(n, dtype=torch.bool), torch.zeros(n)

    method = batch.Method.from_config(_config(), get_strategy("greso"))
    drawn = batch.draw_round(method, SkipAll(), _stream(10_000), _no_history, torch.Generator())
    assert len(drawn.records) == batch.MAX_DRAW_FACTOR * method.prompts_per_round and not drawn.kept()


def test_weigh_completions_drops_zero_variance_groups_only_when_asked():
    groups = [_group([1, 0, 1, 0], [1] * 4), _group([0, 0, 0, 0], [1] * 4, slot=1)]
    for drop in (True, False):
        method = batch.Method.from_config(_config(pruning__drop_zero_variance=drop), get_strategy("none"))
        metrics = batch.weigh_completions(method, get_strategy("none"), groups, torch.Generator())
        assert groups[0].completion_weights == [1.0] * 4 and groups[0].advantages[0] > 0
        assert groups[1].completion_weights == ([0.0] * 4 if drop else [1.0] * 4)
        assert metrics["prune/completions_kept_frac"] == (0.5 if drop else 1.0)


@pytest.mark.parametrize("agg", losses.LOSS_AGGS)
def test_denominators_equal_their_formulas(agg):
    lengths = [[1, 2, 3, 4], [5, 6, 7, 8]]
    groups = [_group([1, 0, 0, 0], lengths[0], w_q=2.0), _group([1, 1, 0, 0], lengths[1], slot=1)]
    for g in groups:
        g.train_weight, g.completion_weights = g.prompt_weight, [1.0, 0.0, 1.0, 1.0]
    G, lmax = 4, 8
    full = batch.Method.from_config(_config(algorithm__loss_agg=agg), get_strategy("dppo"))
    expected_full = {"seq-mean-token-mean": 3 * G, "seq-mean-token-sum-norm": 3 * G * lmax, "token-mean": 2 * 10 + 26}
    assert batch.denominator(full, groups, num_prompts=3) == expected_full[agg]
    refill = full.replace(denominator="refill")
    assert batch.denominator(refill, groups, num_prompts=99) == expected_full[agg]  # the weights (3), not the count
    kept = full.replace(denominator="kept")
    expected_kept = {"seq-mean-token-mean": 6, "seq-mean-token-sum-norm": 6 * lmax, "token-mean": 8 + 20}
    assert batch.denominator(kept, groups, num_prompts=3) == expected_kept[agg]


@pytest.mark.parametrize("agg", losses.LOSS_AGGS)
def test_overlong_filter_drops_truncated_completions_and_their_tokens(agg):
    """docs/algorithm.md: a truncated completion trains with weight 0; token-mean's full-batch
    normaliser counts only untruncated tokens; the per-sequence normalisers (B*G, B*G*Lmax) keep
    every completion, the truncated ones as zero-loss members."""
    method = batch.Method.from_config(
        _config(algorithm__loss_agg=agg, algorithm__overlong_filter=True), get_strategy("none")
    )
    g = _group([1, 0, 1, 0], [3, 8, 8, 2])
    g.truncated = [False, True, True, False]
    trained, _ = batch.select_groups(method, [g], num_drawn=1, filled=0.0)
    batch.weigh_completions(method, get_strategy("none"), trained, torch.Generator())
    assert g.completion_weights == [1.0, 0.0, 0.0, 1.0] and g.loss_lengths() == [3, 0, 0, 2]
    plan = batch.plan_minibatches(method, trained, num_drawn=1)[0]
    assert len(plan.samples) == 2
    expected = {"token-mean": 5, "seq-mean-token-mean": 4, "seq-mean-token-sum-norm": 4 * 8}[agg]
    assert plan.denominator == expected


def test_plan_skips_minibatches_with_nothing_to_train():
    method = batch.Method.from_config(_config(trainer__minibatches_per_step=2), get_strategy("none"))
    groups = [_group([1, 0, 0, 0], [1] * 4), _group([1, 0, 0, 1], [2] * 4, slot=3)]
    trained, _ = batch.select_groups(method, groups, 4, 0.0)
    assert [g.minibatch for g in trained] == [0, 1]
    for g in trained:
        g.advantages = [0.5] * 4
        g.completion_weights = [0.0] * 4 if g.slot == 0 else [1.0] * 4
    plans = batch.plan_minibatches(method, trained, num_drawn=4)
    assert [p.index for p in plans] == [1] and plans[0].tokens == 4 * 3 and plans[0].completion_tokens == 8
    assert batch.needs_old_logprobs(method, plans) is False
    assert batch.needs_old_logprobs(method.replace(epochs=2), plans) is True


def test_verify_unbiased_runs_the_trainers_planning(monkeypatch):
    """Change the planning's denominator rule (here: normalise over what was kept, CPPO-style) and
    verify-unbiased must call DPPO biased; the trainer plans its step with the same functions."""
    cfg = CheckConfig(strategy="dppo", r_q=0.0, r_o=0.5, draws=600, seed=5)
    assert run_check(cfg).unbiased
    original = batch.denominator
    monkeypatch.setattr(batch, "denominator", lambda m, g, n: original(m.replace(denominator="kept"), g, n))
    res = run_check(cfg)
    assert not res.unbiased and res.rel_error > 0.1, res.summary(cfg)
    dyn = CheckConfig(strategy="dppo", num_prompts=8, r_q=0.0, r_o=0.5, draws=300, seed=0, fixed_order=True)
    assert not run_dynamic_check(dyn).unbiased
    # ... and the trainer's step goes through the same module-level functions (no copy of its own).
    step = inspect.getsource(trainer.Trainer.step)
    for fn in ("batch.collect(", "batch.weigh_completions(", "batch.plan_minibatches("):
        assert fn in step and fn in inspect.getsource(unbiased_check)
    assert "full_batch_denominator" not in inspect.getsource(trainer)
