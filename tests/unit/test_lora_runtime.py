"""ext/lora's runtime loads and unloads in the scheduler processes: rank 0 applies a change,
tells it to its TP followers only when it succeeded, and answers with the HTTP status; a
follower replays it through the `tp_changes` point (`Scheduler.follow`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from minisgl import extension
from minisgl.ext.lora.adapter import AdapterError
from minisgl.ext.lora.feature import LoraFeature
from minisgl.ext.lora.runtime import (
    LoraChange,
    LoraUpdateReply,
    LoraUpdateRequest,
    follow_change,
    handle_update,
)
from minisgl.ext.lora.weights import AdapterInUse
from minisgl.message import BatchMsg, ExitMsg, decode, encode


class FakeManager:
    def __init__(self) -> None:
        self.paths: dict[str, str] = {"a": "/a", "busy": "/b"}

    def add(self, name: str, path: str) -> None:
        if not path.startswith("/ok"):
            raise AdapterError(f"LoRA adapter {name!r}: {path!r} is not a directory")
        self.paths[name] = path

    def remove(self, name: str) -> None:
        if name == "busy":
            raise AdapterInUse("LoRA adapter 'busy' is in use by 2 running request(s)")
        if name not in self.paths:
            raise AdapterError(f"unknown LoRA adapter {name!r}")
        del self.paths[name]


def scheduler_with_lora() -> Any:
    feature = LoraFeature.__new__(LoraFeature)
    feature.manager = FakeManager()  # type: ignore[assignment]
    told: list[Any] = []
    return SimpleNamespace(
        features=[feature], _tell=told.append, told=told, manager=feature.manager
    )


def test_rank_0_tells_only_the_changes_that_succeeded() -> None:
    from minisgl.scheduler.io import SchedulerServer

    assert extension.extensions().scheduler_messages[LoraUpdateRequest] is handle_update
    msg = LoraUpdateRequest(LoraChange("b", "/ok/b"), api_rank=1)
    assert decode(encode(msg)) == msg
    sent: list[Any] = []
    server = SchedulerServer.__new__(SchedulerServer)
    server.scheduler = scheduler = scheduler_with_lora()
    server.send, server.dp_rank = SimpleNamespace(put=sent.append), 2
    for change in [LoraChange("b", "/ok/b"), LoraChange("c", "/bad"), LoraChange("busy")]:
        server.handle(LoraUpdateRequest(change, api_rank=1))
    server.handle(LoraUpdateRequest(LoraChange("nope"), api_rank=1))
    server.handle(LoraUpdateRequest(LoraChange("a"), api_rank=1))
    assert [(r.status, r.dp_rank, r.api_rank) for r in sent] == [
        (200, 2, 1),
        (400, 2, 1),
        (409, 2, 1),
        (404, 2, 1),
        (200, 2, 1),
    ]
    assert "in use by 2" in str(sent[2].error) and sent[0] == LoraUpdateReply(2, None, 200, 1)
    assert scheduler.told == [LoraChange("b", "/ok/b"), LoraChange("a")]
    assert scheduler.manager.paths == {"b": "/ok/b", "busy": "/b"}


def test_without_enable_lora_the_change_is_refused() -> None:
    from minisgl.ext.lora.feature import LoraOff

    told: list[Any] = []
    sched = SimpleNamespace(features=[LoraOff()], _tell=told.append)
    sent: list[Any] = []
    server = SimpleNamespace(scheduler=sched, send=SimpleNamespace(put=sent.append), dp_rank=0)
    handle_update(server, LoraUpdateRequest(LoraChange("b", "/ok/b")))  # type: ignore[arg-type]
    assert sent[0].status == 400 and "--enable-lora" in sent[0].error and told == []


def test_a_follower_replays_extension_changes_before_its_step(monkeypatch) -> None:
    """`Scheduler.follow` hands a change type the core does not know to `tp_changes`."""
    from minisgl.scheduler import scheduler as sched_mod

    assert extension.extensions().tp_changes[LoraChange] is follow_change
    steps = iter([BatchMsg([LoraChange("b", "/ok/b"), LoraChange("a")]), ExitMsg()])
    monkeypatch.setattr(sched_mod, "receive_step", lambda: next(steps))
    follower = scheduler_with_lora()
    follower.step = lambda: follower.told.append("step")
    sched_mod.Scheduler.follow(follower)
    assert follower.manager.paths == {"b": "/ok/b", "busy": "/b"}
    assert follower.told == ["step"]  # it answers no one and tells no one
