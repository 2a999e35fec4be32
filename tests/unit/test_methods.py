"""The four other methods (BPPO, ReCo, AdaPrefix-GRPO, SSOPD) as options of the step (docs/methods.md): their
planning in algorithms/batch.py, SSOPD's micro-batches, AdaPrefix's prompts, and verify-unbiased's
verdicts on them (biased by design against GRPO; DPPO unbiased for each method's own loss)."""

import pytest
import torch

from megatron_dppo.algorithms import batch, distill
from megatron_dppo.algorithms.pruning import get_strategy
from megatron_dppo.algorithms.records import Group
from megatron_dppo.config import Config
from megatron_dppo.data.prompts import PromptRecord
from megatron_dppo.jobs.verify_methods import METHODS, run_method_check
from megatron_dppo.jobs.verify_unbiased import CheckConfig


def _method(**algorithm):
    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 2, 4, 8
    cfg.pruning.drop_zero_variance = True
    for k, v in algorithm.items():
        setattr(cfg.algorithm, k, v)
    return batch.Method.from_config(cfg, get_strategy("none"))


def _group(rewards, completions, slot=0, prompt=(1, 2, 3)):
    rec = PromptRecord(id=f"q{slot}", prompt="x", messages=None, answer="1")
    g = Group(rec, 0, slot, list(prompt), [list(c) for c in completions], list(rewards), prompt_weight=1.0)
    g.truncated = [False] * len(completions)
    return g


def test_bppo_trains_the_shortest_correct_and_incorrect_prefixes_with_its_own_denominator():
    method = _method(selection="bppo", loss_agg="token-mean")
    g = _group([1, 0, 1, 0], [[5] * 6, [6] * 3, [7] * 2, [8] * 5])  # shortest correct: #2 (2), incorrect: #1 (3)
    flat = _group([0, 0, 0, 0], [[5] * 3] * 4, slot=1)  # not mixed: nothing
    trained, _ = batch.select_groups(method, [g, flat], num_drawn=2, filled=0.0)
    batch.weigh_completions(method, get_strategy("none"), trained, torch.Generator())
    assert g.completion_weights == [0.0, 1.0, 1.0, 0.0] and flat.completion_weights == [0.0] * 4
    assert g.trained_tokens[1] == g.trained_tokens[2] == 2  # pair_min: min(L_c, L_w) = 2
    plan = batch.plan_minibatches(method, trained, num_drawn=2)[0]
    # the samples stop after their prefix: no forward, log-prob or backward over the tails
    assert sorted(list(s.tokens) for s in plan.samples) == [[1, 2, 3, 6, 6], [1, 2, 3, 7, 7]]
    assert plan.denominator == 2 + 2  # token-mean: P_c + P_w of the one mixed prompt


def test_reco_response_weight_divides_by_the_expected_occurrence():
    method = _method(reweighting="reco")
    g = _group([1, 0, 1, 0], [[5, 5], [6], [7, 7], [8]])
    g.sampling_logprobs = [[-0.1, -0.1], [-9.0], [-0.5, -0.5], [-3.0]]  # G pi_b = 4 e^-0.2, ..., 4 e^-3
    trained, _ = batch.select_groups(method, [g], num_drawn=1, filled=0.0)
    metrics = batch.weigh_completions(method, get_strategy("none"), trained, torch.Generator())
    expected = [1 / (4 * torch.exp(torch.tensor(-0.2))), 1.0, 1 / (4 * torch.exp(torch.tensor(-1.0))), 1.0]
    assert g.completion_weights == pytest.approx([float(x) for x in expected], rel=1e-6)
    assert metrics["reco/frequent_frac"] == 0.5
    assert batch.needs_old_logprobs(method, []) and batch.needs_token_scale(method)


def test_ssopd_pairs_come_from_the_full_group_and_their_rows_align():
    """Pairs are chosen before completion pruning (the shortest correct, the longest wrong), and in
    the packed micro-batch each teacher row predicts the same token of o_w* as its student row."""
    method = _method(aux="ssopd")
    g = _group([1, 0, 1, 0], [[5, 5, 5], [6, 6, 6, 6, 6], [7, 7], [8, 8, 8]])
    trained, _ = batch.select_groups(method, [g], num_drawn=1, filled=0.0)
    batch.weigh_completions(method, get_strategy("none"), trained, torch.Generator())
    g.completion_weights = [0.0, 0.0, 1.0, 1.0]  # pruning the wrong one must not change the pair
    pairs = batch.ssopd_pairs(method, trained)
    assert [(p.correct, p.wrong, p.omega) for p in pairs] == [(2, 1, 1.0)]
    cfg = method.ssopd.__class__(min_positions=1, coef=0.5)
    tokens = {"header": [9], "instruction": [10, 10], "strip": [0]}
    layout = dict(max_context=64, capacity=64, window=4, dp_rank=0, dp_size=1, pad_multiple=1, pad_id=0)
    (mb,), stats = distill.aux_microbatches(pairs, cfg=cfg, num_prompts=2.0, tokens=tokens, layout=layout)
    assert stats.pairs == 1 and stats.positions == 5 and float(mb.loss_mask.sum()) == 0  # no GRPO loss here
    row = mb.tokens[0]
    teacher = row[: int(mb.cu_seqlens[1])].tolist()
    assert teacher == [1, 2, 3, 9, 7, 7, 10, 10, 6, 6, 6, 6, 6]  # x, header, o_c*, instruction, o_w*
    a = mb.aux
    assert torch.equal(row[a.teacher_rows + 1], a.targets) and torch.equal(row[a.student_rows + 1], a.targets)
    assert torch.allclose(a.coef, torch.full((5,), 0.5 * 1.0 / (2.0 * 5), dtype=torch.float64))


def test_adaprefix_shows_whole_steps_of_the_reference_and_never_its_answer():
    from transformers import AutoTokenizer

    from megatron_dppo.algorithms.curriculum import PrefixCurriculum

    cfg = Config()
    cfg.algorithm.adaprefix.boundaries, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = ",", 40, 80
    tok = AutoTokenizer.from_pretrained("examples/tiny/longtail/model")
    cur = PrefixCurriculum(cfg, tok, total_steps=10)
    rec = PromptRecord("m1", "6321*8=", None, "50568", extra={"solution": "2:12642,3:18963,4:25284,8:50568"})
    prompt = tok("6321*8=")["input_ids"]
    assert cur.assisted(rec, prompt, step=1) == (prompt, 0)  # f0 = 0
    rewards_all_wrong = _group([0.0] * 4, [[5]] * 4)
    rewards_all_wrong.record = rec
    for _ in range(4):  # a hard problem: the controller shows more, step by step
        cur.observe([rewards_all_wrong], step=1)
    ids, n = cur.assisted(rec, prompt, step=1)
    shown = tok.decode(ids[len(prompt) :])
    assert n > 0 and shown.endswith(",") and "50568" not in shown  # the answer's step is never shown
    assert cur.assisted(rec, prompt, step=9)[1] == 0  # withdrawn by 80% of the run


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_each_method_is_biased_by_design_and_dppo_unbiased_for_its_own_loss(method):
    # ReCo's is a ratio (its c_t's step mean), judged on its bias: draws for an s.e. under 2.5%
    cfg = CheckConfig(method=method, r_q=0.5, r_o=0.5, draws=3000 if method == "reco" else 800, seed=3)
    res = run_method_check(cfg)
    assert res.unbiased, res.summary(cfg)
    assert method == "adaprefix" or res.design_gap > 0.1, res.summary(cfg)


@pytest.mark.slow
def test_the_method_check_can_fail(monkeypatch):
    """A trainer that forgot ReCo's response weight, or SSOPD's prompt weight w_q in the aux
    coefficients, is caught."""
    monkeypatch.setattr(batch, "_reco_response_weights", lambda method, groups: torch.ones(len(groups), 8))
    res = run_method_check(CheckConfig(method="reco", r_q=0.0, r_o=0.5, draws=400, seed=3))
    assert not res.unbiased
    monkeypatch.undo()
    original = distill.pair_coefficients

    def without_w_q(pairs, positions, num_prompts, lam):
        return original(pairs, positions, num_prompts, lam) / torch.tensor([p.group.train_weight for p in pairs])

    monkeypatch.setattr(distill, "pair_coefficients", without_w_q)
    res = run_method_check(CheckConfig(method="ssopd", r_q=0.5, r_o=0.0, draws=400, seed=3))
    assert not res.unbiased
