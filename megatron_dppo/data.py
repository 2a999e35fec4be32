"""Prompt datasets (JSONL / Parquet), prompt rendering, and a resumable seeded sampler.

Record layouts accepted (detected per record, first match wins):
  native   {id?, prompt | messages, answer, ...}      messages = [{"role", "content"}, ...]
  GSM8K    {question, answer: "...reasoning... #### 42"}  -> answer "42" (commas dropped)
  MATH     {problem, solution: "... \\boxed{...} ..."}     -> answer = content of the last \\boxed{}
                                                          (or the record's 'answer' field, if set)
Other fields are kept in PromptRecord.extra (a user reward function sees them).

Prompt ids are stable across runs, which prompt history (pruning) depends on: the record's `id`
if it has one, else "p-" + a hash of the prompt text (or of the messages).

Rendering (PromptRenderer): "raw" feeds the prompt text as is (the tokenizer adds its special
tokens, e.g. the tiny tokenizer's <bos>); "chat" applies the tokenizer's chat template with a
generation prompt. The tiny model (examples/tiny/model) was trained on raw text, and its chat
template only prepends <bos> to the concatenated contents, so both modes give the same ids there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import asdict, dataclass, field

from megatron_dppo.rewards import gsm8k_final, last_boxed

_LAYOUTS = (
    "expected {id?, prompt or messages, answer}, or GSM8K {question, answer with '#### N'}, "
    "or MATH {problem, solution with \\boxed{...}}"
)


@dataclass
class PromptRecord:
    id: str
    prompt: str | None  # exactly one of prompt / messages is set
    messages: list[dict] | None
    answer: str
    extra: dict = field(default_factory=dict)
    # Where it came from, for error messages: "line 12" (JSONL) or "row 3" (Parquet); not part of
    # the record's identity (the same prompt from either file format is the same record).
    source: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_id(prompt: str | None, messages: list[dict] | None = None) -> str:
    """Stable id of a prompt without one: a hash of its text (messages: their canonical JSON)."""
    text = prompt if messages is None else json.dumps(messages, sort_keys=True, ensure_ascii=False)
    return "p-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _check_messages(messages) -> list[dict]:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError("'messages' must be a non-empty list of {role: str, content: str}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_record(raw: dict) -> PromptRecord:
    """One raw record -> PromptRecord; ValueError saying what is missing or wrong."""
    if not isinstance(raw, dict):
        raise ValueError(f"record must be a JSON object, got {type(raw).__name__}")
    raw = dict(raw)
    rid = raw.pop("id", None)
    if "prompt" in raw or "messages" in raw:  # native
        prompt, messages = raw.pop("prompt", None), raw.pop("messages", None)
        if (prompt is None) == (messages is None):
            raise ValueError("record must have exactly one of 'prompt' or 'messages'")
        if messages is not None:
            messages = _check_messages(messages)
        if raw.get("answer") is None:
            raise ValueError(f"missing field 'answer' ({_LAYOUTS})")
        answer = str(raw.pop("answer"))
    elif "question" in raw:  # GSM8K
        prompt, messages = raw.pop("question"), None
        if raw.get("answer") is None:
            raise ValueError("GSM8K record is missing field 'answer'")
        full = str(raw.pop("answer"))
        final = gsm8k_final(full)
        if final is None:
            raise ValueError("GSM8K 'answer' has no '#### N' final answer")
        answer = re.sub(r"(?<=\d),(?=\d{3})", "", final)  # "1,000" -> "1000"
        raw["solution"] = full
    elif "problem" in raw:  # MATH
        prompt, messages = raw.pop("problem"), None
        given = raw.pop("answer", None)
        if given is not None:  # some MATH variants (MATH-500) carry the answer
            answer = str(given)
        elif raw.get("solution") is None:
            raise ValueError("MATH record is missing field 'solution' (or 'answer')")
        else:
            answer = last_boxed(str(raw["solution"]))
            if answer is None:
                raise ValueError("MATH 'solution' has no \\boxed{...} answer")
    else:
        raise ValueError(f"missing field 'prompt' ({_LAYOUTS}); got fields {sorted(raw)}")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError("prompt text must be a non-empty string")
    rid = prompt_id(prompt, messages) if rid is None or rid == "" else str(rid)
    return PromptRecord(rid, prompt, messages, answer, raw)


def _raw_records(path: str):
    """Yield (location, raw record or JSON error) in file order; location is 'line N' / 'row N'."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".parquet"):
        raise ValueError(f"{path}: unsupported prompt file type {ext!r} (use .jsonl or .parquet)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: prompt file not found")
    if ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: cannot read as Parquet: {e}") from None
        for i, row in enumerate(rows, 1):
            yield f"row {i}", row
    else:
        with open(path, "rb") as f:
            for i, raw_line in enumerate(f, 1):
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:line {i}: not UTF-8 text ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue  # blank lines (a trailing newline) are not records
                try:
                    yield f"line {i}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"line {i}", e


def load_records(path: str) -> list[PromptRecord]:
    """All records of a .jsonl or .parquet file, each knowing its line (or row). A malformed
    record is a ValueError naming the file and line (or row); two records with the same explicit
    id are too (history would mix them)."""
    records, where_by_id = [], {}
    for where, raw in _raw_records(path):
        if isinstance(raw, Exception):
            raise ValueError(f"{path}:{where}: invalid JSON: {raw}") from None
        try:
            rec = parse_record(raw)
        except ValueError as e:
            raise ValueError(f"{path}:{where}: {e}") from None
        rec.source = where
        if isinstance(raw, dict) and raw.get("id") not in (None, ""):
            if rec.id in where_by_id:
                raise ValueError(f"{path}:{where}: duplicate id {rec.id!r} (first at {where_by_id[rec.id]})")
            where_by_id[rec.id] = where
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def check_prompt_lengths(
    records: list[PromptRecord],
    renderer: PromptRenderer,
    max_prompt_tokens: int,
    path: str,
    skip: bool = False,
    limit_desc: str = "",
) -> tuple[list[PromptRecord], int]:
    """Find prompts longer than max_prompt_tokens when the data loads, not at the step that
    draws them (where the engine would fail without naming the record). -> (records, skipped).

    skip=False: the first one is a ValueError "<path>:line N (id X): prompt is T tokens, over the
    limit L (<limit_desc>)". skip=True: they are dropped and counted. limit_desc says where the
    limit comes from, e.g. "rollout.max_model_len 32 - rollout.max_new_tokens 6".
    """
    if max_prompt_tokens < 1:
        raise ValueError(
            f"the prompt token limit must be >= 1, got {max_prompt_tokens}" + (f" ({limit_desc})" if limit_desc else "")
        )
    kept, skipped = [], 0
    for rec in records:
        n = len(renderer.token_ids(rec))
        if n <= max_prompt_tokens:
            kept.append(rec)
        elif skip:
            skipped += 1
        else:
            why = f" ({limit_desc})" if limit_desc else ""
            raise ValueError(
                f"{path}:{rec.source or '?'} (id {rec.id}): prompt is {n} tokens, over the limit "
                f"{max_prompt_tokens}{why}"
            )
    if not kept:
        raise ValueError(
            f"{path}: every prompt is over the limit of {max_prompt_tokens} tokens"
            + (f" ({limit_desc})" if limit_desc else "")
        )
    return kept, skipped


class PromptRenderer:
    """PromptRecord -> prompt token ids (and text), the same way for training and generation.

    mode "raw": record.prompt as is, tokenized with the tokenizer's special tokens (a messages
    record is an error: it needs a chat template). mode "chat": apply_chat_template(messages, or
    [{"role": "user", "content": prompt}], with an optional system prompt first,
    add_generation_prompt=True), tokenized without adding special tokens again.
    """

    def __init__(self, tokenizer, mode: str = "raw", system_prompt: str | None = None):
        if mode not in ("raw", "chat"):
            raise ValueError(f"prompt mode must be 'raw' or 'chat', got {mode!r}")
        if mode == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt mode 'chat' needs a tokenizer with a chat template")
        self.tokenizer, self.mode, self.system_prompt = tokenizer, mode, system_prompt

    def text(self, rec: PromptRecord) -> str:
        if self.mode == "raw":
            if rec.prompt is None:
                raise ValueError(f"record {rec.id!r} has messages; use prompt mode 'chat'")
            return rec.prompt
        messages = rec.messages or [{"role": "user", "content": rec.prompt}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_ids(self, rec: PromptRecord) -> list[int]:
        # Chat templates write their own special tokens (bos etc.); adding them again would double them.
        return list(self.tokenizer(self.text(rec), add_special_tokens=self.mode == "raw")["input_ids"])


class PromptSampler:
    """Batches of record indices in a seeded shuffled order, epoch after epoch.

    Epoch e's order is a permutation determined by (seed, e) alone, so the order never depends on
    how far a run got; state_dict() is just (epoch, position), and a resumed run continues with
    exactly the draws the uninterrupted run would have made, as long as it asks for the same sizes
    (the trainer's sizes are a function of the step, so it does). A draw of n prompts that does
    not fit in the rest of the epoch starts the next epoch (the next epoch reshuffles, so no prompt
    is systematically left out): every draw has exactly n distinct prompts.
    """

    def __init__(self, num_records: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if not 1 <= batch_size <= num_records:
            raise ValueError(f"batch_size must be in [1, {num_records}] (the dataset size), got {batch_size}")
        self.n, self.batch_size, self.seed, self.shuffle = num_records, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, n: int | None = None) -> list[int]:
        """The next n indices (default: batch_size), all distinct. Extra rounds of another size
        (CPPO allocation draws ~B/(1-P)) come from the same stream, so state stays (epoch, pos)."""
        n = self.batch_size if n is None else n
        if not 1 <= n <= self.n:
            raise ValueError(f"cannot draw {n} prompts: a draw must be in [1, {self.n}] (the dataset size)")
        if self.pos + n > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        batch = self._order[self.pos : self.pos + n]
        self.pos += n
        return batch

    def __iter__(self):
        while True:
            yield self.next_indices()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "seed": self.seed,
            "num_records": self.n,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_records", "batch_size", "shuffle"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"sampler state has {key}={state.get(key)!r} but this run has {mine!r}: "
                    f"the data order would not continue; keep the data and batch settings"
                )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._epoch_order(self.epoch)


class PromptDataset:
    """Records of one file plus a sampler over them: `next_batch(n=None)` -> list[PromptRecord].

    With a renderer and max_prompt_tokens, prompts over the limit are found here, at load
    (check_prompt_lengths): an error naming the first, or, with skip_long_prompts, dropped and
    counted in `skipped_long`.
    """

    def __init__(
        self,
        path: str,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        limit: int = 0,
        renderer: PromptRenderer | None = None,
        max_prompt_tokens: int = 0,
        skip_long_prompts: bool = False,
        limit_desc: str = "",
    ):
        self.path = path
        self.records = load_records(path)
        if limit:  # the first `limit` records: a smaller set is revisited more often (prompt history)
            self.records = self.records[:limit]
        self.skipped_long = 0
        if renderer is not None and max_prompt_tokens:
            self.records, self.skipped_long = check_prompt_lengths(
                self.records, renderer, max_prompt_tokens, path, skip=skip_long_prompts, limit_desc=limit_desc
            )
        if len(self.records) < batch_size:
            skipped = f" ({self.skipped_long} skipped as too long)" if self.skipped_long else ""
            raise ValueError(
                f"{path}: {len(self.records)} prompts{skipped}, fewer than one batch of {batch_size} "
                "(trainer.prompts_per_step)"
            )
        self.sampler = PromptSampler(len(self.records), batch_size, seed, shuffle)

    def __len__(self) -> int:
        return len(self.records)

    def next_batch(self, n: int | None = None) -> list[PromptRecord]:
        """The next n records (default: the batch size); see PromptSampler.next_indices."""
        return [self.records[i] for i in self.sampler.next_indices(n)]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
