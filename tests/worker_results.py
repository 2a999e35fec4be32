"""What the dist and e2e tests read back from a script they launched: its output when it succeeded, the
tensors of the safetensors files it wrote."""

from pathlib import Path

from safetensors.torch import load_file


def ok_output(res) -> str:
    """stdout + stderr of a finished run (a CompletedProcess); fails showing them unless it exited 0."""
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-8000:]
    return out


def safetensors_weights(d: Path) -> dict:
    """Every tensor of the *.safetensors files in d, by name."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out
