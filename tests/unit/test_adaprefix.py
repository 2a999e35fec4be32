"""AdaPrefix-GRPO's rules (docs/methods.md sections 3 and 5): the controller holds a synthetic problem's
success near 50% (Monte Carlo, tolerance from the noise), f never passes f_cap or f_max(t), the
prefix is cut at step boundaries and never shows the answer, the context rule shrinks the
prefix, prefix tokens carry no gradient (finite differences), and the state round-trips JSON."""

import json
import math
import random

import pytest
import torch

from megatron_dppo.algorithms.methods.adaprefix import rules as adaprefix
from megatron_dppo.algorithms.methods.adaprefix.rules import AdaPrefixConfig, PrefixFractions
from megatron_dppo.data.tasks import get_task

G = 8


def _success(f, f50, slope=8.0):
    """A synthetic problem: success probability increasing in the fraction shown, 1/2 at f50."""
    return 1 / (1 + math.exp(-slope * (f - f50)))


def _simulate(cfg, f50, visits, seed, f_cap=1.0, f_max=lambda t: 1.0):
    rng = random.Random(seed)
    state = PrefixFractions(cfg.f0)
    fs, probs, p_hats = [], [], []
    for t in range(visits):
        f = state.fraction("q")
        p = _success(f, f50)
        p_hat = sum(rng.random() < p for _ in range(G)) / G
        fs.append(f)
        probs.append(p)
        p_hats.append(p_hat)
        state.update("q", p_hat, f_cap=f_cap, f_max=f_max(t), cfg=cfg)
    return state, fs, probs, p_hats


@pytest.mark.parametrize("ema", [0.0, 0.5])
@pytest.mark.parametrize("f50", [0.4, 0.6])
def test_controller_holds_success_near_one_half(ema, f50):
    """While no clip binds, sum of the updates telescopes: mean(p_hat') = p* - (f_end - f_start)/(eta N),
    so |mean p_hat' - 1/2| <= 1/(eta N); p_hat is unbiased for the success probability at each
    visit (f is fixed before the visit's draws), so the mean success probability is within
    4 sigma = 4 sqrt(1/4 / (G N)) more of it."""
    cfg = AdaPrefixConfig(ema=ema)
    burn, n = 200, 4000
    _, fs, probs, _ = _simulate(cfg, f50, burn + n, seed=1)
    tolerance = 1 / (cfg.eta * n) + 4 * math.sqrt(0.25 / (G * n)) + (2 / n if ema else 0)  # EMA: boundary terms
    assert abs(sum(probs[burn:]) / n - 0.5) < tolerance
    assert 0 < min(fs[burn:]) and max(fs[burn:]) < 1  # no clip bound, so the bound above applies
    # And it is not vacuous: a controller with the sign flipped runs away from 1/2.
    flipped = AdaPrefixConfig(ema=ema, eta=-0.5)
    _, _, wrong, _ = _simulate(flipped, f50, 400, seed=1)
    assert abs(sum(wrong[200:]) / 200 - 0.5) > 0.3


def test_f_never_exceeds_the_answer_cap_or_the_withdrawal_schedule():
    cfg = AdaPrefixConfig()
    total = 300
    # A hard problem: success < 1/2 everywhere below its cap, so the controller pushes into the cap.
    state, fs, _, _ = _simulate(
        cfg, 0.9, total, seed=2, f_cap=0.4, f_max=lambda t: adaprefix.withdrawal_cap(t, total, 0.5, 0.8)
    )
    caps = [min(0.4, adaprefix.withdrawal_cap(t - 1, total)) if t else 1.0 for t in range(total)]
    assert all(f <= c + 1e-12 for f, c in zip(fs, caps))
    assert max(fs) == pytest.approx(0.4)  # it does reach the cap
    assert fs[-1] == 0.0  # withdrawn: plain GRPO at the end
    assert adaprefix.withdrawal_cap(0, 10) == 1.0 and adaprefix.withdrawal_cap(5, 10) == 1.0
    assert adaprefix.withdrawal_cap(65, 100) == pytest.approx(0.5) and adaprefix.withdrawal_cap(80, 100) == 0.0


def _char_ids(text):
    alphabet = get_task("mulsteps").alphabet
    return [alphabet.index(ch) for ch in text]


def test_prefixes_end_at_step_boundaries_and_never_show_the_answer():
    solution = get_task("mulsteps").solution(47, 6)  # "2:94,3:141,4:188,5:235,6:282"
    ref = _char_ids(solution)
    bounds = frozenset(_char_ids(","))
    cap = adaprefix.answer_cap(ref, bounds, margin_steps=1)
    # The answer line is "6:282"; one step of margin also keeps "5:235" back.
    assert solution[: round(cap * len(ref))] == "2:94,3:141,4:188,"
    assert adaprefix.answer_cap(ref, bounds, margin_steps=0) * len(ref) == pytest.approx(len("2:94,3:141,4:188,5:235,"))
    for f in [i / 50 for i in range(51)]:
        shown = solution[: adaprefix.prefix_length(f, ref, bounds)]
        assert shown == "" or shown.endswith(",") or shown == solution
        assert len(shown) <= round(f * len(ref))  # snapping only moves back
        ids, shown_len = adaprefix.assisted_prompt(
            _char_ids("47*6="), ref, f, boundary_ids=bounds, f_cap=cap, max_new_tokens=40, max_model_len=200
        )
        assert ids[len("47*6=") :] == ref[:shown_len] and shown_len <= round(cap * len(ref))
        assert "282" not in solution[:shown_len] and "235" not in solution[:shown_len]
    assert adaprefix.answer_cap(_char_ids("2:94"), bounds) == 0.0  # one step: no help
    assert adaprefix.answer_cap([], bounds) == 0.0


def test_context_overflow_shrinks_the_prefix_not_the_budget():
    solution = "2:94,3:141,4:188,5:235,6:282"
    ref, bounds = _char_ids(solution), frozenset(_char_ids(","))
    full = len("2:94,3:141,4:188,")
    assert (
        adaprefix.fit_prefix(full, prompt_len=5, max_new_tokens=20, max_model_len=100, ref_ids=ref, boundary_ids=bounds)
        == full
    )
    got = adaprefix.fit_prefix(
        full, prompt_len=5, max_new_tokens=20, max_model_len=38, ref_ids=ref, boundary_ids=bounds
    )
    assert got == len("2:94,3:141,") and 5 + got + 20 <= 38
    assert (
        adaprefix.fit_prefix(full, prompt_len=5, max_new_tokens=20, max_model_len=25, ref_ids=ref, boundary_ids=bounds)
        == 0
    )


def test_prefix_tokens_carry_no_gradient_by_finite_differences():
    """A tiny GRPO loss over the assistant turn [prefix | continuation] with free logits: moving
    any logit of a prefix position leaves the loss exactly unchanged; moving a continuation one
    changes it by what autograd says (so the check can fail)."""
    gen = torch.Generator().manual_seed(0)
    prefix_len, cont_len, vocab = 5, 7, 11
    logits = torch.randn(prefix_len + cont_len, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(vocab, (prefix_len + cont_len,), generator=gen)
    mask = adaprefix.loss_mask(prefix_len, cont_len)
    assert mask.tolist() == [False] * prefix_len + [True] * cont_len

    def loss_fn(z):
        logp = torch.log_softmax(z, -1).gather(1, targets[:, None])[:, 0]
        return -(0.7 * logp * mask).sum() / mask.sum()  # token-mean over generated tokens only

    (grad,) = torch.autograd.grad(loss_fn(logits), logits)
    eps = 1e-6
    with torch.no_grad():
        for t in range(prefix_len + cont_len):
            for v in (0, int(targets[t])):
                bumped = logits.clone()
                bumped[t, v] += eps
                fd = (loss_fn(bumped) - loss_fn(logits)) / eps
                if t < prefix_len:
                    assert fd == 0 and grad[t, v] == 0
                else:
                    assert abs(fd - grad[t, v]) < 1e-5 and abs(grad[t, v]) > 1e-4


def test_state_round_trips_through_json_and_rejects_bad_rows():
    cfg = AdaPrefixConfig(ema=0.5)
    state = PrefixFractions(0.1)
    state.update("a", 0.0, f_cap=1.0, f_max=1.0, cfg=cfg)
    state.update("b", 1.0, f_cap=1.0, f_max=1.0, cfg=cfg)
    state.update("a", 0.25, f_cap=1.0, f_max=1.0, cfg=cfg)
    loaded = PrefixFractions()
    loaded.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert loaded.state_dict() == state.state_dict()
    assert loaded.fraction("a") == pytest.approx(0.1 + 0.25 + 0.5 * (0.5 - 0.125)) and loaded.visits("a") == 2
    assert loaded.fraction("b") == 0.0 and loaded.fraction("never") == 0.1
    with pytest.raises(ValueError, match="prompt 'x' must be"):
        loaded.load_state_dict({"version": 1, "prompts": {"x": [2.0, None, 1]}})
    with pytest.raises(ValueError, match="expected version 1"):
        loaded.load_state_dict({"prompts": {}})


def test_boundary_tokens_and_config_checks():
    texts = ["a", "b\n", ",", "\n\n", "x,y", ""]
    assert adaprefix.boundary_token_ids(texts, "\n") == {1, 3}
    assert adaprefix.boundary_token_ids(texts, "\n,") == {1, 2, 3}
    AdaPrefixConfig().validate("curriculum.adaprefix")
    with pytest.raises(ValueError, match=r"config key 'curriculum\.adaprefix\.withdraw_end'"):
        AdaPrefixConfig(withdraw_start=0.7, withdraw_end=0.6).validate("curriculum.adaprefix")
    with pytest.raises(ValueError, match="success_rate of prompt 'q'"):
        PrefixFractions().update("q", 1.5, f_cap=1, f_max=1, cfg=AdaPrefixConfig())


@pytest.mark.parametrize("thinking", [True, False])
def test_prefix_follows_the_thinking_opener_of_a_thinking_template(thinking):
    """docs/methods.md 3.1.2: with a thinking template in thinking mode the prefix goes right after the
    thinking opener ("<think>\\n" for Qwen3; "<think>" on this tokenizer); with thinking off (the
    generation prompt holds the empty block) or a template with no thinking block, the prefix
    starts the assistant turn, right after the rendered prompt."""
    from thinking_template import thinking_tokenizer
    from transformers import AutoTokenizer

    from megatron_dppo.algorithms.methods.adaprefix.curriculum import PrefixCurriculum
    from megatron_dppo.config import Config
    from megatron_dppo.data.prompts import PromptRecord, PromptRenderer

    cfg = Config()
    cfg.algorithm.adaprefix.f0, cfg.algorithm.adaprefix.boundaries = 1.0, "+"
    cfg.data.solution_key, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = "solution", 8, 64
    rec = PromptRecord("q", "12+34=", None, "46", extra={"solution": "10+2+30+4=46"})
    plain = AutoTokenizer.from_pretrained("examples/tiny/model")  # its template writes no thinking block
    for tok, opener in [(thinking_tokenizer(), ["<think>"] if thinking else []), (plain, [])]:
        renderer = PromptRenderer(tok, "chat", None, {} if thinking else {"enable_thinking": False})
        prompt = renderer.token_ids(rec)
        cur = PrefixCurriculum(cfg, tok, total_steps=10, assistant_opening=renderer.assistant_opening())
        ids, added = cur.assisted(rec, prompt, step=0)
        assert ids[: len(prompt)] == prompt and added == len(ids) - len(prompt)
        shown = tok.convert_ids_to_tokens(ids[len(prompt) :])
        # the opener, then whole steps of the reference up to one step before the answer's
        assert shown[: len(opener)] == opener and "".join(shown[len(opener) :]) == "10+2+"
        assert "<think>" not in shown[len(opener) :]
    # The rule on Qwen3's own texts (its template's assistant turn and generation prompts).
    assert adaprefix.thinking_opener("<think>\n\n</think>\n\n") == "<think>\n"
    assert adaprefix.thinking_opener("") == "" and adaprefix.thinking_opener("Answer: ") == ""
