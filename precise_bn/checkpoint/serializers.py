"""Bytes in and out of checkpoint files, below the formats of :mod:`precise_bn.checkpoint.formats`:
how a file begins, loading without running code, and atomic writers for each serializer."""
from __future__ import annotations

import inspect
import io
import pickle
import re
from typing import Any, BinaryIO, Callable, Dict, Mapping, Optional, Tuple

import torch

from ..atomic import atomic_write
from ..errors import BackendUnavailableError, CheckpointError, Fix, UnsafeCheckpointError
from .state import StateDict

#: ``torch.load(weights_only=True)`` exists (torch >= 1.13): files load without running code.
SAFE_LOAD_AVAILABLE = "weights_only" in inspect.signature(torch.load).parameters

#: How a legacy (non-zip) ``torch.save`` file begins: its magic number, pickled with protocol 2.
_LEGACY_TORCH_HEADER = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
ZIP_HEADER = b"PK\x03\x04"
PICKLE_PROTO = b"\x80"  # the PROTO opcode every pickle of protocol 2 or later starts with
#: Bytes read to recognise a file, and shown when it is in no known format.
HEAD_BYTES = 16

Writer = Callable[[BinaryIO], None]


def read_head(path: str) -> Optional[bytes]:
    """The first bytes of an existing file; None when there is none to read (an output)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(HEAD_BYTES)
    except OSError:
        return None


def written_by_torch_save(head: bytes) -> bool:
    """A zip archive, or a pickle that starts with torch's legacy magic number."""
    return head.startswith(ZIP_HEADER) or head.startswith(_LEGACY_TORCH_HEADER[:HEAD_BYTES])


def safetensors_torch() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise BackendUnavailableError(
            ".safetensors files need the safetensors package: pip install safetensors"
        ) from exc
    return safetensors.torch


def load_safetensors(path: str) -> Tuple[StateDict, Dict[str, str]]:
    st = safetensors_torch()
    from safetensors import SafetensorError

    try:
        with st.safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
        return st.load_file(path), metadata
    except (SafetensorError, OSError) as exc:
        raise CheckpointError("{}: cannot be read as a safetensors file: {}".format(path, exc)) from exc


TRUST_FIX = Fix("trust", True, "only if you trust where this file comes from")


def torch_load(path: str, trust: bool) -> Any:
    if not trust and not SAFE_LOAD_AVAILABLE:
        raise UnsafeCheckpointError(
            "{}: torch {} cannot load a checkpoint without the risk of running code from it "
            "(torch.load(weights_only=True) needs torch >= 1.13)".format(path, torch.__version__), TRUST_FIX)
    kwargs: Dict[str, Any] = {"map_location": "cpu"}
    if SAFE_LOAD_AVAILABLE:
        kwargs["weights_only"] = not trust
    try:
        return torch.load(path, **kwargs)
    except pickle.UnpicklingError as exc:
        if trust:
            raise CheckpointError("{}: cannot be unpickled: {}".format(path, exc)) from exc
        raise UnsafeCheckpointError(
            "{}: refused: loading it needs more than tensors and plain containers ({}); "
            "nothing from it was run".format(path, _unpickler_complaint(str(exc))), TRUST_FIX) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError("{}: cannot be read as a PyTorch checkpoint: {}".format(path, exc)) from exc


def _unpickler_complaint(message: str) -> str:
    """The one useful line of torch's weights_only error: the global or opcode it refused."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return "it refers to " + found.group(1)
    detail = message.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
    return detail[0] if detail else message


def write_file(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically; an OS failure becomes a CheckpointError naming the file."""
    try:
        atomic_write(path, write)
    except OSError as exc:
        raise CheckpointError(
            "{}: writing failed ({}); any previous file there is unchanged".format(path, exc.strerror or exc)
        ) from exc


def safetensors_writer(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Writer:
    save = safetensors_torch().save
    return lambda handle: handle.write(save(dict(tensors), metadata=dict(metadata)))


#: Where a Caffe2 checkpoint's ``metadata`` keeps its pickle protocol, to write it back alike.
PICKLE_PROTOCOL = "pickle_protocol"


def caffe2_writer(blobs: Mapping[str, Any], root: Any = None,
                   metadata: Optional[Mapping[str, str]] = None) -> Writer:
    from ..caffe2.checkpoint import DEFAULT_PROTOCOL, save_caffe2_pickle

    protocol = int((metadata or {}).get(PICKLE_PROTOCOL, DEFAULT_PROTOCOL))
    return lambda handle: save_caffe2_pickle(dict(blobs), handle, root=root, protocol=protocol)


def torch_writer(obj: Any, legacy: bool = False) -> Writer:
    """Serialise in memory, then write the bytes: a full disk or a file-size limit then raises
    the plain ``OSError`` (ENOSPC, EFBIG) instead of the zip writer's internal error, which on
    torch 1.10 even aborts the process from a destructor."""

    def write(handle: BinaryIO) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
        handle.write(buffer.getbuffer())

    return write
