"""Resumable checkpoints: Megatron dist checkpoints, written atomically, loaded at any TP/PP.

Layout of <root>/:
    step_000012/            one complete checkpoint
        model_optim/        megatron.core.dist_checkpointing (torch_dist): model + optimizer
        trainer_state.json  step, scheduler, data order, anything JSON the trainer adds
        history.json        the prompt-history store
        rng/rank_<r>.safetensors   per-rank torch RNG states
    latest                  text: name of the newest complete checkpoint

Atomicity: everything is written under .tmp-step_000012/; only when every rank has finished
does rank 0 rename it to step_000012/ and then replace `latest` (write + os.replace). A save
killed at any point leaves `latest` naming the previous complete checkpoint.

Loading never runs pickled code: tensors come from torch_dist shards and safetensors, the
common state through torch.load(weights_only=True) (the torch default Megatron relies on), and
DCP's pickled `.metadata` through a restricted unpickler that only admits the checkpoint
metadata classes (see _restricted_metadata_pickle).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from megatron.core import dist_checkpointing
from safetensors.torch import load_file, save_file

from megatron_dppo.megatron.sharded_state import fit_to_checkpoint  # TE's _extra_state vs local-spec checkpoints

LATEST = "latest"


# ---- safe metadata unpickling -------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED_PREFIXES = ("torch.distributed.checkpoint.",)
    _ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"),
                ("builtins", "frozenset"), ("builtins", "slice"), ("torch.serialization", "_get_layout"),
                ("torch", "strided")}

    def find_class(self, module, name):
        if module.startswith(self._ALLOWED_PREFIXES) or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a checkpoint metadata type: "
            "refusing to load it (it could run code)")


class _restricted_metadata_pickle:
    """Stands in for the `pickle` module inside torch.distributed.checkpoint.filesystem, whose
    read_metadata() would otherwise unpickle `.metadata` without restriction."""
    dump = staticmethod(pickle.dump)
    dumps = staticmethod(pickle.dumps)
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL

    @staticmethod
    def load(f, **kwargs):
        return _MetadataUnpickler(f).load()


dcp_filesystem.pickle = _restricted_metadata_pickle


# ---- paths ----------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under root, or None."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    full = os.path.join(root, name)
    if not os.path.isdir(full):
        raise FileNotFoundError(f"{path} names {name!r}, which is not a directory under {root}")
    return full


def _write_text_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _sharded_state(policy, is_loading: bool) -> dict:
    model_sd = policy.model.module.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


# ---- save / load ----------------------------------------------------------------------------
def save_checkpoint(root: str, step: int, policy, trainer_state: dict, history=None, keep_last: int = 2,
                    extra_files: dict | None = None) -> str:
    """Collective. Writes <root>/step_<step> atomically and points `latest` at it.
    extra_files {name in the checkpoint: source path} are copied in by rank 0 (e.g. the HF
    config, so that the checkpoint converts back to HF on its own)."""
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
        os.makedirs(os.path.join(tmp, "model_optim"))
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    dist_checkpointing.save(_sharded_state(policy, is_loading=False), os.path.join(tmp, "model_optim"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state().cpu()
    save_file(rng, os.path.join(tmp, "rng", f"rank_{_rank()}.safetensors"))
    if _rank() == 0:
        state = dict(trainer_state, step=step, scheduler=policy.scheduler.state_dict())
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        if history is not None:
            history.save(os.path.join(tmp, "history.json"))
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(os.path.join(root, LATEST), step_dir_name(step) + "\n")
        _prune_old(root, keep_last)
    _barrier()
    return final


def _prune_old(root: str, keep_last: int) -> None:
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def load_checkpoint(path: str, policy, load_optimizer: bool = True) -> dict:
    """Collective. Loads model (+ optimizer, scheduler) into `policy`, whatever TP/PP it was
    saved at; returns the trainer state (with 'history_path' when one was saved)."""
    state_path = os.path.join(path, "trainer_state.json")
    if not os.path.exists(state_path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {state_path} is missing")
    with open(state_path) as f:
        state = json.load(f)
    # A converted checkpoint (tools/convert_hf_to_megatron.py) holds only the model: start the
    # optimizer and scheduler fresh.
    load_optimizer = load_optimizer and not state.get("model_only", False)
    if load_optimizer:
        sharded = _sharded_state(policy, is_loading=True)
    else:
        # Not even built: the optimizer's sharded_state_dict(is_loading=True) initialises Adam
        # state (exp_avg, exp_avg_sq without 'step'), and the next optimizer step then fails.
        sharded = {"model": policy.model.module.sharded_state_dict()}
    model_dir = os.path.join(path, "model_optim")
    loaded = dist_checkpointing.load(fit_to_checkpoint(sharded, model_dir), model_dir)
    policy.model.module.load_state_dict(loaded["model"])
    if load_optimizer:
        policy.optimizer.load_state_dict(loaded["optimizer"])
        policy.scheduler.load_state_dict(state["scheduler"])
    else:
        policy.optimizer.reload_model_params()
    rng_path = os.path.join(path, "rng", f"rank_{_rank()}.safetensors")
    if os.path.exists(rng_path):  # absent when resuming at a larger world size
        rng = load_file(rng_path)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    history = os.path.join(path, "history.json")
    if os.path.exists(history):
        state["history_path"] = history
    return state
