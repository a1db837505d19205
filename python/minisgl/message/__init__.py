"""Typed messages between the server's processes, (de)serialised with msgpack by `encode` and
`decode`. Flow: api server -> tokenizer -> scheduler -> detokenizer -> api server;
scheduler rank 0 -> ranks > 0 with tensor parallelism (backend messages)."""

from minisgl.message.backend import (
    AbortBackendMsg,
    AdmitBackendMsg,
    BatchBackendMsg,
    ExitMsg,
    FlushCacheMsg,
    UserMsg,
)
from minisgl.message.base import decode, encode, register
from minisgl.message.detokenizer import (
    BatchDetokenizeMsg,
    DetokenizeMsg,
    DetokInitMsg,
    FlushCacheReply,
    SchedulerStats,
)
from minisgl.message.frontend import (
    ApiFailMsg,
    ApiQueryMsg,
    ApiViewMsg,
    BatchFrontendMsg,
    UserReply,
)
from minisgl.message.tokenizer import AbortMsg, DoneMsg, TokenizeMsg

__all__ = [
    "AbortBackendMsg",
    "AbortMsg",
    "AdmitBackendMsg",
    "ApiFailMsg",
    "ApiQueryMsg",
    "ApiViewMsg",
    "BatchBackendMsg",
    "BatchDetokenizeMsg",
    "BatchFrontendMsg",
    "DetokenizeMsg",
    "DetokInitMsg",
    "DoneMsg",
    "FlushCacheMsg",
    "FlushCacheReply",
    "SchedulerStats",
    "ExitMsg",
    "TokenizeMsg",
    "UserMsg",
    "UserReply",
    "decode",
    "encode",
    "register",
]
