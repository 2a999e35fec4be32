"""Validation: avg@n, pass@k and maj@n per set and data_source, and a dump of every answer.

The sets: `data.eval` (the set "eval") and `eval.sets` (name -> path), in any format and layout
data.py reads; each set's first trainer.eval_size prompts. Every prompt gets eval.n completions
(eval.temperature 0 with n=1 is greedy), scored by the run's reward scorer. A completion is
correct when its reward is >= 1 - 1e-6 (the trainer's reward/accuracy uses the same rule).
Per prompt with c correct of n:
  avg@n   c / n, the mean accuracy of a sample (= the unbiased pass@1)
  pass@k  1 - C(n-c, k) / C(n, k), Chen et al. 2021's unbiased estimator of "one of k samples is
          correct", computed as their product form 1 - prod_{i=n-c+1..n} (1 - k/i) (no huge binomials)
  maj@n   majority vote over the completions' final answers (extract_answer; empty answers do not
          vote): the correctness of the most frequent answer. Ties are not broken by order: the
          value is the mean correctness of the tied answers (the expected result of breaking the
          tie at random); an answer's correctness is the mean over its completions (they agree
          when the verifier reads only the final answer). No answer at all: 0.
Each metric is the mean over prompts, logged as val/<set>/<data_source>/<metric> for every
data_source the set has and val/<set>/all/<metric>. As in the training reward metrics
(rewards/metrics.py), records without a data_source are "unknown" in a set where others have one,
and a set where none has one gets only "all".
`eval/accuracy` (the progress bar, tools/compare_methods.py) is avg@n of the first set's "all":
with the default n=1, temperature 0 that is the greedy pass@1 it always was.

Every answer is written to <dump_dir>/step_<N>.jsonl (the trainer: <run_dir>/val/), one row per
completion: set, index (the prompt's place in its set), prompt_id, data_source, sample, prompt
(the rendered text), completion (decoded), answer (gold), extracted, reward, correct,
finish_reason, tokens. metrics_from_rows() turns such rows back into the metrics.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_dppo.data.prompts import PromptRecord, PromptRenderer, check_prompt_lengths, load_records
from megatron_dppo.data.tasks import write_jsonl
from megatron_dppo.rewards import answer_after_thinking, gsm8k_final, last_boxed
from megatron_dppo.rewards.metrics import NO_SOURCE

CORRECT = 1.0 - 1e-6  # reward >= this counts as correct
ALL = "all"

# generate(prompt_ids, n=, temperature=, top_p=, seeds=) -> completions[i][k] with .token_ids
# and .finish_reason (rollout.vllm_engine.Completion); engine_generate() builds one.
GenerateFn = Callable[..., list]


@dataclass
class EvalSet:
    name: str
    path: object  # a path, or the list of paths data.py accepts
    records: list[PromptRecord]


def eval_set_paths(cfg) -> dict:
    """{set name: path}: data.eval as the set "eval" first, then eval.sets in their order."""
    sets = {"eval": cfg.data.eval} if cfg.data.eval else {}
    sets.update(cfg.eval.sets)
    return sets


def load_eval_sets(
    cfg, renderer: PromptRenderer, max_prompt_tokens: int, skip: bool, limit_desc: str, warnings: list | None = None
):
    """Each set's first trainer.eval_size records, length-checked like the training prompts;
    `warnings`, if given, gets the sets' mostly-unknown-token prompts as the training data does."""
    out = []
    for name, path in eval_set_paths(cfg).items():
        records = load_records(path, cfg.data.prompt_key, cfg.data.answer_key)[: cfg.trainer.eval_size]
        records, _ = check_prompt_lengths(
            records, renderer, max_prompt_tokens, path, skip=skip, limit_desc=limit_desc, warnings=warnings
        )
        named_all = next((r for r in records if r.data_source == ALL), None)
        if named_all is not None:
            raise ValueError(f"{named_all.source}: data_source {ALL!r} is reserved (val/<set>/all/ is every source)")
        out.append(EvalSet(name, path, records))
    return out


def engine_generate(engine, max_new_tokens: int, stop: Sequence[str] | None = None) -> GenerateFn:
    """A GenerateFn over a RolloutEngine, with the run's length limit and stop strings."""

    def generate(prompt_ids, *, n, temperature, top_p, seeds):
        return engine.generate(
            prompt_ids,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seeds=seeds,
            stop=list(stop) if stop else None,
        )

    return generate


# ---- the estimators -----------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def extract_answer(text: str) -> str:
    """The final answer a completion gives, for majority voting: the text after the last </think>
    (a thinking model answers after its thinking; "" when the thinking never closed), then its last
    \\boxed{...}, else the text after its last "####", else all of it; whitespace stripped. String
    equality decides which answers agree (no symbolic normalisation: "1/2" and "0.5" are two)."""
    text = answer_after_thinking(text)
    if text is None:  # still thinking when it stopped: no answer to vote with
        return ""
    found = last_boxed(text)
    if found is None:
        found = gsm8k_final(text)
    return (text if found is None else found).strip()


def majority_correct(answers: Sequence[str], correct: Sequence[bool]) -> float:
    """maj@n of one prompt (module docstring: ties averaged, empty answers do not vote)."""
    votes = Counter(a for a in answers if a)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, count in votes.items() if count == top]
    return sum(sum(c for a2, c in zip(answers, correct) if a2 == a) / top for a in winners) / len(winners)


# ---- metrics ------------------------------------------------------------------------------------
def prompt_scores(rows: list[dict], pass_k: Sequence[int]) -> list[tuple[str, str, dict]]:
    """[(set, data_source, {metric: value})] per prompt, from dump rows (any order)."""
    by_prompt: dict[tuple, list[dict]] = {}
    for r in rows:
        by_prompt.setdefault((r["set"], r["index"]), []).append(r)
    out = []
    for (set_name, _), samples in by_prompt.items():
        n, c = len(samples), sum(bool(s["correct"]) for s in samples)
        values = {
            f"avg@{n}": c / n,
            f"maj@{n}": majority_correct([s["extracted"] for s in samples], [s["correct"] for s in samples]),
        }
        for k in pass_k:
            values[f"pass@{k}"] = pass_at_k(n, c, k)
        out.append((set_name, samples[0]["data_source"], values))
    return out


def metrics_from_rows(rows: list[dict], pass_k: Sequence[int], default_set: str | None = None) -> dict:
    """{val/<set>/<source>/<metric>: mean over prompts} (and val/<set>/all/...), plus
    eval/accuracy = avg@n of default_set's "all" when given."""
    scores = prompt_scores(rows, pass_k)
    with_sources = {set_name for set_name, source, _ in scores if source}
    groups: dict[str, list[dict]] = {}
    for set_name, source, values in scores:
        for group in [ALL] + ([source or NO_SOURCE] if set_name in with_sources else []):
            groups.setdefault(f"val/{set_name}/{group}", []).append(values)
    metrics = {}
    for prefix, per_prompt in groups.items():
        for name in per_prompt[0]:
            metrics[f"{prefix}/{name}"] = sum(v[name] for v in per_prompt) / len(per_prompt)
    if default_set is not None:
        avg = [v for k, v in metrics.items() if k.startswith(f"val/{default_set}/{ALL}/avg@")]
        if avg:
            metrics["eval/accuracy"] = avg[0]
    return metrics


# ---- one validation pass ------------------------------------------------------------------------
def validation_seed(seed: int, set_name: str, rec_id: str) -> int:
    """A prompt's sampling seed: the same at every validation (less noise between steps) and on
    any engine."""
    from megatron_dppo.rollout.vllm_engine import request_seed

    return request_seed("eval", seed, set_name, rec_id)


def _score_slice(mine, outs, scorer, renderer: PromptRenderer) -> list[dict]:
    """Dump rows of this engine's (set, index, record) items and their completions."""
    completions = [c for group in outs for c in group]
    texts = renderer.decode_all([c.token_ids for c in completions])
    n = len(outs[0]) if outs else 0
    recs = [rec for _, _, rec in mine for _ in range(n)]
    rewards, _ = scorer.score(texts, [r.answer for r in recs], recs)
    rows = []
    for q, (set_name, index, rec) in enumerate(mine):
        prompt_text = renderer.text(rec)
        for k in range(n):
            j = q * n + k
            rows.append(
                {
                    "set": set_name,
                    "index": index,
                    "prompt_id": rec.id,
                    "data_source": rec.data_source,
                    "sample": k,
                    "prompt": prompt_text,
                    "completion": texts[j],
                    "answer": rec.answer,
                    "extracted": extract_answer(texts[j]),
                    "reward": float(rewards[j]),
                    "correct": float(rewards[j]) >= CORRECT,
                    "finish_reason": completions[j].finish_reason,
                    "tokens": len(completions[j].token_ids),
                }
            )
    return rows


def run_validation(
    sets: list[EvalSet],
    *,
    generate: GenerateFn,
    scorer,
    renderer: PromptRenderer,
    cfg,
    step: int,
    dump_dir: str | None,
    seed: int = 0,
    engine_index: int = 0,
    num_engines: int = 1,
    engine_leader: bool = True,
    gather: Callable[[object], list] | None = None,
    is_main: bool = True,
) -> dict:
    """Generate, score, dump and measure every set once; -> metrics (the same on every rank).

    cfg is the eval section (n, temperature, top_p, pass_k). The prompts of all sets are split in
    contiguous slices over the engines, as the trainer splits a rollout: every rank of engine k
    (engine_index) generates slice k with the same seeds, its leader scores it, and `gather`
    (distributed.all_gather_objects: collective, every rank calls it) collects the rows. The
    main rank writes <dump_dir>/step_<step:06d>.jsonl (dump_dir None: no dump)."""
    if gather is None:
        from megatron_dppo.run.collectives import all_gather_objects as gather
    items = [(s.name, i, rec) for s in sets for i, rec in enumerate(s.records)]
    per = math.ceil(len(items) / num_engines) if items else 0
    mine = items[engine_index * per : (engine_index + 1) * per]
    rows, error = [], None
    if mine:
        outs = generate(
            [renderer.token_ids(rec) for _, _, rec in mine],
            n=cfg.n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seeds=[validation_seed(seed, name, rec.id) for name, _, rec in mine],
        )
        if engine_leader:
            try:
                rows = _score_slice(mine, outs, scorer, renderer)
            except Exception as e:  # every rank must learn of it, or the others hang in the gather
                error = f"validation at step {step}: {e}"
    parts = gather((rows, error))
    errors = [e for _, e in parts if e]
    if errors:
        raise RuntimeError(errors[0])
    all_rows = [r for part, _ in parts for r in part]
    if is_main and dump_dir is not None:
        write_jsonl(all_rows, os.path.join(dump_dir, f"step_{step:06d}.jsonl"))  # written whole
    return metrics_from_rows(all_rows, cfg.pass_k, default_set=sets[0].name if sets else None)


def read_dump(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
