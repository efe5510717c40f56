"""attn.v1 and grpc.health.v1 messages, built at import time from their descriptors.

The descriptors come from ``_descriptor_set.py`` (written by ``attnd._proto.build`` when the package
is built or installed). In a source checkout without it, they are generated in memory from
proto/ with protoc, and a stale module (proto/ changed since) is regenerated the same way.

The messages live in a descriptor pool of this package's own, not protobuf's default one, so
that they never clash with other code that registers attn.v1 or grpc.health.v1 itself (generated
stubs, grpcio-health-checking). Message classes are attributes of this module:
``attnd._proto.GetServerInfoResponse`` and so on.
"""

from __future__ import annotations

import warnings
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from . import build as _build


def _load_serialized() -> bytes:
    proto_dir = _build.default_proto_dir()
    try:
        from . import _descriptor_set as generated  # type: ignore[attr-defined]
    except ImportError:
        generated = None
    if generated is not None:
        if proto_dir is None or generated.PROTO_SHA256 == _build.proto_digest(proto_dir):
            return generated.SERIALIZED
        try:
            return _build.descriptor_set(proto_dir)
        except RuntimeError as e:
            warnings.warn(f"attnd: {proto_dir} changed since the descriptors were generated and "
                          f"they cannot be generated again ({e}); using the old ones")
            return generated.SERIALIZED
    if proto_dir is None:
        raise ImportError(
            "attnd: the protocol descriptors are missing (attnd/_proto/_descriptor_set.py) and no "
            "proto/ directory was found to generate them from: install the package with pip, run "
            "`python3 -m attnd._proto.build` in the source tree, or set ATTND_PROTO_DIR")
    try:
        return _build.descriptor_set(proto_dir)
    except RuntimeError as e:
        raise ImportError(str(e)) from e


def _message_class(descriptor: Any) -> type:
    get = getattr(message_factory, "GetMessageClass", None)  # protobuf >= 4.22
    if get is not None:
        return get(descriptor)
    return message_factory.MessageFactory(descriptor.file.pool).GetPrototype(descriptor)


POOL = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(_load_serialized()).file:
    POOL.AddSerializedFile(_file.SerializeToString())  # dependencies come first in the set

_ATTN = "attn.v1."
_MESSAGES = (
    "Tensor", "RegionSlice", "ServerTiming", "AttendRequest", "SlidingWindow", "AttendResponse",
    "CreateSessionRequest", "CreateSessionResponse", "StepRequest", "StepResponse",
    "BatchStepRequest", "BatchStepResponse", "StepResult", "TruncateSessionRequest",
    "TruncateSessionResponse", "ForkSessionRequest", "ForkSessionResponse", "CloseSessionRequest",
    "CloseSessionResponse", "KvCacheInfo", "GetServerInfoRequest", "ServerLimits",
    "GetServerInfoResponse", "EchoRequest", "EchoResponse", "RegisterRegionRequest", "RegionInfo",
    "RegisterRegionResponse", "UnregisterRegionRequest", "UnregisterRegionResponse",
    "ListRegionsRequest", "ListRegionsResponse", "Fp8Attend", "Fp8Support",
)
for _name in _MESSAGES:
    globals()[_name] = _message_class(POOL.FindMessageTypeByName(_ATTN + _name))
HealthCheckRequest = _message_class(POOL.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest"))
HealthCheckResponse = _message_class(POOL.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse"))

# Enum values by name, e.g. DType["DTYPE_BFLOAT16"] == 3.
DType = {v.name: v.number for v in POOL.FindEnumTypeByName(_ATTN + "DType").values}
RegionKind = {v.name: v.number for v in POOL.FindEnumTypeByName(_ATTN + "RegionKind").values}


def _method_paths(service: str) -> dict[str, str]:
    s = POOL.FindServiceByName(service)
    return {m.name: f"/{s.full_name}/{m.name}" for m in s.methods}


# gRPC method paths, e.g. ATTENTION["Attend"] == "/attn.v1.Attention/Attend".
ATTENTION = _method_paths("attn.v1.Attention")
SHARED_MEMORY = _method_paths("attn.v1.SharedMemory")
HEALTH = _method_paths("grpc.health.v1.Health")


def field_number(message: str, field: str) -> int:
    """The number of a field of an attn.v1 message (for the wire coding's checks)."""
    return POOL.FindMessageTypeByName(_ATTN + message).fields_by_name[field].number
