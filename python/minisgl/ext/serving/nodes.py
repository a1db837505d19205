"""--nnodes: where the TP ranks of several machines meet (`TcpRendezvous`), a TCP store that
rank 0 hosts at --dist-init-addr. A rank that cannot reach it, or a group that misses ranks,
fails after --dist-timeout seconds with an error naming the flags."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from minisgl.distributed import START_TIMEOUT_S, Rendezvous, stay_on_loopback

if TYPE_CHECKING:  # torch in the ranks that join: the API process names a rendezvous only
    import torch.distributed as dist


def split_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port); ValueError naming the problem."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"must be HOST:PORT with a port in 1..65535, got {addr!r}")
    return host, int(port)


@dataclass(frozen=True)
class TcpRendezvous(Rendezvous):
    """The ranks meet at the TCP store at `addr` (HOST:PORT, --dist-init-addr) within
    `timeout_s`; on node k of several, the node's first rank drives GPU 0 (`device_shift`)."""

    timeout_s: float = START_TIMEOUT_S
    addr: str = ""

    @property
    def local(self) -> bool:
        """Every rank is on this machine: their sockets stay on the loopback interface."""
        try:
            host = socket.gethostbyname(split_addr(self.addr)[0])
            return ipaddress.ip_address(host).is_loopback
        except (OSError, ValueError):
            return False

    def _store(self, rank: int, size: int) -> dist.TCPStore:
        import torch.distributed as dist

        host, port = split_addr(self.addr)
        timeout = timedelta(seconds=self.timeout_s)
        try:
            return dist.TCPStore(
                host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
            )
        except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(
                f"--dist-init-addr {self.addr}: rank {rank} could not "
                f"{'listen there' if rank == 0 else 'reach it'} within --dist-timeout "
                f"{self.timeout_s:g} s ({first})"
            ) from None

    def join(self, rank: int, size: int, backend: str) -> None:
        import torch.distributed as dist

        if self.local:
            stay_on_loopback(backend)
        store = self._store(rank, size)
        timeout = timedelta(seconds=self.timeout_s)
        try:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=size, timeout=timeout
            )
        except (RuntimeError, OSError) as e:
            raise RuntimeError(
                f"TP rank {rank}: the group of {size} ranks at --dist-init-addr {self.addr} did "
                f"not form within --dist-timeout {self.timeout_s:g} s ({type(e).__name__})"
            ) from None
