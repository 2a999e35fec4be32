"""SSOPD's auxiliary micro-batches: each mixed group's teacher/student pair, packed for the policy.

The rules are algorithms/methods/ssopd/rules.py's. Here they meet token ids and packing: for a pair
(c* = shortest correct, w* = longest wrong of the FULL group, chosen in algorithms/batch.py),
    teacher sequence  T(x, o_c*) + o_w*[:T_q]   (the prompt with the solution block inserted after
                                                 the problem text, before the chat template's end of
                                                 the user turn and generation prompt: `problem_end`)
    student sequence  x + o_w*[:T_q]             (the ordinary training sequence, cut at T_q)
go into ONE packed micro-batch, adjacent, so that the last pipeline stage's loss sees both sets of
logits: the teacher's (detached: the policy itself under stop-gradient [3rd], with the weights of
the update it runs in; the step's first update has pi_old's) and the student's (with gradient). The
GRPO loss of these sequences is off (their loss mask is 0); AuxRows carry the rows to compare.
Packs of pairs are spread over data-parallel ranks like the GRPO packs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_dppo.algorithms import packing
from megatron_dppo.algorithms.methods.ssopd import rules as ssopd
from megatron_dppo.algorithms.records import Group


@dataclass
class AuxPair:
    """One mixed group's pair (indices into its completions) and its frontier weight omega."""

    group: Group
    correct: int
    wrong: int
    omega: float


@dataclass(frozen=True)
class AuxTokens:
    """The token ids the teacher prompt is built from: the solution block's header and
    instruction, the ids stripped from the end of the correct completion (eos / end of turn), and
    the chat template's generation suffix (the end of the user turn and the assistant's
    generation prompt, tokenised alone; the block goes before it, after the problem text)."""

    header: list[int]
    instruction: list[int]
    strip: list[int]
    suffix: list[int] = field(default_factory=list)


@dataclass
class AuxStats:
    pairs: int = 0  # pairs distilled
    skipped: int = 0  # pairs with fewer than min_positions positions once fitted to the context
    positions: int = 0  # distilled positions (sum of T_q)


def problem_end(prompt_ids, prefix_len: int, suffix_ids) -> int:
    """Where the problem text ends in a group's prompt: before the chat template's generation
    suffix (data.PromptRenderer.generation_suffix, tokenised: the end of the user turn and the
    assistant's generation prompt; none for raw prompts), which ends the rendered prompt; an
    AdaPrefix prefix (the last prefix_len ids, thinking opener included) comes after it."""
    rendered = len(prompt_ids) - prefix_len
    start = rendered - len(suffix_ids)
    if start < 0 or list(prompt_ids[start:rendered]) != list(suffix_ids):
        raise ValueError(
            f"SSOPD: the prompt's {rendered} rendered tokens do not end with the chat template's generation "
            f"suffix {list(suffix_ids)} (tokenised alone), so the problem's end cannot be found"
        )
    return start


def _sequences(pair: AuxPair, cfg, tokens: AuxTokens, max_context: int):
    """(teacher Sample, student Sample, teacher prompt length, T_q) or None when skipped."""
    g = pair.group
    wrong = list(g.completions[pair.wrong])
    correct = g.completions[pair.correct]
    tp = ssopd.teacher_prompt(
        g.prompt_ids,
        correct,
        header_ids=tokens.header,
        instruction_ids=tokens.instruction,
        insert_at=problem_end(g.prompt_ids, g.prefix_len, tokens.suffix),
        strip_ids=tokens.strip,
    )
    T = ssopd.aux_positions(
        len(tp.ids), len(wrong), aux_max_len=cfg.aux_max_len, max_context=max_context, min_positions=cfg.min_positions
    )
    if T == 0:
        return None
    ssopd.check_only_block_differs(g.prompt_ids + wrong[:T], tp.ids + wrong[:T], tp.block)

    def sample(prompt):
        return packing.Sample(tokens=prompt + wrong[:T], prompt_len=len(prompt), weight=0.0, loss_mask=[0.0] * T)

    return sample(tp.ids), sample(list(g.prompt_ids)), len(tp.ids), T


def aux_microbatches(
    pairs: list[AuxPair], *, cfg, num_prompts: float, tokens: AuxTokens, layout: packing.PackLayout, max_context: int
):
    """This rank's SSOPD micro-batches for one mini-batch, and what they hold.
    cfg: algorithm.ssopd; num_prompts: B of the mini-batch (the aux loss is (1/B) sum_q ...);
    layout: this rank's packing (its capacity, window, DP place, padding); max_context: the
    longest sequence (rollout.max_model_len) a teacher sequence is cut to fit."""
    built, stats = [], AuxStats()
    for p in pairs:
        seqs = _sequences(p, cfg, tokens, max_context)
        if seqs is None:
            stats.skipped += 1
            continue
        built.append((p, *seqs))
    if not built:
        return [], stats
    coef = pair_coefficients([p for p, *_ in built], [T for *_, T in built], num_prompts, cfg.coef)
    stats.pairs, stats.positions = len(built), sum(T for *_, T in built)
    pad = layout.pad_multiple
    lengths = [packing.round_up(len(t.tokens), pad) + packing.round_up(len(s.tokens), pad) for _, t, s, _, _ in built]
    if max(lengths) > layout.capacity:
        raise ValueError(
            f"an SSOPD teacher/student pair of {max(lengths)} tokens does not fit trainer.max_tokens_per_microbatch="
            f"{layout.capacity}: raise it or set algorithm.ssopd.aux_max_len"
        )
    packs = packing.pack(lengths, layout.capacity, layout.window)
    mine = packing.balance_packs(packs, lengths, layout.dp_size)[layout.dp_rank]
    return [_build(built, coef, p, pad, layout.pad_id) for p in mine], stats


def pair_coefficients(pairs: list[AuxPair], positions: list[int], num_prompts: float, lam: float) -> torch.Tensor:
    """Each pair's per-position coefficient lambda * w_q * omega_q / (B * T_q), [Q] float64: w_q is
    the group's trained weight (DPPO's prompt weight, or its refill share), so the aux loss is a
    fixed-weight sum that DPPO's pruning keeps unbiased (verify-unbiased --method ssopd)."""
    omega = torch.tensor([p.omega for p in pairs], dtype=torch.float64)
    w_q = torch.tensor([p.group.train_weight for p in pairs], dtype=torch.float64)
    T = torch.tensor(positions, dtype=torch.float64)
    return ssopd.aux_coefficients(omega, T, num_prompts=num_prompts, prompt_weight=w_q) * lam


def _build(built, coef, pack: list[int], pad_multiple: int, pad_id: int):
    """One packed micro-batch of whole pairs (teacher then student) with their AuxRows; an empty
    pack (fewer pairs than ranks' slots) is a no-op micro-batch every rank still steps through."""
    if not pack:
        filler = packing.Sample(tokens=[pad_id, pad_id], prompt_len=2, weight=0.0)
        return packing.build_thd_batch([filler], pad_multiple=pad_multiple, pad_id=pad_id)
    samples = [s for i in pack for s in built[i][1:3]]
    batch = packing.build_thd_batch(samples, pad_multiple=pad_multiple, pad_id=pad_id)
    starts = batch.cu_seqlens_padded.tolist()
    t_rows, s_rows, targets, c = [], [], [], []
    for k, i in enumerate(pack):
        _, teacher, student, teacher_len, T = built[i]
        t0, s0 = starts[2 * k], starts[2 * k + 1]
        t_rows += range(t0 + teacher_len - 1, t0 + teacher_len - 1 + T)  # ssopd.prediction_rows
        s_rows += range(s0 + student.prompt_len - 1, s0 + student.prompt_len - 1 + T)
        targets += list(student.tokens[student.prompt_len :])
        c += [float(coef[i])] * T
    batch.aux = packing.AuxRows(
        teacher_rows=torch.tensor(t_rows, dtype=torch.long),
        student_rows=torch.tensor(s_rows, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        coef=torch.tensor(c, dtype=torch.float64),
    )
    return batch
