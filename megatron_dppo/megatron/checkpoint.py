"""Resumable checkpoints: Megatron dist checkpoints (torch_dist), written atomically, checked
before use; the weights load at any TP/PP. With the distributed optimizer (the default on GPUs) its
Adam state is saved as "dp_reshardable" (_DISTRIBUTED_OPTIMIZER_FORMAT): it resumes at another DP
size, not at another TP/PP (untested); resuming with the other kind of optimizer is a named error.

    <root>/step_000012/         one complete checkpoint
        model_optim/            megatron.core.dist_checkpointing: model + optimizer shards
        trainer_state.json      step, scheduler, data order, run_id, world_size, what the trainer adds
        history.json            the prompt-history store
        rng/rank_<r>.safetensors  each rank's torch RNG state
        manifest.json           every file above with its size, written last
    <root>/latest               the name of the newest complete checkpoint

Save: everything goes under .tmp-step_000012/; when every rank is done, rank 0 writes the
manifest, renames the dir into place, then replaces `latest`, so a save killed at any point
leaves `latest` naming a complete checkpoint. The shard files are written by threads of the
saving process (_InProcessTorchDistSave), not by the writer processes Megatron-Core forks: a
child forked from the multi-threaded trainer can block on a lock held at fork time, and forked
writers outlive a killed trainer. A full disk is one OSError naming the path.

Before the first update (every step so far skipped it) Adam has no state yet; the save writes the
zero moments Megatron's load asks for, and the load takes them away again, so such a checkpoint
resumes exactly (see _initial_adam_state).

Keep: pruning (keep_last) deletes only checkpoints that carry this run's run_id (new_run_id for
a new run, the loaded checkpoint's for a resumed one) at or below the step just saved, ordered
by step number, so another run's checkpoints in the same dir are never deleted or outranked.

Check (check_checkpoint, before anything is loaded): every manifest file with its size, the DCP
`.metadata`, every shard's bytes, the common state. A failure is one CheckpointError naming the
file and what was expected: a resume never silently differs. A checkpoint without a manifest
(tools/convert_hf_to_megatron.py writes none) gets the other checks.

Load runs no pickled code: tensors come from torch_dist shards and safetensors, the common state
through torch.load(weights_only=True), `.metadata` through megatron/dcp_metadata.py's restricted
unpickler.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import pickle
import queue
import re
import shutil
import tempfile
import uuid
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import megatron.core
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dppo.megatron.dcp_metadata import (
    MetadataUnpickler,
    install_restricted_metadata_unpickler,
    read_dcp_metadata,
)
from megatron_dppo.megatron.lora import is_adapter
from megatron_dppo.megatron.sharded_state import fit_to_checkpoint  # TE's _extra_state vs local-spec checkpoints
from megatron_dppo.run.collectives import barrier, world

LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "model_optim"
PENDING_ROLLOUT = "pending_rollout.json"  # the next step's first round, rolled out before the save
_STEP_DIR = re.compile(r"step_(\d+)")
# What a missing file costs, for the error message.
_WHAT = {
    "history.json": "the prompt history",
    "rng/": "the RNG state",
    MODEL_DIR + "/": "model and optimizer weights",
    TRAINER_STATE: "the step, scheduler and data order",
    PENDING_ROLLOUT: "the next step's rollout, saved at trainer.max_staleness=1",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what was expected."""


# ---- paths ----------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under root; None when nothing was ever saved there.
    A `latest` that is missing while step dirs exist, empty, not text, or naming no directory is a
    CheckpointError naming the file and the step dirs there."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        steps = [d for _, d in _step_dirs(root)]
        if not steps:
            return None
        raise CheckpointError(
            f"{path} is missing, but {root} holds {', '.join(steps[-3:])} (each a complete checkpoint): to resume "
            f"from the newest, write its name into that file (echo {steps[-1]} > {path}), then pass --resume again"
        )
    try:
        with open(path, encoding="utf-8") as f:
            name = f.read().strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path} is not text (byte {e.object[e.start]:#04x} at position {e.start} is not UTF-8): expected the "
            f"name of a checkpoint directory such as {_newest_or_example(root)} (write that name into it)"
        ) from None
    if not name:
        raise CheckpointError(
            f"{path} is empty: expected the name of a checkpoint directory such as "
            f"{step_dir_name(12)} (write the newest complete step_* dir's name into it)"
        )
    full = os.path.join(root, name)
    if not os.path.isdir(full):
        have = ", ".join(d for _, d in _step_dirs(root)[-3:]) or "none"
        raise CheckpointError(
            f"{path} names {name!r}, which is not a directory under {root} (checkpoints there: {have})"
        )
    return full


def _newest_or_example(root: str) -> str:
    steps = _step_dirs(root)
    return steps[-1][1] if steps else step_dir_name(12)


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, name) of every step_<N> dir under root, by step NUMBER (step_1000000 > step_999999)."""
    found = []
    for d in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP_DIR.fullmatch(d)
        if m and os.path.isdir(os.path.join(root, d)):
            found.append((int(m.group(1)), d))
    return sorted(found)


def _write_text_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# The distributed optimizer's checkpoint format, on save and load: one ShardedTensor per DP shard
# of its buffers (Megatron-LM's default, training/checkpointing.py), loadable at another DP size
# only. Megatron-Core's own default, "fully_sharded_model_space", saves flattened ranges, which its
# dist_checkpointing no longer accepts (CheckpointingException: ShardedTensor.flattened_range is
# not supported): no checkpoint could be saved.
_DISTRIBUTED_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_state(policy) -> dict:
    """The model's sharded state; with LoRA its adapters only: the frozen base is model.hf_dir's (or
    model.init_checkpoint's), which the trainer state names and fingerprints (run/identity.py)."""
    model_sd = policy.model.module.sharded_state_dict()
    if getattr(policy, "adapters", None) is None:
        return model_sd
    return {k: v for k, v in model_sd.items() if is_adapter(k)}


def _sharded_state(policy, is_loading: bool) -> dict:
    model_sd = _model_state(policy)
    metadata = None  # plain Adam: its checkpoints keep their keys
    if policy.model.ddp_config.use_distributed_optimizer:
        metadata = _DISTRIBUTED_OPTIMIZER_FORMAT
        _create_missing_adam_state(policy.optimizer)
    with contextlib.nullcontext() if is_loading else _initial_adam_state(policy):
        # (the state dict holds the saved tensors: the state may go once it is built)
        optimizer_sd = policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optimizer_sd}


# ---- Adam before its first update -------------------------------------------------------------
# torch's Adam creates a parameter's state (exp_avg, exp_avg_sq, step) at its first update, but
# Megatron's load asks for every parameter's moments (sharded_state_dict(is_loading=True) runs the
# optimizer's init_state_fn): a run whose steps all skipped the update (no group with a non-zero
# advantage) saved checkpoints that could not be loaded. So the save writes, for a parameter
# without state, what Megatron's load builds (init_state_fn: zero moments, no step), taken away
# again once the state dict to save is built; the load removes the state that carries no step, so
# the resumed optimizer starts its first update from nothing, exactly as the uninterrupted one does.
def _megatron_optimizers(policy) -> list:
    return list(getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]))


@contextlib.contextmanager
def _initial_adam_state(policy):
    """While the state dict to save is built: every parameter without optimizer state has the state
    Megatron's load asks for."""
    created = []
    for megatron_opt in _megatron_optimizers(policy):
        opt = megatron_opt.optimizer
        empty = [p for group in opt.param_groups for p in group["params"] if not opt.state.get(p)]
        if empty:
            megatron_opt.init_state_fn(opt, megatron_opt.config)
            created += [(opt, p) for p in empty]
    try:
        yield
    finally:
        for opt, p in created:
            del opt.state[p]


def _without_unstepped_state(optimizer_sd) -> None:
    """Before loading: per-parameter state without a step (saved by _initial_adam_state; Megatron
    also saves the common step only when it is non-zero) is the state of a parameter that never took
    a step, and torch's Adam refuses it (KeyError 'step'): it is removed from the loaded state dict
    (from every chained optimizer's), and Adam creates it at its first update."""
    if not isinstance(optimizer_sd, dict):
        return
    state = optimizer_sd.get("state")
    if isinstance(state, dict) and "common_step" not in state:
        for key in [k for k, v in state.items() if isinstance(v, dict) and "exp_avg" in v and "step" not in v]:
            del state[key]
    for value in optimizer_sd.values():
        _without_unstepped_state(value)


def _create_missing_adam_state(optimizer) -> None:
    """Creates, for each parameter of the distributed optimizer's torch Adam that has no state yet,
    the state torch's Adam creates at its first step: step 0 and zero moments. The distributed
    optimizer's state_dict() (with torch's Adam, no TE/Apex) reads the step from that state, so a
    never-stepped optimizer fails there (`assert len(steps) == 1`): saved before its first update,
    or loaded into while fresh. The next step is the same as with the lazily created state."""
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(opt, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):  # AdamW is one; TE's/Apex's FusedAdam keep the step apart
            continue
        for group in adam.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                if adam.state[p]:
                    continue
                state = adam.state[p]
                state["step"] = torch.zeros((), dtype=scalar_dtype, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _restore_adam_steps(optimizer) -> None:
    """Sets each parameter's Adam step, one tensor per parameter, to the loaded checkpoint's step.
    The distributed optimizer's load (with torch's Adam, no TE/Apex) gets it wrong twice: its
    load_state_dict gives every parameter the SAME step tensor (which torch's Adam then increments
    once per parameter at each update), and its dp_reshardable load then copies into it the step of
    the state the optimizer held before the load (0 for a fresh one; the format saves no per-parameter
    step). The checkpoint's step survives in each param group ("step", from the saved param_groups)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(opt, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):
            continue
        for group in adam.param_groups:
            for p in group["params"]:
                step = adam.state[p].get("step")
                if torch.is_tensor(step) and "step" in group:
                    adam.state[p]["step"] = torch.full_like(step, float(group["step"]))


# ---- run identity (pruning touches only this run's checkpoints) -----------------------------
def new_run_id() -> str:
    """The id a new run's checkpoints carry (trainer_state.json's run_id); a resumed run keeps the
    loaded checkpoint's (load_checkpoint's state["run_id"])."""
    return uuid.uuid4().hex[:12]


def _read_run_id(step_dir: str) -> str | None:
    try:
        with open(os.path.join(step_dir, TRAINER_STATE)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: not provably ours, never deleted


# ---- in-process shard writing -----------------------------------------------------------------
def _write_buckets_in_threads(transforms, rank, write_buckets, results_queue) -> None:
    """Stands in for FileSystemWriterAsync.write_preloaded_data_multiproc: the same per-bucket
    writer, in one thread per bucket instead of one forked process per bucket; the results go
    to results_queue in the shape retrieve_write_results() expects ({bucket: results} or an exception)."""
    results, done = queue.Queue(), queue.Queue()
    for i in range(len(write_buckets)):
        done.put(i)  # the writer marks each bucket done with get() + task_done()

    def write(i):
        filesystem_async.FileSystemWriterAsync.write_preloaded_data(
            transforms, i, write_buckets[i], results, done, use_fsync=True
        )

    with ThreadPoolExecutor(max(1, len(write_buckets)), thread_name_prefix="ckpt-writer") as pool:
        list(pool.map(write, range(len(write_buckets))))
    out = {}
    while not results.empty():
        i, res = results.get()
        if isinstance(res, Exception):
            results_queue.put(res)
            return
        out[i] = res
    results_queue.put(out)


class _InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """torch_dist saving whose shard files are written by threads of this process (module docstring);
    a failed write keeps its exception, so a full disk is named as one."""

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret, *args, **kwargs):
        # megatron-core 0.17 added an `async_strategy` argument: pass whatever the caller gave.
        request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *args, **kwargs)
        if request.async_fn is None:  # nothing to write on this rank
            return request
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []
        return request._replace(async_fn=partial(_write_buckets_in_threads, transforms))


# The results-queue factory: public with an mp_mode argument since 0.17, private before
# (None: neither, so Megatron's own queue is used: it works, with its server process).
_RESULTS_QUEUE_FACTORY = next(
    (name for name in ("get_write_results_queue", "_get_write_results_queue") if hasattr(filesystem_async, name)),
    None,
)


@contextlib.contextmanager
def _no_results_manager():
    """FileSystemWriterAsync asks for a Manager().Queue() (a server process) for its results;
    the writes here are in-process, so a plain queue does."""
    if _RESULTS_QUEUE_FACTORY is None:
        yield
        return
    original = getattr(filesystem_async, _RESULTS_QUEUE_FACTORY)
    setattr(filesystem_async, _RESULTS_QUEUE_FACTORY, lambda *args, **kwargs: queue.Queue())
    try:
        yield
    finally:
        setattr(filesystem_async, _RESULTS_QUEUE_FACTORY, original)


# megatron-core >= 0.19 reads the non-tensor state from the shards, or from a legacy common.pt.
_READS_COMMON_STATE_SHARD = hasattr(dist_checkpointing.serialization, "_legacy_common_state_exists")


def _common_state_in_shards(metadata) -> bool:
    """megatron-core >= 0.19 saves the non-tensor state as the object shard "common_state"
    inside the torch_dist files; earlier versions (and loading legacy checkpoints) use common.pt."""
    return any(key.split("/")[0] == "common_state" for key in getattr(metadata, "state_dict_metadata", {}))


def save_sharded(sharded_state: dict, directory: str) -> None:
    """Collective: dist_checkpointing.save in the torch_dist format, written in-process."""
    with _no_results_manager():
        dist_checkpointing.save(sharded_state, directory, sharded_strategy=_InProcessTorchDistSave("torch_dist", 1))


# ---- save ---------------------------------------------------------------------------------------
def save_checkpoint(
    root: str,
    step: int,
    policy,
    trainer_state: dict,
    history=None,
    keep_last: int = 2,
    extra_files: dict | None = None,
    *,
    run_id: str,
) -> str:
    """Collective. Writes <root>/step_<step> atomically and points `latest` at it. run_id: the
    run's (new_run_id, or the resumed checkpoint's): pruning deletes only checkpoints that carry it.
    extra_files {name in the checkpoint: source path} are copied in by rank 0 (e.g. the HF
    config, so that the checkpoint converts back to HF on its own). A full disk is an OSError
    (ENOSPC) naming the path, whichever writer thread or DCP wrapper it surfaced through; the
    partial save is removed (rank 0) so that the disk is not left full."""
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    try:
        return _save_checkpoint(root, step, policy, trainer_state, history, keep_last, extra_files, run_id)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        full = _disk_full_error(e)
        if full is None and isinstance(e, CheckpointException):
            raise _save_error(e, tmp) from None
        if full is None:
            raise
        if world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(
            errno.ENOSPC,
            f"No space left on device while saving checkpoint {step_dir_name(step)} (the partial save was "
            f"removed and {os.path.join(root, LATEST)} still names the previous checkpoint; free space, or set "
            "trainer.output_dir to a disk with room)",
            full.filename or tmp,
        ) from None


def _disk_full_error(e: BaseException | None, depth: int = 0) -> OSError | None:
    """The ENOSPC OSError inside e: e itself, its cause/context chain, or a CheckpointException's
    per-rank failures. Those cross ranks pickled, which drops the chain: a failure whose text
    carries "[Errno 28]" (Megatron's "Worker failure: [Errno 28] ...") counts too."""
    if e is None or depth > 8:
        return None
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return e
    inner = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else []
    for sub in [*inner, e.__cause__, e.__context__]:
        found = _disk_full_error(sub, depth + 1)
        if found is not None:
            return found
    if not isinstance(e, CheckpointException) and f"[Errno {errno.ENOSPC}]" in str(e):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _save_error(e: CheckpointException, tmp: str) -> CheckpointError:
    rank, inner = _first_failure(e)
    return CheckpointError(f"saving {tmp} failed on rank {rank} ({type(inner).__name__}: {_first_sentence(inner)})")


def _first_failure(e: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) of the lowest failing rank a CheckpointException holds (each rank's own
    exception, with its traceback); (None, e) for any other exception."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _) = min(e.failures.items(), key=lambda kv: kv[0])
        return rank, inner
    return None, e


def _first_sentence(e: BaseException, limit: int = 300) -> str:
    """An exception's text on one line, up to its first sentence: torch's and Megatron's say there
    what broke, and go on with advice to their own developers."""
    return " ".join(str(e).split()).split(". ")[0][:limit]


def _save_checkpoint(root, step, policy, trainer_state, history, keep_last, extra_files, run_id) -> str:
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    rank, world_size = world()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
        os.makedirs(os.path.join(tmp, MODEL_DIR))
        os.makedirs(os.path.join(tmp, "rng"))
    barrier()
    save_sharded(_sharded_state(policy, is_loading=False), os.path.join(tmp, MODEL_DIR))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state().cpu()
    save_file(rng, os.path.join(tmp, "rng", f"rank_{rank}.safetensors"))
    if rank == 0:
        state = dict(
            trainer_state,
            step=step,
            scheduler=policy.scheduler.state_dict(),
            run_id=run_id,
            world_size=world_size,
            manifest=MANIFEST,
        )
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump(state, f, indent=1)
        if history is not None:
            history.save(os.path.join(tmp, "history.json"))
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
    barrier()
    if rank == 0:
        _write_manifest(tmp)
        if os.path.exists(final):  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(os.path.join(root, LATEST), step_dir_name(step) + "\n")
        _prune_old(root, keep_last, step, run_id)
    barrier()
    return final


def checkpoint_bytes(path: str) -> int:
    """The size of a saved checkpoint dir (its manifest's files, or a walk without one)."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.exists(manifest):
        return sum(_read_json(manifest, "checkpoint manifest").get("files", {}).values())
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def _write_manifest(ckpt: str) -> None:
    files = {}
    for dirpath, _, names in os.walk(ckpt):
        for name in names:
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, ckpt).replace(os.sep, "/")] = os.path.getsize(full)
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _prune_old(root: str, keep_last: int, saved_step: int, run_id: str) -> None:
    """Delete this run's checkpoints at or below saved_step beyond the newest keep_last (module
    docstring); other runs' checkpoints and anything unreadable are left alone."""
    if keep_last <= 0:
        return
    mine = [d for step, d in _step_dirs(root) if step <= saved_step and _read_run_id(os.path.join(root, d)) == run_id]
    for d in mine[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


# ---- check ----------------------------------------------------------------------------------
def _what(rel: str) -> str:
    for prefix, what in _WHAT.items():
        if rel == prefix or rel.startswith(prefix):
            return f" ({what})"
    return ""


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: truncated or corrupt {what} (invalid JSON: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object ({what}), got {type(data).__name__}")
    return data


def check_checkpoint(path: str) -> dict:
    """Check a checkpoint dir's files without loading tensors (module docstring); -> trainer state.
    Raises CheckpointError (one line, naming the file) for anything missing, truncated or corrupt."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    state_path = os.path.join(path, TRAINER_STATE)
    if not os.path.exists(state_path):
        raise CheckpointError(f"{path} is not a complete checkpoint: {state_path} is missing")
    state = _read_json(state_path, "trainer state")
    if state.get("manifest"):  # written by save_checkpoint: every file it wrote must be intact
        manifest_path = os.path.join(path, state["manifest"])
        if not os.path.exists(manifest_path):
            raise CheckpointError(
                f"{manifest_path} is missing, but {state_path} says the save wrote it: the checkpoint is incomplete"
            )
        files = _read_json(manifest_path, "checkpoint manifest").get("files", {})
        for rel, size in files.items():
            full = os.path.join(path, rel)
            if not os.path.exists(full):
                raise CheckpointError(
                    f"{full} is missing{_what(rel)}: the checkpoint's manifest lists it, "
                    "so the checkpoint is incomplete and would not resume the same run"
                )
            have = os.path.getsize(full)
            if have != size:
                raise CheckpointError(
                    f"{full} is {have} bytes, but {size} were written{_what(rel)}: truncated or overwritten"
                )
    _check_dist_files(os.path.join(path, MODEL_DIR))
    return state


def _check_dist_files(model_dir: str) -> None:
    """The dist checkpoint's own files: metadata.json, `.metadata`, every shard's bytes, common.pt."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir} is missing (model and optimizer weights)")
    if not os.path.exists(os.path.join(model_dir, "metadata.json")):
        raise CheckpointError(f"{model_dir}/metadata.json is missing: not a complete Megatron dist checkpoint")
    meta_path = os.path.join(model_dir, ".metadata")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{meta_path} is missing (the index of the tensor shards)")
    try:
        with open(meta_path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        if "refusing to load it" in str(e):
            raise
        raise CheckpointError(f"{meta_path}: truncated or corrupt shard index ({e})") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{meta_path}: truncated or corrupt shard index ({type(e).__name__}: {e})") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{meta_path}: not a torch.distributed.checkpoint metadata file")
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        shard = os.path.join(model_dir, rel)
        if not os.path.exists(shard):
            raise CheckpointError(f"{shard} is missing: {meta_path} indexes tensors in it")
        have = os.path.getsize(shard)
        if have < size:
            raise CheckpointError(
                f"{shard} is {have} bytes, but {meta_path} indexes data up to byte {size}: truncated shard"
            )
    _check_item_headers(model_dir, metadata)
    common = os.path.join(model_dir, "common.pt")
    if not os.path.exists(common) and _common_state_in_shards(metadata):
        if not _READS_COMMON_STATE_SHARD:
            raise CheckpointError(
                f"{model_dir} was saved by megatron-core >= 0.19 (its non-tensor state is a shard, no "
                f"common.pt): this megatron-core {megatron.core.__version__} cannot read it; load it with >= 0.19"
            )
        return  # the non-tensor state is a shard, checked above
    if not os.path.exists(common):
        raise CheckpointError(f"{common} is missing (the checkpoint's non-tensor state)")
    try:
        torch.load(common, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's zip reader names no file: name it
        why = _first_sentence(e, 200)
        raise CheckpointError(f"{common}: truncated or corrupt ({type(e).__name__}: {why})") from None


_TORCH_SAVE_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive: every item of a shard starts so


def _check_item_headers(model_dir: str, metadata) -> None:
    """Every tensor item that torch.save wrote starts where `.metadata` says with its zip header: a
    shard overwritten with other bytes of the same size is named here, not by torch.load's "Weights
    only load failed ... Please file an issue" deep inside DCP. One 4-byte read per item. Which items
    torch.save wrote is read from the index itself (its stored length differs from the tensor's raw
    byte size; a raw serialization such as DCP's safetensors format stores exactly that size), so
    the check holds when every item of every shard is damaged (megatron-core 0.19 saves one shard
    per rank). Bytes items (no fixed format) and transformed (e.g. compressed) items are not read."""
    by_file: dict[str, list] = {}
    for index, info in _tensor_items(metadata):
        if _is_torch_saved_tensor(metadata, index, info):
            by_file.setdefault(info.relative_path, []).append((info.offset, index.fqn))
    for rel, items in sorted(by_file.items()):
        shard = os.path.join(model_dir, rel)
        with open(shard, "rb") as f:
            for offset, fqn in sorted(items):
                f.seek(offset)
                if f.read(len(_TORCH_SAVE_MAGIC)) != _TORCH_SAVE_MAGIC:
                    raise CheckpointError(
                        f"{shard} is corrupt: the data of {fqn!r} at byte {offset} is not what the save wrote "
                        "there (no torch.save header); resume from another step_* dir of the run, or from a "
                        "copy of this one"
                    )


def _tensor_items(metadata):
    """(index, storage info) of every tensor item of a DCP index stored as it is: not pickled
    bytes, not transformed (e.g. compressed)."""
    for index, info in metadata.storage_data.items():
        is_tensor = hasattr(metadata.state_dict_metadata.get(index.fqn), "size")
        if is_tensor and not getattr(info, "transform_descriptors", None):
            yield index, info


def _is_torch_saved_tensor(metadata, index, info) -> bool:
    tensor_meta = metadata.state_dict_metadata[index.fqn]
    chunk = next((c for c in tensor_meta.chunks if c.offsets == index.offset), None)
    if chunk is None:
        return False  # an index this check does not understand
    return info.length != math.prod(chunk.sizes) * tensor_meta.properties.dtype.itemsize


# ---- load -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_load_warnings():
    """torch's "Please use DTensor instead and we are deprecating ShardedTensor" FutureWarning,
    raised on every load through our CPU shim's frame (so quiet.py's per-module filters miss it):
    a note to Megatron's authors, not to a user resuming a run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _check_global_shapes(sharded: dict, model_dir: str) -> None:
    """Every tensor the model asks for has the checkpoint's global shape (the checkpoint of another
    model fails here, naming a tensor and both shapes, before anything is read). Tensors that may
    differ (Megatron's padded vocabulary at another TP) are left to the load."""
    saved = read_dcp_metadata(model_dir).state_dict_metadata
    diffs = []
    for t in nested_values(sharded):
        if not isinstance(t, ShardedTensor) or getattr(t, "allow_shape_mismatch", False):
            continue
        have = getattr(saved.get(t.key), "size", None)
        if have is not None and tuple(have) != tuple(t.global_shape):
            diffs.append((t.key.startswith("optimizer."), t.key, tuple(have), tuple(t.global_shape)))
    if diffs:
        _, key, have, want = min(diffs)  # a model tensor before its optimizer state
        raise CheckpointError(
            f"{model_dir}: the checkpoint does not fit this model: {key} is {list(have)} in the checkpoint but "
            f"{list(want)} in the model ({len(diffs)} tensor(s) differ); is model.hf_dir the model the "
            "checkpoint was trained from?"
        )


def _check_optimizer_kind(policy, model_dir: str) -> None:
    """The optimizer state was saved by the kind of optimizer this run uses: the distributed one's
    (keys optimizer.distributed.*, sharded over DP) and plain Adam's (one tensor per parameter) do
    not load into each other; named here rather than as a list of missing keys."""
    saved = [key for key in read_dcp_metadata(model_dir).state_dict_metadata if key.startswith("optimizer.")]
    saved_distributed = any(key.startswith("optimizer.distributed.") for key in saved)
    distributed = policy.model.ddp_config.use_distributed_optimizer
    if saved and saved_distributed != distributed:
        kind = {True: "the distributed optimizer", False: "plain Adam (no distributed optimizer)"}
        raise CheckpointError(
            f"{model_dir}: its optimizer state was saved by {kind[saved_distributed]}, but this run uses "
            f"{kind[distributed]}: set parallel.distributed_optimizer={str(saved_distributed).lower()} to resume it"
        )


def _load_error(e: BaseException, model_dir: str) -> CheckpointError:
    """One line for a failed dist_checkpointing.load: the first failing rank's own exception (a
    CheckpointException holds them with their tracebacks), and for unreadable data the shard file."""
    _, inner = _first_failure(e)
    text = " ".join(str(inner).split())
    shape = re.search(r"Global shape mismatch for loaded \((.*?)\) and expected \((.*?)\) tensor for key (\S+)", text)
    if shape:
        return CheckpointError(
            f"{model_dir}: the checkpoint does not fit this model: {shape.group(3)} is {shape.group(1)} in the "
            f"checkpoint but {shape.group(2)} in the model"
        )
    if isinstance(inner, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile)) or "PytorchStreamReader" in text:
        found = _find_unreadable_item(model_dir)
        if found:
            shard, fqn, offset = found
            return CheckpointError(
                f"{shard} is corrupt: {fqn!r} at byte {offset} cannot be read back ({type(inner).__name__}); "
                "resume from another step_* dir of the run, or from a copy of this one"
            )
    why = _first_sentence(inner)
    return CheckpointError(f"{model_dir}: cannot load into this model ({type(inner).__name__}: {why})")


def _find_unreadable_item(model_dir: str):
    """(shard path, key, byte offset) of the first tensor item that torch.load cannot read, or None.
    Reads every tensor item once: only after a load failed on unreadable data."""
    metadata = read_dcp_metadata(model_dir)
    items = sorted((info.relative_path, info.offset, info.length, index.fqn) for index, info in _tensor_items(metadata))
    for rel, offset, length, fqn in items:
        shard = os.path.join(model_dir, rel)
        with open(shard, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - whatever torch says, this item is the unreadable one
            return shard, fqn, offset
    return None


def read_pending_rollout(path: str) -> dict | None:
    """The checkpoint's PENDING_ROLLOUT (a save at trainer.max_staleness=1 with dedicated rollout
    ranks), None without one. Damaged bytes (the manifest checks only its size) are a CheckpointError
    naming the file."""
    full = os.path.join(path, PENDING_ROLLOUT)
    if not os.path.exists(full):
        return None
    with open(full, "rb") as f:
        raw = f.read()
    try:
        state = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8 (UnicodeDecodeError)
        raise CheckpointError(
            f"{full} is not valid JSON ({e}): the file is damaged ({_WHAT[PENDING_ROLLOUT]}); to resume from "
            f"an earlier checkpoint, write its step_* name into {os.path.join(os.path.dirname(path), LATEST)}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{full}: expected a JSON object ({_WHAT[PENDING_ROLLOUT]}), got {type(state).__name__}")
    return state


def _load_model_state(policy, model_state: dict, path: str) -> None:
    """The loaded tensors into the model; with LoRA the adapters only (the base is already loaded)."""
    if getattr(policy, "adapters", None) is None:
        policy.model.module.load_state_dict(model_state)
        return
    missing, unexpected = policy.model.module.load_state_dict(model_state, strict=False)
    missing = [k for k in missing if is_adapter(k)]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the LoRA adapters do not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def load_checkpoint(path: str, policy, load_optimizer: bool = True) -> dict:
    """Collective. Checks the checkpoint (check_checkpoint), loads model (+ optimizer,
    scheduler) into `policy`, whatever TP/PP it was saved at; returns the trainer state (with
    'history_path' when one was saved, and the 'run_id' a resumed run saves under: the checkpoint's,
    or a new one for a checkpoint without (a converted one))."""
    install_restricted_metadata_unpickler()  # dist_checkpointing.load reads `.metadata` through it
    state = check_checkpoint(path)
    state["run_id"] = state.get("run_id") or new_run_id()
    # A converted checkpoint (tools/convert_hf_to_megatron.py) holds only the model: start the
    # optimizer and scheduler fresh.
    load_optimizer = load_optimizer and not state.get("model_only", False)
    if load_optimizer:
        sharded = _sharded_state(policy, is_loading=True)
    else:
        # Not even built: the optimizer's sharded_state_dict(is_loading=True) initialises Adam
        # state (exp_avg, exp_avg_sq without 'step'), and the next optimizer step then fails.
        sharded = {"model": _model_state(policy)}
    model_dir = os.path.join(path, MODEL_DIR)
    with _quiet_load_warnings():
        try:
            if load_optimizer:
                _check_optimizer_kind(policy, model_dir)
            fitted = fit_to_checkpoint(sharded, model_dir)
            _check_global_shapes(fitted, model_dir)
            loaded = dist_checkpointing.load(fitted, model_dir)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
            raise _load_error(e, model_dir) from None
    _load_model_state(policy, loaded["model"], path)
    if load_optimizer:
        _without_unstepped_state(loaded["optimizer"])
        # The distributed optimizer copies the loaded state into its fp32 main params, which are
        # views of the model's leaf parameters: in place, so outside autograd.
        with torch.no_grad():
            policy.optimizer.load_state_dict(loaded["optimizer"])
        if policy.model.ddp_config.use_distributed_optimizer:
            _restore_adam_steps(policy.optimizer)
        policy.scheduler.load_state_dict(state["scheduler"])
    else:
        policy.optimizer.reload_model_params()
    rank = world()[0]
    rng_path = os.path.join(path, "rng", f"rank_{rank}.safetensors")
    saved_world = state.get("world_size")
    if os.path.exists(rng_path):
        try:
            rng = load_file(rng_path)
        except SafetensorError as e:
            raise CheckpointError(f"{rng_path}: truncated or corrupt RNG state ({e})") from None
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    elif saved_world is not None and rank < saved_world:  # (a larger world has ranks with none)
        raise CheckpointError(
            f"{rng_path} is missing (the RNG state): the checkpoint was saved by "
            f"{saved_world} ranks, so rank {rank} wrote one"
        )
    history = os.path.join(path, "history.json")
    if os.path.exists(history):
        state["history_path"] = history
    return state
