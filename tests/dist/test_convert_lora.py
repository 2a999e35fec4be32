"""tools/convert_megatron_to_hf.py on a LoRA run's checkpoint (issue 47): the adapters only, under
their HF module names, with the base the run recorded (path and weights fingerprint).

  * by default OUT is a PEFT adapter dir that peft.PeftModel.from_pretrained loads onto the base;
  * with --merge-lora OUT is an HF model dir that transformers loads: its logits are the PEFT
    model's, its weights peft's own merge_and_unload of that dir (the independent reference);
  * --base-dir names the base when the recorded one moved; a base with other weights (one tensor
    changed) is refused naming both paths and the fingerprints (the wrong base merged without a
    word is Miles PR #1087), a missing one is refused when merging;
  * --merge-lora on a full-model checkpoint is a one-line error; OUT's rules hold for both.

One tiny LoRA run (2 steps, rank 8) and one run_tools worker that runs every conversion through
the tool's main(); the tests read what it wrote.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_torchrun
from trainer_runs import run_env, small_train_cmd
from worker_results import safetensors_weights as _weights

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "examples" / "tiny" / "model"
TO_MG = REPO / "tools" / "convert_hf_to_megatron.py"
TO_HF = REPO / "tools" / "convert_megatron_to_hf.py"
RUN_TOOLS = REPO / "tests" / "dist" / "workers" / "convert" / "run_tools.py"
TOKENS = torch.tensor([[5, 9, 12, 7, 3, 11, 4, 8]])


def _train(root: Path) -> Path:
    lora = ["model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-3"]
    cmd = small_train_cmd(
        root, "tiny-addition-dppo", "trainer.max_steps=2", "data.train_size=8", *lora, "trainer.save_every=2"
    )
    res = run_cli(cmd, run_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return root / "tiny-addition-dppo" / "checkpoints" / "step_000002"


def _moved_base_copy(ckpt: Path, dst: Path, gone: Path) -> Path:
    """A copy of the checkpoint whose recorded base is `gone` (as if the base dir had moved); the
    manifest's size of trainer_state.json follows, so the copy passes the checkpoint check."""
    shutil.copytree(ckpt, dst)
    state = json.loads((dst / "trainer_state.json").read_text())
    state["resume"]["model"]["hf_dir"] = str(gone)
    (dst / "trainer_state.json").write_text(json.dumps(state, indent=1))
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = (dst / "trainer_state.json").stat().st_size
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return dst


def _other_base(dst: Path) -> Path:
    """The tiny model with one tensor changed: the same architecture, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY_MODEL, dst)
    weights = load_file(dst / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.01
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{name: {"status", "stdout", "stderr"}} of each conversion, and the paths they used."""
    root = tmp_path_factory.mktemp("convert_lora")
    ckpt = _train(root / "run")
    gone, copy = root / "gone-base", root / "base-copy"
    shutil.copytree(TINY_MODEL, copy)
    moved = _moved_base_copy(ckpt, root / "moved-ckpt", gone)
    wrong = _other_base(root / "other-base")
    busy = root / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    p = {"root": root, "ckpt": ckpt, "gone": gone, "copy": copy, "moved": moved, "wrong": wrong, "busy": busy}

    def merge(name, src, *flags):
        return [name, TO_HF, ["--megatron-dir", src, "--out-dir", root / name, "--merge-lora", *flags]]

    def peft(name, src, *flags):
        return [name, TO_HF, ["--megatron-dir", src, "--out-dir", root / name, *flags]]

    plan = [
        peft("peft", ckpt),
        merge("merged", ckpt),
        peft("peft_moved", moved),
        peft("peft_base_dir", moved, "--base-dir", copy),
        merge("merged_moved", moved),
        merge("merged_base_dir", moved, "--base-dir", copy),
        merge("merged_wrong", ckpt, "--base-dir", wrong),
        peft("peft_wrong", ckpt, "--base-dir", wrong),
        merge("merged_missing", ckpt, "--base-dir", root / "nonexistent"),
        ["into_busy", TO_HF, ["--megatron-dir", ckpt, "--out-dir", busy]],
        ["full_mg", TO_MG, ["--hf-dir", TINY_MODEL, "--out-dir", root / "full"]],
        merge("merged_full", root / "full"),
    ]
    plan_file, out = root / "plan.json", root / "results.json"
    plan_file.write_text(json.dumps([[n, str(t), list(map(str, a))] for n, t, a in plan]))
    run_torchrun(RUN_TOOLS, 1, plan_file, out, timeout=600)
    return {"runs": json.loads(out.read_text()), **p}


def _ok(run: dict) -> str:
    out = run["stdout"] + run["stderr"]
    assert run["status"] == 0, out[-6000:]
    return out


def _refused(run: dict) -> str:
    """A refusal: status 2 and one `error:` line on stderr."""
    err = run["stderr"].strip()
    assert run["status"] == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, run
    return err


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)


def test_peft_dir_loads_in_peft_and_its_logits_are_the_merged_dirs(converted):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runs, root = converted["runs"], converted["root"]
    assert "wrote PEFT adapter dir" in _ok(runs["peft"]) and "merged with 21 LoRA modules" in _ok(runs["merged"])
    assert sorted(p.name for p in (root / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(TINY_MODEL.resolve())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)

    base_logits = _logits(_base())
    lora_logits = _logits(PeftModel.from_pretrained(_base(), str(root / "peft")))
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    merged_logits = _logits(merged)
    assert torch.allclose(merged_logits, lora_logits, rtol=0, atol=1e-5), (merged_logits - lora_logits).abs().max()
    assert float((lora_logits - base_logits).abs().max()) > 1e-3  # the trained adapters act
    # A full HF dir, as the full-model path writes one: config, shards + index, the base's tokenizer files.
    names = {p.name for p in (root / "merged").iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"} <= names
    assert (root / "merged" / "config.json").read_bytes() == (TINY_MODEL / "config.json").read_bytes()


def test_merged_weights_equal_peft_merge_and_unload_of_the_peft_dir(converted):
    """The independent reference: peft's merge of the PEFT dir (W + (alpha / r) * B @ A) onto the base."""
    from peft import PeftModel

    root = converted["root"]
    expect = PeftModel.from_pretrained(_base(), str(root / "peft")).merge_and_unload().state_dict()
    got, base = _weights(root / "merged"), _weights(TINY_MODEL)
    expect = {k: v for k, v in expect.items() if k in base}  # the tied lm_head is the embedding
    assert expect.keys() == got.keys() == base.keys()
    for k in expect:
        assert got[k].dtype == base[k].dtype and torch.allclose(got[k], expect[k], rtol=0, atol=1e-6), k
    changed = [k for k in base if not torch.equal(got[k], base[k])]
    assert len(changed) == 3 * 7 and all(k.endswith("_proj.weight") for k in changed), changed


def test_base_dir_names_a_moved_base(converted):
    runs, root, gone, copy = converted["runs"], converted["root"], converted["gone"], converted["copy"]
    # PEFT dir: the recorded base is named (with a warning); --base-dir names the copy.
    out = _ok(runs["peft_moved"])
    assert f"warning: the base model {gone} that" in out and "does not exist any more" in out, out
    assert json.loads((root / "peft_moved" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(gone)
    named = json.loads((root / "peft_base_dir" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str(copy.resolve()), _ok(runs["peft_base_dir"])
    # Merging needs the base: refused without --base-dir, the same weights with it.
    err = _refused(runs["merged_moved"])
    assert f"the base model {gone} that {converted['moved']}/trainer_state.json records" in err and "--base-dir" in err
    _ok(runs["merged_base_dir"])
    a, b = _weights(root / "merged"), _weights(root / "merged_base_dir")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (root / "merged_moved").exists()


def test_a_base_with_other_weights_or_none_is_refused(converted):
    runs, root, wrong, ckpt = converted["runs"], converted["root"], converted["wrong"], converted["ckpt"]
    for name in ("merged_wrong", "peft_wrong"):
        err = _refused(runs[name])
        assert f"base model {wrong} (--base-dir) has weights fingerprint" in err, err
        assert f"trained on {TINY_MODEL.resolve()} with fingerprint" in err and "resume.model.weights" in err, err
        assert not (root / name).exists()
    err = _refused(runs["merged_missing"])
    assert f"--base-dir {root / 'nonexistent'} is not a directory" in err and str(TINY_MODEL.resolve()) in err, err
    assert str(ckpt) in err


def test_merge_lora_on_a_full_checkpoint_is_refused(converted):
    runs, root = converted["runs"], converted["root"]
    _ok(runs["full_mg"])
    err = _refused(runs["merged_full"])
    assert f"--merge-lora: {root / 'full'} is not a LoRA run's checkpoint" in err, err
    assert not (root / "merged_full").exists()


def test_out_dir_rules_hold_for_lora_checkpoints(converted):
    err = _refused(converted["runs"]["into_busy"])
    assert f"{converted['busy']} already exists and is not an empty directory" in err, err
    assert [p.name for p in converted["busy"].iterdir()] == ["keep.txt"]
    assert not list(converted["root"].glob(".*.partial-*"))  # the refused runs left no staging dirs
