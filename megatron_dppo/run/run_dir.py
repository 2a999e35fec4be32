"""The run directory: <trainer.output_dir>/<trainer.run_name>, the only thing `--overwrite` deletes.

Rules (each refusal is a one-line RunDirError saying why and what to do):
  * trainer.run_name is one plain path component: not empty, no path separator, not "." or "..";
  * the run dir, symlinks resolved, lies strictly inside trainer.output_dir, symlinks resolved;
  * a run dir this project creates carries a marker file (MARKER: a small JSON with the time it
    was created and the version), written before anything else; `--overwrite` deletes a dir only
    when the marker is there (never a dir the user made, nor one another tool filled);
  * a run dir with the marker but no checkpoint (a start that failed, or a run killed before its
    first save) has nothing to resume: it is said so, with --overwrite as the way to start afresh;
    a run dir that holds nothing but the marker (a start that failed before writing anything) is
    simply reused.

Two steps, because every rank must look before any rank writes: `plan_run_dir` only reads and
raises (every rank, before the ranks meet, so all of them see the same directory), `make_run_dir`
deletes/creates (rank 0 only; the caller then holds the other ranks at a barrier).
`prepare_run_dir` does both, for one process.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
import time

MARKER = ".megatron-dppo-run"
CHECKPOINTS = "checkpoints"  # <run dir>/checkpoints: what --resume continues from


class RunDirError(ValueError):
    """A run dir that cannot be used as asked; the message names it, says why and what to do."""


def run_name_problem(name: str) -> str | None:
    """Why `name` is not one plain path component, or None when it is."""
    if not name:
        return "it is empty"
    if name in (".", ".."):
        return f"{name!r} is not a directory of its own"
    seps = [s for s in (os.sep, os.altsep, "/") if s and s in name]
    if seps:
        return f"it contains the path separator {seps[0]!r}"
    if "\0" in name:
        return "it contains a NUL byte"
    return None


@dataclasses.dataclass(frozen=True)
class RunDirPlan:
    path: str  # <output_dir>/<run_name>, as the user spelled output_dir
    action: str  # "create" (absent or reusable), "replace" (--overwrite), "resume"


def _inside(child: str, parent: str) -> bool:
    return os.path.commonpath([child, parent]) == parent and child != parent


def _has_checkpoint(path: str) -> bool:
    """A `latest` file or any step_* dir under <path>/checkpoints (which one resumes is the
    checkpoint module's business, including a missing `latest`)."""
    root = os.path.join(path, CHECKPOINTS)
    if not os.path.isdir(root):
        return False
    return any(n == "latest" or n.startswith("step_") for n in os.listdir(root))


def read_marker(path: str) -> dict | None:
    """The marker's JSON, {} when it is there but unreadable, None when there is none."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def plan_run_dir(output_dir: str, run_name: str, *, resume: bool, overwrite: bool) -> RunDirPlan:
    """Decide what to do with the run dir, reading only. RunDirError for anything refused."""
    problem = run_name_problem(run_name)
    if problem:
        raise RunDirError(
            f"trainer.run_name={run_name!r} is not a plain directory name ({problem}): give one name "
            "such as 'addition-dppo'; the run dir is <trainer.output_dir>/<trainer.run_name>"
        )
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: pass one of them")
    _check_output_dir(output_dir)
    path = os.path.join(output_dir, run_name)
    real_out, real_run = os.path.realpath(output_dir), os.path.realpath(path)
    if not _inside(real_run, real_out):
        raise RunDirError(
            f"run dir {path} resolves to {real_run}, which is not inside trainer.output_dir "
            f"{output_dir} ({real_out}): a run dir must be a real directory inside the output dir "
            "(remove the symlink or choose another trainer.run_name)"
        )
    exists = os.path.isdir(path)
    if os.path.exists(path) and not exists:
        raise RunDirError(f"run dir {path} exists and is not a directory: choose another trainer.run_name")
    entries = set(os.listdir(path)) if exists else set()
    marker = read_marker(path) if exists else None
    if not entries or entries == {MARKER}:  # nothing of any run in it yet
        if resume:
            state = "holds nothing but its marker (a start that failed early)" if entries else "is empty"
            raise RunDirError(
                f"--resume: run dir {path} {state if exists else 'does not exist'}, so there is nothing to "
                "resume (check trainer.output_dir and trainer.run_name, or start without --resume)"
            )
        return RunDirPlan(path, "create")
    has_checkpoint = _has_checkpoint(path)
    if resume and has_checkpoint:  # resuming writes into the dir, deletes nothing: no marker needed
        return RunDirPlan(path, "resume")
    if marker is None:
        raise RunDirError(
            f"{path} already exists and was not created by megatron-dppo (it has no {MARKER} marker"
            f"{' and no checkpoints/' if resume else ''}), so it is neither {'resumed' if resume else 'reused'} "
            "nor deleted: choose another trainer.run_name or trainer.output_dir (a run dir of an older "
            "megatron-dppo: delete it yourself if you no longer need it)"
        )
    if overwrite:
        if os.path.islink(path):
            raise RunDirError(f"--overwrite: run dir {path} is a symlink; remove it yourself or choose another name")
        return RunDirPlan(path, "replace")
    if not has_checkpoint:
        created = f" (created {marker['created']})" if marker.get("created") else ""
        raise RunDirError(
            f"run dir {path}{created} holds a run without a checkpoint: its start failed or it was stopped "
            "before its first save, so there is nothing to resume; pass --overwrite to start it afresh (safe: "
            "it carries this project's marker, and only that dir is deleted), or set trainer.run_name"
        )
    raise RunDirError(
        f"run dir {path} already exists with checkpoints: pass --resume to continue that run, or --overwrite "
        "to delete it and start again (or set trainer.run_name)"
    )


def _check_output_dir(output_dir: str) -> None:
    """trainer.output_dir, reading only: it, or the nearest part of it that exists, must be a
    directory (what cannot be created for another reason, under /proc, is make_run_dir's error)."""
    if not output_dir:
        raise RunDirError("trainer.output_dir is empty: give the directory that holds the run dirs")
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "" if existing == os.path.abspath(output_dir) else f": {existing} is a file"
        raise RunDirError(
            f"trainer.output_dir={output_dir!r} is not a directory{where} (it holds the run dirs: choose a "
            "directory, or a path that can be created)"
        )


def make_run_dir(plan: RunDirPlan, is_main: bool) -> str:
    """Rank 0: delete a replaced run dir, create the dir and its marker. Every rank: the path.
    A dir that cannot be created is a RunDirError naming trainer.output_dir."""
    if not is_main:
        return plan.path
    try:
        if plan.action == "replace":
            shutil.rmtree(plan.path)
        if plan.action in ("create", "replace"):
            os.makedirs(plan.path, exist_ok=True)
            write_marker(plan.path)
    except OSError as e:
        raise RunDirError(
            f"trainer.output_dir: cannot {'replace' if plan.action == 'replace' else 'create'} the run dir "
            f"{plan.path} ({e.strerror or e}: {e.filename or plan.path}): choose a trainer.output_dir that can be "
            "written"
        ) from None
    return plan.path


def write_marker(path: str) -> None:
    info = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "version": _version(), "by": "megatron-dppo"}
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(path, MARKER))


def _version() -> str:
    try:
        return importlib.metadata.version("megatron-dppo")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def prepare_run_dir(output_dir: str, run_name: str, resume: bool, overwrite: bool, is_main: bool = True) -> str:
    """plan_run_dir + make_run_dir in one process (see the module docstring for several)."""
    return make_run_dir(plan_run_dir(output_dir, run_name, resume=resume, overwrite=overwrite), is_main)
