"""Caffe2 ``.pkl`` checkpoints (often Python 2 pickles): read building numpy objects and plain
containers only (unpickling runs what the file names), written back with layout, entries and
protocol kept, only the blobs given changed. Needs numpy, never Caffe2."""
from __future__ import annotations

import collections
import copy
import importlib
import os
import pickle
import pickletools
import types
from typing import Any, BinaryIO, Dict, Mapping, Tuple, Union

import numpy as np
import torch

from ..atomic import PathLike, atomic_write
from ..errors import CheckpointError, UnsafeCheckpointError


def to_numpy(tensor: Any) -> np.ndarray:
    if torch.is_tensor(tensor):
        return tensor.detach().cpu().numpy().copy()
    return np.array(tensor, copy=True)


def _numpy_module(name: str) -> Any:
    """numpy's ``core`` submodule ``name`` under its numpy 2 (``_core``) or numpy 1 (``core``) path."""
    try:
        return importlib.import_module("numpy._core." + name)
    except ImportError:
        return importlib.import_module("numpy.core." + name)


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 protocol-2 pickles use it for bytes: latin-1 only."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError("_codecs.encode with {!r} is not a bytes literal".format(encoding))
    return text.encode("latin1")


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    multiarray, numeric = _numpy_module("multiarray"), _numpy_module("numeric")
    allowed: Dict[Tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
        ("_codecs", "encode"): _latin1_encode,
    }
    for package in ("numpy.core", "numpy._core"):
        allowed[(package + ".multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(package + ".multiarray", "scalar")] = multiarray.scalar
        allowed[(package + ".numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


# Protocol-2 pickles name the builtins by their Python 2 module (Python 3's pickler does too,
# for protocols below 3).
_PY2_MODULES = {"__builtin__": "builtins"}

#: The protocol of files written from scratch: the highest the Python 2 Caffe2 tools can read.
DEFAULT_PROTOCOL = 2


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds numpy arrays, dtypes, scalars and plain containers; refuses every other global."""

    def __init__(self, handle: Any, path: str):
        super().__init__(handle, encoding="latin1")
        self.path = path
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((_PY2_MODULES.get(module, module), name))
        if found is None:
            raise UnsafeCheckpointError(
                "{}: refused to load the global {}.{}: a Caffe2 checkpoint holds only numpy "
                "arrays, dtypes, scalars and plain containers, and this pickle would call other "
                "code while loading; nothing was run".format(self.path, module, name)
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            "{}: refused a persistent reference {!r}: not a Caffe2 blob pickle; nothing was run".format(
                self.path, pid
            )
        )


def _blob_table(root: Any, name: str) -> Dict[Any, Any]:
    """The blob dictionary in a loaded file: ``root["blobs"]``, or ``root`` itself when flat."""
    table = root.get("blobs", root) if isinstance(root, dict) else None
    if not isinstance(table, dict):
        raise CheckpointError(
            "{}: expected {{'blobs': {{name: array}}}} or {{name: array}}, got {}".format(
                name, type(root).__name__
            )
        )
    return table


def _blob_name(key: Any) -> str:
    return key.decode("latin1") if isinstance(key, bytes) else str(key)


def read_caffe2_pickle(path: PathLike) -> Tuple[Any, Dict[str, np.ndarray]]:
    """Read a Caffe2 ``.pkl`` (``{"blobs": {...}}`` or flat): the whole object (``root`` for
    :func:`save_caffe2_pickle`) and its blobs as arrays (scalars 0-d). A pickle naming any other
    global raises ``UnsafeCheckpointError``, nothing run."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            root = _RestrictedUnpickler(handle, name).load()
    except UnsafeCheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError("{}: cannot read the checkpoint: {}".format(name, exc)) from exc
    except Exception as exc:
        raise CheckpointError(
            "{}: not a Caffe2 blob pickle: {}: {}".format(name, type(exc).__name__, exc)
        ) from exc
    blobs = {
        _blob_name(key): np.asarray(value)
        for key, value in _blob_table(root, name).items()
        if isinstance(value, (np.ndarray, np.generic))
    }
    return root, blobs


def pickle_protocol(path: PathLike) -> int:
    """The protocol a pickle file was written with: its ``PROTO`` opcode (protocols 2 and up),
    else 1 if it uses any opcode protocol 1 introduced, else 0."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            head = handle.read(2)
            if len(head) == 2 and head[0] == pickle.PROTO[0]:
                return head[1]
            handle.seek(0)
            return max((opcode.proto for opcode, _, _ in pickletools.genops(handle)), default=0)
    except (OSError, ValueError) as exc:
        raise CheckpointError("{}: cannot read the pickle's protocol: {}".format(name, exc)) from exc


def _with_blobs(root: Any, blobs: Mapping[str, np.ndarray], where: str) -> Any:
    """A shallow copy of ``root`` with ``blobs`` in the dtypes and shapes of those they replace."""
    table = _blob_table(root, where)
    keys = {_blob_name(k): k for k, v in table.items() if isinstance(v, (np.ndarray, np.generic))}
    unknown = sorted(set(blobs) - set(keys))
    if unknown:
        raise CheckpointError(
            "{}: no blob {} in the checkpoint to write back into".format(where, ", ".join(unknown))
        )
    new_table = copy.copy(table)
    for name, array in blobs.items():
        old = table[keys[name]]
        value = array.astype(old.dtype).reshape(np.shape(old))
        new_table[keys[name]] = value[()] if isinstance(old, np.generic) else value
    if table is root:
        return new_table
    new_root = copy.copy(root)
    new_root["blobs"] = new_table
    return new_root


class _PortablePickler(pickle._Pickler):  # the Python pickler: the C one's globals cannot be renamed
    """Names numpy 2's ``numpy._core`` rebuilders ``numpy.core``, which numpy 1.x imports too."""

    def save_global(self, obj: Any, name: Any = None) -> None:
        module = getattr(obj, "__module__", None) or ""
        if not module.startswith("numpy._core"):
            super().save_global(obj, name)
            return
        module = "numpy.core" + module[len("numpy._core"):]
        name = name or obj.__qualname__
        if self.proto >= 4:
            self.save(module)
            self.save(name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + "{}\n{}\n".format(module, name).encode("ascii"))
        self.memoize(obj)

    # The base class's table holds its own save_global for Python functions (numpy's _frombuffer).
    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[types.FunctionType] = save_global


def dump_portable(obj: Any, handle: BinaryIO, protocol: int = DEFAULT_PROTOCOL) -> None:
    """Pickle ``obj`` into ``handle`` so that plain ``pickle`` under numpy 1.x loads it."""
    _PortablePickler(handle, protocol=protocol).dump(obj)


def save_caffe2_pickle(blobs: Mapping[str, Any], path: Union[PathLike, BinaryIO], root: Any = None,
                       protocol: int = DEFAULT_PROTOCOL) -> None:
    """Write ``{"blobs": ...}`` to ``path`` atomically (or an open binary file); with ``root`` (from
    :func:`read_caffe2_pickle`) every entry is kept, only the ``blobs`` given change, in their old
    dtypes and shapes. ``protocol``: keep the original's (:func:`pickle_protocol`)."""
    where = getattr(path, "name", "<stream>") if hasattr(path, "write") else os.fspath(path)
    out: Dict[str, np.ndarray] = {}
    for key, value in blobs.items():
        array = to_numpy(value)
        if array.dtype == object:
            raise CheckpointError(
                "{}: blob {!r} is not a numeric array ({})".format(where, key, type(value).__name__)
            )
        out[str(key)] = array
    content = {"blobs": out} if root is None else _with_blobs(root, out, where)
    if hasattr(path, "write"):
        dump_portable(content, path, protocol)
    else:
        atomic_write(path, lambda handle: dump_portable(content, handle, protocol))
