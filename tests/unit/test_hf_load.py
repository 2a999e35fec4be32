"""Sharded HF loading (megatron_dppo/megatron/hf_load.py) and model-directory errors.

Tiny random Qwen3 models (vocab 50, padded by Megatron to 128 * tp; head_dim 32 != hidden /
heads; 4 query heads in 2 KV groups; norms perturbed away from 1):
  * "tied": tied embeddings, one model.safetensors, fp32;
  * "untied": untied, bf16 on disk (loaded into an fp32 model), several shards + index.
(conftest's sharded_hf_models). The loading itself under torchrun: tests/dist/test_hf_load_sharded.py.
Here: bad model directories fail in one line naming the file (and tensor), in well under a second,
without touching the hub, and the loader reads slices exactly.
"""

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch


# ---- model directory errors ------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _error(path) -> str:
    from megatron_dppo.model.hf_dir import HFModelDirError, check_hf_model_dir

    t0 = time.perf_counter()
    with pytest.raises(HFModelDirError) as info:
        check_hf_model_dir(str(path))
    assert time.perf_counter() - t0 < 2.0  # checked from headers and sizes, never the hub
    message = str(info.value)
    assert "\n" not in message
    return message


def test_model_dir_errors_are_one_line_and_name_the_file(sharded_hf_models, tmp_path):
    from megatron_dppo.model.hf_dir import check_hf_model_dir

    tied, untied = sharded_hf_models["tied"], sharded_hf_models["untied"]
    assert check_hf_model_dir(str(tied)).config.tie_word_embeddings  # the good ones pass
    assert len(check_hf_model_dir(str(untied)).tensors) == 4 * 11 + 3

    missing = tmp_path / "no_such_model"
    msg = _error(missing)
    assert f"model.hf_dir: {missing} does not exist" in msg and "hub" in msg, msg

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file, not a model directory" in _error(afile)

    nocfg = _copy(tied, tmp_path / "nocfg")
    (nocfg / "config.json").unlink()
    assert f"{nocfg / 'config.json'} is missing" in _error(nocfg)

    notype = _copy(tied, tmp_path / "notype")
    cfg = json.loads((notype / "config.json").read_text())
    del cfg["model_type"]
    (notype / "config.json").write_text(json.dumps(cfg))
    msg = _error(notype)
    assert f'{notype / "config.json"} has no "model_type" key' in msg, msg

    badjson = _copy(tied, tmp_path / "badjson")
    (badjson / "config.json").write_text('{"model_type": "qwen3",')
    assert f"{badjson / 'config.json'} is not valid JSON" in _error(badjson)

    llama = _copy(tied, tmp_path / "llama")
    (llama / "config.json").write_text(json.dumps(dict(cfg, model_type="llama", architectures=["LlamaForCausalLM"])))
    msg = _error(llama)
    assert msg.startswith(f"{llama}") and "8 layer tensor(s) that a LlamaForCausalLM does not have" in msg, msg
    assert "model.layers.0.self_attn.k_norm.weight" in msg, msg  # Qwen3's q/k norms under a Llama config

    noweights = _copy(tied, tmp_path / "noweights")
    (noweights / "model.safetensors").unlink()
    assert "has neither model.safetensors.index.json nor model.safetensors" in _error(noweights)

    # A truncated single file: the message names the file and the first tensor cut short.
    single = _copy(tied, tmp_path / "trunc_single")
    st = single / "model.safetensors"
    size = st.stat().st_size
    _truncate(st, size - 1000)
    msg = _error(single)
    assert f"{st} is truncated: {size - 1000} bytes, but tensor" in msg and "ends at byte" in msg, msg
    named = msg.split("tensor '")[1].split("'")[0]
    assert named.startswith("model.")  # a real tensor name from the header
    _truncate(st, _header_len(st) - 10)  # cut inside the header
    msg = _error(single)
    assert f"{st} is truncated" in msg and "header" in msg, msg
    _truncate(st, 5)
    assert f"{st} is truncated: 5 bytes" in _error(single)

    # A truncated shard of an index-sharded checkpoint.
    sharded = _copy(untied, tmp_path / "trunc_shard")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sharded / index["model.layers.2.mlp.down_proj.weight"]
    _truncate(victim, victim.stat().st_size // 2)
    msg = _error(sharded)
    assert f"{victim} is truncated" in msg and "tensor 'model." in msg, msg

    # An index naming a shard that is not there; a broken index; an index that lies about a tensor.
    gone = _copy(untied, tmp_path / "gone")
    shard = index["model.layers.1.self_attn.q_proj.weight"]
    (gone / shard).unlink()
    msg = _error(gone)
    assert "model.safetensors.index.json names shard" in msg and shard in msg, msg
    broken = _copy(untied, tmp_path / "broken_index")
    (broken / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert "model.safetensors.index.json is not valid JSON" in _error(broken)
    lying = _copy(untied, tmp_path / "lying_index")
    wm = dict(index, **{"model.layers.0.mlp.up_proj.weight": index["model.norm.weight"]})
    if wm["model.layers.0.mlp.up_proj.weight"] != index["model.layers.0.mlp.up_proj.weight"]:
        (lying / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        msg = _error(lying)
        assert "maps tensor 'model.layers.0.mlp.up_proj.weight'" in msg and "header does not have it" in msg, msg

    # A tensor the config's model needs is absent (untied head removed from the index).
    nohead = _copy(untied, tmp_path / "nohead")
    (nohead / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: v for k, v in index.items() if k != "lm_head.weight"}})
    )
    msg = _error(nohead)
    assert "lacks 1 tensor(s)" in msg and "lm_head.weight" in msg, msg


def test_loader_reads_slices_exactly(sharded_hf_models):
    """SliceReader: rows, columns and empty ranges equal indexing the whole tensor (bf16 and fp32)."""
    from safetensors.torch import load_file

    from megatron_dppo.megatron.hf_load import SliceReader
    from megatron_dppo.model.hf_dir import check_hf_model_dir

    for which in ("tied", "untied"):
        md = check_hf_model_dir(str(sharded_hf_models[which]))
        whole = {}
        for f in sorted(sharded_hf_models[which].glob("*.safetensors")):
            whole.update(load_file(f))
        reader = SliceReader(md)
        try:
            for name in (
                "model.layers.1.self_attn.o_proj.weight",
                "model.embed_tokens.weight",
                "model.layers.3.mlp.gate_proj.weight",
                "model.norm.weight",
            ):
                t = whole[name]
                assert torch.equal(reader.read(name), t)
                if t.dim() == 2:
                    assert torch.equal(reader.read(name, rows=(3, 17)), t[3:17])
                    assert torch.equal(reader.read(name, cols=(5, 29)), t[:, 5:29])
                    assert torch.equal(reader.read(name, rows=(2, 9), cols=(0, 7)), t[2:9, 0:7])
                    assert reader.read(name, rows=(t.shape[0], t.shape[0])).shape == (0, t.shape[1])
        finally:
            reader.close()
