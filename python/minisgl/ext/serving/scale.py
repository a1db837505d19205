"""The server's processes beyond one scheduler and one API process on one machine (the
`launcher` point): `ServingLauncher` adds a `Reaper`, --dp's replicas (each a TP group on the
GPUs after the previous one's; its tokenizer workers pick a replica per request),
--api-server-count's API processes (each with its own SO_REUSEPORT socket of the port; SIGTERM
drains them all), the nodes of --nnodes (the TP ranks meet at --dist-init-addr; a node other
than 0 runs only its ranks and exits when rank 0 does), the collector's settings of every
server process (--gc-threshold, --gc-warning-threshold-secs: `collector.py`) and
--exit-with-parent's watch (`parent.py`)."""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from minisgl.distributed import Rendezvous, rendezvous_file
from minisgl.engine.config import EngineConfig
from minisgl.ext.serving.apis import ApiQueues
from minisgl.ext.serving.auth import hide_api_key
from minisgl.ext.serving.collector import export_gc_settings
from minisgl.ext.serving.frontend import ApiFailMsg, ServingFrontend
from minisgl.ext.serving.nodes import TcpRendezvous
from minisgl.ext.serving.options import serving_options
from minisgl.ext.serving.parent import exit_with_parent
from minisgl.ext.serving.reaper import Reaper
from minisgl.ext.serving.worker import tokenizer_worker
from minisgl.extension import extensions
from minisgl.message import ExitMsg
from minisgl.server.launch import DEATH_GRACE_S, Addresses, Launcher, Started, _split, http_server
from minisgl.utils.procs import wait_ready
from minisgl.utils.zmq import ZmqPushQueue

if TYPE_CHECKING:
    from minisgl.server.args import ServerArgs

STOP_OTHER_NODES_S = 3.0  # rank 0's wait, on a clean stop, for the other nodes' ranks to stop


def check_scale_out(args: ServerArgs, config: EngineConfig) -> None:
    """Before any process starts: a TP size or --max-model-len the model cannot take, or GPUs
    this machine does not have (--dp x --tp / --nnodes)."""
    from minisgl.engine.config import check_model
    from minisgl.utils.device import gpus_short

    options = serving_options(args)
    gpus = options.dp * args.tp // options.nnodes
    if (found := gpus_short(config.device, gpus)) is not None:  # torch only when it may be
        nodes = f" / --nnodes {options.nnodes}" if options.nnodes > 1 else ""
        raise ValueError(
            f"--dp {options.dp} x --tp {args.tp}{nodes} needs {gpus} GPUs on this machine, "
            f"found {found}"
        )
    check_model(config, args.tp, gpus)


def _send(addr: str, msg: Any) -> None:
    queue = ZmqPushQueue(addr, create=False)
    queue.put(msg)
    queue.close()  # lingers until the message is out


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """The HTTP port's socket for each of `count` API processes, bound before the model loads:
    a taken port fails at once. One socket listens only once uvicorn serves it: until then a
    client is refused at once rather than left waiting in a backlog. Several have SO_REUSEPORT
    and listen now: the kernel spreads new connections evenly over the listening ones (one
    socket that all accept from would let whichever process wakes first take a whole burst). A
    plain bind first makes sure that no other server holds the port: SO_REUSEPORT alone would
    share it with one of the same user."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bound(reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            error = f"cannot listen on {host}:{port} (--host, --port): {e.strerror}"
            raise RuntimeError(error) from None
        return sock

    if count == 1:
        return [bound(reuse_port=False)]
    bound(reuse_port=False).close()
    socks = [bound(reuse_port=True) for _ in range(count)]
    for sock in socks:  # all in the kernel's spread from now on, whichever process serves first
        sock.listen()
    return socks


def _api_main(
    args: ServerArgs, info: dict[str, Any], rank: int, addrs: Addresses, sock: Any, ready: Any
) -> None:
    """API process `rank` > 0 of --api-server-count: the app on the socket of the port that
    rank 0 (the main process) opened for it; a failure it sees (its watchdog) goes to rank 0."""

    def report(reason: str) -> None:
        _send(addrs.apis[0], ApiFailMsg(reason))

    options = serving_options(args)
    frontend = ServingFrontend(
        addrs.tokenizers,
        addrs.apis[rank],
        options.watchdog_timeout,
        report,
        addrs.schedulers,
        api_rank=rank,
        api_addrs=addrs.apis,
        max_queued_requests=options.max_queued_requests,
        request_timeout=options.request_timeout,
    )
    server = http_server(args, info, frontend)
    ready.send(("ready", None))
    server.run(sockets=[sock])  # uvicorn drains on SIGTERM / SIGINT, as rank 0 does


class ServingLauncher(Launcher):
    """The Launcher with --api-server-count's API processes and --nnodes' nodes."""

    def __init__(self, args: ServerArgs) -> None:
        self.options = options = serving_options(args)
        hide_api_key()  # in this process's command line only: the children show their titles
        export_gc_settings(args)  # before any child starts: they read it once ready
        self.api_server_count = options.api_server_count
        super().__init__(
            args, Addresses.make(args.num_tokenizer, options.dp, options.api_server_count)
        )
        self.reaper = Reaper(self.addrs.root)  # clears up after this process however it dies
        self.tokenizer_worker = tokenizer_worker(
            args.engine.page_size,
            options.dp_dispatch,
            options.dp_load_threshold,
            options.chat_template,
        )
        if options.api_server_count > 1:  # each reply to the API process of its request
            self.api_queue = functools.partial(ApiQueues.connect, self.addrs.apis)
        self.api_procs: list[Any] = []  # the API processes other than this one
        self.draining = False  # SIGTERM: the API processes finish their requests, then exit

    @property
    def ranks_here(self) -> int:
        return self.args.tp // self.options.nnodes

    def _spawn(self, name: str, target: Any, *target_args: Any, **kwargs: Any) -> Any:
        started = super()._spawn(name, target, *target_args, **kwargs)
        self.reaper.watch(started[1].pid)
        return started

    def start(self) -> None:
        if self.options.exit_with_parent:  # first: its SIGTERM then unwinds through `stop`
            exit_with_parent()
        if self.options.node_rank == 0:
            if not self.args.shell:  # a taken port fails here, before a download
                self.listeners = listen_sockets(
                    self.args.host, self.args.port, self.api_server_count
                )
            return super().start()
        # scheduler ranks only: no front end on this node
        config = self.resolve_models()
        self.check(config)
        first = self.options.node_rank * self.ranks_here
        followers = [self._follower(config, 0, k) for k in range(first, first + self.ranks_here)]
        wait_ready(*_split(followers))  # hello
        wait_ready(*_split(followers))  # built, in the group

    def check(self, config: EngineConfig) -> None:
        check_scale_out(self.args, config)

    def start_pipeline(self, config: EngineConfig) -> None:
        super().start_pipeline(config)
        if len(self.listeners) > 1:
            args, a = self.args, self.addrs
            apis = [
                self._spawn(f"api_server_{k}", _api_main, args, self.info, k, a, self.listeners[k])
                for k in range(1, self.api_server_count)
            ]
            self.api_procs = [proc for _, proc in apis]
            wait_ready(*_split(apis))
            for sock in self.listeners[1:]:  # each is its process's now: when that one closes
                sock.close()  # it (drain) or dies, the kernel sends its connections elsewhere
            del self.listeners[1:]

    def preload_front_end(self) -> None:
        """While the children start: import what the front end runs on (prompt_toolkit; fastapi,
        uvicorn, the extensions' routes), which would otherwise wait for them (issues 47, 51)."""
        if self.args.shell:
            import prompt_toolkit  # noqa: F401  (~0.1 s)

            return
        import uvicorn  # noqa: F401

        import minisgl.server.api_server  # noqa: F401

        for add_routes in extensions().routes:
            if (resolve := getattr(add_routes, "resolve", None)) is not None:
                resolve()  # an extension's route registered by name (ext/lazy.py): imported now

    def start_schedulers(self, config: EngineConfig) -> tuple[list[Started], list[Started]]:
        """Each replica's TP rank 0 and its other ranks (this node's)."""
        replicas = range(self.options.dp)
        rank0s = [self._replica(config, r) for r in replicas]
        return rank0s, [
            self._follower(config, r, k) for r in replicas for k in range(1, self.ranks_here)
        ]

    def _rendezvous(self, replica: int) -> Rendezvous:
        options = self.options
        if options.nnodes == 1:  # a replica's GPUs follow the previous one's
            return rendezvous_file(
                self.addrs.root, f"tp-rendezvous-{replica}", replica * self.args.tp
            )
        # rank 0's node hosts the TCP store; GPU 0 is the node's first rank
        shift = -options.node_rank * self.ranks_here
        assert options.dist_init_addr is not None  # ServingOptions.check
        return TcpRendezvous("", shift, options.dist_timeout, options.dist_init_addr)

    def _name(self, replica: int, rank: int) -> str:
        return f"scheduler_{rank}" if self.options.dp == 1 else f"dp{replica}_scheduler_{rank}"

    def _replica(self, config: EngineConfig, replica: int) -> Started:
        from minisgl.scheduler.io import run_scheduler_process

        args, a = self.args, self.addrs
        io = (a.schedulers[replica], a.detokenizer, (replica, self.options.dp))
        meet, warm_up = self._rendezvous(replica), not self.options.skip_server_warmup
        entry = (run_scheduler_process, config, args.scheduler, args.tp, meet, *io, warm_up)
        return self._spawn(self._name(replica, 0), *entry)

    def _follower(self, config: EngineConfig, replica: int, rank: int) -> Started:
        from minisgl.scheduler.io import run_follower

        args, name, dp = self.args, self._name(replica, rank), self.options.dp
        entry = (config, args.scheduler, rank, args.tp, self._rendezvous(replica))
        return self._spawn(name, run_follower, *entry, sharing=dp, title=name)

    def expected_exit(self, proc: Any) -> bool:
        # it drained its requests (`stop` may have reaped it: no exit code)
        return self.draining and proc in self.api_procs

    def run(self, front_end: Any) -> int:
        """`front_end` on the serving extension's Frontend (the watchdog, the other API
        processes' views); on a node other than 0, `follow`."""
        if self.options.node_rank > 0:
            return self.follow()
        a, options = self.addrs, self.options
        frontend = ServingFrontend(
            a.tokenizers,
            a.apis[0],
            options.watchdog_timeout,
            self.fail,
            a.schedulers,
            api_addrs=a.apis,
            max_queued_requests=options.max_queued_requests,
            request_timeout=options.request_timeout,
        )
        frontend.on_drain = self.drain
        return front_end(self, frontend)

    def follow(self) -> int:
        """A node other than rank 0's: wait until a scheduler rank ends (rank 0 stopped them,
        or is gone); 0 when every one ended cleanly."""
        from multiprocessing.connection import wait

        print(f"minisgl: node {self.options.node_rank} serving its TP ranks", flush=True)
        wait([p.sentinel for p in self.procs])
        for p in self.procs:
            p.join(timeout=5)
        if any(p.exitcode != 0 for p in self.procs):
            self.failure = "; ".join(
                f"{p.name} process ended with exit code {p.exitcode} (rank 0 gone?)"
                for p in self.procs
                if p.exitcode != 0
            )
        return 0

    def _stop_other_nodes(self) -> None:
        """With --nnodes > 1, rank 0 tells the other ranks to stop (its ExitMsg to them), so
        that the other nodes exit 0; killed instead, it would leave them to find it gone."""
        rank0 = self.procs[0]
        if not rank0.is_alive():
            return
        _send(self.addrs.schedulers[0], ExitMsg())
        rank0.join(timeout=STOP_OTHER_NODES_S)

    def fail(self, reason: str) -> None:
        """The other API processes end their requests too (a failure: a child died, or the
        pipeline hung: the watchdog's)."""
        if self.stopping or self.failure is not None:
            return
        for addr in self.addrs.apis[1:]:
            # on threads: a dead one's socket would hold `close` for its linger
            threading.Thread(target=_send, args=(addr, ApiFailMsg(reason)), daemon=True).start()
        super().fail(reason)

    def drain(self) -> None:
        """SIGTERM reached this process: the other API processes drain their requests too."""
        self.draining = True
        for proc in self.api_procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.draining and not self.failure:  # they got the same time as this process
            deadline = time.monotonic() + self.args.shutdown_timeout + DEATH_GRACE_S
            for proc in self.api_procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        options = self.options
        if options.nnodes > 1 and options.node_rank == 0 and self.procs and not self.failure:
            self.stopping = True  # rank 0's exit is no failure
            self._stop_other_nodes()
        super().stop()
        self.reaper.stop()
