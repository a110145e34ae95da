"""The forward-only aux net of a Caffe2 model, and where its BN layers' blobs are.

The aux net is the backward slice of the model's net from its SpatialBN inputs: only ops that
contribute to some BN layer's input are kept, so gradient, loss-only and optimizer ops (and the
head after the last BN layer) never run. Each SpatialBN runs in train mode (``is_test=0``), as
the training net's do. Parameters are shared by blob name with the training net in the same
workspace; nothing is initialised here.

Every SpatialBN input is read after the net has run, so no later op may overwrite it: an op that
writes the input's blob after the SpatialBN read it (the SpatialBN itself, in place, or an
in-place ReLU) writes a blob of ours instead, and the ops after it read that one. Renaming adds
no op and no copy; the input just stays alive until it is read.

Caffe2 is imported lazily: ``import precise_bn`` never needs it.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
    """The blobs of one SpatialBN layer on one device: its running stats, its input ``x``
    (channels on ``channel_axis``) and the inverse std its kernel saved."""

    layer: str
    device: str
    option: Any
    rm: str
    riv: str
    siv: str
    channel_axis: int
    eps: float
    x: str


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


def forward_only_net(model: Any) -> Any:
    """Build the aux NetDef: the ops feeding some SpatialBN input, with SpatialBN in train mode.

    ``model`` is an aux net already (kept as it is, minus the ops after the last BN layer) or a
    training net: gradient ops, loss-only ops and optimizer updates contribute to no BN input
    and are dropped. Each SpatialBN gets ``is_test=0`` (a test-mode op also gets the running
    and saved stats outputs a train-mode op writes), and its input is kept from being
    overwritten (see the module docstring). The aux net is named after the source net plus
    ``_precise_bn_aux``.
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
        new = aux.op.add()
        new.CopyFrom(op)
        if _is_forward_bn(op):
            _set_train_mode(new)
        produced.update(new.output)
    aux.external_input.extend(external)
    _keep_bn_inputs(aux.op)
    return aux


def _keep_bn_inputs(ops: Any) -> None:
    """Rename, from the first op that overwrites a SpatialBN's input onwards, that blob to one of
    ours, so that the input is still there once the net has run."""
    for index, op in enumerate(ops):
        if not _is_forward_bn(op):
            continue
        blob = op.input[0]
        writer = next((i for i in range(index, len(ops)) if blob in ops[i].output), None)
        if writer is None:
            continue
        renamed = "{}_precise_bn_after_{}".format(blob, writer)
        _rename(ops[writer].output, blob, renamed)
        for later in ops[writer + 1:]:
            _rename(later.input, blob, renamed)
            _rename(later.output, blob, renamed)


def _rename(names: Any, old: str, new: str) -> None:
    for k, name in enumerate(names):
        if name == old:
            names[k] = new


def _is_nhwc(op: Any) -> bool:
    order = _arg(op, "order")
    return order is not None and order.s in (b"NHWC", "NHWC")


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
    hold the same layers, each run once per net run. Each layer keeps its op's epsilon.
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
                "SpatialBN layer {!r} on device {!r} runs more than once per net run (two SpatialBN "
                "ops share its parameters); the Caffe2 backend measures one call per layer and device "
                "and run: give each op its own scale, bias and running stats".format(layer, device or "<unscoped>")
            )
        eps_arg = _arg(op, "epsilon")
        by_device[device][layer] = BNBlobs(
            layer=layer,
            device=device,
            option=device_option(aux, op),
            rm=op.input[3],
            riv=op.input[4],
            siv=op.output[4],
            channel_axis=-1 if _is_nhwc(op) else 1,
            eps=float(eps_arg.f) if eps_arg is not None else CAFFE2_DEFAULT_EPS,
            x=op.input[0],
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
