"""The scheduler process of the server: requests in over ZMQ, one step, tokens out."""

from __future__ import annotations

import logging
import time
from typing import Any

from minisgl.engine import Engine
from minisgl.llm.llm import eos_token_ids, load_tokenizer
from minisgl.message import (
    AbortBackendMsg,
    BatchBackendMsg,
    BatchDetokenizeMsg,
    DetokenizeMsg,
    ExitMsg,
    SchedulerStats,
    UserMsg,
)
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.2


class SchedulerServer:
    def __init__(self, scheduler: Scheduler, recv_addr: str, send_addr: str) -> None:
        self.scheduler = scheduler
        self.recv = ZmqPullQueue(recv_addr, create=True)
        self.send = ZmqPushQueue(send_addr, create=False)
        self.last_stats = 0.0

    def stats(self) -> SchedulerStats:
        s, cache = self.scheduler, self.scheduler.cache
        admitted = s.running + ([s.prefilling] if s.prefilling else [])
        # pages a request allocated itself (its first ones belong to the prefix cache)
        owned = sum(len(r.pages) - r.cache_handle.length // s.page_size for r in admitted)
        free, cached = cache.allocator.num_free, cache.prefix_cache.num_pages
        return SchedulerStats(
            running=len(admitted),
            waiting=len(s.waiting),
            total_pages=cache.num_pages,
            free_pages=free,
            cached_pages=cached,
            locked_pages=cache.prefix_cache.locked_pages,
            leaked_pages=cache.num_pages - free - cached - owned,
            num_preemptions=s.num_preemptions,
            prefill_tokens=s.num_prefill_tokens,
            cached_tokens=s.num_cached_tokens,
        )

    def handle(self, msg: Any) -> bool:
        """Apply one incoming message; False on ExitMsg."""
        if isinstance(msg, BatchBackendMsg):
            return all([self.handle(m) for m in msg.msgs])
        if isinstance(msg, ExitMsg):
            return False
        if isinstance(msg, AbortBackendMsg):
            self.scheduler.abort(msg.uid)
        elif isinstance(msg, UserMsg):
            try:
                req = self.scheduler.make_request(msg.input_ids, msg.params, uid=msg.uid)
            except ValueError as e:
                err = DetokenizeMsg(msg.uid, [], True, "error", error=str(e))
                self.send.put(BatchDetokenizeMsg([err]))
            else:
                self.scheduler.add_request(req)
        else:
            logger.warning("scheduler ignores unexpected message %r", type(msg).__name__)
        return True

    def run(self) -> None:
        self.send.put(BatchDetokenizeMsg([], self.stats()))  # /stats is right before any request
        while True:
            # block only when idle; otherwise drain what arrived and keep stepping
            msg = self.recv.get() if not self.scheduler.has_work else self.recv.get_nowait()
            while msg is not None:
                if not self.handle(msg):
                    return
                msg = self.recv.get_nowait()
            outputs = self.scheduler.step() if self.scheduler.has_work else []
            out = [
                DetokenizeMsg(
                    o.uid, [] if o.token is None else [o.token], o.finished, o.finish_reason
                )
                for o in outputs
            ]
            now = time.monotonic()
            idle = not self.scheduler.has_work
            stats = None
            if idle or now - self.last_stats > STATS_INTERVAL_S:
                stats, self.last_stats = self.stats(), now
            if out or stats is not None:
                self.send.put(BatchDetokenizeMsg(out, stats))


def run_scheduler_process(
    engine_kwargs: dict, sched_config, recv_addr: str, send_addr: str, ready
) -> None:
    """Process entry: build the engine, report readiness (or the error) through `ready`."""
    try:
        engine = Engine(**engine_kwargs)
        scheduler = Scheduler(
            engine, sched_config, eos_token_ids(engine, load_tokenizer(engine.model_path))
        )
        server = SchedulerServer(scheduler, recv_addr, send_addr)
    except Exception as e:  # reported to the launcher, which prints it and exits non-zero
        ready.send(("error", f"scheduler failed to start: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    ready.send(("ready", {"max_seq_len": engine.max_seq_len, "num_pages": engine.num_pages}))
    server.run()
