"""The serving extension's flags (the `options` point): `python -m minisgl --help` lists them
under "serving extension"; without the extension they are unknown flags."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from minisgl.ext.serving.auth import env_api_key
from minisgl.ext.serving.template import read_chat_template
from minisgl.server.args import ServerArgs, seconds
from minisgl.utils.options import OptionError, int_range, number, option


def positive_seconds(value: str) -> float:
    """A finite number of seconds > 0 (the core's `seconds`: >= 0)."""
    x = number(value, float, "seconds")
    if not 0 < x < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return x


def _host_port(value: str) -> str:
    from minisgl.ext.serving.nodes import split_addr

    try:
        split_addr(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


@dataclass
class ServingOptions:
    chat_template: str | None = option(
        None, "chat template replacing the tokenizer's: a file's path, or the Jinja text itself"
    )
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' (unset: $MINISGL_API_KEY, which other local users "
        "cannot read, unlike a command line)",
    )
    dp: int = option(
        1,
        "data-parallel replicas behind this API server, each a TP group (dp x tp GPUs in all)",
        type=int_range(1),
        aliases=["--data-parallel-size", "--dp-size"],  # vLLM's, SGLang's
    )
    dp_dispatch: str = option(
        "prefix",
        "with --dp > 1: the replica holding the longest prefix of the prompt (ties: least "
        "loaded), or round_robin",
        choices=["prefix", "round_robin"],
    )
    dp_load_threshold: int = option(
        8,
        "with --dp-dispatch prefix: replicas whose loads differ by more than this many "
        "requests send the request to the least loaded one",
        type=int_range(0),
    )
    api_server_count: int = option(
        1,
        "HTTP API processes sharing --port (vLLM's name): each takes its own connections and "
        "streams their replies, so more of them deliver more streamed tokens per second where "
        "one API process's CPU is the limit; --max-connections and --max-queued-requests are "
        "split between them",
        type=int_range(1),
    )
    nnodes: int = option(
        1, "machines the --tp group spans (each runs --tp / --nnodes ranks)", type=int_range(1)
    )
    node_rank: int = option(
        0,
        "this machine's index among --nnodes: node 0 runs the API server and TP rank 0, the "
        "others only their scheduler ranks (they exit when rank 0 does)",
        type=int_range(0),
    )
    dist_init_addr: str | None = option(
        None,
        "HOST:PORT where the ranks of several --nnodes meet (node 0 listens there: a TCP store)",
        type=_host_port,
    )
    dist_timeout: float = option(
        60.0,
        "seconds the ranks of several --nnodes wait to meet at --dist-init-addr (and any one "
        "collective) before giving up with an error",
        type=positive_seconds,
    )
    gc_warning_threshold_secs: float = option(
        0.0,
        "log a warning for every garbage collection longer than this many seconds in any "
        "server process once it is ready (a collection stalls the streams that process "
        "serves); 0: off",
        type=seconds,
    )
    gc_threshold: list[int] | None = option(
        None,
        "one to three integers for gc.set_threshold in every server process once it is ready: "
        "allocations before a generation-0 collection, then collections of each generation "
        "before one of the next; default: $MINISGL_GC_THRESHOLD, else 700 10 1000 (full "
        "collections, which walk every live object and stall every stream a process serves, "
        "a hundred times rarer than Python's 700 10 10: measured on an H100, docs/benchmarks.md)",
        type=int_range(0),
        nargs="+",
        metavar="N",
    )
    watchdog_timeout: float = option(
        300.0,
        "seconds the pipeline may stay silent (no step, no reply) while requests are unfinished "
        "before the server fails them, turns /health 503 and exits with code 1; 0: no watchdog",
        type=seconds,
    )
    health_check_timeout: float = option(
        20.0,
        "seconds /health?generate=1 waits for its one-token generation before answering 503",
        type=positive_seconds,
    )
    max_connections: int = option(
        2048,
        "open HTTP connections beyond which the one that has waited longest for its client "
        "(idle, or still sending its request) is closed; when all are busy, requests beyond it "
        "get 503 (never /health); split between --api-server-count processes",
        type=int_range(1),
    )
    timeout_keep_alive: float = option(
        5.0,
        "seconds a connection may take to send a request's headers, from its opening or from the "
        "end of its previous response, before it is closed",
        type=positive_seconds,
    )
    timeout_body_read: float = option(
        30.0,
        "seconds a request's body may take to arrive in full, from the end of its headers; "
        "past it the request gets 408 and its connection is closed",
        type=positive_seconds,
    )
    max_queued_requests: int | None = option(
        None,
        "requests waiting for their first token beyond which new ones get 503",
        type=int_range(1),
    )
    request_timeout: float | None = option(
        None,
        "seconds after which a request is aborted and answered 504",
        type=positive_seconds,
    )
    max_request_bytes: int = option(
        16 * 2**20, "largest HTTP request body accepted (larger ones get 413)", type=int_range(1)
    )
    skip_server_warmup: bool = option(
        False, "serve without the warm-up (on a GPU: short requests that compile the kernels)"
    )
    exit_with_parent: bool = option(
        False, "stop when the process that started the server dies, however it dies"
    )

    def __post_init__(self) -> None:
        if self.api_key is None:  # --api-key wins over the environment
            self.api_key = env_api_key()

    def check(self, args: ServerArgs) -> None:
        """Against the server's options (`ServerArgs.__post_init__`): OptionError naming the
        flag of a combination that cannot run."""
        if self.chat_template is not None:  # a mistyped path fails here, not as a template
            read_chat_template(self.chat_template)
        if self.gc_threshold is not None and not 1 <= len(self.gc_threshold) <= 3:
            raise OptionError(
                "gc_threshold", f"takes one to three counts, got {len(self.gc_threshold)}"
            )
        if self.api_server_count > 1 and args.shell:
            raise OptionError("api_server_count", "is for the HTTP server, not --shell")
        if self.api_server_count > 1 and not hasattr(socket, "SO_REUSEPORT"):
            raise OptionError("api_server_count", "> 1 needs SO_REUSEPORT (Linux, macOS)")
        self.check_nodes(args)

    def check_nodes(self, args: ServerArgs) -> None:
        if self.node_rank >= self.nnodes:
            raise OptionError(
                "node_rank", f"must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})"
            )
        if self.nnodes == 1:
            return
        if self.dist_init_addr is None:
            raise OptionError(
                "dist_init_addr", "is required with --nnodes > 1 (HOST:PORT of node 0)"
            )
        if args.tp % self.nnodes:
            raise OptionError(
                "tp", f"must be a multiple of --nnodes ({self.nnodes}), got {args.tp}"
            )
        if self.dp > 1:
            raise OptionError(
                "dp",
                "--dp > 1 with --nnodes > 1 is not supported: run one "
                "server per replica behind sglang-router",
            )
        if args.shell:
            raise OptionError("shell", "is not supported with --nnodes > 1")


def serving_options(args: ServerArgs) -> ServingOptions:
    """`args`' serving options (the defaults when they were built without the extension)."""
    options = args.extras.get("serving")
    return options if isinstance(options, ServingOptions) else ServingOptions()
