"""attnd: the Python client of the attnd attention service.

    import attnd
    client = attnd.Client("127.0.0.1:50051")
    o = client.attend(q, k, v, causal=True).o            # numpy or torch, fp32/fp16/bf16

    with client.create_session(num_layers=32, num_kv_heads=8, head_dim=128) as s:
        o = s.step(0, q, k_new, v_new).o                  # KV cache kept in attnd

Modules: ``attnd.aio`` (asyncio client, same surface), ``attnd.sessions`` (SessionClient over
replicas), ``attnd.regions`` (shared memory), ``attnd.prepared`` (a BatchStep over regions coded
once for a decode loop), ``attnd.torch`` (a PyTorch attention module and the transformers
integration). Errors are ``attnd.AttndError`` with the gRPC code and attnd's message.
"""

from ._core import (AttendItem, AttendResult, SessionInfo, StepItem, StepResult,
                    TruncateResult)
from ._wire import ServerTiming
from .client import Client, Session
from .errors import (AlreadyExists, AttndError, BatchStepError, Cancelled,
                     DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                     ResourceExhausted, Unauthenticated, Unavailable)
from .prepared import AsyncPreparedBatchStep, BatchStepResults, PreparedBatchStep
from .regions import CudaRegion, HostRegion
from .sessions import AsyncSessionClient, ReplicaInfo, SessionClient

__version__ = "0.1.0"
__all__ = [
    "AlreadyExists", "AsyncPreparedBatchStep", "AsyncSessionClient", "AttendItem", "AttendResult",
    "AttndError", "BatchStepError", "BatchStepResults", "Cancelled", "Client", "CudaRegion", "DeadlineExceeded",
    "FailedPrecondition", "HostRegion", "InvalidArgument", "NotFound", "PreparedBatchStep", "ReplicaInfo",
    "ResourceExhausted", "ServerTiming", "Session", "SessionClient", "SessionInfo", "StepItem",
    "StepResult", "TruncateResult", "Unauthenticated", "Unavailable",
]
