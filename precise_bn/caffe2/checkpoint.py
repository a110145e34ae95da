"""Caffe2 ``.pkl`` checkpoints: safe loading and atomic saving.

Caffe2 tools pickle ``{"blobs": {name: ndarray}}`` (Detectron adds ``"cfg"``) or a flat
``{name: ndarray}``, often from Python 2. Unpickling runs whatever callable the file names, so
:func:`read_caffe2_pickle` resolves only numpy's array, dtype and scalar rebuilders and plain
containers. Writing back keeps every entry, the layout and the pickle protocol; only the blobs
given change. Those files are read under numpy 1.x, which has no ``numpy._core``, so
:class:`_PortablePickler` names numpy's rebuilders by their ``numpy.core`` path. This module
needs numpy only, never Caffe2.
"""
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
    """Builds numpy arrays, dtypes, scalars and plain containers; refuses every other global.

    ``encoding="latin1"`` reads Python 2 ``str`` objects (blob names, array bytes) as numpy
    expects them.
    """

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
    """Read a Caffe2 ``.pkl`` (``{"blobs": {...}}`` or flat), Python 2 pickles included.

    Returns the whole object the file holds (a config string, an iteration count next to
    ``"blobs"`` included; give it to :func:`save_caffe2_pickle` as ``root`` to write the file
    back) and its blobs: blob name -> ndarray, numpy scalars as 0-d arrays; entries of the blob
    dictionary that are not arrays are left out of the blobs.

    Raises:
        UnsafeCheckpointError: the pickle names a global other than numpy's array/dtype/scalar
            rebuilders or plain containers (nothing is run).
        CheckpointError: the file is missing, not a pickle, or holds no blob dictionary.
    """
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
    """A shallow copy of ``root`` whose blob dictionary holds ``blobs`` under the keys, dtypes
    and shapes of the blobs they replace (numpy scalars stay scalars); ``root`` is unchanged."""
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
    """A pickler that names numpy 2's ``numpy._core`` rebuilders by their ``numpy.core`` path,
    which numpy 1.x (and numpy 2, through its compatibility module) import."""

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
    """Write ``{"blobs": {name: ndarray}}`` to ``path`` atomically (temporary file, fsync,
    rename), or into an open binary file whose writer handles atomicity.

    With ``root`` (the object :func:`read_caffe2_pickle` returned) the file keeps the layout and
    every entry of ``root``: only the named ``blobs`` change, each cast to the dtype and shape
    of the blob it replaces, so readers of the original file read the new one alike; pass the
    original's ``protocol`` (:func:`pickle_protocol`) to keep it readable where it was.

    ``protocol`` defaults to 2, the highest that the Python 2 Caffe2 tools can read; numpy's
    modules are named as numpy 1.x imports them (:class:`_PortablePickler`).
    """
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
