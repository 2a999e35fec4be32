"""Checkpoints: exact resume after a kill, loading at another layout, atomicity, no pickled code."""

import json
import os
import pickle
import re

import pytest
import torch

from megatron_dppo.megatron.checkpoint import _READS_COMMON_STATE_SHARD

WORKER = os.path.join(os.path.dirname(__file__), "..", "dist", "workers", "step", "ckpt_check.py")
# .ci/run runs this file at megatron-core 0.16.1 and again at 0.19.0: each test below runs in one of them.
BEFORE_019 = pytest.mark.skipif(
    _READS_COMMON_STATE_SHARD, reason="megatron-core >= 0.19 writes no common.pt (the common state is a shard)"
)


def _ok(res):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.mark.slow
def test_kill_after_save_then_resume_reproduces_losses_and_other_layouts_load(tmp_path, launch):
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.json", tmp_path / "resumed.json"
    _ok(launch(WORKER, 2, "--phase", "full", "--ckpt", str(tmp_path / "ckpt_full"), "--out", str(full), "--tp", "2"))
    killed = launch(WORKER, 2, "--phase", "killed", "--ckpt", str(ckpt), "--tp", "2")
    assert killed.returncode != 0  # it really died (SIGKILL), after writing step 3
    assert (ckpt / "latest").read_text().strip() == "step_000003"
    # The resume, then (same job: each start costs ~10 s) the checkpoint loaded model-only at TP=2,
    # PP=2 and TP=1 (DP=2 on the 2 ranks), each writing the log-probs of one batch.
    layouts = ("tp2", "pp2", "tp1")
    resume = ["--phase", "resume", "--ckpt", str(ckpt), "--out", str(resumed), "--tp", "2"]
    _ok(launch(WORKER, 2, *resume, "--logprobs-at", ",".join(layouts)))
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert sorted(b) == ["4", "5", "6"]
    for step in b:  # loss, grad norm and learning rate, bit for bit
        assert a[step] == b[step], (step, a[step], b[step])

    # The TP=2 checkpoint loads at TP=1 and at PP=2 with the same log-probs.
    outs = {name: torch.load(tmp_path / f"resumed_{name}.pt", weights_only=True) for name in layouts}
    for name in ("pp2", "tp2"):
        for x, y in zip(outs["tp1"], outs[name]):
            assert torch.allclose(x, y, atol=1e-5), (name, (x - y).abs().max())


@pytest.mark.slow
def test_distributed_optimizer_checkpoints_resume_bit_for_bit_and_load_at_another_dp(tmp_path, launch):
    """DP=2 with the distributed optimizer (the default with CUDA): a run saving at step 0 (never
    stepped: no Adam state yet) and at step 3; resuming either at DP=2 reproduces its losses, its
    weights and each rank's Adam shard (moments and step) bit for bit; step 3 also loads at DP=1."""
    dist_opt = ["--distributed-optimizer"]
    ckpt, ckpt0 = tmp_path / "ckpt", tmp_path / "ckpt0"
    runs = {
        "full": ["--phase", "full", "--ckpt", ckpt, "--unstepped-ckpt", ckpt0],
        "from0": ["--phase", "resume", "--ckpt", ckpt0],
        "from3": ["--phase", "resume", "--ckpt", ckpt],
    }
    out = {name: ["--out", tmp_path / f"{name}.json", "--state-out", tmp_path / name] for name in runs}
    _ok(launch(WORKER, 2, *runs["full"], *dist_opt, *out["full"]))
    # Both resumes in one job (each start costs ~10 s): from step 0, then from step 3 into a new policy.
    from3 = ",".join(map(str, [ckpt, *out["from3"][1::2]]))
    _ok(launch(WORKER, 2, *runs["from0"], *dist_opt, *out["from0"], "--resume-also", from3))
    _ok(launch(WORKER, 1, *runs["from3"], *dist_opt, "--out", tmp_path / "dp1.json"))
    record = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in [*runs, "dp1"]}
    assert sorted(record["from0"]) == ["1", "2", "3", "4", "5", "6"] and sorted(record["from3"]) == ["4", "5", "6"]
    for name in ("from0", "from3"):
        for step, got in record[name].items():  # loss, grad norm and learning rate
            assert got == record["full"][step], (name, step, got, record["full"][step])
        for rank in (0, 1):
            want, got = (torch.load(tmp_path / f"{run}.rank{rank}.pt", weights_only=True) for run in ("full", name))
            for part in ("weights", "adam"):
                assert want[part].keys() == got[part].keys() and want[part], (name, rank, part)
                for key, tensor in want[part].items():
                    assert torch.equal(tensor, got[part][key]), (name, rank, part, key)
            assert torch.load(tmp_path / f"full.rank{rank}.pt", weights_only=True)["adam"]["0.0.0.step"] == 6
    for step, (loss, grad_norm, lr) in record["dp1"].items():  # DP=1 sums the gradients in another order
        want = record["full"][step]
        assert loss == pytest.approx(want[0], abs=1e-6) and grad_norm == pytest.approx(want[1], rel=1e-5)
        assert lr == want[2], (step, lr, want[2])
    plain = launch(WORKER, 1, "--phase", "load", "--ckpt", ckpt)  # into plain Adam: named, not a key list
    assert plain.returncode == 3 and re.search(
        r"step_000003/model_optim: its optimizer state was saved by the distributed optimizer, but this run uses "
        r"plain Adam .*: set parallel\.distributed_optimizer=true to resume it",
        plain.stdout,
    ), plain.stdout[-2000:]


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
        checkpoint.save_checkpoint(str(root), 2, policy=None, trainer_state={}, run_id=checkpoint.new_run_id())
    assert (root / "latest").read_text().strip() == "step_000001"
    assert not (root / "step_000002").exists()


class _Evil:
    """A `.metadata` that would run a command when unpickled by pickle itself."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_dppo.megatron.dcp_metadata import install_restricted_metadata_unpickler

    install_restricted_metadata_unpickler()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(tmp_path / "pwned")))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        FileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_checkpoint_readers_install_the_restricted_unpickler(tmp_path, monkeypatch):
    """No import installs it: each reader does, before torch reads a `.metadata`."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from megatron_dppo.megatron.checkpoint import CheckpointError, load_checkpoint
    from megatron_dppo.megatron.dcp_metadata import read_dcp_metadata, restricted_metadata_pickle
    from megatron_dppo.megatron.sharded_state import checkpoint_keys

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(tmp_path / "pwned")))
    for read in (read_dcp_metadata, checkpoint_keys):
        monkeypatch.setattr(dcp_filesystem, "pickle", pickle)  # as torch ships it
        with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
            read(str(tmp_path))
        assert dcp_filesystem.pickle is restricted_metadata_pickle
    monkeypatch.setattr(dcp_filesystem, "pickle", pickle)
    with pytest.raises(CheckpointError, match="does not exist"):  # dist_checkpointing.load reads it later
        load_checkpoint(str(tmp_path / "step_000001"), policy=None)
    assert dcp_filesystem.pickle is restricted_metadata_pickle
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
    first = run_workers(WORKER, 1, "--phase", "save-steps", "--ckpt", root, "--save-steps", "1,2,3", fork=True)
    _ok(first)
    after_first = sorted(p.name for p in root.glob("step_*"))
    latest_first = (root / "latest").read_text().strip()
    second = run_workers(
        WORKER,
        1,
        "--phase",
        "save-steps",
        "--ckpt",
        root,
        "--resume",
        "--save-steps",
        "999998,999999,1000000",
        fork=True,
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
        "random bytes shard": lambda: _randomize(model / "__0_0.distcp"),
    }
    damage[how]()
    return dst


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _randomize(path):
    """A shard of random bytes of the right size: the sizes check passes, torch.load would fail
    with "Weights only load failed ... Please file an issue" and no file named (issue 24)."""
    path.write_bytes(os.urandom(path.stat().st_size))


@pytest.mark.parametrize(
    "how, needle",
    [
        ("truncated .metadata", r"model_optim/\.metadata is \d+ bytes, but \d+ were written"),
        pytest.param(
            "truncated common.pt", r"model_optim/common\.pt is \d+ bytes, but \d+ were written", marks=BEFORE_019
        ),
        ("truncated shard", r"model_optim/__0_0\.distcp is \d+ bytes, but \d+ were written \(model and optimizer"),
        ("missing shard", r"model_optim/__0_\d\.distcp is missing \(model and optimizer weights\)"),
        ("missing history", r"history\.json is missing \(the prompt history\): the checkpoint's manifest lists it"),
        ("missing rng", r"rng/rank_0\.safetensors is missing \(the RNG state\)"),
        ("missing manifest", r"manifest\.json is missing, but .*trainer_state\.json says the save wrote it"),
        ("truncated trainer_state", r"trainer_state\.json: truncated or corrupt trainer state \(invalid JSON"),
        # Without a manifest, the dist checkpoint's own index still finds the damage.
        ("truncated .metadata, no manifest", r"model_optim/\.metadata: truncated or corrupt shard index"),
        pytest.param(
            "truncated common.pt, no manifest", r"model_optim/common\.pt: truncated or corrupt \(", marks=BEFORE_019
        ),
        ("truncated shard, no manifest", r"model_optim/__0_0\.distcp is \d+ bytes, but .*\.metadata indexes data up"),
        ("missing shard, no manifest", r"model_optim/__0_\d\.distcp is missing: .*\.metadata indexes tensors in it"),
        (
            "random bytes shard",
            r"model_optim/__0_0\.distcp is corrupt: the data of '[^']+' at byte \d+ is not what the save wrote there",
        ),
        ("random bytes shard, no manifest", r"model_optim/__0_0\.distcp is corrupt: the data of '[^']+' at byte \d+"),
    ],
)
def test_corrupt_or_incomplete_checkpoint_is_a_one_line_error_naming_the_file(saved_run, tmp_path, how, needle):
    from megatron_dppo.megatron.checkpoint import CheckpointError, check_checkpoint

    intact = saved_run["root"] / "step_1000000"
    assert check_checkpoint(str(intact))["step"] == 1000000  # the reference passes
    bad = _corrupt_copy(intact, tmp_path / "step_1000000", how)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg, msg
    assert re.search(needle, msg), msg


@BEFORE_019  # 0.19 reads such checkpoints: its own are of this kind
def test_a_checkpoint_of_megatron_core_019_is_named_under_older_versions(saved_run, tmp_path):
    """megatron-core 0.19 saves the non-tensor state as the shard "common_state" instead of
    common.pt; 0.16-0.18 cannot read that: a one-line error saying so, not Megatron's AttributeError.
    (Under 0.19 its own checkpoints are of this kind and pass check_checkpoint: the test above.)"""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_dppo.megatron import checkpoint

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


@pytest.fixture(scope="module")
def loads(saved_run, tmp_path_factory):
    """Three loads in ONE worker process (each start costs ~10 s), in this order: saved_run's intact
    latest checkpoint, a copy without its RNG file, a copy with bytes damaged inside one tensor's
    record (its torch.save header intact). -> (the process, {name: its output block}, the damaged
    shard's (path, offset, tensor name))."""
    import shutil

    from conftest import run_workers

    from megatron_dppo.megatron.dcp_metadata import MetadataUnpickler

    work = tmp_path_factory.mktemp("loads")
    rng = work / "missing_rng"
    _corrupt_copy(saved_run["root"] / "step_1000000", rng / "step_1000000", "missing rng")
    (rng / "latest").write_text("step_1000000\n")
    damaged = work / "damaged"
    shutil.copytree(saved_run["root"] / "step_1000000", damaged / "step_1000000")
    (damaged / "latest").write_text("step_1000000\n")
    model = damaged / "step_1000000" / "model_optim"
    with open(model / ".metadata", "rb") as f:
        meta = MetadataUnpickler(f).load()
    rel, offset, fqn = min(
        (i.relative_path, i.offset, k.fqn)
        for k, i in meta.storage_data.items()
        if hasattr(meta.state_dict_metadata[k.fqn], "size") and i.relative_path == "__0_0.distcp"
    )
    with open(model / rel, "r+b") as f:
        f.seek(offset + 8)
        f.write(os.urandom(400))
    roots = {"intact": saved_run["root"], "missing_rng": rng, "damaged": damaged}
    res = run_workers(
        WORKER, 1, "--phase", "load", "--ckpt", roots["intact"], "--then", rng, "--then", damaged, fork=True
    )
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-4000:]  # two of the three fail
    blocks = {name: res.stdout.split(f"== load {root}\n", 1)[1].split("== load ", 1)[0] for name, root in roots.items()}
    return res, blocks, (model / rel, offset, fqn)


def test_load_checks_before_reading(loads):
    """load_checkpoint itself refuses a checkpoint whose RNG file is missing (a real load in a
    worker), instead of resuming with a fresh RNG."""
    _, blocks, _ = loads
    line = _one_error_line(blocks["missing_rng"])
    assert "rng/rank_0.safetensors is missing (the RNG state)" in line, line


def test_latest_missing_or_not_text_names_the_step_dirs(tmp_path):
    """`latest` deleted while step dirs exist was "no checkpoint" with the dirs unnamed; a `latest`
    of other bytes was a UnicodeDecodeError naming no file (issue 24)."""
    from megatron_dppo.megatron.checkpoint import CheckpointError, latest_checkpoint

    for step in (2, 3, 10):
        (tmp_path / f"step_{step:06d}").mkdir()
    (tmp_path / ".tmp-step_000011").mkdir()  # a save killed midway: not a checkpoint
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(str(tmp_path))
    assert str(e.value) == (
        f"{tmp_path}/latest is missing, but {tmp_path} holds step_000002, step_000003, step_000010 (each a complete "
        f"checkpoint): to resume from the newest, write its name into that file (echo step_000010 > "
        f"{tmp_path}/latest), then pass --resume again"
    )
    (tmp_path / "latest").write_bytes(b"step_\xff\xfe03\n")
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(str(tmp_path))
    assert str(e.value) == (
        f"{tmp_path}/latest is not text (byte 0xff at position 5 is not UTF-8): expected the name of a checkpoint "
        "directory such as step_000010 (write that name into it)"
    )


def _load(ckpt_root, *args):
    from conftest import run_workers

    return run_workers(WORKER, 1, "--phase", "load", "--ckpt", ckpt_root, *args, fork=True)


def _one_error_line(res) -> str:
    """The one CheckpointError line of a load (a failed worker, or one block of `loads`)."""
    if isinstance(res, str):
        out = res
    else:
        assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-4000:]
        out = res.stdout
    lines = [line for line in out.splitlines() if line.startswith("CheckpointError: ")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_a_checkpoint_of_another_model_names_a_tensor_and_both_shapes(saved_run):
    """Was torch's CheckpointException (a BaseException: past every `except Exception`), a 55-line
    traceback ending in "Global shape mismatch"."""
    line = _one_error_line(_load(saved_run["root"], "--other-model"))
    assert re.fullmatch(
        r"CheckpointError: .*/step_1000000/model_optim: the checkpoint does not fit this model: (\S+) is \[[\d, ]+\] "
        r"in the checkpoint but \[[\d, ]+\] in the model \(\d+ tensor\(s\) differ\); is model\.hf_dir the model the "
        r"checkpoint was trained from\?",
        line,
    ), line
    # The shapes named are the two models' own: hidden 64 (saved) against 128.
    assert "64" in line.split(" in the checkpoint")[0].split(" is ")[-1] and "128" in line.split(" but ")[-1], line


def test_unreadable_data_inside_a_shard_names_the_file(loads):
    """Bytes damaged inside one tensor's record (its torch.save header intact): only the load can
    tell, and it names the shard file and the tensor instead of "Please file an issue"."""
    _, blocks, (shard, offset, fqn) = loads
    line = _one_error_line(blocks["damaged"])
    assert line == (
        f"CheckpointError: {shard} is corrupt: {fqn!r} at byte {offset} cannot be read back (RuntimeError); "
        "resume from another step_* dir of the run, or from a copy of this one"
    ), line


def test_resume_prints_no_library_warning(loads):
    """Every --resume printed torch's "Please use DTensor instead and we are deprecating
    ShardedTensor" FutureWarning (through our CPU shim's frame, past quiet.py's module filters)."""
    res, blocks, _ = loads
    assert "loaded step 1000000" in blocks["intact"] and "CheckpointError" not in blocks["intact"], blocks
    during = res.stderr  # the worker resets the warning filters just before loading (phase_load)
    assert "ShardedTensor" not in during and "FutureWarning" not in during, during[-3000:]


def test_disk_full_during_save_names_the_path(tmp_path):
    """A full disk was "[Errno 28] No space left on device" naming no path. Every shard write fails
    as write() does on a full disk; the error names the checkpoint being written, the partial save
    is gone and `latest` still names the last complete checkpoint."""
    from conftest import run_workers

    root = tmp_path / "checkpoints"
    _ok(run_workers(WORKER, 1, "--phase", "save-steps", "--ckpt", root, "--save-steps", "4", fork=True))
    res = run_workers(WORKER, 1, "--phase", "save-disk-full", "--ckpt", root, fork=True)
    assert res.returncode == 4, res.stdout[-2000:] + res.stderr[-4000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("OSError: "))
    assert line == (
        "OSError: [Errno 28] No space left on device while saving checkpoint step_000005 (the partial save was "
        f"removed and {root}/latest still names the previous checkpoint; free space, or set trainer.output_dir to "
        f"a disk with room): '{root}/.tmp-step_000005'"
    ), line
    assert (root / "latest").read_text().strip() == "step_000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004"]


def test_checkpoint_exception_from_any_rank_becomes_one_line():
    """The fallback behind the shape check: torch's CheckpointException carrying Megatron's
    CheckpointingException (its exact message form, from megatron/core/dist_checkpointing/
    strategies/torch.py) becomes one line; any other inner error keeps its first sentence."""
    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_dppo.megatron.checkpoint import _load_error

    inner = CheckpointingException(
        f"Global shape mismatch for loaded ({torch.Size([4, 64])}) and expected ((4, 128)) tensor for key dec.w"
    )
    e = _load_error(CheckpointException("x", {1: (ValueError("later rank. more"), None), 0: (inner, None)}), "/c/m")
    assert str(e) == (
        "/c/m: the checkpoint does not fit this model: dec.w is torch.Size([4, 64]) in the checkpoint but (4, 128) "
        "in the model"
    )
    e = _load_error(CheckpointException("x", {1: (ValueError("it broke. details\nmore"), None)}), "/c/m")
    assert str(e) == "/c/m: cannot load into this model (ValueError: it broke)"


def test_checkpoint_bytes_is_what_the_save_wrote(saved_run):
    """The save's size the trainer logs (its cost, to weigh trainer.save_every_minutes against)."""
    from megatron_dppo.megatron.checkpoint import checkpoint_bytes

    step = saved_run["root"] / "step_1000000"
    on_disk = sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert checkpoint_bytes(str(step)) == on_disk > 0


def test_saving_swaps_megatrons_results_queue_only_while_it_saves():
    """save_sharded writes in-process, so FileSystemWriterAsync's results queue is a plain queue
    (no Manager server process) inside _no_results_manager, and Megatron's own outside it."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dppo.megatron.checkpoint import _RESULTS_QUEUE_FACTORY, _no_results_manager

    assert _RESULTS_QUEUE_FACTORY is not None  # this megatron-core has the factory to swap
    original = getattr(filesystem_async, _RESULTS_QUEUE_FACTORY)
    with _no_results_manager():
        assert type(getattr(filesystem_async, _RESULTS_QUEUE_FACTORY)()) is queue.Queue
    assert getattr(filesystem_async, _RESULTS_QUEUE_FACTORY) is original


UNSTEPPED_WORKER = os.path.join(os.path.dirname(__file__), "workers", "step", "ckpt_unstepped.py")


def test_a_checkpoint_before_the_first_update_resumes_bit_for_bit(tmp_path, launch):
    """A run whose steps all skipped the update (every reward 0) saved checkpoints without Adam's
    moments (torch creates them at the first update): the load failed ("lacks 20 key(s) the model
    asks for"). Saved before any update, the
    checkpoint loads, and the resumed policy's next updates (loss, grad norm, lr, weights, Adam's
    moments and step) equal those of a run that never saved and of the saving run going on."""
    out = tmp_path / "out.json"
    res = launch(UNSTEPPED_WORKER, 1, "--ckpt", str(tmp_path / "ckpt"), "--out", str(out))
    _ok(res)
    result = json.loads(out.read_text())
    assert result["ok"], result["diffs"][:8]
