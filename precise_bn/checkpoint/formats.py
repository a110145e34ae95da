"""Checkpoint files as users have them: read without running their code, write back only BN stats.

Layouts found from the file itself:

* ``.safetensors``: a flat name -> tensor table plus a string metadata header;
* a Caffe2 / Detectron ``.pkl`` blob dictionary, through :mod:`precise_bn.caffe2.checkpoint`
  and :mod:`precise_bn.caffe2.names`;
* anything ``torch.save`` wrote: a bare state dict, or a dict holding one under ``state_dict``
  (Lightning), ``model`` (detectron2, torchvision references), ``model_state`` (pycls) or a key
  the user names (``a/b`` for a nested one).

Why the care when writing: users reload the result with their own code. So the whole loaded
object is written back with the same serializer; only the ``running_mean`` / ``running_var``
tensors of layers that were measured change, copied *in place* into the loaded tensors (their
dtype, shape and any storage sharing are kept); optimizer state, epoch, hyper-parameters and EMA
weights keep their exact bits. Tensors are read onto the CPU and written from there. A
``precise_bn`` provenance entry is added where it cannot confuse a loader: next to the state
dict in a dict checkpoint, or in the safetensors metadata, never inside a bare state dict
(``load_state_dict(strict=True)`` would reject the extra key).
"""
from __future__ import annotations

import datetime
import inspect
import io
import json
import logging
import os
import pickle
import re
import zipfile
from typing import Any, BinaryIO, Callable, Dict, Mapping, Optional, Tuple

import torch

from .._version import __version__
from ..errors import BackendUnavailableError, CheckpointError, ConfigError, UnsafeCheckpointError
from ..report import BNReport
from ..atomic import atomic_write
from .paths import check_paths
from .state import PROVENANCE_KEY, Checkpoint, StateDict, locate_state_dict

logger = logging.getLogger("precise_bn")

#: ``torch.load(weights_only=True)`` exists (torch >= 1.13): files load without running code.
SAFE_LOAD_AVAILABLE = "weights_only" in inspect.signature(torch.load).parameters

def detect_format(path: str) -> str:
    """``"safetensors"``, ``"caffe2"`` (a plain pickle named ``.pkl``/``.pickle``) or ``"torch"``.

    A zip archive is always a ``torch.save`` file, whatever its name; a non-zip file is a
    Caffe2 pickle only when its name says so and it does not begin as a legacy ``torch.save``
    file does (those are pickles too, and are sometimes named ``.pkl``).
    """
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith((".pkl", ".pickle")) and not (os.path.isfile(path) and _written_by_torch_save(path)):
        return "caffe2"
    return "torch"


#: How a legacy (non-zip) ``torch.save`` file begins: its magic number, pickled with protocol 2.
_LEGACY_TORCH_HEADER = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _written_by_torch_save(path: str) -> bool:
    """A zip archive, or a pickle that starts with torch's legacy magic number."""
    try:
        if zipfile.is_zipfile(path):
            return True
        with open(path, "rb") as handle:
            return handle.read(len(_LEGACY_TORCH_HEADER)) == _LEGACY_TORCH_HEADER
    except OSError:
        return False  # unreadable: loading it says so


def load_checkpoint(path: str, *, key: Optional[str] = None, trust: bool = False, rules: Any = None) -> Checkpoint:
    """Read ``path`` and locate its state dict (``key``: its place, ``a/b`` for nested dicts).

    Never runs code from the file unless ``trust``: PyTorch files go through
    ``torch.load(weights_only=True)``, and on a torch without it loading is refused; Caffe2
    pickles through a loader that builds numpy arrays only. ``rules`` maps Caffe2 layer names
    to module names (see :func:`precise_bn.caffe2.names.caffe2_to_torch`; default: the
    model-zoo ResNet names).

    Raises:
        CheckpointError: the file is missing or unreadable, or holds no state dict where looked.
        UnsafeCheckpointError: the file needs code to load and ``trust`` is False.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError("{}: is a folder, not a checkpoint file (a sharded or distributed checkpoint? "
                              "consolidate it into one file first)".format(path))
    if not os.path.isfile(path):
        raise CheckpointError("{}: no such checkpoint file".format(path))
    if os.path.getsize(path) == 0:
        raise CheckpointError("{}: the file is empty (0 bytes), an interrupted save?".format(path))
    fmt = detect_format(path)
    if key is not None and fmt != "torch":
        raise CheckpointError("{}: a {} file is one flat table of tensors; --key applies to torch.save files".format(path, fmt))
    if fmt == "safetensors":
        tensors, metadata = _load_safetensors(path)
        return Checkpoint(path, fmt, tensors, tensors, metadata=metadata)
    if fmt == "caffe2":
        from ..caffe2.checkpoint import pickle_protocol, read_caffe2_pickle
        from ..caffe2.names import caffe2_to_torch

        root, blobs = read_caffe2_pickle(path)
        # Blobs no rule maps stay in ``root``, which is what is written back: nothing is lost.
        state_dict, conversion = caffe2_to_torch(blobs, rules, source=path, unmapped="drop")
        logger.info("%s: Caffe2 blobs to PyTorch names: %s", path, conversion)
        names = {key: blob for blob, key in conversion.mapped.items()}
        return Checkpoint(path, fmt, root, state_dict, source_names=names,
                          metadata={PICKLE_PROTOCOL: str(pickle_protocol(path))})
    root = _torch_load(path, trust)
    where, state_dict = locate_state_dict(root, path, key)
    return Checkpoint(path, fmt, root, state_dict, where=where, legacy_format=not zipfile.is_zipfile(path))


def _safetensors_torch() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise BackendUnavailableError(
            ".safetensors files need the safetensors package: pip install safetensors"
        ) from exc
    return safetensors.torch


def _load_safetensors(path: str) -> Tuple[StateDict, Dict[str, str]]:
    st = _safetensors_torch()
    from safetensors import SafetensorError

    try:
        with st.safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
        return st.load_file(path), metadata
    except (SafetensorError, OSError) as exc:
        raise CheckpointError("{}: cannot be read as a safetensors file: {}".format(path, exc)) from exc


def _torch_load(path: str, trust: bool) -> Any:
    if not trust and not SAFE_LOAD_AVAILABLE:
        raise UnsafeCheckpointError(
            "{}: torch {} cannot load a checkpoint without the risk of running code from it "
            "(torch.load(weights_only=True) needs torch >= 1.13); pass --trust-checkpoint "
            "(trust=True) only if you trust where this file comes from".format(path, torch.__version__)
        )
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
            "nothing from it was run. Pass --trust-checkpoint (trust=True) only if you trust "
            "where this file comes from".format(path, _unpickler_complaint(str(exc)))
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError("{}: cannot be read as a PyTorch checkpoint: {}".format(path, exc)) from exc


def _unpickler_complaint(message: str) -> str:
    """The one useful line of torch's weights_only error: the global or opcode it refused."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return "it refers to " + found.group(1)
    detail = message.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
    return detail[0] if detail else message


def _now() -> datetime.datetime:
    """The time to record: ``SOURCE_DATE_EPOCH`` when set (reproducible builds' convention, so
    that two identical runs write identical bytes), else the current time, in UTC."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        return datetime.datetime.now(datetime.timezone.utc)
    try:
        return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
    except (ValueError, OverflowError, OSError) as exc:
        raise ConfigError("SOURCE_DATE_EPOCH={!r} is not a number of seconds since 1970".format(epoch)) from exc


def provenance(report: BNReport) -> Dict[str, Any]:
    """What the ``precise_bn`` entry records: how the stats were measured, by what, when."""
    return {
        "version": __version__,
        "torch": str(torch.__version__),
        "date": _now().isoformat(timespec="seconds"),
        "samples": report.samples,
        "iterations": report.batches,
        "world_size": report.world_size,
        "estimator": report.estimator,
        "layers": len(report.layers) - len(report.unused),
    }


def set_provenance(ckpt: Checkpoint, info: Mapping[str, Any]) -> None:
    """Record ``info`` as the ``precise_bn`` entry where the layout has room (logged if not)."""
    if ckpt.format == "safetensors":
        ckpt.metadata[PROVENANCE_KEY] = json.dumps(dict(info), sort_keys=True)
    elif ckpt.format == "torch" and ckpt.where and isinstance(ckpt.root, dict):
        ckpt.root[PROVENANCE_KEY] = dict(info)
    else:
        logger.info(
            "%s: a %s layout has no room for a precise_bn provenance entry; none recorded",
            ckpt.path, "bare state dict" if ckpt.format == "torch" else ckpt.format,
        )


def check_output(source: str, output: str, in_place: bool, *, break_hardlinks: bool = False) -> str:
    """Check before any work that ``output`` may be written (see
    :func:`precise_bn.checkpoint.paths.check_paths`): never the input ``source`` unless
    ``in_place``, which writes nothing else. Returns the file that will be written (symbolic
    links resolved)."""
    return check_paths([("the input", source)], [("the output", output)], in_place=in_place,
                       break_hardlinks=break_hardlinks)[0]


def write_file(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically; an OS failure becomes a CheckpointError naming the file."""
    try:
        atomic_write(path, write)
    except OSError as exc:
        raise CheckpointError(
            "{}: writing failed ({}); any previous file there is unchanged".format(path, exc.strerror or exc)
        ) from exc


def _safetensors_writer(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]):
    save = _safetensors_torch().save
    return lambda handle: handle.write(save(dict(tensors), metadata=dict(metadata)))


#: Where a Caffe2 checkpoint's ``metadata`` keeps its pickle protocol, to write it back alike.
PICKLE_PROTOCOL = "pickle_protocol"


def _caffe2_writer(blobs: Mapping[str, Any], root: Any = None, metadata: Optional[Mapping[str, str]] = None):
    from ..caffe2.checkpoint import DEFAULT_PROTOCOL, save_caffe2_pickle

    protocol = int((metadata or {}).get(PICKLE_PROTOCOL, DEFAULT_PROTOCOL))
    return lambda handle: save_caffe2_pickle(dict(blobs), handle, root=root, protocol=protocol)


def _torch_writer(obj: Any, legacy: bool = False):
    """Serialise in memory, then write the bytes: a full disk or a file-size limit then raises
    the plain ``OSError`` (ENOSPC, EFBIG) instead of the zip writer's internal error, which on
    torch 1.10 even aborts the process from a destructor."""

    def write(handle: BinaryIO) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
        handle.write(buffer.getbuffer())

    return write


def _caffe2_blobs_with(ckpt: Checkpoint) -> Dict[str, Any]:
    """Each updated tensor under the name of the blob it was read from (written back into
    ``ckpt.root`` in that blob's dtype and shape)."""
    return {ckpt.source_names[key]: ckpt.state_dict[key] for key in ckpt.updated}


def save_checkpoint(ckpt: Checkpoint, output: str) -> None:
    """Write ``ckpt`` (with the stats :func:`apply_bn_stats` put in) to ``output``, atomically.

    The same serializer as the input's (zip or legacy ``torch.save``, safetensors with its
    metadata, Caffe2 pickle). ``output`` is one :func:`check_output` accepted before any work.
    """
    if ckpt.format == "safetensors":
        writer = _safetensors_writer(ckpt.state_dict, ckpt.metadata)
    elif ckpt.format == "caffe2":
        writer = _caffe2_writer(_caffe2_blobs_with(ckpt), ckpt.root, ckpt.metadata)
    else:
        writer = _torch_writer(ckpt.root, ckpt.legacy_format)
    write_file(output, writer)
    logger.info("wrote %s (%d BatchNorm tensors updated)", output, len(ckpt.updated))


def save_state_dict(state_dict: Mapping[str, torch.Tensor], path: str, fmt: str, rules: Any = None,
                    unmapped: str = "error") -> Any:
    """Write a bare state dict as ``fmt`` (``torch``, ``safetensors`` or ``caffe2``, with the
    name ``rules`` and ``unmapped`` policy of :func:`precise_bn.caffe2.names.torch_to_caffe2`),
    atomically. Returns the name conversion's report for ``caffe2``, else None."""
    conversion = None
    if fmt == "safetensors":
        # safetensors refuses tensors that share memory; a state dict may hold views.
        tensors = {k: v.detach().contiguous().clone() for k, v in state_dict.items()}
        writer = _safetensors_writer(tensors, {"format": "pt"})
    elif fmt == "caffe2":
        from ..caffe2.names import torch_to_caffe2

        blobs, conversion = torch_to_caffe2(dict(state_dict), rules, unmapped=unmapped, source="converting to " + path)
        logger.info("%s: PyTorch names to Caffe2 blobs: %s", path, conversion)
        writer = _caffe2_writer(blobs)
    else:
        writer = _torch_writer(dict(state_dict))
    write_file(path, writer)
    return conversion

