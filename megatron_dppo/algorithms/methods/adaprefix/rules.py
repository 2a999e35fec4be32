"""AdaPrefix-GRPO: a feedback controller on the reference-solution prefix (docs/methods.md section 3).

Paper facts [paper]: each training problem has a reference solution; a correct prefix of it is
prepended to the assistant turn; the prefix length per problem is adjusted throughout training to
hold success near 50%; then the help is withdrawn; prefix tokens are loss-masked; the trainer is
otherwise stock. Everything else here is our choice:
  - state f_q in [0, 1], the fraction of the reference shown, f0 = 0 (`PrefixFractions`, JSON
    state for the checkpoint, beside the prompt history);
  - controller after each visit: f <- clip(f + eta (p* - p_hat), 0, min(f_cap, f_max(t))), p* = 0.5,
    eta = 0.5, p_hat this visit's success rate or an EMA of it (`PrefixFractions.update`);
  - withdrawal f_max(t): 1 before 0.5 T, linear to 0 at 0.8 T, then 0 (`withdrawal_cap`);
  - prefix l = snap(round(f |ref|)), snapped back to the end of a step (a token ending in a
    newline or the task's step separator; `prefix_length`);
  - answer cap f_cap = start of the line `margin` steps before the line holding the final answer,
    over |ref| (`answer_cap`): the answer is never given;
  - prompt + prefix + max_new_tokens > context: shrink the prefix, not the budget (`fit_prefix`).
With a thinking template the prefix follows the template's thinking opener ("<think>\\n" for
Qwen3 in thinking mode, `thinking_opener`), else it starts the assistant turn.
The prefix goes to vLLM as token ids (the reference is tokenised once, cut at a token boundary),
so the continuation's log-probs match between engine and trainer. The verifier sees prefix +
continuation. f_q must be fixed before the step's pruning draws (it is: the previous visit's).
Biased w.r.t. the unassisted objective (a curriculum); DPPO stays unbiased for the assisted loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megatron_dppo.algorithms.methods.configs import AdaPrefixConfig
from megatron_dppo.rewards.extract import THINK_OPEN

__all__ = [
    "AdaPrefixConfig",
    "PrefixFractions",
    "answer_cap",
    "assisted_prompt",
    "boundary_token_ids",
    "fit_prefix",
    "loss_mask",
    "prefix_length",
    "step_starts",
    "thinking_opener",
    "withdrawal_cap",
]

_STATE_VERSION = 1


class PrefixFractions:
    """Per-problem f_q (fraction of the reference shown) and the controller that moves it.
    Keyed by the prompt id (str), like PromptHistory; unseen problems have f0. state_dict() is
    JSON-serialisable: {"version": 1, "f0": f0, "prompts": {id: [f, p_ema, visits]}}."""

    def __init__(self, f0: float = 0.0):
        if not 0.0 <= f0 <= 1.0:
            raise ValueError(f"adaprefix f0 must be in [0, 1], got {f0!r}")
        self.f0 = float(f0)
        self._rows: dict[str, list] = {}  # id -> [f, p_ema (None before the first visit), visits]

    def __len__(self):
        return len(self._rows)

    def fraction(self, prompt_id) -> float:
        row = self._rows.get(str(prompt_id))
        return self.f0 if row is None else row[0]

    def visits(self, prompt_id) -> int:
        row = self._rows.get(str(prompt_id))
        return 0 if row is None else row[2]

    def update(self, prompt_id, success_rate: float, *, f_cap: float, f_max: float, cfg: AdaPrefixConfig) -> float:
        """After a visit with success rate p_hat (correct completions / G): returns the new f_q.
        f <- clip(f + eta (target - p_hat'), 0, min(f_cap, f_max)), p_hat' = p_hat, or with
        cfg.ema = beta > 0, beta p_hat'_prev + (1 - beta) p_hat (the first visit: p_hat)."""
        if not 0.0 <= success_rate <= 1.0:
            raise ValueError(f"success_rate of prompt {prompt_id!r} must be in [0, 1], got {success_rate!r}")
        pid = str(prompt_id)
        f, p_ema, visits = self._rows.get(pid, [self.f0, None, 0])
        p = success_rate if p_ema is None or cfg.ema == 0 else cfg.ema * p_ema + (1 - cfg.ema) * success_rate
        upper = max(0.0, min(f_cap, f_max, 1.0))
        f = min(max(f + cfg.eta * (cfg.target - p), 0.0), upper)
        self._rows[pid] = [f, p, visits + 1]
        return f

    def distribution(self) -> list[float]:
        """Every tracked f (log its histogram)."""
        return [r[0] for r in self._rows.values()]

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "f0": self.f0, "prompts": {k: list(r) for k, r in self._rows.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"adaprefix state: expected version {_STATE_VERSION}, got {got!r}")
        rows = {}
        for pid, row in state.get("prompts", {}).items():
            ok = (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], (int, float))
                and 0 <= row[0] <= 1
                and (row[1] is None or isinstance(row[1], (int, float)))
                and isinstance(row[2], int)
            )
            if not ok:
                raise ValueError(
                    f"adaprefix state: prompt {pid!r} must be [f in [0, 1], p_ema or null, visits], got {row!r}"
                )
            rows[str(pid)] = [float(row[0]), None if row[1] is None else float(row[1]), int(row[2])]
        self.f0 = float(state.get("f0", self.f0))
        self._rows = rows


def withdrawal_cap(step: int, total_steps: int, start: float = 0.5, end: float = 0.8) -> float:
    """f_max(t) (our choice; the paper's mechanism is unknown): 1 for t < start T, linear down to 0
    at end T, 0 after (the last part is plain GRPO). Evaluation is always unassisted."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    t = step / total_steps
    if t < start:
        return 1.0
    if t >= end:
        return 0.0
    return (end - t) / (end - start)


def boundary_token_ids(token_texts: Sequence[str] | Iterable[tuple[int, str]], chars: str = "\n") -> frozenset[int]:
    """Ids of the tokens whose text ends with one of `chars` (a prefix may end right after them).
    token_texts: the decoded text of every id (a list indexed by id, or (id, text) pairs), e.g.
    [tokenizer.decode([i]) for i in range(len(tokenizer))]."""
    pairs = enumerate(token_texts) if isinstance(token_texts, Sequence) else token_texts
    return frozenset(i for i, text in pairs if text and text[-1] in chars)


def step_starts(ref_ids: Sequence[int], boundary_ids: Iterable[int]) -> list[int]:
    """Token indices where a step of the reference starts: 0 and every index right after a
    boundary token (the end, len(ref), is not a start)."""
    bounds = set(boundary_ids)
    return [0] + [i + 1 for i, t in enumerate(ref_ids[:-1]) if t in bounds]


def _snap(n: int, ref_ids: Sequence[int], boundary_ids: Iterable[int]) -> int:
    """The largest step end <= n: a step start, or len(ref) itself."""
    if n >= len(ref_ids):
        return len(ref_ids)
    return max(s for s in step_starts(ref_ids, boundary_ids) if s <= n)


def prefix_length(f: float, ref_ids: Sequence[int], boundary_ids: Iterable[int]) -> int:
    """l = snap(round(f |ref|)): the number of reference tokens shown, moved back to the last
    step boundary (our choice), so the prefix ends after a whole step."""
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"prefix fraction must be in [0, 1], got {f!r}")
    return _snap(round(f * len(ref_ids)), ref_ids, boundary_ids)


def answer_cap(
    ref_ids: Sequence[int], boundary_ids: Iterable[int], *, answer_start: int | None = None, margin_steps: int = 1
) -> float:
    """f_cap (our choice): the fraction of the reference up to the start of the step
    `margin_steps` before the step holding the final answer, so the answer is never shown.
    answer_start: the token index where the final answer begins (None: it is in the last step).
    0 for a one-step reference (e.g. a bare answer): no help at all."""
    if not ref_ids:
        return 0.0
    starts = step_starts(ref_ids, boundary_ids)
    at = len(ref_ids) - 1 if answer_start is None else answer_start
    if not 0 <= at < len(ref_ids):
        raise ValueError(f"answer_start must be in [0, {len(ref_ids)}), got {answer_start!r}")
    answer_step = max(i for i, s in enumerate(starts) if s <= at)
    return starts[max(answer_step - margin_steps, 0)] / len(ref_ids)


def fit_prefix(
    prefix_len: int,
    *,
    prompt_len: int,
    max_new_tokens: int,
    max_model_len: int,
    ref_ids: Sequence[int],
    boundary_ids: Iterable[int],
) -> int:
    """Shrink the prefix, never the generation budget (our choice), when prompt + prefix +
    max_new_tokens would exceed the context: the longest step-snapped prefix that fits, 0 when
    even the bare prompt does not leave max_new_tokens (the data layer's overlong-prompt rule
    then applies)."""
    room = max_model_len - prompt_len - max_new_tokens
    if prefix_len <= room:
        return prefix_len
    return 0 if room <= 0 else _snap(room, ref_ids, boundary_ids)


def assisted_prompt(
    prompt_ids: Sequence[int],
    ref_ids: Sequence[int],
    f: float,
    *,
    boundary_ids: Iterable[int],
    f_cap: float,
    max_new_tokens: int,
    max_model_len: int,
    opener_ids: Sequence[int] = (),
) -> tuple[list[int], int]:
    """(token ids to give vLLM, the number of tokens added after the prompt). prompt_ids open the
    assistant turn (the rendered prompt with its generation prompt); when a prefix is shown,
    opener_ids (the template's thinking opener, `thinking_opener`: "<think>\\n" for Qwen3 in
    thinking mode, where the prefix goes: docs/methods.md 3.1.2) come first, then the reference prefix
    ref_ids[:l], with f clipped to f_cap (answer never shown) and l shrunk to fit the context.
    No prefix (empty ref_ids, or l = 0): the plain prompt, nothing added (the model opens its
    thinking itself)."""
    bounds = frozenset(boundary_ids)
    # round() is monotone and snapping only moves back: the prefix <= round(f_cap |ref|), the cap's step start.
    shown = prefix_length(min(f, f_cap), ref_ids, bounds) if ref_ids else 0
    shown = fit_prefix(
        shown,
        prompt_len=len(prompt_ids) + len(opener_ids),
        max_new_tokens=max_new_tokens,
        max_model_len=max_model_len,
        ref_ids=ref_ids,
        boundary_ids=bounds,
    )
    if shown == 0:
        return list(prompt_ids), 0
    added = [*opener_ids, *ref_ids[:shown]]
    return list(prompt_ids) + added, len(added)


def thinking_opener(assistant_opening: str, open_tag: str = THINK_OPEN) -> str:
    """The text that opens the template's thinking block at the assistant turn's start, where
    a prefix goes after it: "<think>\\n" when the opening (data.PromptRenderer.assistant_opening:
    "<think>\\n\\n</think>\\n\\n" for Qwen3 in thinking mode) starts with the tag (and a
    newline after it when the template writes one); "" otherwise (no thinking block, or the
    generation prompt already opened or closed it: the prefix goes at the prompt's end)."""
    if not assistant_opening.startswith(open_tag):
        return ""
    return open_tag + ("\n" if assistant_opening[len(open_tag) :].startswith("\n") else "")


def loss_mask(prefix_len: int, continuation_len: int) -> torch.Tensor:
    """bool [prefix_len + continuation_len] over the assistant turn: False on the prefix tokens
    (no gradient, [paper]), True on the generated continuation. When the prefix travels as part
    of the prompt segment (loss only on completion tokens), the existing completion-only loss
    already gives this mask; token-count denominators then count generated tokens only."""
    return torch.cat([torch.zeros(prefix_len, dtype=torch.bool), torch.ones(continuation_len, dtype=torch.bool)])
