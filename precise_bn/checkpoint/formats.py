"""Checkpoint files as users have them (one :class:`Format` per layout): read without running their
code, written back whole with the same serializer, only the BN stats changed (docs/cli.md)."""
from __future__ import annotations

import json
import logging
import os
import zipfile
from typing import Any, Mapping, Optional, Tuple

import torch

from ..errors import CheckpointError
from .serializers import (PICKLE_PROTO, PICKLE_PROTOCOL, ZIP_HEADER, Writer, caffe2_writer, load_safetensors,
                          read_head, safetensors_writer, torch_load, torch_writer, write_file, written_by_torch_save)
from .state import PROVENANCE_KEY, Checkpoint, locate_state_dict

logger = logging.getLogger("precise_bn")

class Format:
    """How a file is recognised, read and written back; a new one is listed in :data:`FORMATS`."""

    name = ""
    extensions: Tuple[str, ...] = ()
    #: Whether the file may hold a state dict among other objects (the ``key`` of loading).
    nested = False

    def claims(self, path: str, head: Optional[bytes]) -> bool:
        """Whether ``path`` is in this format, from its name and first bytes (``head``, None if new)."""
        return path.lower().endswith(self.extensions)

    def load(self, path: str, key: Optional[str], trust: bool, rules: Any) -> Checkpoint:
        raise NotImplementedError

    def writer(self, ckpt: Checkpoint) -> Writer:
        """What writes ``ckpt`` back, with the serializer it was read with."""
        raise NotImplementedError

    def state_dict_writer(self, state: Mapping[str, torch.Tensor], path: str, rules: Any,
                          unmapped: str) -> Tuple[Writer, Any]:
        """What writes a bare state dict to ``path``, and the name conversion's report (or None)."""
        raise NotImplementedError

    def provenance(self, ckpt: Checkpoint) -> Any:
        """The ``precise_bn`` entry ``ckpt`` holds, as stored; None where the format has no room."""
        return None

    def set_provenance(self, ckpt: Checkpoint, info: Mapping[str, Any]) -> bool:
        """Record ``info`` in ``ckpt``; False where the format has no room for it."""
        return False


class SafetensorsFormat(Format):
    """A name -> tensor table with a metadata header (by name, or its length and ``{`` first)."""

    name, extensions = "safetensors", (".safetensors",)

    def claims(self, path: str, head: Optional[bytes]) -> bool:
        if super().claims(path, head):
            return True
        if head is None or len(head) < 9:
            return False
        return head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= os.path.getsize(path)

    def load(self, path: str, key: Optional[str], trust: bool, rules: Any) -> Checkpoint:
        tensors, metadata = load_safetensors(path)
        return Checkpoint(path, self.name, tensors, tensors, metadata=metadata)

    def writer(self, ckpt: Checkpoint) -> Writer:
        return safetensors_writer(ckpt.state_dict, ckpt.metadata)

    def state_dict_writer(self, state: Mapping[str, torch.Tensor], path: str, rules: Any,
                          unmapped: str) -> Tuple[Writer, Any]:
        # safetensors refuses tensors that share memory; a state dict may hold views.
        tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
        return safetensors_writer(tensors, {"format": "pt"}), None

    def provenance(self, ckpt: Checkpoint) -> Any:
        """Files come from anywhere: an entry that is not JSON comes back as its text."""
        text = ckpt.metadata.get(PROVENANCE_KEY)
        try:
            return None if text is None else json.loads(text)
        except ValueError:
            return text

    def set_provenance(self, ckpt: Checkpoint, info: Mapping[str, Any]) -> bool:
        ckpt.metadata[PROVENANCE_KEY] = json.dumps(dict(info), sort_keys=True)
        return True


class Caffe2Format(Format):
    """A Caffe2 / Detectron pickle of numpy blobs: ``.pkl``/``.pickle``, not a legacy ``torch.save``."""

    name, extensions = "caffe2", (".pkl", ".pickle")

    def claims(self, path: str, head: Optional[bytes]) -> bool:
        return super().claims(path, head) and not (head and written_by_torch_save(head))

    def load(self, path: str, key: Optional[str], trust: bool, rules: Any) -> Checkpoint:
        from ..caffe2.checkpoint import pickle_protocol, read_caffe2_pickle
        from ..caffe2.names import caffe2_to_torch

        root, blobs = read_caffe2_pickle(path)
        # Blobs no rule maps stay in ``root``, which is what is written back: nothing is lost.
        state_dict, conversion = caffe2_to_torch(blobs, rules, source=path, unmapped="drop")
        logger.info("%s: Caffe2 blobs to PyTorch names: %s", path, conversion)
        names = {key: blob for blob, key in conversion.mapped.items()}
        return Checkpoint(path, self.name, root, state_dict, source_names=names,
                          metadata={PICKLE_PROTOCOL: str(pickle_protocol(path))})

    def writer(self, ckpt: Checkpoint) -> Writer:
        # Each updated tensor goes back into the blob it was read from, in that blob's dtype and shape.
        blobs = {ckpt.source_names[key]: ckpt.state_dict[key] for key in ckpt.updated}
        return caffe2_writer(blobs, ckpt.root, ckpt.metadata)

    def state_dict_writer(self, state: Mapping[str, torch.Tensor], path: str, rules: Any,
                          unmapped: str) -> Tuple[Writer, Any]:
        from ..caffe2.names import torch_to_caffe2

        blobs, conversion = torch_to_caffe2(dict(state), rules, unmapped=unmapped, source="converting to " + path)
        return caffe2_writer(blobs), conversion  # the caller shows the conversion (convert lists it)


class TorchFormat(Format):
    """Anything ``torch.save`` wrote (zip or legacy pickle), and every file no other format claims."""

    name, nested = "torch", True

    def claims(self, path: str, head: Optional[bytes]) -> bool:
        return True

    def load(self, path: str, key: Optional[str], trust: bool, rules: Any) -> Checkpoint:
        head = read_head(path) or b""
        if not (head.startswith(ZIP_HEADER) or head.startswith(PICKLE_PROTO)):
            raise CheckpointError("{}: neither a PyTorch checkpoint (a zip archive or a pickle), a pickle nor a "
                                  "safetensors file; it begins with {!r}".format(path, head))
        root = torch_load(path, trust)
        where, state_dict = locate_state_dict(root, path, key)
        return Checkpoint(path, self.name, root, state_dict, where=where, legacy_format=not zipfile.is_zipfile(path))

    def writer(self, ckpt: Checkpoint) -> Writer:
        return torch_writer(ckpt.root, ckpt.legacy_format)

    def state_dict_writer(self, state: Mapping[str, torch.Tensor], path: str, rules: Any,
                          unmapped: str) -> Tuple[Writer, Any]:
        return torch_writer(dict(state)), None

    def provenance(self, ckpt: Checkpoint) -> Any:
        return ckpt.root.get(PROVENANCE_KEY) if ckpt.where and isinstance(ckpt.root, Mapping) else None

    def set_provenance(self, ckpt: Checkpoint, info: Mapping[str, Any]) -> bool:
        """Next to the state dict, never inside a bare one (``load_state_dict(strict=True)`` refuses)."""
        if not (ckpt.where and isinstance(ckpt.root, dict)):
            return False
        ckpt.root[PROVENANCE_KEY] = dict(info)
        return True


#: Every format, in the order they are tried: the first that claims a file reads it.
FORMATS: Tuple[Format, ...] = (SafetensorsFormat(), Caffe2Format(), TorchFormat())


def format_named(name: str) -> Format:
    """The format a :class:`Checkpoint` names in its ``format``."""
    return next(fmt for fmt in FORMATS if fmt.name == name)


def format_of(path: str) -> Format:
    """The format of ``path``: from its first bytes when it exists, else from its name."""
    head = read_head(path) if os.path.isfile(path) else None
    return next(fmt for fmt in FORMATS if fmt.claims(path, head))


def detect_format(path: str) -> str:
    """The name of :func:`format_of` ``path``: ``"safetensors"``, ``"caffe2"`` or ``"torch"``."""
    return format_of(path).name


def check_key(path: str, fmt: Format, key: Optional[str]) -> None:
    """A ``key`` only for a format whose files nest a state dict among other objects."""
    if key is not None and not fmt.nested:
        raise CheckpointError("{}: a {} file is one flat table of tensors, with no key to choose; a key applies to "
                              "torch.save files".format(path, fmt.name))


def load_checkpoint(path: str, *, key: Optional[str] = None, trust: bool = False, rules: Any = None) -> Checkpoint:
    """Read ``path`` and locate its state dict (``key``: its place, ``a/b`` nested), running no code
    from it unless ``trust`` (else ``UnsafeCheckpointError``); ``rules`` map Caffe2 names."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError("{}: is a folder, not a checkpoint file (a sharded or distributed checkpoint? "
                              "consolidate it into one file first)".format(path))
    if not os.path.isfile(path):
        raise CheckpointError("{}: no such checkpoint file".format(path))
    if os.path.getsize(path) == 0:
        raise CheckpointError("{}: the file is empty (0 bytes), an interrupted save?".format(path))
    fmt = format_of(path)
    check_key(path, fmt, key)
    return fmt.load(path, key, trust, rules)


def save_checkpoint(ckpt: Checkpoint, output: str) -> None:
    """Write ``ckpt`` to ``output`` (one :func:`check_output` accepted), atomically, with the
    input's serializer."""
    write_file(output, format_named(ckpt.format).writer(ckpt))
    logger.info("wrote %s (%d BatchNorm tensors updated)", output, len(ckpt.updated))


def save_state_dict(state_dict: Mapping[str, torch.Tensor], path: str, fmt: str, rules: Any = None,
                    unmapped: str = "error") -> Any:
    """Write a bare state dict as ``fmt`` atomically; for ``caffe2``, return the names' report."""
    writer, conversion = format_named(fmt).state_dict_writer(state_dict, path, rules, unmapped)
    write_file(path, writer)
    return conversion
