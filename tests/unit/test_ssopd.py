"""SSOPD's rules (docs/methods.md sections 4 and 5): the pair from the full group, the frontier weight,
the teacher context, the length rules, each divergence against a direct full-vocabulary
computation (values and student gradients; also sharded over a real 2-process gloo TP group),
and the whole aux term on a tiny Qwen3: zero when teacher and student contexts match, zero for
non-mixed groups, unchanged by completion pruning."""

import pytest
import torch

from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.methods.ssopd import rules as ssopd
from megatron_dppo.algorithms.methods.ssopd.rules import SSOPDConfig
from megatron_dppo.algorithms.pruning import prune_completions

VOCAB, PADDED = 50, 64
CASES = [
    ("fkl_clip", 0, 1.0),
    ("fkl", 0, 1.0),
    ("jsd", 0, 1.0),
    ("rkl_sampled", 0, 1.0),
    ("fkl_clip", 7, 1.0),
    ("jsd", 7, 0.8),
    ("fkl", 0, 0.7),
]


def _logits(seed, n=29, v=PADDED):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2.5


def _reference(zt, zs, kind, targets, topk, temperature, tau=0.05, beta=0.5):
    """d_t straight from the definitions over the real vocabulary (top-k: gather the support)."""
    zt, zs = zt[:, :VOCAB].double() / temperature, zs[:, :VOCAB].double() / temperature
    if topk:
        support = zt.topk(topk, dim=-1).indices
        zt, zs = zt.gather(1, support), zs.gather(1, support)
    logp, logq = torch.log_softmax(zt, -1), torch.log_softmax(zs, -1)
    p, q = logp.exp(), logq.exp()
    if kind == "fkl":
        return (p * (logp - logq)).sum(-1)
    if kind == "fkl_clip":
        return torch.clamp(p * (logp - logq), max=tau).sum(-1)
    if kind == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * (p * (logp - m.log())).sum(-1) + (1 - beta) * (q * (logq - m.log())).sum(-1)
    rows = torch.arange(len(targets))
    d = (logq[rows, targets] - logp[rows, targets]).detach()
    return d + d * (logq[rows, targets] - logq[rows, targets].detach())  # score-function gradient


def _brute_pair(rewards, lengths, terminated=None, pool="all", min_correct=0):
    idx = range(len(rewards))
    correct = [(lengths[i], i) for i in idx if rewards[i] >= 0.5]
    wrong = [(-lengths[i], i) for i in idx if rewards[i] < 0.5]
    if pool == "terminated" and any(terminated[i] for _, i in wrong):
        wrong = [(k, i) for k, i in wrong if terminated[i]]
    if not correct or not wrong or min(correct)[0] < min_correct:
        return -1, -1
    return min(correct)[1], min(wrong)[1]  # longest wrong, lowest index on ties


def test_pair_is_shortest_correct_and_longest_wrong_of_the_full_group():
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(40, 6, generator=gen) < 0.5).float()
    lengths = torch.randint(1, 6, (40, 6), generator=gen)  # many ties
    terminated = torch.rand(40, 6, generator=gen) < 0.4
    for pool, min_correct in [("all", 0), ("terminated", 0), ("all", 3)]:
        sel = ssopd.select_pair(rewards, lengths, terminated=terminated, wrong_pool=pool, min_correct_len=min_correct)
        for q in range(40):
            want = _brute_pair(rewards[q].tolist(), lengths[q].tolist(), terminated[q].tolist(), pool, min_correct)
            assert (int(sel.correct[q]), int(sel.wrong[q])) == want, (pool, q)


def test_frontier_weight_is_zero_for_non_mixed_groups():
    rewards = torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    torch.testing.assert_close(ssopd.frontier_weight(rewards), torch.tensor([0, 0, 0.75, 1.0], dtype=torch.float64))
    assert ssopd.frontier_weight(rewards, "indicator").tolist() == [0, 0, 1, 1]
    sel = ssopd.select_pair(rewards, torch.ones(4, 4, dtype=torch.long))
    assert sel.selected.tolist() == [False, False, True, True]


def _compare(kind, topk, temperature, zt, zs_full, targets, *, cols=slice(None), group=None, **kw):
    """(max value error, max student-gradient error) of divergence() on this rank's columns
    against the full-vocabulary reference, for the loss 0.3 * sum_t d_t (replicated over ranks)."""
    want_zs = zs_full.clone().requires_grad_()
    want = _reference(zt.detach(), want_zs, kind, targets, topk, temperature)
    (want_grad,) = torch.autograd.grad(0.3 * want.sum(), want_zs)
    zs = zs_full[:, cols].clone().requires_grad_()
    got = ssopd.divergence(
        zt[:, cols], zs, kind, targets=targets, topk=topk, temperature=temperature, vocab_size=VOCAB, group=group, **kw
    )
    (0.3 * got.sum()).backward()  # each rank gets its own columns' gradient
    padding = zs.grad[:, max(VOCAB - (cols.start or 0), 0) :]  # this rank's columns at or past VOCAB
    assert padding.numel() == 0 or padding.abs().max() == 0  # take no gradient
    return float((got.detach() - want.detach()).abs().max()), float((zs.grad - want_grad[:, cols]).abs().max())


@pytest.mark.parametrize("kind,topk,temperature", CASES)
def test_divergence_matches_the_full_vocabulary_definition(kind, topk, temperature):
    zt, zs = _logits(1), _logits(2)
    targets = torch.randint(VOCAB, (zt.shape[0],), generator=torch.Generator().manual_seed(3))
    zt.requires_grad_()  # the teacher side must be cut off whatever the caller passes
    for recompute, chunk in [(True, 4), (False, 1000)]:
        err, grad_err = _compare(kind, topk, temperature, zt, zs, targets, chunk_size=chunk, recompute=recompute)
        assert err < 1e-10 and grad_err < 1e-10, (err, grad_err)  # float64 in, float64 through
        assert zt.grad is None  # gradient flows only into the student logits
    if kind == "fkl_clip":  # the clip is active on these logits: it is not plain fkl
        clipped = _reference(zt.detach(), zs, "fkl_clip", targets, topk, temperature)
        assert (_reference(zt.detach(), zs, "fkl", targets, topk, temperature) - clipped).abs().max() > 1e-3


def test_identical_logits_give_zero_divergence():
    z = _logits(4)
    for kind, topk, _ in CASES:
        d = ssopd.divergence(
            z, z.clone(), kind, targets=torch.zeros(z.shape[0], dtype=torch.long), topk=topk, vocab_size=VOCAB
        )
        assert d.abs().max() < 1e-6, kind


def test_teacher_context_and_the_check_that_only_the_block_differs():
    prompt = [1, 2, 3, 4, 9, 8]  # ... problem 2 3 4 | end-of-user 9 8
    at = ssopd.insertion_point(prompt, [9, 8])
    t = ssopd.teacher_prompt(
        prompt, [20, 21, 22, 0], header_ids=[30, 31], instruction_ids=[40], insert_at=at, strip_ids=[0]
    )
    assert t.ids == [1, 2, 3, 4, 30, 31, 20, 21, 22, 40, 9, 8] and t.block == [30, 31, 20, 21, 22, 40]
    wrong = [5, 6, 7]
    assert ssopd.check_only_block_differs(prompt + wrong, t.ids + wrong, t.block) == 4
    assert ssopd.check_only_block_differs(prompt, t.ids) in range(0, 5)
    with pytest.raises(ValueError, match="differ outside one inserted block"):
        ssopd.check_only_block_differs(prompt + wrong, t.ids + [5, 6, 8])
    with pytest.raises(ValueError, match="not the solution block"):
        ssopd.check_only_block_differs(prompt, t.ids, [30, 31, 20, 21, 22, 41])
    with pytest.raises(ValueError, match="marker"):
        ssopd.insertion_point(prompt, [7, 7])


def test_positions_are_cut_to_the_context_and_skipped_below_the_minimum():
    assert ssopd.aux_positions(100, 300, max_context=1024) == 300
    assert ssopd.aux_positions(100, 300, aux_max_len=64, max_context=1024) == 64
    assert ssopd.aux_positions(900, 300, max_context=1024) == 124
    assert ssopd.aux_positions(1010, 300, max_context=1024) == 0  # 14 < 16: skipped
    assert ssopd.aux_positions(10, 12, max_context=1024) == 0
    assert ssopd.prediction_rows(5, 3) == slice(4, 7)


def test_aux_coefficients_add_up_over_any_split_of_the_pairs():
    gen = torch.Generator().manual_seed(5)
    omega, w_q = torch.rand(6, generator=gen), torch.rand(6, generator=gen) + 0.5
    positions = torch.tensor([20, 0, 17, 33, 16, 40])
    divs = [torch.rand(int(t), generator=gen) for t in positions]
    coef = ssopd.aux_coefficients(omega, positions, num_prompts=8, prompt_weight=w_q)
    want = sum(float(w_q[q] * omega[q] * divs[q].mean()) for q in range(6) if positions[q] > 0) / 8
    assert float(ssopd.aux_loss(divs, coef)) == pytest.approx(want, rel=1e-6)
    parts = [ssopd.aux_loss(divs[a:b], coef[a:b]) for a, b in [(0, 2), (2, 3), (3, 6)]]
    assert float(sum(parts)) == pytest.approx(want, rel=1e-6)


# --- the whole aux term on a tiny model -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from tiny_models import tiny_qwen3_model

    return tiny_qwen3_model(0)[1].eval()


_LOGITS_CACHE: dict = {}


def _no_grad_logits(model, ids):
    """The tiny model's logits [len(ids), V] without gradient, cached (the model is fixed)."""
    key = (id(model), tuple(ids))
    if key not in _LOGITS_CACHE:
        with torch.no_grad():
            _LOGITS_CACHE[key] = model(input_ids=torch.tensor([list(ids)])).logits[0]
    return _LOGITS_CACHE[key]


def _step_aux(model, rewards, lengths, completions, prompt, cfg, header, instruction, num_prompts, sel=None):
    """The aux term of one step as the policy would build it from this module's functions."""
    sel = ssopd.select_pair(rewards, lengths) if sel is None else sel
    omega = ssopd.frontier_weight(rewards, cfg.frontier) * sel.selected
    divs, positions = [], []
    for q in range(rewards.shape[0]):
        if not sel.selected[q]:
            divs.append(torch.zeros(0))
            positions.append(0)
            continue
        correct, wrong = completions[q][int(sel.correct[q])], completions[q][int(sel.wrong[q])]
        teacher = ssopd.teacher_prompt(prompt, correct, header_ids=header, instruction_ids=instruction)
        ssopd.check_only_block_differs(prompt + wrong, teacher.ids + wrong, teacher.block)
        t = ssopd.aux_positions(len(teacher.ids), len(wrong), max_context=128, min_positions=cfg.min_positions)
        zt = _no_grad_logits(model, teacher.ids + wrong)[ssopd.prediction_rows(len(teacher.ids), t)]
        if torch.is_grad_enabled():
            zs = model(input_ids=torch.tensor([prompt + wrong])).logits[0, ssopd.prediction_rows(len(prompt), t)]
        else:
            zs = _no_grad_logits(model, prompt + wrong)[ssopd.prediction_rows(len(prompt), t)]
        divs.append(ssopd.divergence(zt, zs, cfg.div, targets=torch.tensor(wrong[:t]), tau=cfg.tau, chunk_size=8))
        positions.append(t)
    coef = ssopd.aux_coefficients(omega, torch.tensor(positions), num_prompts=num_prompts)
    return ssopd.aux_loss(divs, coef), sel


def _tiny_step(seed, num_prompts=5, g=4):
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(num_prompts, g, generator=gen) < 0.5).float()
    rewards[0] = 1.0
    rewards[1, :2], rewards[1, 2:] = 1.0, 0.0
    lengths = torch.randint(16, 30, (num_prompts, g), generator=gen)
    completions = [[torch.randint(3, 50, (int(n),), generator=gen).tolist() for n in row] for row in lengths]
    return rewards, lengths, completions


@pytest.mark.slow
@pytest.mark.parametrize("div", ["fkl_clip", "jsd", "rkl_sampled"])
def test_aux_is_zero_when_teacher_context_equals_student_context(tiny_model, div):
    rewards, lengths, completions = _tiny_step(0)
    prompt, cfg = [1, 5, 6, 7, 2], SSOPDConfig(div=div)
    # An empty block (no header, instruction or solution): the teacher context IS the student's.
    empty = [[[] for _ in row] for row in completions]
    sel = ssopd.select_pair(rewards, lengths)
    same = [[completions[q][i] if i == int(sel.wrong[q]) else empty[q][i] for i in range(4)] for q in range(5)]
    aux_same, _ = _step_aux(tiny_model, rewards, lengths, same, prompt, cfg, [], [], 5)
    assert abs(float(aux_same.detach())) < 1e-6
    aux, _ = _step_aux(tiny_model, rewards, lengths, completions, prompt, cfg, [8, 9], [10], 5)
    assert abs(float(aux.detach())) > 1e-4  # a real solution block changes the teacher: the check can fail
    aux.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_model.parameters())
    tiny_model.zero_grad(set_to_none=True)


def test_non_mixed_groups_add_no_aux(tiny_model):
    rewards, lengths, completions = _tiny_step(1)
    prompt, cfg = [1, 5, 6, 7, 2], SSOPDConfig(div="fkl")
    full, sel = _step_aux(tiny_model, rewards, lengths, completions, prompt, cfg, [8], [9], 5)
    mixed = sel.selected
    assert not mixed[0] and mixed[1]
    # Only the mixed groups contribute: aux over them alone (B unchanged) is the same number.
    sub, _ = _step_aux(
        tiny_model,
        rewards[mixed],
        lengths[mixed],
        [c for c, m in zip(completions, mixed) if m],
        prompt,
        cfg,
        [8],
        [9],
        5,
    )
    assert float(full.detach()) == pytest.approx(float(sub.detach()), rel=1e-6)
    tiny_model.zero_grad(set_to_none=True)


def test_aux_is_unchanged_by_completion_pruning(tiny_model):
    """The pair comes from the full group's rewards and lengths, which completion pruning does not
    change, so the aux term is the same for every DPPO mask draw: `select_pair` and `_step_aux`
    take no mask. Picking the pair from the survivors instead moves it for some draws, and with it
    the aux value, so that is what the full-group rule protects."""
    rewards, lengths, completions = _tiny_step(2, num_prompts=4, g=6)
    prompt, cfg = [1, 5, 6, 7, 2], SSOPDConfig(div="fkl_clip")
    with torch.no_grad():
        reference, sel = _step_aux(tiny_model, rewards, lengths, completions, prompt, cfg, [8], [9], 4)
    moved = 0
    for seed in range(20):
        keep, _ = prune_completions(group_advantages(rewards), 0.5, torch.Generator().manual_seed(seed))
        pairs = []
        for q in range(4):
            kept = [i for i in range(6) if keep[q, i]]
            c, w = _brute_pair([rewards[q, i] for i in kept], [int(lengths[q, i]) for i in kept])
            pairs.append((kept[c], kept[w]) if c >= 0 else (-1, -1))
        on_survivors = ssopd.PairSelection(
            correct=torch.tensor([c for c, _ in pairs]), wrong=torch.tensor([w for _, w in pairs])
        )
        if torch.equal(on_survivors.correct, sel.correct) and torch.equal(on_survivors.wrong, sel.wrong):
            continue
        moved += 1
        if moved > 3:
            continue
        with torch.no_grad():
            aux, _ = _step_aux(tiny_model, rewards, lengths, completions, prompt, cfg, [8], [9], 4, sel=on_survivors)
        assert float(aux) != float(reference)
    assert moved > 0
    with torch.no_grad():  # and the full-group rule itself is deterministic
        again, _ = _step_aux(tiny_model, rewards, lengths, completions, prompt, cfg, [8], [9], 4)
    assert float(again) == float(reference)


def test_config_validate_names_the_key():
    SSOPDConfig().validate("aux.ssopd")
    with pytest.raises(ValueError, match=r"config key 'aux\.ssopd\.div': expected one of"):
        SSOPDConfig(div="kl").validate("aux.ssopd")
    with pytest.raises(ValueError, match=r"'aux\.ssopd\.min_positions'"):
        SSOPDConfig(min_positions=0).validate("aux.ssopd")


# --- tensor parallel --------------------------------------------------------------------------


# --- the teacher context in chat mode, through the trainer's packing (algorithms/methods/ssopd/distill.py) ---


def _chat_tokenizers():
    from thinking_template import thinking_tokenizer
    from transformers import AutoTokenizer

    tiny = AutoTokenizer.from_pretrained("examples/tiny/model")
    return {"tiny": tiny, "thinking": thinking_tokenizer()}


def _aux_teacher_student(renderer, prompt_ids, correct, wrong, prefix_len=0):
    """The teacher and student rows of the one pair's packed micro-batch, as the trainer builds them."""
    from megatron_dppo.algorithms.methods.ssopd import distill
    from megatron_dppo.algorithms.packing import PackLayout
    from megatron_dppo.algorithms.records import Group
    from megatron_dppo.data.prompts import PromptRecord

    tok = renderer.tokenizer
    group = Group(
        PromptRecord("q", "12+34=", None, "46"), 0, 0, prompt_ids, [correct, wrong], [1.0, 0.0], train_weight=1.0
    )
    group.prefix_len = prefix_len

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    tokens = distill.AuxTokens(
        header=ids("("), instruction=ids(")"), strip=[tok.eos_token_id], suffix=ids(renderer.generation_suffix())
    )
    layout = PackLayout("window", 128, 4, pad_multiple=1, pad_id=0, dp_rank=0, dp_size=1, local_attention=True)
    cfg = SSOPDConfig(min_positions=1)
    pair = distill.AuxPair(group, correct=0, wrong=1, omega=1.0)
    (mb,), stats = distill.aux_microbatches(
        [pair], cfg=cfg, num_prompts=1.0, tokens=tokens, layout=layout, max_context=64
    )
    cu = mb.cu_seqlens.tolist()
    return mb.tokens[0][cu[0] : cu[1]].tolist(), mb.tokens[0][cu[1] : cu[2]].tolist()


@pytest.mark.parametrize("system", [None, "1"])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("template", ["tiny", "thinking"])
def test_chat_teacher_context_is_the_template_rendering_the_problem_with_the_block(template, thinking, system):
    """docs/methods.md 4.1.3: the solution block goes after the problem text, inside the user turn, in every
    prompt mode. The reference is independent of the insertion code: the chat template rendering
    a user message whose content is the problem followed by the block's text (the tokenizer is
    character-level, so text and ids agree). The student is the ordinary prompt + o_w*."""
    from megatron_dppo.data.prompts import PromptRecord, PromptRenderer

    tok = _chat_tokenizers()[template]
    renderer = PromptRenderer(tok, "chat", system, {} if thinking else {"enable_thinking": False})
    prompt = renderer.token_ids(PromptRecord("q", "12+34=", None, "46"))
    correct, wrong = tok("46", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], [7, 8, 9, 10]
    teacher, student = _aux_teacher_student(renderer, prompt, correct, wrong)
    want = renderer.token_ids(PromptRecord("q", "12+34=(46)", None, "46"))
    assert teacher == want + wrong and student == prompt + wrong
    if renderer.generation_suffix():  # the old rule (the block after the whole prompt) differs here
        assert teacher[: len(prompt)] != prompt
    assert ssopd.check_only_block_differs(student, teacher) == len(prompt) - len(
        tok(renderer.generation_suffix(), add_special_tokens=False)["input_ids"]
    )


def test_chat_teacher_block_goes_before_an_adaprefix_prefix():
    """With AdaPrefix the prompt ends with the thinking opener and the reference prefix (prefix_len
    ids after the rendered prompt): the block still goes after the problem text, before them."""
    from megatron_dppo.data.prompts import PromptRecord, PromptRenderer

    tok = _chat_tokenizers()["thinking"]
    renderer = PromptRenderer(tok, "chat")
    prompt = renderer.token_ids(PromptRecord("q", "12+34=", None, "46"))
    added = tok("<think>10+", add_special_tokens=False)["input_ids"]
    correct, wrong = tok("46", add_special_tokens=False)["input_ids"], [7, 8, 9]
    teacher, _ = _aux_teacher_student(renderer, prompt + added, correct, wrong, prefix_len=len(added))
    assert teacher == renderer.token_ids(PromptRecord("q", "12+34=(46)", None, "46")) + added + wrong
    with pytest.raises(ValueError, match="generation suffix"):  # a prefix_len that is not the prefix's
        _aux_teacher_student(renderer, prompt + added, correct, wrong, prefix_len=1)


def test_the_trainers_context_check_fails_on_a_template_mismatch(monkeypatch):
    """check_only_block_differs can fail where the trainer calls it: a teacher prompt rendered
    with another template mode (thinking on for the teacher, off for the student: the mismatch
    OPSD's repo documents) is refused, naming the difference."""
    from megatron_dppo.data.prompts import PromptRecord, PromptRenderer

    tok = _chat_tokenizers()["thinking"]
    student_renderer = PromptRenderer(tok, "chat", None, {"enable_thinking": False})
    teacher_renderer = PromptRenderer(tok, "chat")
    prompt = student_renderer.token_ids(PromptRecord("q", "12+34=", None, "46"))
    mismatched = teacher_renderer.token_ids(PromptRecord("q", "12+34=(46)", None, "46"))
    original = ssopd.teacher_prompt

    def other_template(*args, **kwargs):
        t = original(*args, **kwargs)
        return ssopd.TeacherPrompt(ids=mismatched, insert_at=t.insert_at, block=t.block)

    correct, wrong = tok("46", add_special_tokens=False)["input_ids"], [7, 8, 9]
    _aux_teacher_student(student_renderer, prompt, correct, wrong)  # the real teacher passes
    monkeypatch.setattr(ssopd, "teacher_prompt", other_template)
    with pytest.raises(ValueError, match="teacher context"):
        _aux_teacher_student(student_renderer, prompt, correct, wrong)


def test_ssopd_teacher_keys_that_nothing_built_are_refused():
    """The teacher is the current policy; `teacher: fixed|ema` and `teacher_ema` were accepted and
    read by nothing: now an unknown key, named."""
    from megatron_dppo.config import load_config

    base = ["algorithm.aux=ssopd"]
    for key in ("algorithm.ssopd.teacher=fixed", "algorithm.ssopd.teacher_ema=0.9"):
        with pytest.raises(ValueError, match=key.split("=")[0].replace(".", r"\.")):
            load_config("examples/tiny/addition.yaml", overrides=[*base, key])
