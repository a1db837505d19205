"""Prometheus metrics of the server (`GET /metrics`).

Request-level numbers (tokens, latencies, outcomes) are counted here, in the api server, as the
replies arrive. Scheduler-level ones (running requests, KV pages, prefix-cache hits, preemptions)
are read at scrape time from the latest `SchedulerStats` snapshot, at most 0.2 s old: summed over
the --dp replicas, and per replica in the `minisgl_replica_*` series (label `dp_rank`). With
--api-server-count N, each API process counts its own requests; the one that answers /metrics
adds up every process's series (`summed_exposition`).

`Metrics` is the serving Frontend's `metrics` (it counts each reply, each request ended early;
the serving Gate each response); `add_metrics_route` serves it as a `routes` point."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.responses import PlainTextResponse, Response  # fastapi's: its package is heavy

from minisgl.message import SchedulerStats, UserReply, register
from minisgl.server.protocol import APIError

if TYPE_CHECKING:  # types only: the extension loads while the api server module may be loading
    from fastapi import FastAPI

    from minisgl.ext.serving.frontend import ServingFrontend
    from minisgl.server.api_server import ApiServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PRIORITY_LABELS = 16  # priorities in [-16, 16] get a label of their own, the rest "<-16" / ">16"


@register
@dataclass
class ApiViewMsg:
    """An API process's answer to query `seq` (/stats and /metrics add them up)."""

    rank: int
    seq: int
    pid: int
    in_flight: int
    queued: int
    metrics: str
    rss_bytes: int


def priority_label(priority: int) -> str:
    """The `priority` label value: bounded, so clients cannot grow the series without limit."""
    if priority < -PRIORITY_LABELS:
        return f"<-{PRIORITY_LABELS}"
    return f">{PRIORITY_LABELS}" if priority > PRIORITY_LABELS else str(priority)


def total_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' snapshots summed (one replica: its own)."""
    if len(replicas) == 1:
        return replicas[0]
    names = [f.name for f in fields(SchedulerStats) if f.name not in ("dp_rank", "counts")]
    counts = {k: sum(r.counts.get(k, 0) for r in replicas) for r0 in replicas for k in r0.counts}
    return SchedulerStats(**{n: sum(getattr(r, n) for r in replicas) for n in names}, counts=counts)


def _replica_families(
    replicas: list[SchedulerStats],
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    def family(kind: type, name: str, doc: str) -> Any:
        return kind(f"minisgl_replica_{name}", doc + " (per --dp replica)", labels=["dp_rank"])

    running = family(GaugeMetricFamily, "num_running_requests", "requests running")
    waiting = family(GaugeMetricFamily, "num_waiting_requests", "requests waiting")
    free = family(GaugeMetricFamily, "kv_pages_free", "KV pages free")
    prefill = family(CounterMetricFamily, "prefill_tokens", "prompt tokens scheduled")
    hits = family(CounterMetricFamily, "prefix_cache_hit_tokens", "of those, cache hits")
    for s in replicas:
        rank = [str(s.dp_rank)]
        running.add_metric(rank, s.running)
        waiting.add_metric(rank, s.waiting)
        free.add_metric(rank, s.free_pages)
        prefill.add_metric(rank, s.prefill_tokens)
        hits.add_metric(rank, s.cached_tokens)
    yield from (running, waiting, free, prefill, hits)


class TokenHistogram(Collector):
    """A histogram that takes a reply's n tokens as one call, with no lock (the event loop's
    thread observes and scrapes it): the API process observes every token of every stream, and
    prometheus_client's `Histogram.observe` takes a lock and scans the buckets per value."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n  # a bound is inclusive (le)
        self.sum += value * n

    def collect(self) -> Iterator[HistogramMetricFamily]:
        les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        cumulative = [sum(self.counts[: i + 1]) for i in range(len(self.counts))]
        buckets = list(zip(les, cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _SchedulerCollector(Collector):
    def __init__(self, replicas: Callable[[], list[SchedulerStats]]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        replicas = self.replicas()
        yield from _replica_families(replicas)
        s = total_stats(replicas)
        gauges = {
            "num_running_requests": ("requests running in the scheduler", s.running),
            "kv_pages_total": ("KV cache pages", s.total_pages),
            "kv_pages_used": (
                "KV pages held by running requests (locked prefix-cache pages included)",
                s.total_pages - s.free_pages - s.cached_pages + s.locked_pages,
            ),
            "kv_pages_cached": ("KV pages held by the prefix cache", s.cached_pages),
            "kv_pages_leaked": ("KV pages owned by nobody (must stay 0)", s.leaked_pages),
            "prefix_cache_hit_rate": (
                "share of scheduled prompt tokens found in the prefix cache",
                s.cached_tokens / s.prefill_tokens if s.prefill_tokens else 0.0,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"minisgl_{name}", doc, value=value)
        counters = {
            "preemptions": ("requests preempted for lack of KV pages", s.num_preemptions),
            "prefill_tokens": ("prompt tokens scheduled (incl. re-prefills)", s.prefill_tokens),
            "prefix_cache_hit_tokens": ("of those, found in the prefix cache", s.cached_tokens),
            "spec_draft_tokens": (
                "speculative decoding: tokens proposed",
                s.counts.get("spec_draft_tokens", 0),
            ),
            "spec_accepted_tokens": (
                "speculative decoding: of those, accepted",
                s.counts.get("spec_accepted_tokens", 0),
            ),
            "spec_verified_rows": (
                "speculative decoding: request-steps that verified proposals (accepted tokens"
                " over these: the mean accepted length)",
                s.counts.get("spec_verified_rows", 0),
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"minisgl_{name}", doc, value=value)


class _Summed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def summed_exposition(texts: list[str]) -> bytes:
    """Several processes' Prometheus text as one: each series summed over them (counters,
    histogram buckets, gauges of what each process counts), except `_created` timestamps,
    the earliest. A series only some processes have is kept."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif sample.name.endswith("_created"):
                    samples[key] = min(samples[key], sample.value)
                else:
                    samples[key] += sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry()
    registry.register(_Summed(list(families.values())))
    return generate_latest(registry)


def tree_rss_bytes() -> int:
    """Resident memory of this process and its children (the server's workers); 0 off Linux."""
    total = 0
    for pid in [os.getpid(), *(p.pid for p in mp.active_children())]:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
    return total


class Metrics:
    def __init__(
        self,
        replicas: Callable[[], list[SchedulerStats]],
        queued: Callable[[], int],
        rss: Callable[[], int] = tree_rss_bytes,
    ) -> None:
        """`replicas`: the latest scheduler snapshots; `queued`: this process's requests not
        started yet; `rss`: the server's resident memory as this process counts it."""
        r = self.registry = CollectorRegistry()  # what this API process counts
        Gauge("minisgl_num_queued_requests", "requests not started yet", registry=r).set_function(
            queued
        )
        Gauge(
            "minisgl_resident_memory_bytes", "RSS of all server processes", registry=r
        ).set_function(rss)
        self.prompt_tokens = Counter(
            "minisgl_prompt_tokens", "prompt tokens of requests", registry=r
        )
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "tokens generated", registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "from submission to the first generated token, by request priority",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "minisgl_queue_time_seconds",
            "in the scheduler's waiting queue, until the first prompt chunk runs, by priority",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds",
            "from submission to the last token of requests that completed, by priority",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = TokenHistogram(
            "minisgl_inter_token_latency_seconds",
            "between consecutive generated tokens of a request",
            LATENCY_BUCKETS,
        )
        r.register(self.itl)
        self.finished = Counter(
            "minisgl_requests_finished",
            "generation requests by how they ended (stop, length, abort, error, timeout)",
            ["reason"],
            registry=r,
        )
        self.http = Counter(
            "minisgl_http_requests",
            "HTTP responses by path and status",
            ["path", "status"],
            registry=r,
        )
        self.scheduler = CollectorRegistry()
        self.scheduler.register(_SchedulerCollector(replicas))

    def request_text(self) -> str:
        return generate_latest(self.registry).decode()

    def render(self, peers: list[str] | None = None) -> bytes:
        """The exposition: this process's series, summed with `peers` (the other API
        processes' `request_text`), then the scheduler's."""
        if peers:
            own = summed_exposition([self.request_text(), *peers])
        else:
            own = generate_latest(self.registry)
        return own + generate_latest(self.scheduler)

    def reply(
        self,
        priority: int,
        submitted: float,
        last_token: float | None,
        reply: UserReply,
        now: float,
    ) -> None:
        label, n = priority_label(priority), len(reply.token_ids)
        if reply.queue_time is not None:
            self.queue_time.labels(label).observe(reply.queue_time)
        if n:
            if last_token is None:
                self.ttft.labels(label).observe(now - submitted)
                self.prompt_tokens.inc(reply.prompt_tokens)
            else:
                self.itl.observe((now - last_token) / n, n)
            self.generation_tokens.inc(n)
        if reply.finished:
            self.finished.labels(reply.finish_reason or "unknown").inc()
            if reply.finish_reason in ("stop", "length"):
                self.e2e.labels(label).observe(now - submitted)

    def ended(self, reason: str) -> None:
        self.finished.labels(reason).inc()

    def response(self, path: str, status: int) -> None:
        self.http.labels(path, str(status)).inc()

    def text(self) -> str:
        return self.request_text()


def frontend_metrics(frontend: ServingFrontend) -> Metrics:
    """A serving Frontend's metrics, reading its replicas' snapshots; the server's RSS is API
    process 0's to count (its children include the other API processes)."""
    rss = tree_rss_bytes if frontend.api_rank == 0 else lambda: 0
    return Metrics(lambda: frontend.replica_stats, lambda: frontend.num_queued, rss)


async def all_views(api: ApiServer, metrics: bool = False) -> list[ApiViewMsg]:
    """Every API process's counts (`Frontend.views`); 503 when one does not answer."""
    try:
        return await cast("ServingFrontend", api.frontend).views(metrics)  # its launcher's
    except asyncio.TimeoutError:
        message = "an API process did not answer"
        raise APIError(503, message, code="server_unavailable") from None


def add_metrics_route(app: FastAPI, api: ApiServer, info: dict[str, Any]) -> None:
    """GET /metrics (a `routes` point): every API process's series summed, then the
    scheduler's."""

    async def metrics() -> Response:
        views = await all_views(api, metrics=True)
        frontend = cast("ServingFrontend", api.frontend)  # its launcher's
        peers = [v.metrics for v in views if v.rank != frontend.api_rank]
        return Response(frontend.metrics.render(peers), media_type=CONTENT_TYPE)

    app.get("/metrics", response_class=PlainTextResponse)(metrics)  # documents text/plain
