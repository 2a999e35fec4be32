"""`megatron-dppo plan` with dedicated rollout ranks (issue 32, item 3): memory per training GPU
and per rollout GPU, the step time colocated against dedicated, and the counts that do not divide.
The trainer's start-up refusal of parallel.rollout_ranks > 0 is in tests/unit/test_preflight.py."""

import json
import math
from pathlib import Path

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.jobs.plan import Arch, load_hf_config, memory_plan, plan_main, sync_peak_bytes
from megatron_dppo.jobs.plan_step import StepInputs, step_times
from megatron_dppo.model.vocab import padded_vocab_size

REPO = Path(__file__).resolve().parents[2]
DENSE = REPO / "examples" / "presets" / "qwen3_32b_disagg.yaml"
MOE = REPO / "examples" / "presets" / "qwen3_30b_a3b_disagg.yaml"
GiB = 1 << 30


def _cfg(path, *overrides):
    return load_config(str(path), list(overrides))


def _transformers_model(path):
    """The transformers model of the preset's config.json on the meta device (nothing allocated):
    counts independent of Arch."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = load_hf_config(_cfg(path).model.hf_dir)
    d = {k: v for k, v in d.items() if k != "transformers_version"}
    config, model = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if d.get("num_experts") else (Qwen3Config, Qwen3ForCausalLM)
    with torch.device("meta"):
        return model(config(**d))


def _transformers_params(path) -> int:
    return sum(p.numel() for p in _transformers_model(path).parameters())


@pytest.mark.parametrize("path", [DENSE, MOE], ids=lambda p: p.stem)
def test_training_gpu_is_the_colocated_plan_at_the_training_layout_without_vllm(path):
    """A training GPU of 16 + R holds what a colocated GPU of the same 16-GPU layout holds in
    training (the optimizer shard over DP of the 16, not of the whole world); its second phase is
    that resident state plus the sync's sending side only (no vLLM share, no vLLM reload)."""
    cfg = _cfg(path)
    plan = memory_plan(cfg)
    par, lay = cfg.parallel, plan["layout"]
    assert (lay["gpus"], lay["train_gpus"], lay["rollout_gpus"]) == (16 + par.rollout_ranks, 16, par.rollout_ranks)
    colocated = memory_plan(_cfg(path, "parallel.rollout_ranks=0", "parallel.nodes=2"))
    assert colocated["layout"]["gpus"] == 16 and colocated["layout"]["dp"] == plan["layout"]["dp"]
    arch = Arch.from_hf(load_hf_config(cfg.model.hf_dir))
    sync = sync_peak_bytes(arch, 2, tp=par.tp, ep=par.ep, etp=par.etp, rollout_tp=par.rollout_tp)
    for name, s in plan["stages"].items():
        c = colocated["stages"][name]
        assert s["train"] == c["train"]
        assert "vllm" not in s["generate"] and c["generate"]["vllm"] > 0
        assert s["generate"]["weight_sync"] == sync["trainer"] < c["generate"]["weight_sync"]
        resident = ("weights", "gradients", "optimizer", "reference")
        assert all(s["generate"][k] == c["generate"][k] for k in resident)
        # by hand: bf16 weights, fp32 grads, Adam 12 B a parameter over DP (experts over expert DP)
        assert s["train"]["weights"] == 2 * s["params"] and s["train"]["gradients"] == 4 * s["params"]
        dense = s["params"] - s["expert_params"]
        assert math.isclose(s["train"]["optimizer"], 12 * (dense / lay["dp"] + s["expert_params"] / lay["edp"]))
    assert lay["dp"] == 16 // (par.tp * par.pp)


@pytest.mark.parametrize("path", [DENSE, MOE], ids=lambda p: p.stem)
def test_rollout_gpu_holds_vllms_share_of_the_whole_gpu_and_the_arriving_bucket(path):
    """vLLM's weights on a rollout GPU = the model's bf16 bytes (transformers' count) / rollout_tp;
    its share is gpu_memory_utilization of the whole GPU; the weights arriving are one bucket of
    the sync: the 1 GiB bucket or the largest unit gathered whole, a decoder layer (all its
    experts) or the output head with the final norm (Megatron's padded vocabulary)."""
    cfg = _cfg(path)
    plan, par = memory_plan(cfg), cfg.parallel
    v, r = plan["vllm"], plan["rollout_gpu"]
    assert v["weights"] == _transformers_params(path) * 2 / par.rollout_tp
    assert r["rows"]["vllm"] == cfg.rollout.gpu_memory_utilization * 80 * GiB
    arch = Arch.from_hf(load_hf_config(cfg.model.hf_dir))
    assert not arch.tied
    head = padded_vocab_size(arch.vocab, par.tp) * arch.hidden + arch.hidden
    layer = max(sum(p.numel() for p in m.parameters()) for m in _transformers_model(path).model.layers)
    assert r["rows"]["weight_receive"] == max(GiB, 2 * head, 2 * layer) > GiB
    assert r["total"] == sum(r["rows"].values()) < 80 * GiB
    assert v["kv_cache"] == r["rows"]["vllm"] - v["weights"] - v["runtime"]
    # the step's sequences over the engines of the rollout GPUs only
    engines = par.rollout_ranks // par.rollout_tp
    assert v["seqs_needed"] == math.ceil(cfg.trainer.prompts_per_step * cfg.rollout.group_size / engines)
    assert plan["fits"]


def test_presets_plan_and_print_both_kinds_of_gpu(capsys):
    for path, rollout in ((DENSE, 16), (MOE, 8)):
        assert plan_main(["--config", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"16 training GPUs, {rollout} rollout GPUs" in out and "per rollout GPU:" in out and "FITS" in out
        assert "a dedicated engine never sleeps" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.rollout_ranks=6"],  # 26 training ranks: TP 8 does not divide them; 6 % 4
            "parallel.tp=8 x parallel.pp=1 must divide the training ranks 26 (world 32 - parallel.rollout_ranks=6)",
        ),
        (["parallel.rollout_ranks=6"], "parallel.rollout_tp=4 must divide parallel.rollout_ranks=6"),
        (["parallel.rollout_ranks=32"], "parallel.rollout_ranks=32 must leave training ranks"),
        (["parallel.rollout_ranks=-1"], "config key 'parallel.rollout_ranks'"),
    ],
)
def test_counts_that_do_not_divide_are_refused_naming_the_field(overrides, message, capsys):
    assert plan_main(["--config", str(DENSE), *overrides]) == 2
    out = capsys.readouterr().out
    assert message in out and out.count("\n") == 1


def test_a_rollout_gpu_that_does_not_fit_is_refused():
    plan = memory_plan(_cfg(DENSE, "rollout.gpu_memory_utilization=0.97"))
    assert not plan["fits"] and any(p.startswith("a rollout GPU needs") for p in plan["problems"])
    assert plan["rollout_gpu"]["total"] > 80 * GiB


STEP_FLAGS = [
    "--generated-tokens=1000000",
    "--trained-tokens=3000000",
    "--gen-tokens-per-s=700",
    "--train-tokens-per-s=2500",
    "--dedicated-gen-tokens-per-s=1100",
    "--transfer-gb-per-s=25",
    "--sync-gb-per-s=100",
]


def test_step_time_is_the_formula_of_the_printed_inputs(capsys):
    """The step times against a hand computation from the inputs the plan prints: colocated on all
    24 GPUs, dedicated 16 + 8 with the rollout's dedicated rate, weights = transformers' count x 2 B."""
    assert plan_main(["--config", str(MOE), *STEP_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "generated tokens per step 1,000,000 (given)" in out and "trained tokens per step 3,000,000 (given)" in out
    assert "generation 700 tokens/s, training (log-prob + update) 2500 tokens/s" in out
    assert "per dedicated GPU: generation 1100 tokens/s, training 2500 tokens/s (not given: the colocated rate)" in out
    W = _transformers_params(MOE) * 2
    assert f"weights {W / 1e9:.1f} GB; colocated sync 100 GB/s; transfer to the rollout ranks 25 GB/s" in out
    colocated = 1e6 / (700 * 24) + 3e6 / (2500 * 24) + W / 100e9
    r, t, x = 1e6 / (1100 * 8), 3e6 / (2500 * 16), W / 25e9
    by_hand = {"colocated": colocated, "staleness 0": r + t + x, "staleness 1": max(r, t) + x}
    assert plan_main(["--config", str(MOE), "--json", *STEP_FLAGS]) == 0
    st = json.loads(capsys.readouterr().out)["step_time"]
    for key, want in by_hand.items():
        assert math.isclose(st["rows"][key]["step_s"], want, rel_tol=1e-12), key
    one = st["rows"]["staleness 1"]
    assert math.isclose(one["idle_train"], (max(r, t) - t) / by_hand["staleness 1"]) and r > t
    assert math.isclose(one["idle_rollout"], 0.0, abs_tol=1e-12)  # the rollout side is the longer
    a, b = 1e6 / 1100, 3e6 / 2500
    assert math.isclose(st["balanced_rollout_gpus"], 24 * a / (a + b))
    ratio = f"{colocated / (r + t + x):.2f} at staleness 0, {colocated / (max(r, t) + x):.2f} at staleness 1"
    assert plan_main(["--config", str(MOE), *STEP_FLAGS]) == 0
    assert ratio in capsys.readouterr().out


def test_equal_rates_never_beat_colocated_but_the_weight_move():
    """With the same per-GPU rates on dedicated GPUs, max(a / R, b / (N - R)) >= (a + b) / N at
    every split R: the staleness-1 step is at least the colocated step with the sync swapped for
    the transfer, and equals it at the balanced split."""
    inp = StepInputs(2_000_000, 3_000_000, 900.0, 1500.0, transfer_gb_per_s=50.0)
    W = 65e9
    for R in range(1, 32):
        st = step_times(inp, gpus=32, rollout_gpus=R, weight_bytes=W)
        rows = st["rows"]
        assert rows["staleness 1"]["step_s"] >= rows["colocated"]["step_s"] - 1e-9  # sync and transfer equal here
        assert rows["staleness 0"]["step_s"] > rows["staleness 1"]["step_s"]
    assert math.isclose(st["balanced_step_s"], rows["colocated"]["step_s"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gen-tokens-per-s=900"], "--train-tokens-per-s: the step time needs both measured rates"),
        (["--gen-tokens-per-s=0", "--train-tokens-per-s=1", "--transfer-gb-per-s=1"], "--gen-tokens-per-s: expected"),
        (["--gen-tokens-per-s=9", "--train-tokens-per-s=1", "--sync-gb-per-s=1"], "--transfer-gb-per-s: dedicated"),
        (["--gen-tokens-per-s=9", "--train-tokens-per-s=1"], "--transfer-gb-per-s: the step time needs"),
    ],
)
def test_step_time_inputs_that_cannot_be_used_are_named(flags, message, capsys):
    assert plan_main(["--config", str(DENSE), *flags]) == 2
    assert message in capsys.readouterr().out


def test_colocated_config_prints_the_colocated_step_and_the_balanced_split(capsys):
    preset = REPO / "examples" / "presets" / "qwen3_32b.yaml"
    args = ["--gen-tokens-per-s=700", "--train-tokens-per-s=2500", "--sync-gb-per-s=100"]
    assert plan_main(["--config", str(preset), *args]) == 0
    out = capsys.readouterr().out
    assert "colocated" in out and "staleness" not in out and "balanced split of the 32 GPUs" in out
