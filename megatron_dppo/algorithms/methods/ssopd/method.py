"""SSOPD as the step's auxiliary loss (algorithm.aux=ssopd): each mixed group's longest wrong
completion distilled from the policy conditioned on its shortest correct one."""

from __future__ import annotations

import torch

from megatron_dppo.algorithms.methods.base import AuxLoss
from megatron_dppo.algorithms.methods.ssopd import distill, rules


class SSOPD(AuxLoss):
    name, section = "ssopd", "ssopd"

    def pairs(self, method, groups):
        """Each mixed group's pair, chosen from the FULL group (before completion pruning):
        shortest correct c*, longest wrong w* (rules.select_pair), with the frontier weight
        omega; groups without a pair (not mixed, or a too-short correct witness) have none."""
        if not groups:
            return []
        verdicts = torch.tensor([g.correct() for g in groups], dtype=torch.float32)
        lengths = torch.tensor([g.completion_lengths() for g in groups])
        terminated = ~torch.tensor([g.truncated or [False] * g.group_size for g in groups], dtype=torch.bool)
        cfg = self.cfg
        sel = rules.select_pair(
            verdicts, lengths, terminated=terminated, wrong_pool=cfg.wrong_pool, min_correct_len=cfg.min_correct_len
        )
        omega = rules.frontier_weight(verdicts, cfg.frontier)
        return [
            distill.AuxPair(g, int(c), int(w), float(o))
            for g, c, w, o in zip(groups, sel.correct.tolist(), sel.wrong.tolist(), omega.tolist())
            if c >= 0 and w >= 0 and o > 0
        ]

    def tokens(self, tokenizer, renderer):
        def ids(text):
            return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

        return distill.AuxTokens(
            header=ids(self.cfg.solution_header),
            instruction=ids(self.cfg.instruction),
            strip=[t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None],
            suffix=ids(renderer.generation_suffix()),  # the block goes before it
        )

    def pack(self, minibatches, *, tokens, layout, max_context):
        """Each mini-batch's teacher/student micro-batches (distill.aux_microbatches)."""
        pairs = skipped = positions = 0
        for mb in minibatches:
            mb.aux_microbatches, stats = distill.aux_microbatches(
                mb.aux_pairs,
                cfg=self.cfg,
                num_prompts=mb.num_prompts,
                tokens=tokens,
                layout=layout,
                max_context=max_context,
            )
            pairs, skipped, positions = pairs + stats.pairs, skipped + stats.skipped, positions + stats.positions
        return {"ssopd/pairs": pairs, "ssopd/skipped": skipped, "ssopd/positions": positions}

    def check(self, cfg, strategy, recipe):
        if cfg.parallel.pp > 1:
            raise ValueError(
                "config keys 'algorithm.aux' and 'parallel.pp': ssopd's teacher and student share a micro-batch on "
                f"the last stage; pipeline parallelism is not supported with it yet (parallel.pp={cfg.parallel.pp})"
            )

    def inert_keys(self, cfg):
        out = {}
        for name, div in (("tau", "fkl_clip"), ("jsd_beta", "jsd")):
            if self.cfg.div != div:
                out[f"algorithm.ssopd.{name}"] = f"algorithm.ssopd.div={self.cfg.div} (it acts with div={div})"
        return out
