"""Loading and unloading adapters while serving, the scheduler processes' side (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter; the routes are `routes.py`'s): an API process
asks every --dp replica's scheduler (`LoraUpdateRequest`, the `scheduler_messages` point), which
applies it to its LoRA step feature's manager and answers (`LoraUpdateReply`) through the
detokenizer to the API process that asked. A change that succeeded on TP rank 0 is told to its
followers (`LoraChange`, replayed before the next step through the `tp_changes` point): a
failed one changes nothing on any rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.ext.lora.feature import NAME, LoraFeature
from minisgl.message import register

if TYPE_CHECKING:  # types only: the scheduler's modules load torch
    from minisgl.scheduler.io import SchedulerServer
    from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@register
@dataclass
class LoraChange:
    """Load (`path` set) or unload (`path` None) the adapter `name`: what rank 0 tells its TP
    followers, and the body of `LoraUpdateRequest`."""

    name: str
    path: str | None = None


@register
@dataclass
class LoraUpdateRequest:
    """API process -> each replica's scheduler: apply `change`."""

    change: LoraChange
    api_rank: int = 0  # the API process (--api-server-count) that waits for the reply


@register
@dataclass
class LoraUpdateReply:
    """One replica's answer: `error` None when done, else why and its HTTP status (404: no
    such adapter, 409: requests use it, 400: anything else)."""

    dp_rank: int
    error: str | None = None
    status: int = 200
    api_rank: int = 0


def apply_change(scheduler: Scheduler, change: LoraChange) -> tuple[int, str | None]:
    """Apply `change` to the scheduler's adapters -> (HTTP status, error); nothing changed on
    an error."""
    from minisgl.ext.lora.adapter import AdapterError
    from minisgl.ext.lora.weights import AdapterInUse

    feature = next((f for f in scheduler.features if f.name == NAME), None)
    if not isinstance(feature, LoraFeature):
        return 400, "loading LoRA adapters needs --enable-lora"
    manager = feature.manager
    try:
        if change.path is not None:
            manager.add(change.name, change.path)
        else:
            manager.remove(change.name)
    except AdapterInUse as e:
        return 409, str(e)
    except AdapterError as e:  # a bad adapter, a name taken, or (unload) not loaded
        return (404 if change.path is None else 400), str(e)
    except (ValueError, TypeError, KeyError, OSError) as e:  # a config that the checks missed:
        # an answer, not a dead scheduler (`add` reads and checks before it changes anything)
        return 400, f"LoRA adapter {change.name!r}: {type(e).__name__}: {e}"
    return 200, None


def handle_update(server: SchedulerServer, msg: LoraUpdateRequest) -> None:
    """In the scheduler process (rank 0 of a replica): apply, tell the TP followers, answer."""
    status, error = apply_change(server.scheduler, msg.change)
    if error is None:
        server.scheduler._tell(msg.change)  # replayed with the next step
    server.send.put(LoraUpdateReply(server.dp_rank, error, status, msg.api_rank))


def follow_change(scheduler: Scheduler, change: LoraChange) -> None:
    """A TP follower replays what rank 0 did (the `tp_changes` point); it answers no one."""
    status, error = apply_change(scheduler, change)
    if error is not None:  # e.g. the adapter's files changed between the ranks' reads
        logger.error("TP rank: LoRA adapter change %r failed (%d): %s", change, status, error)
