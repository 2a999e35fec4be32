"""Bundled synthetic verifiable tasks: arithmetic prompts with exact answers.

They make the tiny CPU main job possible (docs/platform.md section 2): a task that a 0.74M-parameter model can
partly solve after a short warm-up, with a verifier that is a plain string comparison.

Two kinds:
  ArithmeticTask       {id, prompt, answer}: "123+456=" -> "579". The completion IS the answer
                       (reward kind "exact"); every completion is a few tokens long.
  WorkedMultiplication {id, prompt, answer, solution}: "47*4=" -> "2:94,3:141,4:188", the
                       running multiples of a up to b*a, one "j:j*a" step per line of work. The
                       answer is the last number (reward kind "megatron_dppo.data.tasks:final_answer_reward").
                       The number of steps b-1 is drawn with P(b) ~ 1/(b-1), so completion
                       lengths are long-tailed like RL reasoning traces (most short, a few 6x
                       the median) and longer problems are harder: what dense packing is for.
Every character of a prompt and a solution is in the task's `alphabet`, which the tiny model's
character vocabulary covers (tools/make_tiny_model.py).
Pure Python on purpose: no torch, so reward workers and data tools import it cheaply.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from megatron_dppo.rewards.verifiers import exact_match


@dataclass(frozen=True)
class ArithmeticTask:
    """Two operands drawn uniformly from [lo, hi], joined by `op`; the answer is the exact result."""

    name: str
    op: str
    lo: int
    hi: int

    def answer(self, a: int, b: int) -> str:
        if self.op == "+":
            return str(a + b)
        if self.op == "-":
            return str(a - b)
        if self.op == "*":
            return str(a * b)
        raise ValueError(f"task {self.name!r}: unsupported operator {self.op!r}")

    def prompt(self, a: int, b: int) -> str:
        return f"{a}{self.op}{b}="

    @property
    def num_problems(self) -> int:
        return (self.hi - self.lo + 1) ** 2

    alphabet = "0123456789+-*="

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)

    def record(self, a: int, b: int) -> dict:
        return {"prompt": self.prompt(a, b), "answer": self.answer(a, b)}

    def score(self, completion: str, answer: str) -> float:
        return exact_match(completion, answer)


@dataclass(frozen=True)
class WorkedMultiplication:
    """a*b by running sums: "a*b=" -> "2:2a,3:3a,...,b:ba"; the answer is b*a.

    a is uniform in [lo, hi]; b in [2, max_b] with P(b) proportional to 1/(b-1), so half the
    problems take one or two steps and the longest take max_b - 1. Each step adds a to the
    previous sum (a is at the start of the prompt, the previous sum right before), and its
    counter j says when to stop (j == b): local work a small model can learn, and errors
    compound with the number of steps.
    """

    name: str
    lo: int
    hi: int
    max_b: int

    alphabet = "0123456789*=:,"

    def solution(self, a: int, b: int) -> str:
        return ",".join(f"{j}:{j * a}" for j in range(2, b + 1))

    def answer(self, a: int, b: int) -> str:
        return str(a * b)

    def prompt(self, a: int, b: int) -> str:
        return f"{a}*{b}="

    @property
    def num_problems(self) -> int:
        return (self.hi - self.lo + 1) * (self.max_b - 1)

    @property
    def max_solution_chars(self) -> int:
        return len(self.solution(self.hi, self.max_b))

    def draw(self, rng: random.Random) -> tuple[int, int]:
        steps = range(1, self.max_b)
        return rng.randint(self.lo, self.hi), 1 + rng.choices(steps, weights=[1 / k for k in steps])[0]

    def record(self, a: int, b: int) -> dict:
        return {"prompt": self.prompt(a, b), "answer": self.answer(a, b), "solution": self.solution(a, b)}

    def score(self, completion: str, answer: str) -> float:
        return 1.0 if final_answer(completion) == str(answer).strip() else 0.0


# "add3" is the one docs/platform.md section 2 measured (the tiny main job); the others are there for variety.
# add2 is too easy to show a difference between methods (60% -> 90% in seconds).
TASKS = {
    "add3": ArithmeticTask("add3", "+", 100, 999),
    "add2": ArithmeticTask("add2", "+", 10, 99),
    "sub3": ArithmeticTask("sub3", "-", 100, 999),
    "mul2": ArithmeticTask("mul2", "*", 10, 99),
    # The long-tailed task (examples/tiny/longtail.yaml): 2-4 digit a, up to 15 steps.
    "mulsteps": WorkedMultiplication("mulsteps", 10, 9999, 16),
}


def get_task(name: str) -> ArithmeticTask | WorkedMultiplication:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; bundled tasks: {sorted(TASKS)}") from None


def final_answer(completion: str) -> str:
    """The number a worked solution ends with: the text after its last ':' (the whole text when
    there is none), stripped. "2:94,3:141" -> "141"."""
    return completion.rsplit(":", 1)[-1].strip()


def final_answer_reward(completion: str, answer: str, record=None) -> float:
    """Reward function for worked tasks (reward kind "megatron_dppo.data.tasks:final_answer_reward"):
    1.0 iff the completion's final number is the answer. Only the end is checked, as a
    reasoning-RL verifier checks a final answer and not the steps that led to it."""
    return 1.0 if final_answer(completion) == str(answer).strip() else 0.0


def make_splits(task: str, seed: int = 0, **sizes: int) -> dict[str, list[dict]]:
    """Disjoint problem lists, deterministic in `seed` and in the order of `sizes`.

    make_splits("add3", seed=0, train=20000, test=500) -> {"train": [...], "test": [...]}.
    Ids are stable and split-prefixed ("add3-000123" for train, "add3-test-000007" otherwise), so
    prompt-history entries and evaluations refer to the same problem in every run with this seed.
    """
    t = get_task(task)
    total = sum(sizes.values())
    if any(n < 0 for n in sizes.values()):
        raise ValueError(f"split sizes must be >= 0, got {sizes}")
    if total > t.num_problems // 2:  # rejection sampling below would crawl near exhaustion
        raise ValueError(f"task {task!r} has {t.num_problems} problems; {total} requested is too many")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < total:
        p = t.draw(rng)
        if p not in seen:
            seen.add(p)
            pairs.append(p)
    out, start = {}, 0
    for split, n in sizes.items():
        prefix = f"{task}-" if split == "train" else f"{task}-{split}-"
        out[split] = [{"id": f"{prefix}{i:06d}", **t.record(a, b)} for i, (a, b) in enumerate(pairs[start : start + n])]
        start += n
    return out


def write_jsonl(records, path: str) -> None:
    """Write records one JSON object per line, atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_task_data(task: str, out_dir: str, n_train: int = 20000, n_test: int = 500, seed: int = 0):
    """Write {out_dir}/train.jsonl and {out_dir}/test.jsonl; returns {split: path}."""
    splits = make_splits(task, seed, train=n_train, test=n_test)
    paths = {}
    for name, records in splits.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        write_jsonl(records, paths[name])
    return paths


LAYOUTS = ("native", "verl", "gsm8k", "math")


def as_layout(records: list[dict], layout: str, data_source: str = "", split: str = "train") -> list[dict]:
    """The bundled task's records ({id, prompt, answer, solution?}) in another community layout,
    for tests and examples (data.py reads them all back to the same prompts and answers):
      native  as they are (plus data_source when given)
      verl    {data_source, prompt: [{role: user, content}], ability, reward_model: {style: rule,
              ground_truth}, extra_info: {index, split}}: verl's own preprocessing output
      gsm8k   {question, answer: "<solution>\\n#### <answer>"}
      math    {problem, solution: "<solution> \\boxed{<answer>}"}
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {LAYOUTS}")
    out = []
    for i, r in enumerate(records):
        work = r.get("solution", "")
        if layout == "native":
            out.append(dict(r, data_source=data_source) if data_source else dict(r))
        elif layout == "verl":
            out.append(
                {
                    "data_source": data_source,
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "ability": "arithmetic",
                    "reward_model": {"style": "rule", "ground_truth": r["answer"]},
                    "extra_info": {"index": i, "split": split},
                }
            )
        elif layout == "gsm8k":
            out.append({"question": r["prompt"], "answer": f"{work}\n#### {r['answer']}"})
        else:
            out.append({"problem": r["prompt"], "solution": f"{work} \\boxed{{{r['answer']}}}"})
    return out


def write_parquet(records: list[dict], path: str) -> None:
    """Write records as a Parquet table (verl's file format), atomically. Its columns are every
    field any record has (a record without one gets null there: pyarrow's from_pylist alone would
    keep only the first record's fields)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for r in records for k in r))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in records]), tmp)
    os.replace(tmp, path)
