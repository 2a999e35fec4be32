"""AdaPrefix-GRPO as the step's curriculum (algorithm.curriculum=adaprefix): each problem's
rollouts continue a prefix of its reference solution, its length held near 50% success."""

from __future__ import annotations

from megatron_dppo.algorithms.methods.base import Curriculum


class AdaPrefix(Curriculum):
    name, section = "adaprefix", "adaprefix"

    def build(self, cfg, *, records, tokenizer, renderer):
        """records: the training records; renderer: data.PromptRenderer, whose assistant_opening()
        (what the chat template writes at the assistant turn's start) has the thinking opener
        that precedes every prefix."""
        from megatron_dppo.algorithms.methods.adaprefix.curriculum import PrefixCurriculum, reference_text

        key = cfg.data.solution_key
        if not any(reference_text(r, key) for r in records):
            raise ValueError(
                f"config key 'data.solution_key': algorithm.curriculum=adaprefix needs a reference solution per "
                f"problem, and no record of {cfg.data.train} has {key!r}"
            )
        opening = renderer.assistant_opening()
        return PrefixCurriculum(cfg, tokenizer, cfg.trainer.max_steps, assistant_opening=opening)

    def input_warnings(self, cfg, tokenizer):
        from megatron_dppo.algorithms.methods.adaprefix.rules import boundary_token_ids

        texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        if boundary_token_ids(texts, self.cfg.boundaries):
            return []
        return [
            f"warning: algorithm.adaprefix.boundaries={self.cfg.boundaries!r} is inert: no token of the "
            f"tokenizer of model.hf_dir {cfg.model.hf_dir} ends in one of these characters, so no prefix is "
            "ever cut (name characters its tokens end in)"
        ]

    def check(self, cfg, strategy, recipe):
        if not cfg.data.solution_key:
            raise ValueError(
                "config key 'data.solution_key': algorithm.curriculum=adaprefix needs a reference solution"
            )

    def inert_keys(self, cfg):
        return {}
