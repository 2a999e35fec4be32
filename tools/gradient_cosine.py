#!/usr/bin/env python
"""BPPO's premise on a tiny model: are per-completion policy gradients of the same class nearly
parallel, and correct-vs-incorrect ones distinct? (docs/methods.md 1.4: the BPPO paper reports
such a gradient-similarity diagnostic; its numbers were not seen.)

    .venv/bin/python tools/gradient_cosine.py                        # long-tailed task, 32 prompts x 8
    .venv/bin/python tools/gradient_cosine.py --model examples/tiny/model --data examples/tiny/data/train.jsonl
    .venv/bin/python tools/gradient_cosine.py --quick                # addition, seconds: format and self-check

For each prompt, G completions are sampled from the HF model at --temperature (the tiny models'
character tokenizer; tools/make_tiny_model.py's sampling loop) and scored with the task's
verifier (megatron_dppo.data.tasks, task from the record id). For each completion o_i the vector
g_i = grad_theta log pi(o_i | x) over every parameter (EOS included when it ended), and within
each MIXED group the cosine of every pair: correct-correct, incorrect-incorrect, correct-incorrect,
and BPPO's own pair (shortest correct, shortest incorrect). The policy-gradient contribution of o_i
is A_i g_i, so for a correct-incorrect pair (A of opposite signs) the cosine of the contributions is
minus the printed one; within a class it is the printed one. Cosine ignores each vector's scale, so
sum and mean over tokens give the same numbers.

Rows print the mean over groups of each group's mean pair cosine, with its standard error over
groups (groups are independent; pairs within a group are not). The self-check recomputes the
first completion's gradient from scratch: its cosine with the first computation must be 1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from megatron_dppo.run.quiet import quiet_libraries

quiet_libraries()  # before torch and transformers load: some of its settings are read at import

import torch

from megatron_dppo.data.tasks import get_task

# "distinct": pairs of different token sequences only (two copies of one completion have one gradient).
ROWS = (
    "correct-correct",
    "correct-correct, distinct",
    "incorrect-incorrect",
    "incorrect-incorrect, distinct",
    "same class",
    "correct-incorrect",
    "BPPO pair",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="HF model dir (default: the long-tailed task's; --quick: addition's)")
    p.add_argument("--data", default="", help="JSONL prompts (default: the model's task's train.jsonl)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=134)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="", help="also write the numbers to this file")
    p.add_argument("--quick", action="store_true", help="addition, 4 prompts x 4, 8 new tokens: seconds")
    args = p.parse_args(argv)
    task_dir = REPO / "examples/tiny" / ("" if args.quick else "longtail")
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens = 4, 4, 8
    args.model = args.model or str(task_dir / "model")
    args.data = args.data or str(task_dir / ("data/train.jsonl" if args.quick else "train.jsonl"))
    return args


def load_records(path: str, n: int, seed: int) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return random.Random(seed).sample(records, min(n, len(records)))


def sample_group(model, codec, record, g, max_new_tokens, seed, temperature) -> list[list[int]]:
    """G completions (token ids, EOS appended when the completion ended before the budget)."""
    from make_tiny_model import greedy_completions

    if temperature != 1.0:
        raise ValueError("--temperature: the tiny models' sampling loop samples at temperature 1 only")
    rows = greedy_completions(model, [record] * g, codec, max_new_tokens, kv_cache=True, sample_seed=seed)
    model.eval()  # greedy_completions leaves the model in train mode
    return [row + [codec.eos] if len(row) < max_new_tokens else row for row in rows]


def completion_gradient(model, prompt_ids, completion_ids, temperature) -> torch.Tensor:
    """grad_theta of sum_t log pi(completion_t | prefix), flattened over every parameter, fp64."""
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt_ids) :, None]).sum()
    logp.backward()
    return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


def group_cosines(grads, rewards, completions) -> dict[str, list[float]]:
    """Every pair's cosine of one group, by row name (completions: token-id lists)."""
    out = {k: [] for k in ROWS}
    n = len(grads)
    for i in range(n):
        for j in range(i + 1, n):
            c = cosine(grads[i], grads[j])
            if rewards[i] != rewards[j]:
                out["correct-incorrect"].append(c)
                continue
            out["correct-correct" if rewards[i] else "incorrect-incorrect"].append(c)
            out["same class"].append(c)
            if completions[i] != completions[j]:
                out[("correct-correct" if rewards[i] else "incorrect-incorrect") + ", distinct"].append(c)
    correct = [i for i in range(n) if rewards[i]]
    wrong = [i for i in range(n) if not rewards[i]]
    if correct and wrong:  # shortest of each, ties to the lowest index, as bppo.select_pairs
        c = min(correct, key=lambda i: (len(completions[i]), i))
        w = min(wrong, key=lambda i: (len(completions[i]), i))
        out["BPPO pair"].append(cosine(grads[c], grads[w]))
    return out


def mean_and_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def measure(args) -> dict:
    from make_tiny_model import CharCodec
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar of every from_pretrained

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    codec = CharCodec(tokenizer)
    per_group = {k: [] for k in ROWS}  # each group's mean cosine, by row
    pairs = {k: 0 for k in ROWS}
    correct_total = completions = mixed = 0
    self_cos = math.nan
    for q, record in enumerate(load_records(args.data, args.prompts, args.seed)):
        task = get_task(record["id"].split("-")[0])
        prompt_ids = [codec.bos] + codec.ids(record["prompt"])
        seed = args.seed * 100003 + q
        group = sample_group(model, codec, record, args.group_size, args.max_new_tokens, seed, args.temperature)
        rewards = [task.score(codec.text(c), record["answer"]) >= 0.5 for c in group]
        correct_total += sum(rewards)
        completions += len(group)
        if math.isnan(self_cos):
            first = completion_gradient(model, prompt_ids, group[0], args.temperature)
            again = completion_gradient(model, prompt_ids, group[0], args.temperature)
            self_cos = cosine(first, again)
        if not 0 < sum(rewards) < len(rewards):
            continue
        mixed += 1
        grads = [completion_gradient(model, prompt_ids, c, args.temperature) for c in group]
        for name, values in group_cosines(grads, rewards, group).items():
            if values:
                per_group[name].append(sum(values) / len(values))
                pairs[name] += len(values)
    rows = {}
    for name in ROWS:
        mean, se = mean_and_se(per_group[name])
        rows[name] = {"groups": len(per_group[name]), "pairs": pairs[name], "mean": mean, "se": se}
    return {
        "model": args.model,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "mixed_groups": mixed,
        "completions": completions,
        "accuracy": correct_total / max(completions, 1),
        "rows": rows,
        "self_cosine": self_cos,
    }


def report(result: dict) -> str:
    lines = [
        f"gradient cosine: {result['model']}: {result['prompts']} prompts x G={result['group_size']}, "
        f"{result['mixed_groups']} mixed groups, sampled accuracy {result['accuracy']:.3f}",
        f"{'pairs':<32}{'groups':>8}{'pairs':>8}{'mean cos':>11}{'s.e.':>9}",
    ]
    for name, r in result["rows"].items():
        mean = "n/a" if math.isnan(r["mean"]) else f"{r['mean']:.4f}"
        se = "n/a" if math.isnan(r["se"]) else f"{r['se']:.4f}"
        lines.append(f"{name:<32}{r['groups']:>8}{r['pairs']:>8}{mean:>11}{se:>9}")
    lines.append("(a correct-incorrect pair's policy-gradient contributions A_i g_i have cosine -1 x the printed one)")
    lines.append(f"self-cosine check: {result['self_cosine']:.6f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if not abs(result["self_cosine"] - 1) < 1e-6:
        print(f"self-cosine check failed: {result['self_cosine']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
