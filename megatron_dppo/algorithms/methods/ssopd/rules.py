"""SSOPD, self-supervised on-policy distillation (docs/methods.md section 4), as pure rules.

Paper facts [paper]: in a mixed group the teacher is a distribution conditioned on the shortest
correct completion; it is distilled into prefixes of the longest wrong completion; an auxiliary
loss next to GRPO; a prompt-level frontier weight concentrates it on groups where correct and
wrong coexist; no external traces. The teacher is the policy itself under stop-gradient [3rd].

    L = L_GRPO + lambda * L_aux,  L_aux = (1/B) sum_q w_q omega_q (1/T_q) sum_{t < T_q} d_t

  - pair (`select_pair`): c* = shortest correct, w* = longest wrong of the FULL group, before
    completion pruning [paper], ties to the lowest index (our choice); wrong_pool=terminated and
    min_correct_len are options (our choice). Reads only full-group rewards and lengths, so
    completion pruning never changes the aux term.
  - teacher context (`teacher_prompt`): the student prompt with a block inserted where the
    problem ends: a header ("here is a correct solution:"), o_c*'s tokens, an instruction (our
    choice, OPSD-style); then o_w* teacher-forced. `check_only_block_differs` tests that the two
    contexts differ by that block alone (OPSD's repo documents a template mismatch it kept).
  - positions (`aux_positions`): T_q = min(L_w*, aux_max_len), cut to fit the context, skipped
    when T_q < min_positions (16) (our choice).
  - divergence d_t per position (`divergence`), teacher p = softmax(z_T) (no grad), student
    q = softmax(z_S), temperature 1 (our choice): fkl_clip sum_v min(p log(p/q), tau), tau = 0.05
    [3rd]; fkl; jsd (beta = 0.5, the OPSD/TRL convention); rkl_sampled on the realised token;
    optional top-k support of the teacher (our choice). Vocab-parallel over TP and chunked over
    positions (with activation checkpointing per chunk), so [T, V] fp32 tensors never sit whole.
  - frontier weight (`frontier_weight`): omega = 4 p (1 - p) (our choice; the form was not seen),
    or the indicator 1[0 < k < G].
  - aggregation (`aux_coefficients`, `aux_loss`): B the full-batch prompt count (the trained
    groups' total weight under refill), w_q the prompt's DPPO weight: a fixed-weight sum, so DPPO
    keeps it unbiased for the full-batch aux loss.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from megatron_dppo.algorithms.methods import _vocab
from megatron_dppo.algorithms.methods._groups import (
    CORRECT_THRESHOLD,
    PairSelection,
    check_lengths,
    correct_mask,
    pick,
)
from megatron_dppo.algorithms.methods.configs import SSOPDConfig

__all__ = [
    "DIVERGENCES",
    "SSOPDConfig",
    "TeacherPrompt",
    "aux_coefficients",
    "aux_loss",
    "aux_positions",
    "check_only_block_differs",
    "divergence",
    "frontier_weight",
    "insertion_point",
    "prediction_rows",
    "select_pair",
    "teacher_prompt",
]

DIVERGENCES = ("fkl_clip", "fkl", "jsd", "rkl_sampled")


def select_pair(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    *,
    terminated: torch.Tensor | None = None,
    wrong_pool: str = "all",
    min_correct_len: int = 0,
    threshold: float = CORRECT_THRESHOLD,
) -> PairSelection:
    """From the FULL group: rewards, lengths [P, G] (terminated [P, G] bool: ended with EOS) ->
    PairSelection(correct = shortest correct c*, wrong = longest wrong w*), -1 in both where the
    group is not mixed or the shortest correct is shorter than min_correct_len (a lucky bare
    answer is a weak witness). wrong_pool=terminated: the longest EOS-terminated wrong one, or any
    wrong one when none terminated (the default "all" keeps truncated repetition loops: they are
    the persistent failures the method targets)."""
    correct = correct_mask(rewards, threshold)
    lengths = check_lengths(lengths, rewards.shape)
    c = pick(lengths, correct)
    wrong = ~correct
    if wrong_pool == "terminated":
        if terminated is None or terminated.shape != rewards.shape:
            raise ValueError("wrong_pool='terminated' needs terminated [P, G] (completion ended with EOS)")
        ended = wrong & terminated.bool()
        wrong = torch.where(ended.any(dim=1, keepdim=True), ended, wrong)
    elif wrong_pool != "all":
        raise ValueError(f"wrong_pool must be 'all' or 'terminated', got {wrong_pool!r}")
    w = pick(lengths, wrong, longest=True)
    l_c = lengths.gather(1, c.clamp(min=0)[:, None])[:, 0]
    ok = (c >= 0) & (w >= 0) & (l_c >= min_correct_len)
    none = torch.full_like(c, -1)
    return PairSelection(correct=torch.where(ok, c, none), wrong=torch.where(ok, w, none))


def frontier_weight(
    rewards: torch.Tensor, kind: str = "variance", threshold: float = CORRECT_THRESHOLD
) -> torch.Tensor:
    """omega [P] float64 from the full group's rewards [P, G], p = k / G: variance = 4 p (1 - p)
    (our choice: 1 at p = 1/2, 0 for non-mixed groups); indicator = 1[0 < k < G]."""
    p = correct_mask(rewards, threshold).double().mean(dim=1)
    if kind == "variance":
        return 4 * p * (1 - p)
    if kind == "indicator":
        return ((p > 0) & (p < 1)).double()
    raise ValueError(f"frontier must be 'variance' or 'indicator', got {kind!r}")


@dataclass(frozen=True)
class TeacherPrompt:
    ids: list[int]  # the student prompt with `block` inserted at `insert_at`
    insert_at: int
    block: list[int]  # header + o_c* (trailing stop tokens removed) + instruction


def teacher_prompt(
    prompt_ids: Sequence[int],
    correct_ids: Sequence[int],
    *,
    header_ids: Sequence[int],
    instruction_ids: Sequence[int],
    insert_at: int | None = None,
    strip_ids: Sequence[int] = (),
) -> TeacherPrompt:
    """T(x, o_c*) as token ids. prompt_ids: the student's prompt (chat-templated or raw);
    insert_at: where the problem text ends in it (for a chat prompt, before the user turn's end
    marker: see `insertion_point`); None = the end (raw prompts). correct_ids: o_c*'s tokens; its
    trailing `strip_ids` (EOS, end-of-turn) are dropped so the block does not end the turn.
    header_ids / instruction_ids: the config's solution_header / instruction, tokenised."""
    at = len(prompt_ids) if insert_at is None else insert_at
    if not 0 <= at <= len(prompt_ids):
        raise ValueError(f"insert_at must be in [0, {len(prompt_ids)}], got {insert_at!r}")
    solution = list(correct_ids)
    stops = set(strip_ids)
    while solution and solution[-1] in stops:
        solution.pop()
    block = [*header_ids, *solution, *instruction_ids]
    return TeacherPrompt(ids=[*prompt_ids[:at], *block, *prompt_ids[at:]], insert_at=at, block=block)


def insertion_point(prompt_ids: Sequence[int], marker_ids: Sequence[int]) -> int:
    """The index of the last occurrence of marker_ids in prompt_ids (e.g. the tokens that close
    the user turn and open the assistant's), where the block goes."""
    m = len(marker_ids)
    for i in range(len(prompt_ids) - m, -1, -1):
        if list(prompt_ids[i : i + m]) == list(marker_ids):
            return i
    raise ValueError(f"marker {list(marker_ids)} not found in the prompt's {len(prompt_ids)} tokens")


def check_only_block_differs(
    student_ids: Sequence[int], teacher_ids: Sequence[int], block: Sequence[int] | None = None
):
    """Raise a one-line ValueError unless teacher_ids == student_ids[:a] + X + student_ids[a:] for
    some a, with X == block when block is given: the two contexts (prompts, or prompts + the
    teacher-forced o_w*) then differ by the inserted solution block alone. Returns a."""
    s, t = list(student_ids), list(teacher_ids)
    extra = len(t) - len(s)
    if extra < 0 or (block is not None and extra != len(block)):
        want = "at least as long as" if block is None else f"exactly {len(block)} tokens longer than"
        raise ValueError(f"teacher context ({len(t)} tokens) must be {want} the student's ({len(s)} tokens)")
    head = next((i for i in range(len(s)) if s[i] != t[i]), len(s))
    tail = next((j for j in range(len(s)) if s[len(s) - 1 - j] != t[len(t) - 1 - j]), len(s))
    if head + tail < len(s):
        raise ValueError(
            f"teacher and student contexts differ outside one inserted block: first difference at token {head}, "
            f"last at student token {len(s) - 1 - tail}"
        )
    # Any a in [len(s) - tail, head] splits them; with a block, find one where it fits exactly.
    for a in range(max(len(s) - tail, 0), head + 1):
        if block is None or t[a : a + extra] == list(block):
            return a
    raise ValueError("teacher context inserts tokens that are not the solution block")


def aux_positions(
    teacher_prompt_len: int, wrong_len: int, *, aux_max_len: int = 0, max_context: int, min_positions: int = 16
) -> int:
    """T_q = min(L_w*, aux_max_len) (0 = L_w*), cut so teacher prompt + T_q fits max_context;
    0 (skip the pair, log it) when fewer than min_positions remain (our choice)."""
    t = wrong_len if aux_max_len <= 0 else min(wrong_len, aux_max_len)
    t = min(t, max_context - teacher_prompt_len)
    return t if t >= min_positions else 0


def prediction_rows(prompt_len: int, positions: int) -> slice:
    """The logit rows of a sequence prompt + completion that predict completion tokens 0..T-1
    (row j predicts token j + 1): for the student, prompt_len = len(x); for the teacher, the
    teacher prompt's length. Both slices then align position by position."""
    return slice(prompt_len - 1, prompt_len - 1 + positions)


def _chunk_divergence(
    teacher_logits, student_logits, targets, *, kind, tau, beta, topk, vocab_size, group, temperature
) -> torch.Tensor:
    with torch.no_grad():
        zt = _vocab.scaled_logits(teacher_logits.detach(), vocab_size=vocab_size, group=group, temperature=temperature)
        outside = None
        if topk:
            outside = zt < _vocab.topk_threshold(zt, topk, group)
            zt = zt.masked_fill(outside, _vocab.PAD_LOGIT)
        logp = _vocab.log_softmax(zt, group)
    zs = _vocab.scaled_logits(student_logits, vocab_size=vocab_size, group=group, temperature=temperature)
    if outside is not None:
        zs = zs.masked_fill(outside, _vocab.PAD_LOGIT)
    logq = _vocab.log_softmax(zs, group)
    if kind == "rkl_sampled":
        # Value: log q(a) - log p(a), a single-sample estimate of KL(q || p) on o_w*'s tokens
        # (sampled from pi_old, i.e. the student at the step start). Gradient: sg(d) grad log q(a),
        # the score-function gradient of KL(q || p) (our choice; the direct grad log q(a) of the
        # value has mean 0 under q and only adds noise).
        lq = _vocab.select_columns(logq, targets, group)
        d = (lq - _vocab.select_columns(logp, targets, group)).detach()
        return d + d * (lq - lq.detach())
    p = torch.exp(logp)
    if kind in ("fkl", "fkl_clip"):
        term = p * (logp - logq)
        if kind == "fkl_clip":
            term = term.clamp(max=tau)  # pointwise: clipped vocabulary entries get no gradient
        return _vocab.sum_over_ranks(term.sum(dim=-1), group)
    if kind == "jsd":
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1 - beta))
        kl_pm = (p * (logp - logm)).sum(dim=-1)
        kl_qm = (torch.exp(logq) * (logq - logm)).sum(dim=-1)
        return _vocab.sum_over_ranks(beta * kl_pm + (1 - beta) * kl_qm, group)
    raise ValueError(f"divergence must be one of {DIVERGENCES}, got {kind!r}")


def divergence(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    kind: str = "fkl_clip",
    *,
    targets: torch.Tensor | None = None,
    tau: float = 0.05,
    beta: float = 0.5,
    topk: int = 0,
    vocab_size: int | None = None,
    group=None,
    temperature: float = 1.0,
    chunk_size: int = 256,
    recompute: bool = True,
) -> torch.Tensor:
    """d_t per position, [T] fp32 (fp64 for fp64 logits), differentiable in student_logits only.

    teacher_logits, student_logits [T, V_local]: this TP rank's vocab slice (see _vocab) at
    aligned positions (`prediction_rows`), any float dtype; the teacher side is detached here
    whatever the caller passes. targets [T]: o_w*'s tokens (rkl_sampled only). topk > 0: p and q
    restricted to the teacher's top-k tokens of the whole vocabulary and renormalised (ties at
    the k-th value are all kept). Runs chunk_size positions at a time; with recompute each chunk
    is activation-checkpointed (its softmax temporaries are rebuilt in backward, collectives
    included, identically on every TP rank), so fp32 [T, V_local] temporaries never sit whole.
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {kind!r}")
    if teacher_logits.shape != student_logits.shape or teacher_logits.dim() != 2:
        raise ValueError(
            f"teacher and student logits must be equal [T, V_local] shapes, got {tuple(teacher_logits.shape)}, "
            f"{tuple(student_logits.shape)}"
        )
    if kind == "rkl_sampled" and (targets is None or targets.shape != teacher_logits.shape[:1]):
        raise ValueError("divergence 'rkl_sampled' needs targets [T], the realised tokens of o_w*")
    if kind == "rkl_sampled" and topk:
        raise ValueError("topk restricts full-vocabulary divergences; rkl_sampled uses the realised token only")
    fn = functools.partial(
        _chunk_divergence,
        kind=kind,
        tau=tau,
        beta=beta,
        topk=topk,
        vocab_size=vocab_size,
        group=group,
        temperature=temperature,
    )
    if targets is None:
        targets = torch.zeros(teacher_logits.shape[0], dtype=torch.long, device=teacher_logits.device)
    parts = []
    for rows in _vocab.chunks(teacher_logits.shape[0], chunk_size):
        args = (teacher_logits[rows], student_logits[rows], targets[rows])
        if recompute and student_logits.requires_grad and torch.is_grad_enabled():
            parts.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            parts.append(fn(*args))
    if not parts:
        return student_logits.new_zeros(
            0, dtype=torch.float64 if student_logits.dtype == torch.float64 else torch.float32
        )
    return torch.cat(parts)


def aux_coefficients(
    omega: torch.Tensor, positions: torch.Tensor, *, num_prompts: float, prompt_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-position coefficient of each pair, [Q] float64: w_q omega_q / (B T_q), 0 where T_q = 0
    (skipped). omega, positions (T_q) and prompt_weight (w_q; None = 1) are [Q]. num_prompts B:
    the full-batch prompt count (prompts drawn, skipped ones included; with refill the trained
    groups' total weight). Then L_aux = sum_q coef_q sum_{t < T_q} d_{q,t}, a fixed-weight sum: split
    over micro-batches, pipeline stages or DP ranks, the partial sums add up to the same value."""
    if not num_prompts > 0:
        raise ValueError(f"num_prompts must be > 0, got {num_prompts!r}")
    w = omega.double() if prompt_weight is None else omega.double() * prompt_weight.double()
    t = positions.double()
    return torch.where(t > 0, w / (num_prompts * t.clamp(min=1)), torch.zeros_like(w))


def aux_loss(divergences: Sequence[torch.Tensor], coefficients: torch.Tensor) -> torch.Tensor:
    """L_aux = sum_q coefficients[q] * sum_t divergences[q][t] (pairs with no positions: empty)."""
    if len(divergences) != coefficients.shape[0]:
        raise ValueError(f"{len(divergences)} divergence rows for {coefficients.shape[0]} coefficients")
    total = coefficients.new_zeros((), dtype=torch.float32)
    for d, c in zip(divergences, coefficients.tolist()):
        if d.numel() and c:
            total = total + c * d.sum()
    return total
