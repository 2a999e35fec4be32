"""The four other methods (BPPO, ReCo, AdaPrefix-GRPO, SSOPD) as options of the step (docs/methods.md): their
planning in algorithms/batch.py, SSOPD's micro-batches, AdaPrefix's prompts, and verify-unbiased's
verdicts on them (biased by design against GRPO; DPPO unbiased for each method's own loss)."""

import ast
import pathlib

import pytest
import torch

from megatron_dppo.algorithms import batch
from megatron_dppo.algorithms.methods import registry
from megatron_dppo.algorithms.methods.base import Reweighting, StepSettings
from megatron_dppo.algorithms.methods.reco.method import ReCo
from megatron_dppo.algorithms.methods.ssopd import distill
from megatron_dppo.algorithms.packing import PackLayout
from megatron_dppo.algorithms.pruning import PromptStats, get_strategy
from megatron_dppo.algorithms.records import Group
from megatron_dppo.config import Config, inert_keys, load_config
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


def _layout(capacity: int) -> PackLayout:
    """One rank's packing, no padding (what the trainer's PackLayout holds)."""
    return PackLayout("window", capacity, 4, pad_multiple=1, pad_id=0, dp_rank=0, dp_size=1, local_attention=True)


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
    assert batch.needs_old_logprobs(method, []) and method.reweighting.needs_token_scale


def test_ssopd_pairs_come_from_the_full_group_and_their_rows_align():
    """Pairs are chosen before completion pruning (the shortest correct, the longest wrong), and in
    the packed micro-batch each teacher row predicts the same token of o_w* as its student row."""
    method = _method(aux="ssopd")
    g = _group([1, 0, 1, 0], [[5, 5, 5], [6, 6, 6, 6, 6], [7, 7], [8, 8, 8]])
    trained, _ = batch.select_groups(method, [g], num_drawn=1, filled=0.0)
    batch.weigh_completions(method, get_strategy("none"), trained, torch.Generator())
    g.completion_weights = [0.0, 0.0, 1.0, 1.0]  # pruning the wrong one must not change the pair
    pairs = method.aux.pairs(method, trained)
    assert [(p.correct, p.wrong, p.omega) for p in pairs] == [(2, 1, 1.0)]
    cfg = method.aux.cfg.__class__(min_positions=1, coef=0.5)
    tokens = distill.AuxTokens(header=[9], instruction=[10, 10], strip=[0])
    (mb,), stats = distill.aux_microbatches(
        pairs, cfg=cfg, num_prompts=2.0, tokens=tokens, layout=_layout(capacity=64), max_context=64
    )
    assert stats.pairs == 1 and stats.positions == 5 and float(mb.loss_mask.sum()) == 0  # no GRPO loss here
    row = mb.tokens[0]
    teacher = row[: int(mb.cu_seqlens[1])].tolist()
    assert teacher == [1, 2, 3, 9, 7, 7, 10, 10, 6, 6, 6, 6, 6]  # x, header, o_c*, instruction, o_w*
    a = mb.aux
    assert torch.equal(row[a.teacher_rows + 1], a.targets) and torch.equal(row[a.student_rows + 1], a.targets)
    assert torch.allclose(a.coef, torch.full((5,), 0.5 * 1.0 / (2.0 * 5), dtype=torch.float64))


def test_adaprefix_shows_whole_steps_of_the_reference_and_never_its_answer():
    from transformers import AutoTokenizer

    from megatron_dppo.algorithms.methods.adaprefix.curriculum import PrefixCurriculum

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
    monkeypatch.setattr(ReCo, "response_weights", lambda self, method, groups: torch.ones(len(groups), 8))
    res = run_method_check(CheckConfig(method="reco", r_q=0.0, r_o=0.5, draws=400, seed=3))
    assert not res.unbiased
    monkeypatch.undo()
    original = distill.pair_coefficients

    def without_w_q(pairs, positions, num_prompts, lam):
        return original(pairs, positions, num_prompts, lam) / torch.tensor([p.group.train_weight for p in pairs])

    monkeypatch.setattr(distill, "pair_coefficients", without_w_q)
    res = run_method_check(CheckConfig(method="ssopd", r_q=0.5, r_o=0.0, draws=400, seed=3))
    assert not res.unbiased


# ---- a method is one class and one registry line (docs/methods.md section 6) -------------------


class HalfTruncated(Reweighting):
    """docs/methods.md 6's worked example: truncated completions train with half their weight."""

    name = "halftrunc"

    def response_weights(self, method, groups):
        return torch.tensor([[0.5 if t else 1.0 for t in g.truncated] for g in groups])

    def metrics(self, response_weights):
        return {"halftrunc/halved_frac": float((response_weights < 1).float().mean())}


def test_a_method_is_one_class_and_one_registry_line(monkeypatch):
    overrides = ["algorithm.reweighting=halftrunc", "pruning.strategy=none", "pruning.r_q=0", "pruning.r_o=0"]
    with pytest.raises(ValueError, match=r"config key 'algorithm\.reweighting': expected one of \['none', 'reco'\]"):
        load_config("examples/tiny/addition.yaml", overrides)
    monkeypatch.setitem(registry.SLOTS["reweighting"], "halftrunc", HalfTruncated)  # the registry line
    cfg = load_config("examples/tiny/addition.yaml", overrides)  # validates
    assert "algorithm.reco" in inert_keys(cfg)  # reco's section is inert under it
    cfg.trainer.prompts_per_step, cfg.rollout.group_size = 2, 4
    strategy = get_strategy(cfg.pruning.strategy)
    method = batch.Method.from_config(cfg, strategy)
    assert isinstance(method.reweighting, HalfTruncated) and method.reweighting.enabled
    groups = {
        "q0": _group([1, 0, 1, 0], [[5] * 3, [6] * 4, [7] * 2, [8] * 5], slot=0),
        "q1": _group([0, 1, 1, 1], [[5] * 2, [6] * 2, [7] * 6, [8] * 2], slot=1),
    }
    groups["q0"].truncated = [False, True, False, True]
    groups["q1"].truncated = [False, False, True, False]
    records = [g.record for g in groups.values()]

    def rollout(rnd, items):
        return [groups[rec.id] for rec, _, _ in items]

    stats = PromptStats(score=torch.full((2,), float("nan")), zero_var_streak=torch.zeros(2, dtype=torch.long))
    collected = batch.collect(
        method, strategy, next_batch=lambda n: records[:n], stats_of=lambda ids: stats, rollout=rollout,
        generator=torch.Generator(),
    )  # fmt: skip
    metrics = batch.weigh_completions(method, strategy, collected.trained, torch.Generator())
    (plan,) = batch.plan_minibatches(method, collected.trained, collected.drawn)
    # independent reference: w = w_q (1) x w_o (1) x u, u = 0.5 where truncated
    weights = {(g.record.id, i): 0.5 if t else 1.0 for g in groups.values() for i, t in enumerate(g.truncated)}
    assert [g.completion_weights for g in groups.values()] == [[1.0, 0.5, 1.0, 0.5], [1.0, 1.0, 0.5, 1.0]]
    assert sorted(s.weight for s in plan.samples) == sorted(weights.values())
    assert metrics["halftrunc/halved_frac"] == 3 / 8
    lengths = [n for g in groups.values() for n in g.completion_lengths()]
    assert plan.denominator == sum(lengths)  # token-mean over the full batch: unchanged by the method


# Names of the methods' options (not the plain step's): no code outside algorithms/methods/ compares
# a string with one of them, nor a slot key (method.selection, cfg.algorithm.aux ...) with a string.
METHOD_NAMES = {name for options in registry.SLOTS.values() for name in list(options)[1:]}
PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dppo"


def name_comparisons(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        strings = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
        slot_attr = any(isinstance(s, ast.Attribute) and s.attr in registry.SLOTS for s in sides)
        if METHOD_NAMES & set(strings) or (slot_attr and strings):
            found.append(f"{where}:{node.lineno}")
    return found


def test_no_method_name_is_compared_outside_the_registry():
    methods_dir = PACKAGE / "algorithms" / "methods"
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if methods_dir not in p.parents]
    assert PACKAGE / "algorithms" / "batch.py" in sources  # the walk reads the package (from tests/unit it read none)
    found = [f for p in sources for f in name_comparisons(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert found == []


def test_the_name_comparison_walk_finds_one():
    """The walk can fail: the dispatch the registry replaced is found."""
    old = 'def f(method, a):\n    return method.reweighting == "reco" or a.aux != "none" or "bppo" == a.x\n'
    assert name_comparisons(old, "old.py") == ["old.py:2"] * 3


def test_the_hooks_read_of_the_step_only_what_step_settings_lists():
    """The methods read the step's batch.Method through base.StepSettings and never import
    algorithms/batch.py (which imports them: pyproject.toml's import-linter contract): every
    `method.<field>` read under algorithms/methods/ is a member of the protocol, and Method has each."""
    listed = {name for name in vars(StepSettings) if not name.startswith("_")}
    read = {
        node.attr
        for p in (PACKAGE / "algorithms" / "methods").rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "method"
    }
    assert read and read <= listed, f"read through `method` but not in StepSettings: {sorted(read - listed)}"
    assert isinstance(_method(), StepSettings)
