"""Reading a dist checkpoint's `.metadata` (torch.distributed.checkpoint's pickled shard index)
without running pickled code.

torch's FileSystemReader.read_metadata unpickles `.metadata` with the plain `pickle` module: a
crafted checkpoint could run any code on load. `install_restricted_metadata_unpickler` puts a
stand-in for that module into torch.distributed.checkpoint.filesystem whose load() admits only
the checkpoint metadata classes; every reader of a checkpoint here calls it (read_dcp_metadata,
checkpoint.check_checkpoint and load_checkpoint), since dist_checkpointing.load reads `.metadata`
through the same module.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint import FileSystemReader


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler of DCP metadata: torch.distributed.checkpoint's classes, torch sizes and dtypes,
    a few containers; anything else is an UnpicklingError naming it."""

    _ALLOWED_PREFIXES = ("torch.distributed.checkpoint.",)
    _ALLOWED = {
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("torch.serialization", "_get_layout"),
        ("torch", "strided"),
    }

    def find_class(self, module, name):
        if module.startswith(self._ALLOWED_PREFIXES) or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a checkpoint metadata type: "
            "refusing to load it (it could run code)"
        )


class restricted_metadata_pickle:
    """Stands in for the `pickle` module inside torch.distributed.checkpoint.filesystem: dumps as
    pickle does, loads through MetadataUnpickler."""

    dump = staticmethod(pickle.dump)
    dumps = staticmethod(pickle.dumps)
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL

    @staticmethod
    def load(f, **kwargs):
        return MetadataUnpickler(f).load()


def install_restricted_metadata_unpickler() -> None:
    """Make torch.distributed.checkpoint.filesystem unpickle `.metadata` through MetadataUnpickler
    (idempotent; the process keeps it: nothing else here unpickles through that module)."""
    dcp_filesystem.pickle = restricted_metadata_pickle


def read_dcp_metadata(model_dir: str):
    """The DCP metadata of a torch_dist checkpoint dir, read through the restricted unpickler."""
    install_restricted_metadata_unpickler()
    return FileSystemReader(model_dir).read_metadata()
