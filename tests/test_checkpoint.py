"""Checkpoints: exact resume after a kill, loading at another layout, atomicity, no pickled code."""

import json
import os
import pickle
import re

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "dist_step", "ckpt_check.py")


def _ok(res):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.mark.slow
def test_kill_after_save_then_resume_reproduces_losses_and_other_layouts_load(tmp_path, launch):
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.json", tmp_path / "resumed.json"
    _ok(launch(WORKER, 2, "--phase", "full", "--ckpt", str(tmp_path / "ckpt_full"), "--out", str(full), "--tp", "2"))
    killed = launch(WORKER, 2, "--phase", "killed", "--ckpt", str(ckpt), "--tp", "2")
    assert killed.returncode != 0  # it really died (SIGKILL), after writing step 3
    assert (ckpt / "latest").read_text().strip() == "step_000003"
    _ok(launch(WORKER, 2, "--phase", "resume", "--ckpt", str(ckpt), "--out", str(resumed), "--tp", "2"))
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert sorted(b) == ["4", "5", "6"]
    for step in b:  # loss, grad norm and learning rate, bit for bit
        assert a[step] == b[step], (step, a[step], b[step])

    # The TP=2 checkpoint loads at TP=1 (1 process) and at PP=2 with the same log-probs.
    outs = {}
    for name, nproc, args in [("tp1", 1, []), ("pp2", 2, ["--pp", "2"]), ("tp2", 2, ["--tp", "2"])]:
        out = tmp_path / f"logp_{name}.pt"
        _ok(launch(WORKER, nproc, "--phase", "logprobs", "--ckpt", str(ckpt), "--out", str(out), *args))
        outs[name] = torch.load(out, weights_only=True)
    for name in ("pp2", "tp2"):
        for x, y in zip(outs["tp1"], outs[name]):
            assert torch.allclose(x, y, atol=1e-5), (name, (x - y).abs().max())


def test_interrupted_save_keeps_latest_and_is_cleaned_up(tmp_path, monkeypatch):
    from megatron_dppo.megatron import checkpoint

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step_000001").mkdir()
    (root / "step_000001" / "trainer_state.json").write_text("{}")
    (root / "latest").write_text("step_000001\n")
    (root / ".tmp-step_000002").mkdir()  # what a save killed midway leaves
    assert checkpoint.latest_checkpoint(str(root)) == str(root / "step_000001")

    class Boom(RuntimeError):
        pass

    def fail(*a, **k):
        raise Boom()

    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", fail)
    monkeypatch.setattr(checkpoint, "_sharded_state", lambda policy, is_loading: {})
    with pytest.raises(Boom):
        checkpoint.save_checkpoint(str(root), 2, policy=None, trainer_state={})
    assert (root / "latest").read_text().strip() == "step_000001"
    assert not (root / "step_000002").exists()


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_dppo.megatron import checkpoint  # noqa: F401  (installs the restricted unpickler)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        FileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "pwned").exists()


# ---- pruning, and corrupt or incomplete checkpoints (one real save, many corruptions) -------------
def _fake_old_run_step(root, step):
    """What an older run in the same dir left: a step dir with its own run_id."""
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": "older-run"}))
    return d


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint root where an older run left steps 0 and 4 (and `latest` -> step 4); a new
    run saves steps 1, 2, 3 (keep_last=2), is resumed, and saves 999998, 999999, 1000000."""
    from conftest import run_workers

    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    old = [_fake_old_run_step(root, 0), _fake_old_run_step(root, 4)]
    (root / "latest").write_text("step_000004\n")
    first = run_workers(WORKER, 1, "--phase", "save-steps", "--ckpt", root, "--save-steps", "1,2,3")
    _ok(first)
    after_first = sorted(p.name for p in root.glob("step_*"))
    latest_first = (root / "latest").read_text().strip()
    second = run_workers(
        WORKER, 1, "--phase", "save-steps", "--ckpt", root, "--resume", "--save-steps", "999998,999999,1000000"
    )
    _ok(second)
    return {
        "root": root,
        "old": old,
        "after_first": after_first,
        "latest_first": latest_first,
        "second_out": second.stdout,
    }


def test_pruning_orders_by_step_number_and_touches_only_this_runs_checkpoints(saved_run):
    root = saved_run["root"]
    # The older run's step 4 neither outranked nor deleted the new run's steps 2 and 3.
    assert saved_run["after_first"] == ["step_000000", "step_000002", "step_000003", "step_000004"]
    assert saved_run["latest_first"] == "step_000003"
    assert "resumed step 3" in saved_run["second_out"]
    # The resumed run is the same run: its steps 2 and 3 were pruned. By name, step_1000000 sorts
    # before step_999998 and would have been the one deleted.
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000000", "step_000004", "step_1000000", "step_999999"]
    assert (root / "latest").read_text().strip() == "step_1000000"
    for d in saved_run["old"]:
        assert json.loads((d / "trainer_state.json").read_text())["run_id"] == "older-run"


def _corrupt_copy(src, dst, how):
    """Copy checkpoint src to dst and damage it as `how` says; ", no manifest" first turns the
    copy into a checkpoint without a manifest (converted, or written by an older version)."""
    import shutil

    shutil.copytree(src, dst)
    model = dst / "model_optim"
    if how.endswith(", no manifest"):
        how = how.removesuffix(", no manifest")
        (dst / "manifest.json").unlink()
        state = json.loads((dst / "trainer_state.json").read_text())
        del state["manifest"]
        (dst / "trainer_state.json").write_text(json.dumps(state))
    damage = {
        "truncated .metadata": lambda: _truncate(model / ".metadata"),
        "truncated common.pt": lambda: _truncate(model / "common.pt"),
        "truncated shard": lambda: _truncate(model / "__0_0.distcp"),
        "missing shard": lambda: sorted(model.glob("*.distcp"))[-1].unlink(),  # 0.19 writes one, 0.16 two
        "missing history": lambda: (dst / "history.json").unlink(),
        "missing rng": lambda: (dst / "rng" / "rank_0.safetensors").unlink(),
        "missing manifest": lambda: (dst / "manifest.json").unlink(),
        "truncated trainer_state": lambda: _truncate(dst / "trainer_state.json"),
    }
    damage[how]()
    return dst


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "how, needle",
    [
        ("truncated .metadata", r"model_optim/\.metadata is \d+ bytes, but \d+ were written"),
        ("truncated common.pt", r"model_optim/common\.pt is \d+ bytes, but \d+ were written"),
        ("truncated shard", r"model_optim/__0_0\.distcp is \d+ bytes, but \d+ were written \(model and optimizer"),
        ("missing shard", r"model_optim/__0_\d\.distcp is missing \(model and optimizer weights\)"),
        ("missing history", r"history\.json is missing \(the prompt history\): the checkpoint's manifest lists it"),
        ("missing rng", r"rng/rank_0\.safetensors is missing \(the RNG state\)"),
        ("missing manifest", r"manifest\.json is missing, but .*trainer_state\.json says the save wrote it"),
        ("truncated trainer_state", r"trainer_state\.json: truncated or corrupt trainer state \(invalid JSON"),
        # Without a manifest, the dist checkpoint's own index still finds the damage.
        ("truncated .metadata, no manifest", r"model_optim/\.metadata: truncated or corrupt shard index"),
        ("truncated common.pt, no manifest", r"model_optim/common\.pt: truncated or corrupt \("),
        ("truncated shard, no manifest", r"model_optim/__0_0\.distcp is \d+ bytes, but .*\.metadata indexes data up"),
        ("missing shard, no manifest", r"model_optim/__0_\d\.distcp is missing: .*\.metadata indexes tensors in it"),
    ],
)
def test_corrupt_or_incomplete_checkpoint_is_a_one_line_error_naming_the_file(saved_run, tmp_path, how, needle):
    from megatron_dppo.megatron.checkpoint import CheckpointError, check_checkpoint

    intact = saved_run["root"] / "step_1000000"
    assert check_checkpoint(str(intact))["step"] == 1000000  # the reference passes
    if "common.pt" in how and not (intact / "model_optim" / "common.pt").exists():
        pytest.skip("megatron-core >= 0.19 writes no common.pt (the common state is a shard)")
    bad = _corrupt_copy(intact, tmp_path / "step_1000000", how)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg, msg
    assert re.search(needle, msg), msg


def test_a_checkpoint_of_megatron_core_019_is_named_under_older_versions(saved_run, tmp_path):
    """megatron-core 0.19 saves the non-tensor state as the shard "common_state" instead of
    common.pt; 0.16-0.18 cannot read that: a one-line error saying so, not Megatron's AttributeError.
    (Under 0.19 its own checkpoints are of this kind and pass check_checkpoint: the test above.)"""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_dppo.megatron import checkpoint

    if checkpoint._READS_COMMON_STATE_SHARD:
        pytest.skip("this megatron-core (>= 0.19) reads such checkpoints")
    bad = _corrupt_copy(saved_run["root"] / "step_1000000", tmp_path / "step_1000000", "missing manifest")
    model = bad / "model_optim"
    (model / "common.pt").unlink()
    metadata = FileSystemReader(str(model)).read_metadata()
    metadata.state_dict_metadata["common_state/shard_0_1"] = BytesStorageMetadata()  # as 0.19 writes it
    (model / ".metadata").write_bytes(pickle.dumps(metadata))
    state = json.loads((bad / "trainer_state.json").read_text())
    del state["manifest"]
    (bad / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"model_optim was saved by megatron-core >= 0\.19 .* \S+ cannot read it"
    ):
        checkpoint.check_checkpoint(str(bad))


def test_latest_file_errors(tmp_path):
    from megatron_dppo.megatron.checkpoint import CheckpointError, latest_checkpoint

    assert latest_checkpoint(str(tmp_path)) is None  # nothing saved yet
    (tmp_path / "step_000007").mkdir()
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match=r"latest is empty: expected the name of a checkpoint directory"):
        latest_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("step_000009\n")
    with pytest.raises(
        CheckpointError,
        match=r"latest names 'step_000009', which is not a directory under .*"
        r"\(checkpoints there: step_000007\)",
    ):
        latest_checkpoint(str(tmp_path))


def test_load_checks_before_reading(saved_run, tmp_path):
    """load_checkpoint itself refuses a checkpoint whose RNG file is missing (a real load in a
    worker), instead of resuming with a fresh RNG."""
    from conftest import run_workers

    root = tmp_path / "checkpoints"
    root.mkdir()
    _corrupt_copy(saved_run["root"] / "step_1000000", root / "step_1000000", "missing rng")
    (root / "latest").write_text("step_1000000\n")
    res = run_workers(WORKER, 1, "--phase", "load", "--ckpt", root)
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-4000:]
    assert "CheckpointError: " in res.stdout and "rng/rank_0.safetensors is missing (the RNG state)" in res.stdout
