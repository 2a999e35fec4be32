"""LoRA in real training runs (model.lora, megatron/lora.py): the rollout engine serves the adapters
the policy trains (vLLM's log-probs equal the trainer's at every step), a checkpoint holds the
adapters and their optimizer state only, --resume continues exactly and refuses another base model
or another adapter shape by name, and the HF export is a PEFT adapter directory that PEFT loads
onto the base and that reproduces the trained policy."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from trainer_runs import (
    TINY,
    assert_same_rollouts,
    metrics,
    rel_close,
    rollouts,
    run,
    run_env,
    small_train_cmd,
    train_cmd,
)

from megatron_dppo.megatron.dcp_metadata import read_dcp_metadata
from megatron_dppo.model.peft_dir import read_peft_adapter

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "examples" / "tiny" / "model"
# the adapters' sync (the CPU's default is merged weights: test_merged_sync_serves_the_same_policy)
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapters", "optim.lr=1e-3", "data.train_size=8"]


def _run(out, name, *overrides, resume=False, ok=True):
    res = run_cli(small_train_cmd(out, name, *LORA, *overrides, resume=resume), run_env())
    if ok:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def _metrics(run_dir: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step LoRA run, and the same run stopped after step 2 and resumed to step 4."""
    out = tmp_path_factory.mktemp("lora")
    steps = ["trainer.max_steps=4", "trainer.save_hf_every=4"]
    _run(out, "ref", *steps)
    _run(out, "cut", "trainer.max_steps=2", "trainer.save_every=2")
    _run(out, "cut", *steps, resume=True)
    return out


def test_engine_serves_the_trained_adapters_at_every_step(runs):
    """vLLM samples with the adapters of the last update: its log-probs of the sampled tokens equal
    the trainer's (fp32, the tiny model) at every step, also after the adapters moved."""
    rows = _metrics(runs / "ref")
    assert sorted(rows) == [1, 2, 3, 4]
    for step, row in rows.items():
        assert row["train/logprob_gap_vllm"] < 1e-4, (step, row["train/logprob_gap_vllm"])
    assert rows[4]["time/sync"] > 0


def test_checkpoint_holds_the_adapters_only_and_resume_continues_exactly(runs):
    ckpt = runs / "cut" / "checkpoints" / "step_000004"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora"]["rank"] == 8 and state["resume"]["settings"]["model.lora.rank"] == 8
    keys = list(read_dcp_metadata(str(ckpt / "model_optim")).state_dict_metadata)
    weights = [k for k in keys if not k.startswith("optimizer.")]
    assert len(weights) == 3 * 7 * 2 and all(k.startswith("lora_adapters.model.layers.") for k in weights), weights[:3]
    assert all("lora_adapters." in k for k in keys), [k for k in keys if "lora_adapters." not in k][:3]  # Adam too
    ref, got = _metrics(runs / "ref"), _metrics(runs / "cut")
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "reward/mean"):
            assert abs(got[step][key] - ref[step][key]) <= 1e-5 * max(1.0, abs(ref[step][key])), (step, key)
    a, _ = read_peft_adapter(runs / "ref" / "hf" / "step_000004")
    b, _ = read_peft_adapter(runs / "cut" / "hf" / "step_000004")
    assert a.keys() == b.keys() and len(a) == 3 * 7 * 2  # 3 layers x 7 modules x (A, B)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    assert any(float(a[k].abs().max()) > 0 for k in a if k.endswith("lora_B.weight"))  # B moved from 0


def test_peft_loads_the_export_onto_the_base_and_it_is_the_trained_policy(runs):
    """The export (hf/step_000004) is a PEFT adapter dir: PeftModel.from_pretrained loads it onto the
    base, where it changes the logits, and its merged weights give the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 9, 12, 7, 3, 11, 4]])
    with torch.no_grad():
        base_logits = base(tokens).logits
    model = PeftModel.from_pretrained(base, str(runs / "ref" / "hf" / "step_000004")).eval()
    with torch.no_grad():
        lora_logits = model(tokens).logits
    merged = model.merge_and_unload()
    with torch.no_grad():
        merged_logits = merged(tokens).logits
    assert float((lora_logits - base_logits).abs().max()) > 1e-4  # the adapters act
    assert torch.allclose(merged_logits, lora_logits, atol=1e-5)


def test_resume_refuses_another_adapter_shape_or_base_model(runs, tmp_path):
    res = _run(runs, "cut", "trainer.max_steps=5", "model.lora.rank=4", resume=True, ok=False)
    assert res.returncode != 0
    assert "model.lora.rank=4, but the run was trained with 8" in res.stderr, res.stderr[-2000:]
    other = tmp_path / "other-base"
    shutil.copytree(TINY_MODEL, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    weights = {k: v + 0.01 if k.endswith("mlp.down_proj.weight") else v for k, v in weights.items()}
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    res = _run(runs, "cut", "trainer.max_steps=5", f"model.hf_dir={other}", resume=True, ok=False)
    assert res.returncode != 0
    assert "is not the model the run was trained from" in res.stderr and "its weights differ" in res.stderr


def test_lora_config_errors_are_named_at_start_up(tmp_path):
    res = _run(tmp_path, "te", "model.attention=te", ok=False)
    assert res.returncode != 0 and "config key 'model.attention'" in res.stderr
    res = _run(tmp_path, "init", "model.init_checkpoint=/nonexistent", ok=False)
    assert res.returncode != 0 and "config key 'model.init_checkpoint'" in res.stderr


def test_dedicated_rollout_rank_gets_the_adapters_and_equals_the_colocated_run(tmp_path):
    """1 training + 1 rollout process at staleness 0: the adapters go over the weights bridge after
    every update, and the run equals the colocated one token for token (step 2 is sampled with the
    adapters of update 1), with vLLM's log-probs the trainer's."""
    lora = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapters", "optim.lr=1e-3"]
    run(train_cmd(tmp_path, "colocated", TINY / "model", 1, *lora))
    res = run(train_cmd(tmp_path, "dedicated", TINY / "model", 2, *lora, "parallel.rollout_ranks=1"))
    assert "1 training + 1 rollout process(es)" in res.stdout + res.stderr
    ref, got = metrics(tmp_path / "colocated"), metrics(tmp_path / "dedicated")
    for step in (1, 2):
        assert_same_rollouts(rollouts(tmp_path / "dedicated", step), rollouts(tmp_path / "colocated", step))
        assert got[step]["train/logprob_gap_vllm"] < 1e-4
        for key in ("train/loss", "train/grad_norm", "reward/mean"):
            assert rel_close(got[step][key], ref[step][key], rel=1e-6), (step, key)


def test_merged_sync_serves_the_same_policy(runs, tmp_path):
    """model.lora.sync=merged (the CPU's default): vLLM gets W + alpha/r B A as full weights and no
    LoRA slot; its log-probs are still the trainer's at every step, the start-up line says so, and
    the run trains as the adapters-synced one does (same losses: the policy is the same)."""
    res = _run(tmp_path, "merged", "trainer.max_steps=4", "model.lora.sync=merged")
    assert "LoRA: merged weights synced to vLLM (model.lora.sync=merged)" in res.stdout + res.stderr
    got, ref = _metrics(tmp_path / "merged"), _metrics(runs / "ref")
    for step in (1, 2, 3, 4):
        assert got[step]["train/logprob_gap_vllm"] < 1e-4, (step, got[step]["train/logprob_gap_vllm"])
        assert got[step]["sync/bytes"] > ref[step]["sync/bytes"]  # every weight, not the adapters
        assert abs(got[step]["train/loss"] - ref[step]["train/loss"]) <= 1e-4 * max(1.0, abs(ref[step]["train/loss"]))
