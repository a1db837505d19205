"""ext/lora's runtime loads and unloads in the scheduler processes: rank 0 applies a change,
tells it to its TP followers only when it succeeded, and answers with the HTTP status; a
follower replays it through the `tp_changes` point (`Scheduler.follow`). The routes (routes.py)
over --dp replicas, in process with a fake front end: a load on every replica or none, an
unload that waits for the adapter's requests or answers `lora_in_use` past UNLOAD_WAIT_S (the
adapter served again by every replica)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from minisgl import extension
from minisgl.ext.lora import routes
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
from minisgl.ext.serving.frontend import ServingFrontend
from minisgl.message import BatchMsg, ExitMsg, decode, encode
from minisgl.server.protocol import APIError


class FakeManager:
    """A scheduler's LoraManager as the runtime changes see it: `users` (name -> running
    requests) make an unload fail, a path not under /ok or in `unreadable` a load."""

    def __init__(
        self,
        paths: dict[str, str] | None = None,
        users: dict[str, int] | None = None,
        unreadable: tuple[str, ...] = (),
    ) -> None:
        self.paths = {"a": "/a", "busy": "/b"} if paths is None else dict(paths)
        self.users = {"busy": 2} if users is None else dict(users)
        self.unreadable = set(unreadable)

    def add(self, name: str, path: str) -> None:
        if name in self.paths:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        if not path.startswith("/ok") or path in self.unreadable:
            raise AdapterError(f"LoRA adapter {name!r}: {path!r} is not a directory")
        self.paths[name] = path

    def remove(self, name: str) -> None:
        if self.users.get(name, 0) > 0:
            count = self.users[name]
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {count} running request(s)")
        if name not in self.paths:
            raise AdapterError(f"unknown LoRA adapter {name!r}")
        del self.paths[name]


def scheduler_with_lora(manager: FakeManager | None = None) -> Any:
    feature = LoraFeature.__new__(LoraFeature)
    feature.manager = manager or FakeManager()  # type: ignore[assignment]
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


# ---- the routes over --dp replicas (routes.py), in process: a fake front end hands each
# question to every replica's real `handle_update`, over a FakeManager each
class FakeFrontend(ServingFrontend):
    def __init__(self, managers: list[FakeManager]) -> None:  # none of the pipeline
        self.managers, self.dead, self.api_count = managers, None, 1
        self.scheduler_addrs = [f"replica-{i}" for i in range(len(managers))]
        self.asks: list[LoraChange] = []
        self.on_ask: Callable[[int], None] = lambda count: None  # after each question

    async def ask_schedulers(self, make_msg: Any, reply_type: Any, timeout: float) -> list[Any]:
        replies: list[Any] = []
        for rank, manager in enumerate(self.managers):
            server = SimpleNamespace(
                scheduler=scheduler_with_lora(manager),
                send=SimpleNamespace(put=replies.append),
                dp_rank=rank,
            )
            msg = make_msg(0)
            handle_update(server, msg)  # type: ignore[arg-type]
        self.asks.append(msg.change)
        self.on_ask(len(self.asks))
        return replies


def lora_app(managers: list[FakeManager], monkeypatch: pytest.MonkeyPatch) -> Any:
    """(the API's `api` with the LoRA routes, their app), serving "a" (--lora-modules) on
    replicas with `managers`."""
    from minisgl.ext.lora import http
    from minisgl.ext.lora.options import LoraOptions
    from minisgl.server.api_server import api_error

    monkeypatch.setattr(http, "_served", None)  # this process's API state, restored after
    monkeypatch.setattr(routes, "UNLOAD_POLL_S", 0.0)
    options = LoraOptions(enable_lora=True, lora_modules=("a=/ok/a",))
    args = SimpleNamespace(
        scheduler=SimpleNamespace(extras={"lora": options}),
        served_model_name="tiny",
        engine=SimpleNamespace(model="/m/tiny"),
    )
    api = SimpleNamespace(args=args, adapters={}, served={"tiny"}, frontend=FakeFrontend(managers))
    app = FastAPI()
    app.exception_handler(APIError)(api_error)
    routes.add_lora_routes(app, api, {})
    return api, app


def post(app: Any, action: str, **body: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(f"/v1/{action}_lora_adapter", json=body)

    return asyncio.run(run())


def replicas(*users: int, unreadable: tuple[str, ...] = ()) -> list[FakeManager]:
    """One replica per `users` (the running requests on "a"), each serving "a"."""
    return [FakeManager({"a": "/ok/a"}, {"a": n}, unreadable) for n in users]


def test_a_load_is_done_on_every_replica_or_on_none(monkeypatch: pytest.MonkeyPatch) -> None:
    managers = replicas(0, 0)
    managers[1].unreadable.add("/ok/x")
    api, app = lora_app(managers, monkeypatch)
    r = post(app, "load", lora_name="x", lora_path="/ok/x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert r.json()["error"]["message"].startswith("replica 1: LoRA adapter 'x'")
    # replica 0 loaded it, and unloaded it again: neither has it, the API does not serve it
    assert [m.paths for m in managers] == [{"a": "/ok/a"}] * 2 and "x" not in api.adapters
    assert api.frontend.asks == [LoraChange("x", "/ok/x"), LoraChange("x")]
    r = post(app, "load", lora_name="y", lora_path="/ok/y")
    assert r.status_code == 200, r.text
    assert [m.paths["y"] for m in managers] == ["/ok/y"] * 2
    assert api.adapters["y"] == {"root": "/ok/y", "parent": "tiny"}


def test_an_unload_waits_for_the_adapters_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    managers = replicas(0, 1)
    api, app = lora_app(managers, monkeypatch)

    def end_the_request(asks: int) -> None:
        if asks == 3:  # the request on replica 1 ends after the third question
            managers[1].users["a"] = 0

    api.frontend.on_ask = end_the_request
    r = post(app, "unload", lora_name="a")
    assert r.status_code == 200, r.text
    assert [m.paths for m in managers] == [{}, {}] and "a" not in api.adapters
    assert len(api.frontend.asks) == 4
    r = post(app, "unload", lora_name="a")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("users", [(2,), (0, 2), (2, 0)])
def test_an_unload_past_the_wait_answers_lora_in_use(
    monkeypatch: pytest.MonkeyPatch, users: tuple[int, ...]
) -> None:
    """A request that runs on past UNLOAD_WAIT_S: 400 `lora_in_use` with how many run, and
    "a" served again by every replica (one that had dropped it loads it again)."""
    managers = replicas(*users)
    api, app = lora_app(managers, monkeypatch)
    monkeypatch.setattr(routes, "UNLOAD_WAIT_S", 0.0)
    r = post(app, "unload", lora_name="a")
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "lora_in_use", r.text
    assert error["param"] == "lora_name" and "is in use by 2 running request(s)" in error["message"]
    assert [m.paths for m in managers] == [{"a": "/ok/a"}] * len(users)
    assert api.adapters["a"] == {"root": "/ok/a", "parent": "tiny"}


def test_a_replica_that_cannot_load_it_again_leaves_it_unserved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replica 0 dropped "a" and cannot read it any more: not served (a request for it would
    fail there); once replica 1's request ends, a second unload finishes the job."""
    managers = replicas(0, 2, unreadable=("/ok/a",))
    api, app = lora_app(managers, monkeypatch)
    monkeypatch.setattr(routes, "UNLOAD_WAIT_S", 0.0)
    r = post(app, "unload", lora_name="a")
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "lora_in_use", r.text
    assert "replica 0: LoRA adapter 'a': '/ok/a' is not a directory" in error["message"]
    assert "no longer served" in error["message"] and "a" not in api.adapters
    assert [m.paths for m in managers] == [{}, {"a": "/ok/a"}]
    managers[1].users["a"] = 0
    r = post(app, "unload", lora_name="a")
    assert r.status_code == 200, r.text
    assert [m.paths for m in managers] == [{}, {}]
