"""examples/smollm2: the task tool's Parquet files and the final-number reward.

The committed data equal a fresh run of tools/make_smollm2_task.py (so the files are what the
tool says they are), the splits are disjoint and read by the trainer's own loader as verl chat
records whose answer is a + b computed here, and the reward reads the final answer the way its
docstring says (\\boxed, then ####, then the last number), checked on completions written out by hand.
"""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from shared_helpers import load_tool

from megatron_dppo.data.prompts import load_records

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "smollm2" / "data"


tool = load_tool("make_smollm2_task")
reward = load_tool(REPO / "examples" / "smollm2" / "reward.py", module_name="smollm2_reward")


def test_committed_data_is_the_tools_output_and_the_splits_are_disjoint(tmp_path):
    assert tool.main(["--out", str(tmp_path)]) == 0
    for split in ("train", "test"):
        assert pq.read_table(tmp_path / f"{split}.parquet").equals(pq.read_table(DATA / f"{split}.parquet")), split
    records = {s: load_records([str(DATA / f"{s}.parquet")]) for s in ("train", "test")}
    assert len(records["train"]) == 1800 and len(records["test"]) == 200
    pairs = {}
    for split, recs in records.items():
        pairs[split] = set()
        for r in recs:
            a, b = r.extra_info["a"], r.extra_info["b"]
            assert r.prompt is None and r.messages == [
                {"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}
            ]
            assert r.answer == str(a + b) and 1 <= a <= 49 and 1 <= b <= 49
            assert r.data_source == "smollm2/addition"
            pairs[split].add((a, b))
        assert len(pairs[split]) == len(recs)  # no problem twice within a split
    assert not pairs["train"] & pairs["test"]


def test_too_many_problems_for_the_range_is_a_named_error(tmp_path):
    with pytest.raises(SystemExit, match="distinct pairs in \\[1, 3\\]"):
        tool.main(["--out", str(tmp_path), "--hi", "3", "--train", "8", "--test", "2"])


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("13 + 34 = 47", "47"),
        ("47", "47"),
        ("The sum is 1,234.", "1234"),
        ("First 12, then \\boxed{47} and later 99", "47"),  # \boxed wins over later numbers
        ("#### 47\nor maybe 50", "47"),  # the line after ####, not the last number
        ("13 + 34 = 45, no wait: 47", "47"),  # the answer it ends on
        ("I cannot add these.", None),
        ("-3 is the answer", "-3"),
    ],
)
def test_final_number(completion, expected):
    assert reward.final_number(completion) == expected


def test_reward_compares_numbers_not_strings():
    assert reward.final_number_reward("13 + 34 = 47.0", "47") == 1.0
    assert reward.final_number_reward("13 + 34 = 47", "47") == 1.0
    assert reward.final_number_reward("13 + 34 = 46", "47") == 0.0
    assert reward.final_number_reward("no number", "47") == 0.0


def test_the_lora_example_is_the_dppo_example_with_adapters():
    """examples/smollm2/lora.yaml differs from dppo.yaml only in model.lora, the learning rate and the
    run name, so the two compare LoRA with the full fine-tune and nothing else."""
    from megatron_dppo.config.load import load_config, to_dict

    full, lora = (to_dict(load_config(str(REPO / "examples" / "smollm2" / f"{n}.yaml"))) for n in ("dppo", "lora"))
    assert lora["model"].pop("lora")["rank"] == 16 and full["model"].pop("lora")["rank"] == 0
    assert (lora["optim"].pop("lr"), full["optim"].pop("lr")) == (2e-4, 2e-5)
    assert lora["trainer"].pop("run_name") == full["trainer"].pop("run_name") + "-lora"
    assert lora == full
