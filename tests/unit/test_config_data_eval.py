"""The data, eval and sampling keys of the config (issue 19): containers, merging, named errors."""

import pytest
import yaml
from tiny_config import FACTS, TINY

from megatron_dppo.config import load_config, resolve, save_config


def test_data_train_is_a_path_a_list_or_comma_separated(tmp_path):
    assert load_config(TINY, ["data.train=[a.jsonl, b.parquet]"]).data.train == ["a.jsonl", "b.parquet"]
    assert load_config(TINY, ["data.train=a.jsonl,b.parquet"]).data.train == "a.jsonl,b.parquet"
    with pytest.raises(ValueError, match=r"'data.train\[1\]': expected str, got 3"):
        load_config(TINY, ["data.train=[a.jsonl, 3]"])
    with pytest.raises(ValueError, match="'data.train': expected a path"):
        load_config(TINY, ["data.train=[]"])


def test_mappings_merge_and_lists_replace(tmp_path):
    path = tmp_path / "c.yaml"
    data = yaml.safe_load(open(TINY))
    data["data"].update(prompt_mode="chat", chat_template_kwargs={"enable_thinking": False, "x": 1})
    data["eval"] = {"sets": {"a": "a.jsonl"}, "n": 4, "temperature": 0.7, "pass_k": [1, 4]}
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(str(path), ["data.chat_template_kwargs.enable_thinking=true", "eval.sets.b=b.parquet"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": True, "x": 1}
    assert cfg.eval.sets == {"a": "a.jsonl", "b": "b.parquet"}
    assert load_config(str(path), ["eval.pass_k=[2]"]).eval.pass_k == [2]
    # The saved config loads back to the same one.
    resolved = resolve(cfg, **FACTS)
    save_config(resolved, tmp_path / "saved.yaml")
    assert load_config(str(tmp_path / "saved.yaml")) == resolved


def test_sampling_keys():
    cfg = load_config(TINY, ["rollout.top_k=5", 'rollout.stop=["\\n", "####"]'])  # YAML "\\n": a newline
    assert cfg.rollout.top_k == 5 and cfg.rollout.stop == ["\n", "####"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.chat_template_kwargs={enable_thinking: false}"],
            "'data.chat_template_kwargs': expected no entries unless data.prompt_mode=chat",
        ),
        (["rollout.top_k=-1"], "'rollout.top_k': expected an integer >= 0"),
        (["rollout.stop=['']"], "'rollout.stop': expected a list of non-empty strings"),
        (["rollout.stop=x"], "'rollout.stop': expected a list, got 'x'"),
        (["eval.n=0"], "'eval.n': expected an integer >= 1"),
        (["eval.n=4"], r"'eval.temperature': expected a number > 0, or 0 \(greedy\) with eval.n=1 \(eval.n is 4\)"),
        (["eval.temperature=-1"], "'eval.temperature'"),
        (["eval.top_p=0"], "'eval.top_p'"),
        (
            ["eval.n=4", "eval.temperature=1", "eval.pass_k=[1,8]"],
            r"'eval.pass_k': expected a non-empty list of integers in \[1, eval.n=4\]",
        ),
        (["eval.pass_k=[]"], "'eval.pass_k'"),
        (["eval.sets={a/b: x.jsonl}"], "'eval.sets': expected a mapping of set names"),
        (["eval.sets={all: x.jsonl}"], "'eval.sets'"),
        (["eval.sets={eval: x.jsonl}"], "'eval.sets': expected no set named 'eval' when data.eval is given"),
        (["eval.sets=x.jsonl"], "'eval.sets': expected dict, got 'x.jsonl'"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY, overrides)
