import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dppo.data.prompts import (
    PromptDataset,
    PromptRecord,
    PromptRenderer,
    PromptSampler,
    check_prompt_lengths,
    load_records,
    parse_record,
    prompt_id,
)
from megatron_dppo.data.tasks import make_splits, write_task_data
from megatron_dppo.rewards.verifiers import exact_match


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_native_records_and_stable_ids(tmp_path):
    rows = [
        {"id": "q1", "prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": 4, "level": 3},
        {"messages": [{"role": "user", "content": "3+3="}], "answer": "6"},
    ]
    recs = load_records(_write_jsonl(tmp_path / "p.jsonl", rows))
    assert [r.id for r in recs][0] == "q1"
    assert recs[1].answer == "4" and recs[1].extra == {"level": 3}
    assert recs[1].id == prompt_id("2+2=") and recs[1].id.startswith("p-")
    assert recs[2].prompt is None and recs[2].messages[0]["content"] == "3+3="
    # Ids are a function of the text alone: the same file gives the same ids in every run.
    assert [r.id for r in load_records(str(tmp_path / "p.jsonl"))] == [r.id for r in recs]
    assert prompt_id("2+2=") != prompt_id("2+3=")


def test_parquet_matches_jsonl(tmp_path):
    rows = [{"id": f"a{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_parquet = load_records(str(tmp_path / "p.parquet"))
    from_jsonl = load_records(_write_jsonl(tmp_path / "p.jsonl", rows))
    assert from_parquet == from_jsonl


def test_gsm8k_and_math_layouts(tmp_path):
    gsm = [
        {
            "question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
            "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn total 48+24 = <<48+24=72>>72.\n#### 72",
        },
        {"question": "Big?", "answer": "so\n#### 1,250"},
    ]
    # A Parquet table has every column in every row: absent values read back as None.
    math = [
        {"problem": "Simplify 2/4.", "solution": r"We get $\boxed{\frac{1}{2}}$.", "answer": None},
        {"problem": "x?", "solution": r"First \boxed{3}, then really \boxed{\sqrt{x^{2}}}.", "answer": None},
        {"problem": "MATH-500 style", "solution": "...", "answer": "7"},
    ]
    for i, r in enumerate(math):
        r["level"] = f"Level {i + 1}"
    g = load_records(_write_jsonl(tmp_path / "gsm.jsonl", gsm))
    assert [r.answer for r in g] == ["72", "1250"]
    assert g[0].prompt.startswith("Natalia") and g[0].extra["solution"].endswith("#### 72")
    pq.write_table(pa.Table.from_pylist(math), tmp_path / "math.parquet")
    m = load_records(str(tmp_path / "math.parquet"))
    assert [r.answer for r in m] == [r"\frac{1}{2}", r"\sqrt{x^{2}}", "7"]
    assert m[0].extra["level"] == "Level 1"


@pytest.mark.parametrize(
    "bad_line, needle",
    [
        ('{"prompt": "1+1=", "answer": "2"', "invalid JSON"),
        ('{"prompt": "1+1="}', "'answer'"),
        ('{"text": "1+1=", "answer": "2"}', "'prompt'"),
        ('{"problem": "x", "solution": "no box here"}', "boxed"),
        ('{"question": "x", "answer": "no marker"}', "####"),
        ('{"prompt": "", "answer": "1"}', "non-empty"),
        ('["not", "an", "object"]', "JSON object"),
        ('{"id": "a", "prompt": "2+2=", "answer": "4"}', "duplicate id"),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path, bad_line, needle):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "prompt": "1+1=", "answer": "2"}, "", bad_line])
    with pytest.raises(ValueError) as e:
        load_records(path)
    msg = str(e.value)
    assert f"{path}:line 3" in msg and needle in msg, msg


def test_malformed_parquet_row_is_named(tmp_path):
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
        tmp_path / "bad.parquet",
    )
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: missing field 'answer'"):
        load_records(str(tmp_path / "bad.parquet"))


def test_sampler_is_seeded_and_covers_each_epoch():
    a = PromptSampler(10, 3, seed=5)
    b = PromptSampler(10, 3, seed=5)
    batches = [a.next_indices() for _ in range(9)]
    assert batches == [b.next_indices() for _ in range(9)]
    assert batches != [PromptSampler(10, 3, seed=6).next_indices() for _ in range(9)]
    for epoch in range(3):  # 3 full batches per epoch (the partial 4th is dropped), no repeats
        flat = sum(batches[3 * epoch : 3 * epoch + 3], [])
        assert len(set(flat)) == 9
    assert sum(batches[:3], []) != sum(batches[3:6], [])  # reshuffled each epoch


def test_sampler_resume_continues_same_order():
    full = PromptSampler(7, 2, seed=1)
    reference = [full.next_indices() for _ in range(10)]
    first = PromptSampler(7, 2, seed=1)
    head = [first.next_indices() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(7, 2, seed=1)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices() for _ in range(6)] == reference
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(7, 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError):
        PromptSampler(3, 4)


def test_sampler_draws_of_other_sizes_resume_exactly():
    """Extra rounds of another size (CPPO draws ~B/(1-P)) come from the same stream: a run
    resumed from any point draws exactly what the uninterrupted run drew."""
    sizes = [4, None, 7, 2, None, 11, 1, 4, 9, None, 3, 13, 5, None, 8, 6]
    full = PromptSampler(13, 4, seed=9)
    reference = [full.next_indices(n) for n in sizes]
    for got, n in zip(reference, sizes):
        assert len(got) == (n or 4) and len(set(got)) == len(got)
    # Within an epoch no index repeats: each epoch's draws are disjoint slices of one permutation.
    epochs, seen = 0, set()
    for got in reference:
        if seen & set(got):
            epochs, seen = epochs + 1, set()
        seen |= set(got)
    assert epochs >= 3 and full.epoch == epochs
    for cut in range(1, len(sizes)):
        first = PromptSampler(13, 4, seed=9)
        head = [first.next_indices(n) for n in sizes[:cut]]
        resumed = PromptSampler(13, 4, seed=9)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + [resumed.next_indices(n) for n in sizes[cut:]] == reference, cut
    # The default size is the batch size, unchanged from next_indices() without n.
    assert [PromptSampler(13, 4, seed=9).next_indices() for _ in range(1)] == [reference[0]]
    for bad in (0, 14, -1):
        with pytest.raises(ValueError, match=rf"cannot draw {bad} prompts.*\[1, 13\]"):
            PromptSampler(13, 4).next_indices(bad)


def test_dataset_batches_and_resume(tmp_path):
    paths = write_task_data("add3", str(tmp_path), n_train=50, n_test=10, seed=3)
    ds = PromptDataset(paths["train"], batch_size=8, seed=2)
    assert len(ds) == 50 and all(isinstance(r, PromptRecord) for r in ds.next_batch())
    state = ds.state_dict()
    nxt = [r.id for r in ds.next_batch()]
    ds2 = PromptDataset(paths["train"], batch_size=8, seed=2)
    ds2.load_state_dict(state)
    assert [r.id for r in ds2.next_batch()] == nxt
    extra = ds.next_batch(13)  # an extra round of another size
    assert len(extra) == 13 and len({r.id for r in extra}) == 13
    ds2.load_state_dict(ds.state_dict())
    assert [r.id for r in ds.next_batch(5)] == [r.id for r in ds2.next_batch(5)]


def test_task_splits_are_deterministic_disjoint_and_correct():
    s1 = make_splits("add3", seed=0, train=300, test=50)
    assert s1 == make_splits("add3", seed=0, train=300, test=50)
    assert s1 != make_splits("add3", seed=1, train=300, test=50)
    assert s1["train"][7]["id"] == "add3-000007" and s1["test"][0]["id"] == "add3-test-000000"
    assert not {r["prompt"] for r in s1["train"]} & {r["prompt"] for r in s1["test"]}
    for r in s1["train"]:
        a, b = map(int, r["prompt"][:-1].split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and r["answer"] == str(a + b)
    assert exact_match(" 579\n", "579") == 1.0 and exact_match("5790", "579") == 0.0


class _FakeChatTokenizer:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [len(text), int(add_special_tokens)]}


def test_renderer_raw_and_chat():
    rec = parse_record({"prompt": "1+1=", "answer": "2"})
    msg = parse_record({"messages": [{"role": "user", "content": "hi"}], "answer": "2"})
    tok = _FakeChatTokenizer()
    raw = PromptRenderer(tok, "raw")
    assert raw.text(rec) == "1+1=" and raw.token_ids(rec) == [4, 1]
    with pytest.raises(ValueError, match="chat"):
        raw.text(msg)
    chat = PromptRenderer(tok, "chat", system_prompt="Be brief.")
    assert chat.text(rec) == "<system>Be brief.<user>1+1=<assistant>"
    assert chat.text(msg) == "<system>Be brief.<user>hi<assistant>"
    assert chat.token_ids(msg)[1] == 0  # the template wrote the special tokens; none added again


TINY_MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model")
LIMIT_DESC = "rollout.max_model_len 32 - rollout.max_new_tokens 6"


@pytest.fixture(scope="module")
def tiny_renderer():
    from transformers import AutoTokenizer

    return PromptRenderer(AutoTokenizer.from_pretrained(TINY_MODEL), "raw")


def test_records_remember_their_line_or_row(tmp_path):
    recs = load_records(
        _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}, "", {"prompt": "b", "answer": "2"}])
    )
    assert [r.source for r in recs] == [f"{tmp_path / 'p.jsonl'}:line 1", f"{tmp_path / 'p.jsonl'}:line 3"]
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]), tmp_path / "p.parquet"
    )
    parquet = tmp_path / "p.parquet"
    assert [r.source for r in load_records(str(parquet))] == [f"{parquet}:row 1", f"{parquet}:row 2"]


def test_long_prompts_are_found_at_load_naming_file_line_and_id(tmp_path, tiny_renderer):
    long_prompt = "123+456=" * 4
    rows = [
        {"id": "ok1", "prompt": "1+2="},
        "",
        {"id": "long1", "prompt": long_prompt},
        {"id": "ok2", "prompt": "3+4="},
        {"prompt": long_prompt + "1"},
    ]
    path = _write_jsonl(tmp_path / "p.jsonl", [r if isinstance(r, str) else dict(r, answer="3") for r in rows])
    recs = load_records(path)
    # The reference count: the tokenizer itself (the tiny tokenizer adds <bos>).
    n_long = len(tiny_renderer.tokenizer(long_prompt)["input_ids"])
    limit = 26
    assert n_long > limit and len(tiny_renderer.tokenizer("1+2=")["input_ids"]) <= limit
    with pytest.raises(ValueError) as e:
        check_prompt_lengths(recs, tiny_renderer, limit, path, limit_desc=LIMIT_DESC)
    assert str(e.value) == (
        f"{path}:line 3 (id long1): prompt is {n_long} tokens, over the limit {limit} ({LIMIT_DESC})"
    )
    kept, skipped = check_prompt_lengths(recs, tiny_renderer, limit, path, skip=True)
    assert [r.id for r in kept] == ["ok1", "ok2"] and skipped == 2
    # Exactly at the limit is allowed.
    assert check_prompt_lengths(recs, tiny_renderer, n_long + 1, path) == (recs, 0)
    with pytest.raises(ValueError, match=r"p\.jsonl: every prompt is over the limit of 2 tokens"):
        check_prompt_lengths(recs, tiny_renderer, 2, path, skip=True)


def test_dataset_checks_lengths_once_at_load(tmp_path, tiny_renderer):
    paths = write_task_data("add3", str(tmp_path), n_train=40, n_test=4, seed=3)
    with open(paths["train"], "a") as f:
        f.write(json.dumps({"id": "too-long", "prompt": "999+999=" * 5, "answer": "0"}) + "\n")
    with pytest.raises(
        ValueError, match=r"train\.jsonl:line 41 \(id too-long\): prompt is \d+ tokens, over the limit 26"
    ):
        PromptDataset(paths["train"], batch_size=8, renderer=tiny_renderer, max_prompt_tokens=26)
    ds = PromptDataset(
        paths["train"], batch_size=8, renderer=tiny_renderer, max_prompt_tokens=26, skip_long_prompts=True
    )
    assert len(ds) == 40 and ds.skipped_long == 1 and "too-long" not in {r.id for r in ds.records}
    # When skipping leaves less than one batch, the error says how many were skipped.
    rows = [json.loads(line) for line in open(paths["train"])]
    for r in rows[3:]:
        r["prompt"] = r["prompt"] * 5
    _write_jsonl(tmp_path / "mostly_long.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=r"mostly_long\.jsonl: 3 prompts \(38 skipped as too long\), fewer than "
        r"one batch of 8",
    ):
        PromptDataset(
            str(tmp_path / "mostly_long.jsonl"),
            batch_size=8,
            renderer=tiny_renderer,
            max_prompt_tokens=26,
            skip_long_prompts=True,
        )


@pytest.mark.parametrize(
    "name, content, needle",
    [
        (
            "bad.jsonl",
            b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n',
            r"bad\.jsonl:line 2: not UTF-8 text \(invalid start byte at byte 12\)",
        ),
        ("bad.parquet", b"PAR1 this is not a parquet file", r"bad\.parquet: cannot read as Parquet: "),
        ("bad.csv", b"prompt,answer\n", r"bad\.csv: unsupported prompt file type '\.csv'"),
    ],
)
def test_unreadable_files_are_named(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=needle):
        load_records(str(tmp_path / name))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: prompt file not found"):
        load_records(str(tmp_path / "nope.jsonl"))


# ---- community layouts, file formats, several files (issue 19 item 1, issue 24's data cases) ----
from megatron_dppo.data.tasks import as_layout, write_jsonl, write_parquet  # noqa: E402


def _tasks(n=6):
    """Both bundled tasks' native records (the reference every other layout must read back to)."""
    return make_splits("add3", seed=1, train=n)["train"], make_splits("mulsteps", seed=1, train=n)["train"]


def _save_dataset(rows, path, num_shards=1, splits=None):
    """A real `datasets` save_to_disk dir (a Dataset, or a DatasetDict of `splits`)."""
    import datasets

    datasets.disable_progress_bars()
    columns = list(dict.fromkeys(k for r in rows for k in r))  # from_list keeps only the first row's keys
    rows = [{k: r.get(k) for k in columns} for r in rows]
    if splits is None:
        datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=num_shards)
    else:
        datasets.DatasetDict({s: datasets.Dataset.from_list(rows) for s in splits}).save_to_disk(str(path))
    return str(path)


def test_verl_parquet_of_both_tasks_reads_back_the_native_records(tmp_path):
    add, mul = _tasks()
    rows = as_layout(add, "verl", "add3") + as_layout(mul, "verl", "mulsteps")
    write_parquet(rows, str(tmp_path / "verl.parquet"))
    recs = load_records(str(tmp_path / "verl.parquet"))
    native = add + mul
    assert [r.messages for r in recs] == [[{"role": "user", "content": r["prompt"]}] for r in native]
    assert [r.answer for r in recs] == [r["answer"] for r in native] and all(r.prompt is None for r in recs)
    assert [r.data_source for r in recs] == ["add3"] * 6 + ["mulsteps"] * 6
    # Stable ids from the record's own index and source; extra_info and the other columns are kept.
    assert [r.id for r in recs] == [f"add3/{i}" for i in range(6)] + [f"mulsteps/{i}" for i in range(6)]
    assert recs[7].extra_info == {"index": 1, "split": "train"}
    assert recs[0].extra == {
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": add[0]["answer"]},
    }


@pytest.mark.parametrize("layout", ["native", "verl", "gsm8k", "math"])
def test_every_layout_reads_the_same_from_jsonl_parquet_and_datasets_dirs(tmp_path, layout):
    add, mul = _tasks()
    native = add + mul
    rows = as_layout(native, layout, "mix")
    paths = [_write_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "d.parquet")]
    write_parquet(rows, paths[1])
    paths.append(_save_dataset(rows, tmp_path / "ds", num_shards=3))  # shards are read in order
    paths.append(_save_dataset(rows, tmp_path / "dd", splits=["train"]))  # a one-split DatasetDict
    got = [load_records(p) for p in paths]
    for recs in got:
        assert recs == got[0], layout  # the record, not where it came from (source is not compared)
        assert [r.answer for r in recs] == [r["answer"] for r in native]
        assert [r.prompt or r.messages[0]["content"] for r in recs] == [r["prompt"] for r in native]
    assert got[2][4].source == f"{paths[2]}:row 5"


def test_datasets_dirs_that_cannot_be_read_are_named(tmp_path):
    add, _ = _tasks()
    two = _save_dataset(add, tmp_path / "two", splits=["train", "test"])
    with pytest.raises(ValueError, match=r"two: a datasets DatasetDict with splits \['train', 'test'\]: point at one"):
        load_records(two)
    assert [r.answer for r in load_records(str(tmp_path / "two" / "test"))] == [r["answer"] for r in add]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"plain: a directory, but not a dataset saved with datasets' save_to_disk"):
        load_records(str(tmp_path / "plain"))
    one = _save_dataset(add, tmp_path / "one")
    shard = next((tmp_path / "one").glob("data-*.arrow"))
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"data-00000-of-00001\.arrow: cannot read as an Arrow stream"):
        load_records(one)


def test_prompt_and_answer_keys_read_any_layout(tmp_path):
    rows = [{"q": {"text": f"{i}+1="}, "gt": {"value": i + 1}, "data_source": "custom", "level": i} for i in range(3)]
    path = _write_jsonl(tmp_path / "c.jsonl", rows)
    recs = load_records(path, prompt_key="q.text", answer_key="gt.value")
    assert [(r.prompt, r.answer, r.data_source) for r in recs] == [(f"{i}+1=", str(i + 1), "custom") for i in range(3)]
    assert recs[0].extra == {"q": {"text": "0+1="}, "gt": {"value": 1}, "level": 0}  # nested fields stay
    # A key overrides one field of a detected layout: verl's prompt from another column.
    verl = as_layout(_tasks()[0], "verl", "add3")
    for r in verl:
        r["raw_text"] = r["prompt"][0]["content"]
    write_parquet(verl, str(tmp_path / "v.parquet"))
    recs = load_records(str(tmp_path / "v.parquet"), prompt_key="raw_text")
    assert recs[0].prompt == verl[0]["raw_text"] and recs[0].answer == verl[0]["reward_model"]["ground_truth"]


@pytest.mark.parametrize(
    "row, keys, needle",
    [
        # missing prompt: the fields the row has are named
        ({"text": "1+1=", "answer": "2"}, {}, r"missing field 'prompt' .* \(the row has fields \['answer', 'text'\]\)"),
        # a ground truth of the wrong type
        (
            {"data_source": "s", "prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": [1]}},
            {},
            r"'reward_model\.ground_truth' must be a string or a number, got list",
        ),
        ({"prompt": "1+1=", "answer": {"v": 2}}, {}, r"'answer' must be a string or a number, got dict"),
        # a dotted key that is absent, at the first level and deeper
        (
            {"prompt": "1+1=", "reward_model": {"style": "rule"}},
            {"answer_key": "reward_model.ground_truth"},
            r"data\.answer_key 'reward_model\.ground_truth' is absent: no 'ground_truth' in 'reward_model' "
            r"\(it has \['style'\]\)",
        ),
        (
            {"prompt": "1+1=", "answer": "2"},
            {"prompt_key": "question.text"},
            r"data\.prompt_key 'question\.text' is absent",
        ),
        ({"messages": "hi", "answer": "2"}, {}, r"'messages' must be a non-empty list"),
        ({"prompt": "1+1=", "answer": "2", "extra_info": [1]}, {}, r"'extra_info' must be a mapping"),
    ],
)
def test_bad_rows_are_one_line_errors_naming_file_row_and_key(tmp_path, row, keys, needle):
    good = {"prompt": "0+0=", "answer": "0"}
    write_parquet([row], str(tmp_path / "bad.parquet"))  # (a Parquet column has one type in all rows)
    lines = [row] if keys else [good, good, row]  # (good rows lack the keys' fields)
    for path in (_write_jsonl(tmp_path / "bad.jsonl", lines), str(tmp_path / "bad.parquet")):
        with pytest.raises(ValueError) as e:
            load_records(path, **keys)
        msg = str(e.value)
        where = f"line {len(lines)}" if path.endswith(".jsonl") else "row 1"
        assert msg.startswith(f"{path}:{where}: ") and "\n" not in msg, msg
        assert re.search(needle, msg), msg


def test_a_verl_row_with_an_answer_column_is_read_as_verl(tmp_path):
    """Issue 24: a verl row that also has an `answer` column gave "prompt text must be a non-empty
    string". The ground truth is reward_model's; the answer column stays in extra."""
    row = as_layout(_tasks()[0][:1], "verl", "add3")[0]
    row["answer"] = "the worked answer"
    (rec,) = load_records(_write_jsonl(tmp_path / "v.jsonl", [row]))
    assert rec.answer == row["reward_model"]["ground_truth"] and rec.extra["answer"] == "the worked answer"


def test_a_messages_record_in_raw_mode_names_file_line_and_key(tmp_path, tiny_renderer):
    path = _write_jsonl(
        tmp_path / "m.jsonl",
        [{"prompt": "1+2=", "answer": "3"}, {"messages": [{"role": "user", "content": "1+2="}], "answer": "3"}],
    )
    recs = load_records(path)
    with pytest.raises(ValueError) as e:
        check_prompt_lengths(recs, tiny_renderer, 20, path)
    assert str(e.value) == (
        f"{path}:line 2 (id {recs[1].id}): the prompt is a list of chat messages, which data.prompt_mode=raw cannot "
        "render as text: set data.prompt_mode=chat (the tokenizer's chat template)"
    )


def test_several_training_files_are_concatenated_and_sampled_together(tmp_path):
    add, mul = _tasks(10)
    a = _write_jsonl(tmp_path / "add.jsonl", add)
    m = str(tmp_path / "mul.parquet")
    write_parquet(as_layout(mul, "verl", "mulsteps"), m)
    as_list = load_records([a, m])
    assert load_records(f"{a}, {m}") == as_list  # the comma-separated form
    assert [r.id for r in as_list] == [r["id"] for r in add] + [f"mulsteps/{i}" for i in range(10)]
    ds = PromptDataset([a, m], batch_size=5, seed=4)
    epoch = [r.id for _ in range(4) for r in ds.next_batch()]  # 4 draws of 5 = one epoch of 20
    assert sorted(epoch) == sorted(r.id for r in as_list)  # each file in proportion to its size
    # Explicit ids must be unique over all files (prompt history would mix them).
    write_jsonl(add[:2], str(tmp_path / "again.jsonl"))
    with pytest.raises(ValueError, match=rf"again\.jsonl:line 1: duplicate id 'add3-000000' \(first at {a}:line 1\)"):
        load_records([a, str(tmp_path / "again.jsonl")])
    with pytest.raises(ValueError, match="no prompt file"):
        load_records(" , ")


def test_chat_template_kwargs_reach_the_template_and_thinking_off_differs_as_designed(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    rec = parse_record({"prompt": "12+34=", "answer": "46"})
    raw = PromptRenderer(tok, "raw").token_ids(rec)
    assert raw == [tok.bos_token_id] + [tok.convert_tokens_to_ids(c) for c in "12+34="]  # the main job's ids
    assert PromptRenderer(tok, "chat").token_ids(rec) == raw
    assert PromptRenderer(tok, "chat", chat_template_kwargs={"enable_thinking": True}).token_ids(rec) == raw
    off = PromptRenderer(tok, "chat", chat_template_kwargs={"enable_thinking": False})
    # Thinking off: the generation prompt ends with an empty thinking block "()" (Qwen3: <think>\n\n</think>\n\n).
    assert off.text(rec) == "<bos>12+34=()"
    assert off.token_ids(rec) == raw + [tok.convert_tokens_to_ids("("), tok.convert_tokens_to_ids(")")]
    with pytest.raises(ValueError, match="data.chat_template_kwargs .* need data.prompt_mode=chat"):
        PromptRenderer(tok, "raw", chat_template_kwargs={"enable_thinking": False})
    # The committed longtail tokenizer has the same template.
    longtail = AutoTokenizer.from_pretrained(str(Path(TINY_MODEL).parent / "longtail" / "model"))
    assert longtail.chat_template == tok.chat_template


def test_renderer_decodes_completions_as_rewards_see_them(tiny_renderer):
    tok = tiny_renderer.tokenizer
    ids = tok("579", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tiny_renderer.decode(ids) == "579" == tok.decode(ids, skip_special_tokens=True)
    assert tiny_renderer.decode_all([ids, ids[:1]]) == ["579", "5"]


def test_numeric_ground_truths_become_the_text_a_reward_compares(tmp_path):
    """A float ground truth with an integral value (1458.0: pandas' int column with nulls) is read
    as "1458"; other numbers as their text; NaN is refused naming the field and the row."""
    import pandas as pd

    add, _ = _tasks(3)
    rows = as_layout(add, "verl", "addsrc")
    path = str(tmp_path / "float.parquet")
    frame = pd.DataFrame(rows)
    frame["reward_model"] = [{"style": "rule", "ground_truth": v} for v in (1458.0, 0.5, 7)]
    frame.to_parquet(path)
    answers = [r.answer for r in load_records(path)]
    assert answers == ["1458", "0.5", "7"]
    # the reward that reads them: an exact match of the completion's "1458"
    assert exact_match("1458", answers[0]) == 1.0
    bad = _write_jsonl(tmp_path / "nan.jsonl", [{"prompt": "1+1=", "answer": float("nan")}])
    with pytest.raises(ValueError, match=r"nan\.jsonl:line 1: 'answer' must be a finite number or a string, got nan"):
        load_records(bad)


def test_verl_index_ids_repeated_across_files_get_the_file_name(tmp_path):
    """Two train shards of one data_source, each indexed 0..n-1 (verl's layout): every index id
    gets its file's name; a repeat inside one file is an error saying what the id is made of."""
    add, _ = _tasks(8)
    a, b = str(tmp_path / "shard0.parquet"), str(tmp_path / "shard1.parquet")
    write_parquet(as_layout(add[:4], "verl", "addsrc"), a)
    write_parquet(as_layout(add[4:], "verl", "addsrc"), b)
    ids = [r.id for r in load_records([a, b])]
    assert ids == [f"shard0.parquet:addsrc/{i}" for i in range(4)] + [f"shard1.parquet:addsrc/{i}" for i in range(4)]
    assert [r.id for r in load_records(a)] == [f"addsrc/{i}" for i in range(4)]  # one file: as before
    (tmp_path / "x").mkdir(), (tmp_path / "y").mkdir()  # shards of one name in two folders
    x, y = str(tmp_path / "x" / "train.parquet"), str(tmp_path / "y" / "train.parquet")
    write_parquet(as_layout(add[:2], "verl", "addsrc"), x)
    write_parquet(as_layout(add[2:4], "verl", "addsrc"), y)
    assert [r.id for r in load_records([x, y])] == [f"{d}/train.parquet:addsrc/{i}" for d in "xy" for i in range(2)]
    same = as_layout(add[:2], "verl", "addsrc")
    same[1]["extra_info"]["index"] = 0
    dup = str(tmp_path / "dup.parquet")
    write_parquet(same, dup)
    with pytest.raises(ValueError) as e:
        load_records(dup)
    assert str(e.value) == (
        f"{dup}:row 2: duplicate id 'addsrc/0' (first at {dup}:row 1): the id is data_source + '/' + "
        "extra_info.index (the file's name is prefixed only when index ids repeat across files); give each "
        "record of a source its own extra_info.index, or an 'id' field"
    )


def test_prompts_that_are_mostly_unknown_tokens_are_a_warning_naming_them(tmp_path, tiny_renderer):
    rows = [{"id": f"p{i}", "prompt": p, "answer": "1"} for i, p in enumerate(["12+34=", "héllo wörld", "1+é="])]
    path = _write_jsonl(tmp_path / "unk.jsonl", rows)
    ds = PromptDataset(path, batch_size=1, renderer=tiny_renderer, max_prompt_tokens=20)
    # the tiny tokenizer knows digits and + - * / = ( ): "héllo wörld" is 11 <unk> of 11, "1+é=" 1 of 4
    assert ds.warnings == [
        f"warning: 1 prompt(s) of {path} are mostly the tokenizer's unknown token <unk> (characters it has no "
        f"token for; check the data's language and encoding): {path}:line 2 (id p1): 11 of 11 tokens"
    ]
    assert (
        PromptDataset(
            _write_jsonl(tmp_path / "ok.jsonl", rows[:1]), 1, renderer=tiny_renderer, max_prompt_tokens=20
        ).warnings
        == []
    )
