"""The scheduler process of the server: requests in over ZMQ, one step, tokens out."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from minisgl.distributed import Rendezvous, destroy_tp, init_tp, select_device
from minisgl.engine.config import EngineConfig
from minisgl.extension import extensions
from minisgl.message import (
    AbortBackendMsg,
    BatchMsg,
    DetokenizeMsg,
    ExitMsg,
    SchedulerStats,
    UserMsg,
)
from minisgl.models.hf import eos_token_ids, load_tokenizer
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.device import device_type
from minisgl.utils.procs import build_or_report, die_with_parent, freeze_startup_heap, set_title
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

if TYPE_CHECKING:  # the engine (torch) in build_scheduler: the API process, which names this
    # module's entry points for its children, starts without torch (issue 47)
    from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.2


class SchedulerServer:
    def __init__(
        self, scheduler: Scheduler, recv_addr: str, send_addr: str, dp_rank: int = 0
    ) -> None:
        self.scheduler = scheduler
        self.dp_rank = dp_rank
        self.recv = ZmqPullQueue(recv_addr, create=True)
        self.send = ZmqPushQueue(send_addr, create=False)
        self.last_stats = 0.0

    def stats(self) -> SchedulerStats:
        s, cache = self.scheduler.planner, self.scheduler.cache
        owned, running = len(s.owned_pages()), len(s.admitted())
        free, cached = cache.allocator.num_free, cache.prefix_cache.num_pages
        return SchedulerStats(
            running=running,
            waiting=len(self.scheduler.requests) - running,  # queued, or held by a feature
            total_pages=cache.num_pages,
            free_pages=free,
            cached_pages=cached,
            locked_pages=cache.prefix_cache.locked_pages,
            leaked_pages=cache.num_pages - free - cached - owned,
            num_preemptions=s.num_preemptions,
            prefill_tokens=s.num_prefill_tokens,
            cached_tokens=s.num_cached_tokens,
            counts=self.scheduler.spec.counts() if self.scheduler.spec is not None else {},
            dp_rank=self.dp_rank,
        )

    def handle(self, msg: Any) -> bool:
        """Apply one incoming message; False on ExitMsg."""
        if isinstance(msg, ExitMsg):
            return False
        if isinstance(msg, AbortBackendMsg):
            self.scheduler.abort(msg.uid)
        elif isinstance(msg, UserMsg):
            try:
                req = self.scheduler.make_request(msg.input_ids, msg.params, uid=msg.uid)
            except (ValueError, TypeError) as e:  # TypeError: a message with fields gone wrong
                self.send.put(BatchMsg([DetokenizeMsg(msg.uid, [], True, "error", str(e))]))
            else:
                self.scheduler.add_request(req)
        elif (handler := extensions().scheduler_messages.get(type(msg))) is not None:
            handler(self, msg)  # an extension's request, e.g. ext/serving's /flush_cache
        else:
            logger.warning("scheduler ignores unexpected message %r", type(msg).__name__)
        return True

    def run(self) -> None:
        self.send.put(BatchMsg([], self.stats()))  # /stats is right before any request
        while True:
            msg = self._next_message()
            while msg is not None:
                if not self.handle(msg):
                    return
                msg = self.recv.get_nowait()
            out = self.scheduler.step() if self.scheduler.has_work else []
            now, stats = time.monotonic(), None
            if not self.scheduler.has_work or now - self.last_stats > STATS_INTERVAL_S:
                stats, self.last_stats = self.stats(), now
            if out or stats is not None:
                self.send.put(BatchMsg(out, stats))

    def _next_message(self) -> Any:
        """Block when idle, else never (held requests alone: a step waits a little, held.py)."""
        return self.recv.get_nowait() if self.scheduler.has_work else self.recv.get()


def build_scheduler(
    engine_config: EngineConfig,
    sched_config: SchedulerConfig,
    rank: int,
    tp: int,
    rendezvous: Rendezvous | None = None,
    sharing: int = 1,
) -> Scheduler:
    """Join the TP group (tp > 1, at `rendezvous`), build this rank's engine and scheduler.
    `sharing`: processes sharing the CPU cores (--dp replicas; TP ranks > 0 with their group)."""
    import torch

    from minisgl.engine.engine import Engine
    from minisgl.scheduler.scheduler import Scheduler

    share = sharing * (tp if rank > 0 else 1)  # rank 0 may be the user's own process
    if share > 1:
        threads = max(1, torch.get_num_threads() // share)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # ext/cpu's set_cpu_threads keeps it
    kind = device_type(engine_config.device)
    if kind == "cuda":
        select_device(rank, rendezvous)
    if tp > 1:
        assert rendezvous is not None
        init_tp(rank, tp, rendezvous, kind)
    for adjust in extensions().engine_config:  # e.g. the KV memory a draft model leaves
        engine_config = adjust(engine_config, sched_config)
    engine = Engine(engine_config)
    for adjust in extensions().scheduler_config:  # e.g. ext/perf's budgets on a big GPU
        sched_config = adjust(engine, sched_config)
    tokenizer = load_tokenizer(engine.model_path)
    eos = eos_token_ids(engine.model_path, engine.model_config.eos_token_ids, tokenizer)
    return Scheduler(engine, sched_config, eos, tokenizer)


def run_follower(
    engine_config: EngineConfig,
    sched_config: SchedulerConfig,
    rank: int,
    tp: int,
    rendezvous: Rendezvous,
    ready: Any,
    sharing: int = 1,
    title: str | None = None,
) -> None:
    """Process entry of TP ranks > 0 (server and LLM): say hello before joining (rank 0 waits
    for no process that died importing), build, follow rank 0; rank 0 gone: exit code 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    set_title(title or f"scheduler_{rank}")
    ready.send(("ready", None))
    build = partial(build_scheduler, engine_config, sched_config, rank, tp, rendezvous, sharing)
    scheduler = build_or_report(f"TP rank {rank}", ready, build)
    freeze_startup_heap()
    ready.send(("ready", None))
    try:
        scheduler.follow()
    except RuntimeError as e:  # gloo / NCCL: the connection to rank 0 is gone
        logger.error("TP rank %d: lost rank 0 (%s); exiting", rank, e)
        raise SystemExit(1) from None
    scheduler.shutdown()
    scheduler.engine.shutdown()
    destroy_tp()


def start_followers(
    start: Callable[..., Any],
    config: EngineConfig,
    sched: SchedulerConfig,
    tp: int,
    meet: Rendezvous,
) -> list[Any]:
    """TP ranks 1..tp-1 (server and LLM): `start(name, run_follower, *args)` for each (as
    `utils.procs.spawn` without its context), -> what each returned."""
    return [start(f"scheduler_{k}", run_follower, config, sched, k, tp, meet) for k in range(1, tp)]


def run_scheduler_process(
    engine_config: EngineConfig,
    sched_config: SchedulerConfig,
    tp: int,
    rendezvous: Rendezvous,
    recv_addr: str,
    send_addr: str,
    dp: tuple[int, int],
    warm_up: bool,
    ready: Any,
) -> None:
    """Process entry of rank 0 of replica `dp` = (its rank, replicas): build, warm up where
    kernels compile, report readiness (or the error) through `ready`, serve."""
    dp_rank, dp_size = dp

    def build() -> SchedulerServer:
        scheduler = build_scheduler(engine_config, sched_config, 0, tp, rendezvous, dp_size)
        if warm_up and (warm := extensions().warm_up) is not None:
            warm(scheduler)  # ext/serving's, where kernels compile at first use
        return SchedulerServer(scheduler, recv_addr, send_addr, dp_rank)

    server = build_or_report("scheduler", ready, build)
    scheduler, engine = server.scheduler, server.scheduler.engine
    freeze_startup_heap()
    ready.send(("ready", {"max_seq_len": engine.max_seq_len, "num_pages": engine.num_pages}))
    server.run()
    scheduler.stop_followers()
    scheduler.shutdown()
