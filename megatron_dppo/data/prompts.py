"""Prompt datasets (JSONL / Parquet / `datasets` dirs), prompt rendering, and a resumable seeded sampler.

Files (data_files.py): .jsonl, .parquet, or a directory written by datasets' `save_to_disk`.
`data.train` may name several (a YAML list, or one comma-separated string): their records are
concatenated in the order given and the seeded sampler shuffles over all of them, so each file is
drawn in proportion to its size (data.train_size takes the first N of the concatenation).

Record layouts accepted (detected per record, first match wins):
  verl     {data_source, prompt: [{role, content}], ability, reward_model: {style, ground_truth},
            extra_info: {index, ...}}                      -> answer = reward_model.ground_truth
  native   {id?, prompt | messages, answer, ...}      prompt = text, or a list of {role, content}
  GSM8K    {question, answer: "...reasoning... #### 42"}  -> answer "42" (commas dropped)
  MATH     {problem, solution: "... \\boxed{...} ..."}     -> answer = content of the last \\boxed{}
                                                          (or the record's 'answer' field, if set)
Any other layout: `data.prompt_key` / `data.answer_key` name the fields, as dotted paths into
nested fields ("reward_model.ground_truth"); a named field is read as it is (no '####' or
\\boxed{} extraction). An answer is a string or a finite number (its text; an integral float's
is the integer's: 1458.0 -> "1458").
`data_source` and `extra_info` (verl's columns; any layout may have them) are kept on the record
and reach the reward functions; the other (non-null) fields stay in PromptRecord.extra.

Prompt ids are stable across runs, which prompt history (pruning) depends on: the record's `id`
if it has one, else "<data_source>/<extra_info.index>" when the record carries an index (verl),
else "p-" + a hash of the prompt text (or of the messages). Explicit ids (the first two kinds)
must be unique over all the files of a run, with one exception: when index ids repeat across
files (verl train shards, each indexed from 0), every index id of the run is prefixed with its
file's name, "<file name>:<data_source>/<index>".

Rendering (PromptRenderer): "raw" feeds the prompt text as is (the tokenizer adds its special
tokens, e.g. the tiny tokenizer's <bos>); "chat" applies the tokenizer's chat template with a
generation prompt, and `data.chat_template_kwargs` (e.g. {enable_thinking: false}). A record whose
prompt is a list of messages needs "chat": raw mode refuses it, naming the record, rather than
inventing a text format (joined contents, guessed separators) the model was never trained on.
The tiny model (examples/tiny/model) was trained on raw text, and its chat template only
prepends <bos> to the concatenated contents, so both modes give the same ids there (with
enable_thinking=false it appends an empty thinking block "()", as Qwen3's template appends
"<think>\\n\\n</think>\\n\\n").
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import random
import re
from dataclasses import asdict, dataclass, field

from megatron_dppo.data.files import data_paths, read_rows
from megatron_dppo.rewards import gsm8k_final, last_boxed

_LAYOUTS = (
    "expected verl {prompt, reward_model: {ground_truth}}, {id?, prompt or messages, answer}, GSM8K "
    "{question, answer with '#### N'}, or MATH {problem, solution with \\boxed{...}}; "
    "data.prompt_key / data.answer_key name the fields of any other layout"
)


@dataclass
class PromptRecord:
    id: str
    prompt: str | None  # exactly one of prompt / messages is set
    messages: list[dict] | None
    answer: str
    extra: dict = field(default_factory=dict)  # the row's other fields
    data_source: str = ""  # verl's data_source ("" when the row has none): reward routing, per-source metrics
    extra_info: dict = field(default_factory=dict)  # verl's extra_info (index, split, ...), as in the row
    # Where it came from, for error messages: "<file>:line 12" (JSONL) or "<file>:row 3" (Parquet,
    # datasets dirs); not part of the record's identity.
    source: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_id(prompt: str | None, messages: list[dict] | None = None) -> str:
    """Stable id of a prompt without one: a hash of its text (messages: their canonical JSON)."""
    text = prompt if messages is None else json.dumps(messages, sort_keys=True, ensure_ascii=False)
    return "p-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _check_messages(messages, key: str) -> list[dict]:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError(f"{key!r} must be a non-empty list of {{role: str, content: str}}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def dotted_get(row: dict, key: str, config_key: str):
    """row["a"]["b"] for key "a.b"; ValueError naming config_key and the missing part."""
    value, seen = row, []
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            if not seen:  # (the loader names the row's fields)
                raise ValueError(f"{config_key} {key!r} is absent: no {part!r} in the row")
            have = f"it has {sorted(value)}" if isinstance(value, dict) else f"a {type(value).__name__}, not a mapping"
            raise ValueError(f"{config_key} {key!r} is absent: no {part!r} in {'.'.join(seen)!r} ({have})")
        value, seen = value[part], seen + [part]
    return value


def _answer_text(value, key: str) -> str:
    """A string as it is; a number as its text, an integral float as the integer's: 1458.0 (how
    pandas writes an int column that holds nulls) -> "1458", the answer verl's math rewards and
    ours compare with, where "1458.0" would match no completion; 0.5 -> "0.5"."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{key!r} must be a finite number or a string, got {value!r}")
        return str(int(value)) if isinstance(value, numbers.Integral) or float(value).is_integer() else str(value)
    raise ValueError(f"{key!r} must be a string or a number, got {type(value).__name__} {str(value)[:60]!r}")


def _layout(raw: dict) -> str | None:
    if isinstance(raw.get("reward_model"), dict):
        return "verl"
    if "prompt" in raw or "messages" in raw:
        return "native"
    if "question" in raw:
        return "gsm8k"
    if "problem" in raw:
        return "math"
    return None


def _prompt_field(raw: dict, layout: str | None) -> str:
    if layout in ("verl", "native"):
        if ("prompt" in raw) == ("messages" in raw):
            raise ValueError("record must have exactly one of 'prompt' or 'messages'")
        return "prompt" if "prompt" in raw else "messages"
    if layout == "gsm8k":
        return "question"
    if layout == "math":
        return "problem"
    raise ValueError(f"missing field 'prompt' ({_LAYOUTS})")


def _layout_answer(raw: dict, layout: str | None) -> tuple[str, str | None]:
    """(answer, the top-level field it came from, or None) by the row's layout."""
    if layout == "verl":
        if "ground_truth" not in raw["reward_model"]:
            raise ValueError("verl record's 'reward_model' has no 'ground_truth'")
        return _answer_text(raw["reward_model"]["ground_truth"], "reward_model.ground_truth"), None
    if layout == "gsm8k":
        if raw.get("answer") is None:
            raise ValueError("GSM8K record is missing field 'answer'")
        final = gsm8k_final(_answer_text(raw["answer"], "answer"))
        if final is None:
            raise ValueError("GSM8K 'answer' has no '#### N' final answer")
        return re.sub(r"(?<=\d),(?=\d{3})", "", final), "answer"  # "1,000" -> "1000"
    if layout == "math" and raw.get("answer") is None:  # some MATH variants (MATH-500) carry the answer
        if raw.get("solution") is None:
            raise ValueError("MATH record is missing field 'solution' (or 'answer')")
        answer = last_boxed(_answer_text(raw["solution"], "solution"))
        if answer is None:
            raise ValueError("MATH 'solution' has no \\boxed{...} answer")
        return answer, None
    if raw.get("answer") is None:
        raise ValueError(f"missing field 'answer' ({_LAYOUTS})")
    return _answer_text(raw["answer"], "answer"), "answer"


def parse_record(raw: dict, prompt_key: str = "", answer_key: str = "") -> PromptRecord:
    """One raw record -> PromptRecord; ValueError saying what is missing or wrong.
    prompt_key / answer_key (dotted paths) override the layout's fields."""
    if not isinstance(raw, dict):
        raise ValueError(f"record must be a JSON object, got {type(raw).__name__}")
    # A null field is one this row lacks (a Parquet or Arrow table has every column in every row).
    raw = {k: v for k, v in raw.items() if v is not None}
    layout = _layout(raw)
    pfield = prompt_key or _prompt_field(raw, layout)
    value = dotted_get(raw, pfield, "data.prompt_key") if prompt_key else raw[pfield]
    is_chat = isinstance(value, list) or pfield == "messages"
    prompt, messages = (None, _check_messages(value, pfield)) if is_chat else (value, None)
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{pfield!r} must be a non-empty string or a list of {{role, content}} messages")
    if answer_key:
        answer, afield = _answer_text(dotted_get(raw, answer_key, "data.answer_key"), answer_key), answer_key
    else:
        answer, afield = _layout_answer(raw, layout)
    source_name = raw.get("data_source")
    data_source = "" if source_name is None else str(source_name)
    extra_info = raw.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise ValueError(f"'extra_info' must be a mapping, got {type(extra_info).__name__}")
    rid = raw.get("id")
    if rid is None or rid == "":
        index = extra_info.get("index")
        rid = prompt_id(prompt, messages) if index is None else f"{data_source or 'index'}/{index}"
    taken = {"id", "data_source", "extra_info", pfield, afield}
    extra = {k: v for k, v in raw.items() if k not in taken}
    if layout == "gsm8k" and not answer_key:
        extra["solution"] = raw["answer"]  # the worked answer, for a reward that reads it
    return PromptRecord(str(rid), prompt, messages, answer, extra, data_source, extra_info)


def load_records(paths, prompt_key: str = "", answer_key: str = "") -> list[PromptRecord]:
    """All records of one or several files (a path, a list of paths, or comma-separated paths; see
    data_files.py), concatenated in order, each knowing its file and line (or row). A malformed
    record is a one-line ValueError naming the file, the line (or row) and the row's fields; two
    records with the same explicit id are too (history would mix them), across files as well,
    except index ids repeated across files, which get the file's name (the module docstring)."""
    paths = data_paths(paths)
    by_file = [_file_records(path, prompt_key, answer_key) for path in paths]
    if _index_ids_repeat_across_files(by_file):
        # the file's path below the files' common folder: its name, unless names repeat (a/train.parquet)
        where = [os.path.abspath(os.path.normpath(p)) for p in paths]
        common = os.path.commonpath([os.path.dirname(w) for w in where])
        for path, recs in zip(where, by_file):
            for rec, kind in recs:
                if kind == "index":
                    rec.id = f"{os.path.relpath(path, common)}:{rec.id}"
    records, where_by_id = [], {}
    for recs in by_file:
        for rec, kind in recs:
            if kind:
                if rec.id in where_by_id:
                    first = where_by_id[rec.id]
                    raise ValueError(f"{rec.source}: duplicate id {rec.id!r} (first at {first}): {_ID_HELP[kind]}")
                where_by_id[rec.id] = rec.source
            records.append(rec)
    return records


_ID_HELP = {
    "id": "the id is the record's 'id' field; give each record its own",
    "index": "the id is data_source + '/' + extra_info.index (the file's name is prefixed only when index ids "
    "repeat across files); give each record of a source its own extra_info.index, or an 'id' field",
}


def _index_ids_repeat_across_files(by_file) -> bool:
    first_file = {}
    for n, recs in enumerate(by_file):
        for rec, kind in recs:
            if kind == "index" and first_file.setdefault(rec.id, n) != n:
                return True
    return False


def id_kind(raw) -> str:
    """How the row names its own id: "id" (an `id` field), "index" (verl's extra_info.index, no
    `id`), or "" (none: the id is a hash of the prompt). Named ids must be unique."""
    if not isinstance(raw, dict):
        return ""
    if raw.get("id") not in (None, ""):
        return "id"
    info = raw.get("extra_info")
    return "index" if isinstance(info, dict) and info.get("index") is not None else ""


def _file_records(path: str, prompt_key: str, answer_key: str) -> list[tuple[PromptRecord, str]]:
    """One file's records, each with its id_kind."""
    out = []
    for where, raw in read_rows(path):
        loc = f"{path}:{where}"
        if isinstance(raw, Exception):
            raise ValueError(f"{loc}: invalid JSON: {raw}") from None
        try:
            rec = parse_record(raw, prompt_key, answer_key)
        except ValueError as e:
            fields = (
                f" (the row has fields {sorted(k for k, v in raw.items() if v is not None)})"
                if isinstance(raw, dict)
                else ""
            )
            raise ValueError(f"{loc}: {e}{fields}") from None
        rec.source = loc
        out.append((rec, id_kind(raw)))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def check_prompt_lengths(
    records: list[PromptRecord],
    renderer: PromptRenderer,
    max_prompt_tokens: int,
    path,
    skip: bool = False,
    limit_desc: str = "",
    warnings: list[str] | None = None,
) -> tuple[list[PromptRecord], int]:
    """Find prompts longer than max_prompt_tokens when the data loads, not at the step that
    draws them (where the engine would fail without naming the record). -> (records, skipped).

    skip=False: the first one is a ValueError "<file>:line N (id X): prompt is T tokens, over the
    limit L (<limit_desc>)". skip=True: they are dropped and counted. limit_desc says where the
    limit comes from, e.g. "rollout.max_model_len 32 - rollout.max_new_tokens 6". A record the
    renderer cannot render (messages in raw mode) is a ValueError naming it too. `path` (the
    data files) names the data in the errors about all of them. `warnings`, if given, gets a line
    naming the prompts that are mostly the tokenizer's unknown token (unk_warning).
    """
    if max_prompt_tokens < 1:
        raise ValueError(
            f"the prompt token limit must be >= 1, got {max_prompt_tokens}" + (f" ({limit_desc})" if limit_desc else "")
        )
    kept, skipped, unknown = [], 0, []
    special = set(getattr(renderer.tokenizer, "all_special_ids", ())) - {renderer.tokenizer.unk_token_id}
    for rec in records:
        ids = render_checked(renderer, rec)
        n = len(ids)
        if renderer.tokenizer.unk_token_id is not None:
            text_ids = [t for t in ids if t not in special]
            n_unk = text_ids.count(renderer.tokenizer.unk_token_id)
            if 2 * n_unk > len(text_ids):
                unknown.append((rec, n_unk, len(text_ids)))
        if n <= max_prompt_tokens:
            kept.append(rec)
        elif skip:
            skipped += 1
        else:
            why = f" ({limit_desc})" if limit_desc else ""
            raise ValueError(
                f"{rec.source or path} (id {rec.id}): prompt is {n} tokens, over the limit {max_prompt_tokens}{why}"
            )
    if unknown and warnings is not None:
        warnings.append(unk_warning(unknown, renderer.tokenizer.unk_token, path))
    if not kept:
        raise ValueError(
            f"{_describe(path)}: every prompt is over the limit of {max_prompt_tokens} tokens"
            + (f" ({limit_desc})" if limit_desc else "")
        )
    return kept, skipped


def unk_warning(unknown, unk_token: str, path, shown: int = 3) -> str:
    """One line for the prompts (rec, unknown tokens, text tokens) that are mostly unk_token:
    text the tokenizer cannot represent, which the policy would train on as that one token."""
    first = "; ".join(f"{rec.source or path} (id {rec.id}): {k} of {n} tokens" for rec, k, n in unknown[:shown])
    more = f"; and {len(unknown) - shown} more" if len(unknown) > shown else ""
    return (
        f"warning: {len(unknown)} prompt(s) of {_describe(path)} are mostly the tokenizer's unknown token "
        f"{unk_token} (characters it has no token for; check the data's language and encoding): {first}{more}"
    )


def render_checked(renderer: PromptRenderer, rec: PromptRecord) -> list[int]:
    """The record's prompt ids; a record the renderer refuses is a ValueError naming its file and line."""
    try:
        return renderer.token_ids(rec)
    except ValueError as e:
        raise ValueError(f"{rec.source or '?'} (id {rec.id}): {e}") from None


def _describe(paths) -> str:
    return ",".join(data_paths(paths)) if paths else "?"


class PromptRenderer:
    """PromptRecord -> prompt token ids (and text), the same way for training and generation.

    mode "raw": record.prompt as is, tokenized with the tokenizer's special tokens (a messages
    record is an error: it needs a chat template). mode "chat": apply_chat_template(messages, or
    [{"role": "user", "content": prompt}], with an optional system prompt first,
    add_generation_prompt=True, **chat_template_kwargs), tokenized without adding special tokens
    again. chat_template_kwargs (data.chat_template_kwargs, e.g. {"enable_thinking": False}) are
    variables of the template; raw mode applies no template, so it refuses them.
    """

    def __init__(
        self, tokenizer, mode: str = "raw", system_prompt: str | None = None, chat_template_kwargs: dict | None = None
    ):
        if mode not in ("raw", "chat"):
            raise ValueError(f"prompt mode must be 'raw' or 'chat', got {mode!r}")
        if mode == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt mode 'chat' needs a tokenizer with a chat template")
        if chat_template_kwargs and mode != "chat":
            raise ValueError(
                f"data.chat_template_kwargs {chat_template_kwargs} need data.prompt_mode=chat "
                "(raw mode applies no template)"
            )
        self.tokenizer, self.mode, self.system_prompt = tokenizer, mode, system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def text(self, rec: PromptRecord) -> str:
        if self.mode == "raw":
            if rec.prompt is None:
                raise ValueError(
                    "the prompt is a list of chat messages, which data.prompt_mode=raw cannot render as text: "
                    "set data.prompt_mode=chat (the tokenizer's chat template)"
                )
            return rec.prompt
        return self._render(rec.messages or [{"role": "user", "content": rec.prompt}], add_generation_prompt=True)

    _PROBE = "\x00probe-content\x00"  # a content no template writes itself: where a message goes

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The chat template over messages, data.system_prompt first unless they open with their own."""
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )

    def generation_suffix(self) -> str:
        """The text the template writes after the last user message's content: the end of the
        user turn and the generation prompt ("" in raw mode). A prompt's problem text ends
        right before it (SSOPD inserts its solution block there)."""
        if self.mode == "raw":
            return ""
        text = self._render([{"role": "user", "content": self._PROBE}], add_generation_prompt=True)
        return text[text.rindex(self._PROBE) + len(self._PROBE) :]

    def assistant_opening(self) -> str:
        """What the template writes at an assistant turn's start past its generation prompt,
        before the content: "<think>\\n\\n</think>\\n\\n" for Qwen3 in thinking mode (the model
        opens that block itself), "" when the generation prompt already holds it (Qwen3 with
        enable_thinking=false), when the template writes none, or in raw mode."""
        if self.mode == "raw":
            return ""
        user = [{"role": "user", "content": self._PROBE}]
        prompt = self._render(user, add_generation_prompt=True)
        full = self._render(user + [{"role": "assistant", "content": self._PROBE + "a"}], add_generation_prompt=False)
        head = full[: full.rindex(self._PROBE + "a")]
        return head[len(prompt) :] if head.startswith(prompt) else ""

    def token_ids(self, rec: PromptRecord) -> list[int]:
        # Chat templates write their own special tokens (bos etc.); adding them again would double them.
        return list(self.tokenizer(self.text(rec), add_special_tokens=self.mode == "raw")["input_ids"])

    def decode(self, token_ids) -> str:
        """Generated ids -> text, as the reward functions see it (special tokens such as eos dropped)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def decode_all(self, token_id_lists) -> list[str]:
        """decode() of many completions in one tokenizer call (logging.rollouts, validation dumps)."""
        return self.tokenizer.batch_decode([list(t) for t in token_id_lists], skip_special_tokens=True)


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
    """Records of one or several files (load_records) plus a sampler over them:
    `next_batch(n=None)` -> list[PromptRecord].

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
        prompt_key: str = "",
        answer_key: str = "",
    ):
        self.path = path
        self.records = load_records(path, prompt_key, answer_key)
        if limit:  # the first `limit` records: a smaller set is revisited more often (prompt history)
            self.records = self.records[:limit]
        self.skipped_long = 0
        self.warnings: list[str] = []  # start-up warnings about the prompts (unk_warning)
        if renderer is not None and max_prompt_tokens:
            self.records, self.skipped_long = check_prompt_lengths(
                self.records,
                renderer,
                max_prompt_tokens,
                path,
                skip=skip_long_prompts,
                limit_desc=limit_desc,
                warnings=self.warnings,
            )
        if len(self.records) < batch_size:
            skipped = f" ({self.skipped_long} skipped as too long)" if self.skipped_long else ""
            raise ValueError(
                f"{_describe(path)}: {len(self.records)} prompts{skipped}, fewer than one batch of {batch_size} "
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
