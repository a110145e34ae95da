"""The forward-only aux net of a Caffe2 model, and where its BN layers' blobs are.

The aux net is the backward slice of the model's net from its SpatialBN inputs: only ops that
contribute to some BN layer's input are kept, so gradient, loss-only and optimizer ops (and the
head after the last BN layer) never run. Each SpatialBN runs in train mode (``is_test=0``), so
it saves its batch mean in ``{layer}_bn_sm`` and ``1 / sqrt(var + eps)`` in ``{layer}_bn_siv``,
and is followed by a ``Shape`` op on its input, so the element count per channel is read
without copying an activation out of the workspace. Parameters are shared by blob name with the
training net in the same workspace; nothing is initialised here.

For the exact path (``channels`` given) each SpatialBN gets its input shifted by its own float32
batch mean: ``ReduceMean`` over every axis but the channel's gives ``c``, ``Sub`` forms
``x - c`` in a blob of ours, and the SpatialBN normalises that. Batch normalisation does not
depend on a per-channel shift of its input, so the output is the same function of ``x``, but
the kernel's float32 ``E[x^2] - E[x]^2`` no longer cancels: its variance is not NaN, and the
layers after it see the activations an accurate kernel would give them, even when a channel's
mean is 1e4 times its std. ``x - c`` is exact where ``x`` and ``c`` are within a factor 2 of
each other (Sterbenz), which is every element once the mean dwarfs the std; the shifted blob is
ours alone, so nothing overwrites it before it is read.

Caffe2 is imported lazily: ``import precise_bn`` never needs it.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import BackendUnavailableError, ConfigError, LayerError

CAFFE2_INSTALL_HINT = (
    "Caffe2 ships only in PyTorch wheels up to 1.10.2: create a Python 3.9 environment and run "
    "`pip install torch==1.10.2 numpy==1.22.4 'protobuf<4' six future networkx==2.8.8` "
    "(`bash scripts/dev.sh setup` builds it as .venv-caffe2)"
)

# The epsilon Caffe2's SpatialBN uses when the op carries no ``epsilon`` argument.
CAFFE2_DEFAULT_EPS = 1e-5


def import_caffe2() -> Tuple[Any, Any, Any]:
    """Return ``(core, workspace, caffe2_pb2)``, or raise BackendUnavailableError saying how to get them."""
    try:
        from caffe2.proto import caffe2_pb2
        from caffe2.python import core, workspace
    except ImportError as exc:
        raise BackendUnavailableError(
            "the caffe2 backend needs Caffe2 ({}). {}".format(exc, CAFFE2_INSTALL_HINT)
        ) from exc
    return core, workspace, caffe2_pb2


class BNBlobs(NamedTuple):
    """The blobs of one SpatialBN layer on one device, and how to read its element count."""

    layer: str
    device: str
    option: Any
    rm: str
    riv: str
    sm: str
    siv: str
    shape: str
    channel_axis: int
    eps: float
    x: str
    shift: str


def _arg(op: Any, name: str) -> Any:
    for arg in op.arg:
        if arg.name == name:
            return arg
    return None


def _is_gradient(op: Any) -> bool:
    return bool(op.is_gradient_op) or op.type.endswith("Gradient")


def _is_forward_bn(op: Any) -> bool:
    return op.type == "SpatialBN" and not _is_gradient(op)


def device_option(net: Any, op: Any) -> Any:
    """Where ``op`` runs: its own device option, else the net's."""
    return op.device_option if op.HasField("device_option") else net.device_option


def _net_proto(model: Any) -> Any:
    """The NetDef of a ModelHelper, a core.Net or a NetDef, or of what a callable returns."""
    core, _, caffe2_pb2 = import_caffe2()
    from caffe2.python import model_helper

    net_types = (caffe2_pb2.NetDef, core.Net, model_helper.ModelHelper)
    if callable(model) and not isinstance(model, net_types):
        model = model()
    if isinstance(model, caffe2_pb2.NetDef):
        return model
    if isinstance(model, core.Net):
        return model.Proto()
    if isinstance(model, model_helper.ModelHelper):
        return model.net.Proto()
    raise ConfigError(
        "model must be a caffe2 ModelHelper, core.Net, NetDef or a callable building one, got {}".format(
            type(model).__name__
        )
    )


def forward_only_net(model: Any, channels: Optional[Callable[[str], int]] = None) -> Any:
    """Build the aux NetDef: the ops feeding some SpatialBN input, with SpatialBN in train mode.

    ``model`` is an aux net already (kept as it is, minus the ops after the last BN layer) or a
    training net: gradient ops, loss-only ops and optimizer updates contribute to no BN input
    and are dropped. Each SpatialBN gets ``is_test=0`` (a test-mode op also gets the running
    and saved stats outputs a train-mode op writes), followed by a ``Shape`` op on its input.
    The aux net is named after the source net plus ``_precise_bn_aux``. Given ``channels`` (the
    channel count of a scale blob), every SpatialBN normalises its input shifted by its batch
    mean, for the exact path (see the module docstring).
    """
    _, _, caffe2_pb2 = import_caffe2()
    source = _net_proto(model)
    needed: set = set()
    kept = []
    for op in reversed(source.op):
        if _is_gradient(op):
            continue
        if _is_forward_bn(op) or needed.intersection(op.output):
            kept.append(op)
            needed.difference_update(op.output)
            needed.update(op.input)
    if not any(_is_forward_bn(op) for op in kept):
        raise LayerError(
            "net {!r} has no SpatialBN op: nothing to recompute (params ending in _bn_s consumed "
            "by AffineChannel are BN folded into a fixed affine map, with no statistics)".format(
                source.name
            )
        )
    aux = caffe2_pb2.NetDef()
    aux.name = (source.name or "net") + "_precise_bn_aux"
    if source.HasField("type"):
        aux.type = source.type
    if source.HasField("num_workers"):
        aux.num_workers = source.num_workers
    if source.HasField("device_option"):
        aux.device_option.CopyFrom(source.device_option)
    produced: set = set()
    external: List[str] = []
    for op in reversed(kept):
        for blob in op.input:
            if blob not in produced and blob not in external:
                external.append(blob)
        bn = _is_forward_bn(op)
        if bn and channels is not None:
            produced.update(_add_shift(aux, op, channels))
        new = aux.op.add()
        new.CopyFrom(op)
        if bn:
            if channels is not None:
                new.input[0] = _shifted_blob(op)
            _set_train_mode(new)
            produced.update(_add_op(aux, op, "Shape", [new.input[0]], [_shape_blob(new)]))
        produced.update(new.output)
    aux.external_input.extend(external)
    return aux


def _add_op(aux: Any, bn_op: Any, kind: str, inputs: Sequence[str], outputs: Sequence[str], **args: Any) -> List[str]:
    """Append a ``kind`` op placed where ``bn_op`` runs; returns its outputs."""
    core, _, _ = import_caffe2()
    op = aux.op.add()
    op.CopyFrom(core.CreateOperator(kind, list(inputs), list(outputs), **args))
    if bn_op.HasField("device_option"):
        op.device_option.CopyFrom(bn_op.device_option)
    return list(outputs)


def _shift_blob(bn_op: Any) -> str:
    return bn_op.input[1] + "_precise_bn_shift"


def _shifted_blob(bn_op: Any) -> str:
    return bn_op.input[1] + "_precise_bn_input"


def _is_nhwc(op: Any) -> bool:
    order = _arg(op, "order")
    return order is not None and order.s in (b"NHWC", "NHWC")


def _add_shift(aux: Any, bn_op: Any, channels: Callable[[str], int]) -> List[str]:
    """``c``, the mean of ``x`` over every axis but the channel's, and ``x - c``, ahead of ``bn_op``.

    A NetDef does not know its blobs' ranks, so ``x`` is viewed as ``(N, C, rest)`` (NCHW) or
    ``(rest, C)`` (NHWC, ``C`` read from the scale blob) for the reduction and the broadcast
    subtraction, and given its own shape back.
    """
    x, shift, shifted = bn_op.input[0], _shift_blob(bn_op), _shifted_blob(bn_op)
    nhwc = _is_nhwc(bn_op)
    view, axes = ([-1, channels(bn_op.input[1])], [0]) if nhwc else ([0, 0, -1], [0, 2])
    produced = _add_op(aux, bn_op, "Reshape", [x], [shifted, shift + "_shape"], shape=view)
    produced += _add_op(aux, bn_op, "ReduceMean", [shifted], [shift], axes=axes, keepdims=1)
    _add_op(aux, bn_op, "Sub", [shifted, shift], [shifted])
    _add_op(aux, bn_op, "Reshape", [shifted, shift + "_shape"], [shifted, shift + "_view"])
    return produced + [shift + "_view"]


def _set_train_mode(op: Any) -> None:
    is_test = _arg(op, "is_test")
    if is_test is None:
        is_test = op.arg.add()
        is_test.name = "is_test"
    is_test.i = 0
    if len(op.output) == 1:
        scale = op.input[1]
        stem = scale[: -len("_s")] if scale.endswith("_s") else op.output[0]
        op.output.extend([op.input[3], op.input[4], stem + "_sm", stem + "_siv"])


def _shape_blob(bn_op: Any) -> str:
    return bn_op.output[3] + "_precise_bn_shape"


def _layer_name(scale_blob: str) -> str:
    base = scale_blob.rsplit("/", 1)[-1]
    for suffix in ("_bn_s", "_s"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def find_bn_layers(aux: Any, devices: Sequence[str]) -> Dict[str, List[BNBlobs]]:
    """Map layer name (device scope and ``_bn_s`` removed) to its blobs on each device, in order.

    A layer is a train-mode SpatialBN op of ``aux``; its device is the ``{prefix}_{i}`` name
    scope of its scale parameter (``""`` for an unscoped single-device net). Every device must
    hold the same layers, and a layer must run once per net run (its saved stats are
    overwritten by a second call). Each layer keeps the epsilon its kernel used for ``siv``.
    """
    by_device: Dict[str, Dict[str, BNBlobs]] = {device: {} for device in devices}
    for op in aux.op:
        if not _is_forward_bn(op):
            continue
        scale = op.input[1]
        device = _device_of(scale, devices)
        layer = _layer_name(scale)
        if device is None:
            raise ConfigError(
                "SpatialBN layer {!r} (scale blob {!r}) is on no expected device {}: check "
                "num_gpus, root_gpu_id and device_prefix".format(layer, scale, list(devices))
            )
        if layer in by_device[device]:
            raise LayerError(
                "SpatialBN layer {!r} on device {!r} runs more than once per net run: its saved "
                "batch stats {!r} keep only the last call, so it cannot be measured".format(
                    layer, device or "<unscoped>", op.output[3]
                )
            )
        eps_arg = _arg(op, "epsilon")
        shifted = op.input[0] == _shifted_blob(op)
        by_device[device][layer] = BNBlobs(
            layer=layer,
            device=device,
            option=device_option(aux, op),
            rm=op.input[3],
            riv=op.input[4],
            sm=op.output[3],
            siv=op.output[4],
            shape=_shape_blob(op),
            channel_axis=-1 if _is_nhwc(op) else 1,
            eps=float(eps_arg.f) if eps_arg is not None else CAFFE2_DEFAULT_EPS,
            x=op.input[0],
            shift=_shift_blob(op) if shifted else "",
        )
    names = list(by_device[devices[0]])
    for device in devices:
        if list(by_device[device]) != names:
            raise ConfigError(
                "devices hold different SpatialBN layers: {} has {}, {} has {}".format(
                    devices[0] or "<unscoped>", names, device or "<unscoped>", list(by_device[device])
                )
            )
    return {name: [by_device[device][name] for device in devices] for name in names}


def _device_of(blob: str, devices: Sequence[str]) -> Optional[str]:
    for device in devices:
        if (device == "" and "/" not in blob) or (device and blob.startswith(device + "/")):
            return device
    return None


def devices_of_net(aux: Any, settings: Dict[str, Any]) -> List[str]:
    """``{prefix}_{root}`` ... ``{prefix}_{root + num_gpus - 1}``; ``[""]`` for an unscoped net."""
    prefix = settings["device_prefix"]
    num, root = int(settings["num_gpus"]), int(settings["root_gpu_id"])
    if num <= 0 or root < 0:
        raise ConfigError("num_gpus must be > 0 and root_gpu_id >= 0, got {} and {}".format(num, root))
    scoped = re.compile(r"^{}_\d+/".format(re.escape(prefix)))
    bn_scales = [op.input[1] for op in aux.op if _is_forward_bn(op)]
    if num == 1 and not any(scoped.match(blob) for blob in bn_scales):
        return [""]
    return ["{}_{}".format(prefix, root + i) for i in range(num)]
