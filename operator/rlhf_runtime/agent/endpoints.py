"""The addresses of an HTTP environment server and the episodes pinned to them.

A server that keeps episode state must see all of an episode's requests; a Service that balances per connection
would send an episode's ``/step`` to another pod than its ``/reset``. So the job's environment server has a
headless Service (one DNS A record per ready pod) and each episode is pinned here to one address for all its
requests, new episodes going to the address with the fewest episodes in progress (round-robin among equals).

The name is resolved again every ``period`` seconds and when a pinned address fails; an address that failed is
given no new episode until it answers again or the next regular resolution, and one that the name no longer
lists (its pod is gone or not ready) is reported ``gone``: its episodes are the environment's faults.

Which URLs are pinned: the operator's server (``pin_single``) whenever its name resolves (a Service that is not
headless resolves to its one cluster IP: pinned to it, as good as the name); a user's ``http.url`` only when its
host resolves to several addresses of one family. An ``https`` URL, an IP address, a URL with user info, or a
name that does not resolve is used as it is.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

#: Seconds between regular resolutions of the server's name.
RESOLVE_SECONDS = 10.0
#: A failed address makes the name resolve again at most this often (many episodes fail together).
FAILED_RESOLVE_SECONDS = 0.5

#: ``(host, port) -> addresses``: the ones to spread episodes over, in a stable order.
Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """The host's addresses of one family (IPv4 when it has any), each once, sorted; none if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:  # socket.gaierror too
        return []
    v4 = {i[4][0] for i in infos if i[0] == socket.AF_INET}
    v6 = {i[4][0] for i in infos if i[0] == socket.AF_INET6}
    return sorted(v4 or v6)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Endpoints:
    """Where the episodes of one server go (module docstring). Thread-safe: resolutions run in worker threads."""

    def __init__(self, url: str, pin_single: bool = False, resolver: Resolver = resolve,
                 period: float = RESOLVE_SECONDS) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.parts, self.host_header = parts, parts.netloc
        host = parts.hostname or ""
        self.pinnable = parts.scheme == "http" and bool(host) and "@" not in parts.netloc and not _is_ip(host)
        self.host, self.port = host, parts.port or 80
        self.pin_single, self.resolver, self.period = pin_single, resolver, period
        self.addrs: list[str] = []
        self.resolved_at: float | None = None
        self.load: dict[str, int] = {}
        self.failed: dict[str, float] = {}
        self.turn = 0
        self.lock = threading.Lock()

    def due(self) -> bool:
        """Whether the regular resolution is due (then ``refresh`` in a worker thread before ``pin``)."""
        return self.pinnable and (self.resolved_at is None or time.monotonic() - self.resolved_at >= self.period)

    def refresh(self, within: float | None = None) -> list[str]:
        """Resolve the name unless it was resolved less than ``within`` seconds ago (default: ``period``); the
        addresses. Blocking: call it from a worker thread."""
        if not self.pinnable:
            return []
        within = self.period if within is None else within
        with self.lock:
            now = time.monotonic()
            if self.resolved_at is not None and now - self.resolved_at < within:
                return list(self.addrs)
            addrs = self.resolver(self.host, self.port)
            now = time.monotonic()
            if within >= self.period:  # a regular resolution: the failed addresses it lists get episodes again
                self.failed.clear()
            self.addrs, self.resolved_at = list(addrs), now
            return list(addrs)

    def pin(self) -> str | None:
        """The address of a new episode (counted until ``release``), or None: the URL as it is."""
        with self.lock:
            addrs = self.addrs if len(self.addrs) > 1 or (self.pin_single and self.addrs) else []
            if not addrs:
                return None
            live = [a for a in addrs if a not in self.failed] or addrs
            least = min(self.load.get(a, 0) for a in live)
            choices = [a for a in live if self.load.get(a, 0) == least]
            addr = choices[self.turn % len(choices)]
            self.turn += 1
            self.load[addr] = self.load.get(addr, 0) + 1
            return addr

    def release(self, addr: str | None) -> None:
        if addr is None:
            return
        with self.lock:
            n = self.load.get(addr, 0) - 1
            if n > 0:
                self.load[addr] = n
            else:
                self.load.pop(addr, None)

    def answered(self, addr: str | None) -> None:
        if addr is not None and addr in self.failed:
            with self.lock:
                self.failed.pop(addr, None)

    def gone(self, addr: str) -> bool:
        """After a failure of ``addr``: mark it failed, resolve the name again (at most every
        ``FAILED_RESOLVE_SECONDS``) and say whether it is no longer listed. Blocking: call it from a worker thread."""
        with self.lock:
            self.failed[addr] = time.monotonic()
        return addr not in self.refresh(FAILED_RESOLVE_SECONDS)

    def url_of(self, addr: str | None) -> str:
        """The base URL with the host replaced by ``addr`` (the URL itself for None)."""
        if addr is None:
            return self.url
        host = f"[{addr}]" if ":" in addr else addr
        return urlunsplit((self.parts.scheme, f"{host}:{self.port}", self.parts.path, "", ""))
