"""Checkpoints: exact resume after a kill, loading at another layout, atomicity, no pickled code."""
import json
import os
import pickle

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "dist_step", "ckpt_check.py")


def _ok(res):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


def test_kill_after_save_then_resume_reproduces_losses_and_other_layouts_load(tmp_path, launch):
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.json", tmp_path / "resumed.json"
    _ok(launch(WORKER, 2, "--phase", "full", "--ckpt", str(tmp_path / "ckpt_full"), "--out", str(full),
                    "--tp", "2"))
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
    from megatron_dppo.megatron import checkpoint  # noqa: F401  (installs the restricted unpickler)
    from torch.distributed.checkpoint import FileSystemReader

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        FileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "pwned").exists()
