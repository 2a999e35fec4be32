"""AdaPrefix-GRPO in the rollout: each problem's reference-solution prefix, held near 50% success.

The rules are algorithms/methods/adaprefix/rules.py's (pure, on token ids); this module adds what needs
the tokenizer and the data: each record's reference (data.solution_key, tokenised once and cut at
token boundaries, so vLLM continues from exactly the ids the trainer trains on), the step-boundary
token ids, the prompt vLLM gets (the rendered prompt + the template's thinking opener, if it opens
one at the assistant turn's start, + the prefix: the prefix is part of the
prompt segment, so the completion-only loss masks it and token counts are the generated tokens'),
the controller's update after every visit, and the state a checkpoint keeps.
"""

from __future__ import annotations

from megatron_dppo.algorithms.methods.adaprefix import rules as adaprefix
from megatron_dppo.data.prompts import PromptRecord, dotted_get


def reference_text(record: PromptRecord, key: str) -> str:
    """The record's worked reference solution at `key` (a dotted path in the row's other fields,
    extra_info, or "answer"); "" when it has none (that problem is trained unassisted)."""
    fields = {"answer": record.answer, **record.extra, "extra_info": record.extra_info}
    try:
        value = dotted_get(fields, key, "data.solution_key")
    except ValueError:
        return ""
    return value if isinstance(value, str) else str(value)


class PrefixCurriculum:
    """The run's AdaPrefix state and the tokenizer-side rules. One per rank; every rank makes the
    same updates (from the gathered groups), so the state agrees everywhere."""

    def __init__(self, cfg, tokenizer, total_steps: int, assistant_opening: str = ""):
        """assistant_opening: data.PromptRenderer.assistant_opening(), what the chat template
        writes at the assistant turn's start; its thinking opener precedes every prefix."""
        self.cfg, self.key, self.total_steps = cfg.algorithm.adaprefix, cfg.data.solution_key, total_steps
        self.max_new_tokens, self.max_model_len = cfg.rollout.max_new_tokens, cfg.rollout.max_model_len
        self.tokenizer = tokenizer
        opener = adaprefix.thinking_opener(assistant_opening)
        self.opener_ids = tokenizer(opener, add_special_tokens=False)["input_ids"] if opener else []
        self.fractions = adaprefix.PrefixFractions(self.cfg.f0)
        texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        self.boundary_ids = adaprefix.boundary_token_ids(texts, self.cfg.boundaries)
        self._refs: dict[str, tuple[list[int], float]] = {}  # id -> (reference ids, f_cap)

    def _reference(self, record: PromptRecord) -> tuple[list[int], float]:
        if record.id not in self._refs:
            text = reference_text(record, self.key)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            cap = adaprefix.answer_cap(ids, self.boundary_ids, margin_steps=self.cfg.answer_margin_steps)
            self._refs[record.id] = (ids, cap)
        return self._refs[record.id]

    def f_max(self, step: int) -> float:
        return adaprefix.withdrawal_cap(step, self.total_steps, self.cfg.withdraw_start, self.cfg.withdraw_end)

    def assisted(self, record: PromptRecord, prompt_ids: list[int], step: int) -> tuple[list[int], int]:
        """(the ids vLLM continues from, the number of tokens after the prompt: the thinking
        opener, if the template has one, and the reference prefix; no loss on any of them)."""
        ids, cap = self._reference(record)
        if not ids:
            return list(prompt_ids), 0
        f = min(self.fractions.fraction(record.id), self.f_max(step))
        return adaprefix.assisted_prompt(
            prompt_ids,
            ids,
            f,
            boundary_ids=self.boundary_ids,
            f_cap=cap,
            max_new_tokens=self.max_new_tokens,
            max_model_len=self.max_model_len,
            opener_ids=self.opener_ids,
        )

    def observe(self, groups, step: int) -> dict:
        """The controller's step after each visit (this step's groups, success before shaping);
        returns metrics of the state."""
        for g in groups:
            ids, cap = self._reference(g.record)
            if ids:
                correct = g.correct()
                self.fractions.update(
                    g.record.id, sum(correct) / len(correct), f_cap=cap, f_max=self.f_max(step), cfg=self.cfg
                )
        fs = self.fractions.distribution()
        prefix = [g.prefix_len for g in groups]
        # What the controller steers: the success rate of this step's assisted groups.
        assisted = [sum(c) / len(c) for g in groups if g.prefix_len > 0 for c in [g.correct()]]
        success = {"adaprefix/assisted_success": sum(assisted) / len(assisted)} if assisted else {}
        return {
            **success,
            "adaprefix/assisted_frac": len(assisted) / len(groups) if groups else 0.0,
            "adaprefix/f_mean": sum(fs) / len(fs) if fs else 0.0,
            "adaprefix/f_nonzero_frac": sum(f > 0 for f in fs) / len(fs) if fs else 0.0,
            "adaprefix/prefix_tokens_mean": sum(prefix) / len(prefix) if prefix else 0.0,
            "adaprefix/f_max": self.f_max(step),
        }

    def state_dict(self) -> dict:
        return self.fractions.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.fractions.load_state_dict(state)
