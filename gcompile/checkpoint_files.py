"""A checkpoint is data, never code: the files of a checkpoint folder that are not tensors, read safely.

DCP writes its `.metadata` with pickle and reads it back with `pickle.load`, which calls whatever
a crafted file names. `MetadataReader` reads it instead with an unpickler whose `find_class` admits
only the globals a `.metadata` of plain tensors refers to (torch_api.DCP_METADATA_GLOBALS) and torch
dtypes. Anything else is refused with one line naming the file: `os.system`, `builtins.eval`, and
DCP's own BytesStorageMetadata too, since DCP would read the bytes it points at with
`torch.load(weights_only=False)`. Shard files must be plain names inside the folder. Tensors
themselves DCP reads with `torch.load(weights_only=True)`.

Checksums. gcompile.json holds each tensor's CRC-32 (gcompile.checkpoint); the two files that say
where the tensors are and what they mean are covered by `checksums.json`, written last before the
commit:

    iter_0000100/checksums.json    {"gcompile.json": CRC-32, ".metadata": CRC-32} of their bytes

Each is checked before it is parsed, so a damaged one is refused rather than misread. A checksum
finds damage, not an attacker (who can recompute it); the allow-list is what keeps code out.
"""

import io
import json
import os
import pickle
import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gcompile.torch_api import DCP_METADATA_GLOBALS

GCOMPILE_JSON = "gcompile.json"
"""What the keys mean, the model, the run config, progress (gcompile.checkpoint)."""
DCP_METADATA = ".metadata"
"""The file DCP's FileSystemWriter writes its pickled Metadata to."""
CHECKSUMS = "checksums.json"
DESCRIBED = (GCOMPILE_JSON, DCP_METADATA)
"""The files checksums.json covers."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message names what does not match."""


def write_checksums(folder: str) -> str:
    """checksums.json's text for the DESCRIBED files of `folder` (the caller writes it durably)."""
    return json.dumps({name: zlib.crc32(_read(folder, name)) for name in DESCRIBED}) + "\n"


def read_checked(folder: str, name: str) -> bytes:
    """The bytes of one DESCRIBED file of `folder`, after checking them against checksums.json."""
    data = _read(folder, name)
    path = os.path.join(folder, CHECKSUMS)
    try:
        with open(path, "rb") as f:
            recorded = json.loads(f.read())[name]
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {CHECKSUMS} (saved by an older gcompile, or not committed); load an "
                              f"earlier checkpoint, or save this one again") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: unreadable; the file is damaged") from None
    if zlib.crc32(data) != recorded:
        raise CheckpointError(f"{os.path.join(folder, name)} does not match its checksum in {CHECKSUMS}; "
                              f"one of the two is corrupted")
    return data


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)  # no lazy import
        if not dtype and (module, name) not in DCP_METADATA_GLOBALS:
            raise CheckpointError(f"{self.path} names {module}.{name}, which a checkpoint's metadata never "
                                  f"holds; refusing to load it (a checkpoint is data, never code)")
        return super().find_class(module, name)


def read_dcp_metadata(folder: str) -> Metadata:
    """DCP's Metadata of `folder`, checked against checksums.json and unpickled with the allow-list."""
    path = os.path.join(folder, DCP_METADATA)
    data = read_checked(folder, DCP_METADATA)
    try:
        metadata = _AllowListUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # a file that passed its checksum but is no pickle of ours
        raise CheckpointError(f"{path}: not DCP metadata ({type(e).__name__}); the save is damaged or not "
                              f"written by gcompile, load an earlier checkpoint or save again") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in metadata.storage_data.values():
        if os.path.basename(info.relative_path) != info.relative_path or info.relative_path in ("", ".", ".."):
            raise CheckpointError(f"{path} points outside its folder ({info.relative_path!r})")
    return metadata


class MetadataReader(dcp.FileSystemReader):
    """DCP's reader with `.metadata` read by `read_dcp_metadata`, once: a load a parameter at a time
    would otherwise read it again for every parameter."""

    def __init__(self, folder: str):
        super().__init__(folder)
        self.folder = folder
        self.metadata = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.metadata is None:
            self.metadata = read_dcp_metadata(self.folder)
            if self.metadata.storage_meta is None:  # as FileSystemReader.read_metadata does
                self.metadata.storage_meta = StorageMeta()
            self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def _read(folder: str, name: str) -> bytes:
    try:
        with open(os.path.join(folder, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {name}; the checkpoint is incomplete, load an earlier one "
                              f"or save again") from None
