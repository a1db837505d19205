"""The scheduler process of the server: requests in over ZMQ, one step, tokens out."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import torch

from minisgl.distributed import Rendezvous, destroy_tp, init_tp, select_device
from minisgl.engine import Engine, EngineConfig
from minisgl.extension import extensions
from minisgl.message import (
    AbortBackendMsg,
    BatchBackendMsg,
    BatchDetokenizeMsg,
    DetokenizeMsg,
    ExitMsg,
    FlushCacheMsg,
    FlushCacheReply,
    SchedulerStats,
    UserMsg,
)
from minisgl.models.hf import eos_token_ids, load_tokenizer
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.device import device_type
from minisgl.utils.procs import die_with_parent, freeze_startup_heap, set_title
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.2
# While the only work is held requests (grammars compiling), wait this long for a message
# between the steps that look at them: no busy loop, and a released request is admitted within it
GRAMMAR_POLL_S = 0.02


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
        owned = len(s.owned_pages())
        free, cached = cache.allocator.num_free, cache.prefix_cache.num_pages
        return SchedulerStats(
            running=len(s.admitted()),
            waiting=len(s.waiting) + len(self.scheduler.held),
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
        if isinstance(msg, BatchBackendMsg):
            return all([self.handle(m) for m in msg.msgs])
        if isinstance(msg, ExitMsg):
            return False
        if isinstance(msg, AbortBackendMsg):
            self.scheduler.abort(msg.uid)
        elif isinstance(msg, FlushCacheMsg):
            error = self.scheduler.flush_cache()
            # the stats first, on the same ordered path: a /stats read after the flush's
            # answer shows the emptied cache (the other order raced under load)
            self.send.put(BatchDetokenizeMsg([], self.stats()))
            self.send.put(FlushCacheReply(self.dp_rank, error, msg.api_rank))
        elif isinstance(msg, UserMsg):
            try:
                req = self.scheduler.make_request(msg.input_ids, msg.params, uid=msg.uid)
            except (ValueError, TypeError) as e:  # TypeError: a message with fields gone wrong
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
            msg = self._next_message()
            while msg is not None:
                if not self.handle(msg):
                    return
                msg = self.recv.get_nowait()
            outputs = self.scheduler.step() if self.scheduler.has_work else []
            out = [
                DetokenizeMsg(
                    o.uid,
                    [] if o.token is None else [o.token],
                    o.finished,
                    o.finish_reason,
                    o.error,
                    None if o.logprob is None else [o.logprob],
                    o.prompt_logprobs,
                    o.queue_time,
                    o.cached_tokens,
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

    def _next_message(self) -> Any:
        """Block when idle; while only held requests wait, a little (GRAMMAR_POLL_S);
        otherwise take what has arrived and keep stepping."""
        if self.scheduler.runnable:
            return self.recv.get_nowait()
        if self.scheduler.has_work:
            return self.recv.get(timeout=GRAMMAR_POLL_S)
        return self.recv.get()


def build_scheduler(
    engine_config: EngineConfig,
    sched_config: SchedulerConfig,
    rank: int,
    tp: int,
    rendezvous: Rendezvous | None = None,
    sharing: int = 1,
) -> Scheduler:
    """Join the TP group (when tp > 1; its ranks meet at `rendezvous`), then build this rank's
    engine shard and scheduler. `sharing`: processes of this kind that share the CPU cores (the
    --dp replicas' rank 0s); TP ranks > 0 share them with their group too."""
    share = sharing * (tp if rank > 0 else 1)  # rank 0 may be the user's own process
    if share > 1:
        threads = max(1, torch.get_num_threads() // share)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the engine's set_cpu_threads keeps it
    kind = device_type(engine_config.device)
    if kind == "cuda":
        select_device(rank, rendezvous)
    if tp > 1:
        assert rendezvous is not None
        init_tp(rank, tp, rendezvous, kind)
    for adjust in extensions().engine_config:  # e.g. the KV memory a draft model leaves
        engine_config = adjust(engine_config, sched_config)
    engine = Engine(engine_config)
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
    """Process entry of TP ranks > 0 (server and offline LLM alike): say hello before joining
    the group (so rank 0 waits for no process that died importing), build, follow rank 0.
    Ctrl-C is rank 0's to handle; the kernel ends this process with its parent. Rank 0 gone
    (its sockets closed: killed, or on another node) ends it with code 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    set_title(title or f"scheduler_{rank}")
    ready.send(("ready", None))
    try:
        scheduler = build_scheduler(engine_config, sched_config, rank, tp, rendezvous, sharing)
    except Exception as e:
        ready.send(("error", f"TP rank {rank} failed to start: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
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
    """Process entry of rank 0 of replica `dp` = (its rank, replicas): build the engine, warm
    it up where it compiles (unless `warm_up` is False), report readiness (or the error) through
    `ready`, then serve."""
    dp_rank, dp_size = dp
    try:
        scheduler = build_scheduler(engine_config, sched_config, 0, tp, rendezvous, dp_size)
        if warm_up and scheduler.engine.needs_warm_up:
            scheduler.warm_up()
        server = SchedulerServer(scheduler, recv_addr, send_addr, dp_rank)
    except Exception as e:  # reported to the launcher, which prints it and exits non-zero
        ready.send(("error", f"scheduler failed to start: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    engine = scheduler.engine
    freeze_startup_heap()
    ready.send(("ready", {"max_seq_len": engine.max_seq_len, "num_pages": engine.num_pages}))
    server.run()
    scheduler.stop_followers()
    scheduler.shutdown()
