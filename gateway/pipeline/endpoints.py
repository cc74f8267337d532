"""The decoder (and cache) endpoints a gateway routes over, one channel each, kept up to date.

``GATEWAY_DECODER_ADDRESS`` (and ``GATEWAY_CACHE_ADDRESS``) names them as gRPC targets do:

- ``host:port``: one endpoint;
- ``ipv4:10.0.0.1:50054,10.0.0.2:50054`` (or ``ipv6:[::1]:50054,...``): a fixed list;
- ``dns:///decoder-headless.ns.svc.cluster.local:50054``: every ``A``/``AAAA`` record of the
  name (a Kubernetes headless Service lists its ready pods), re-resolved every
  ``GATEWAY_DECODER_RESOLVE_S`` seconds: a replica that joins gets its share of keys, one
  that leaves gives its share to the others (consistent hashing moves nothing else).

With ``GATEWAY_DECODER_ROUTING=proxy`` the whole target is one endpoint on one channel
(round robin over its addresses, or a proxy such as HAProxy that routes by the
``x-splitvl-affinity`` header itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from qwenvl.decoder.v1 import decoder_service_pb2_grpc

from gateway.pipeline.route import DecoderRouter, Endpoint

log = logging.getLogger(__name__)


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as ``(host, port)``.

    Raises:
        ValueError: no port.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} has no port")
    return host.strip("[]"), int(port)


def static_addresses(target: str) -> list[str] | None:
    """The addresses of a fixed target (``ipv4:``/``ipv6:`` lists, or one ``host:port``);
    None for a ``dns:`` target, resolved at run time."""
    if target.startswith("dns:"):
        return None
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return [a.strip() for a in target[len(scheme) :].split(",") if a.strip()]
    return [target]


def _dns_name(target: str) -> tuple[str, int]:
    """``(host, port)`` of ``dns:///host:port`` or ``dns:host:port`` (an authority, if any,
    is ignored: the system resolver answers)."""
    rest = target[len("dns:") :]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else rest[2:]
    return split_host_port(rest)


class DecoderEndpoints:
    """Keeps ``router``'s endpoints equal to what the target names, one channel each.

    Args:
        target: ``GATEWAY_DECODER_ADDRESS``.
        make_channel: Opens a channel to one address (TLS, token, limits, tracing); its
            second argument is the DNS name the address was resolved from (None for a fixed
            address), which TLS checks the certificate against, not the IP.
        router: The router to keep up to date.
        proxy: One endpoint for the whole target (``GATEWAY_DECODER_ROUTING=proxy``).
        resolve_s: Seconds between DNS resolutions of a ``dns:`` target.
        stub: The stub class of each endpoint's channel (the decoder's by default).
        what: The service's name in log lines.
    """

    def __init__(
        self,
        target: str,
        make_channel: Callable[[str, str | None], Any],
        router: DecoderRouter,
        *,
        proxy: bool = False,
        resolve_s: float = 5.0,
        stub: Callable[[Any], Any] = decoder_service_pb2_grpc.DecoderServiceStub,
        what: str = "decoder",
    ) -> None:
        self.target = target
        self.stub = stub
        self.what = what
        self.make_channel = make_channel
        self.router = router
        self.proxy = proxy
        self.resolve_s = resolve_s
        self._task: asyncio.Task[None] | None = None
        self._retired: list[Endpoint] = []

    def _endpoint(self, address: str) -> Endpoint:
        name = (
            _dns_name(self.target)[0] if self.target.startswith("dns:") and not self.proxy else None
        )
        channel = self.make_channel(address, name)
        return Endpoint(address, self.stub(channel), channel)

    def _apply(self, addresses: list[str]) -> None:
        """Make the router's endpoints ``addresses``: new ones get a channel, gone ones
        are retired (their channels close once their calls have ended)."""
        current = {e.address: e for e in self.router.endpoints}
        if set(current) == set(addresses):
            return
        endpoints = [current.get(a) or self._endpoint(a) for a in addresses]
        gone = self.router.set_endpoints(endpoints)
        self._retired.extend(gone)
        log.info("%s endpoints: %s", self.what, ", ".join(addresses))

    async def start(self) -> None:
        """Open the endpoints (a ``dns:`` target: resolve now, then every ``resolve_s``)."""
        fixed = [self.target] if self.proxy else static_addresses(self.target)
        if fixed is not None:
            self._apply(fixed)
            return
        await self.refresh()
        self._task = asyncio.create_task(self._follow())

    async def resolve(self) -> list[str]:
        """The target's addresses now (``host:port``, IPv6 in brackets), sorted."""
        host, port = _dns_name(self.target)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        out = set()
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
        return sorted(out)

    async def refresh(self) -> None:
        """Resolve once; on failure (or no record) keep the endpoints as they are."""
        try:
            addresses = await self.resolve()
        except OSError as err:
            log.warning(
                "cannot resolve %s (%s); keeping %d endpoints",
                self.target,
                err,
                len(self.router.endpoints),
            )
            return
        if addresses:
            self._apply(addresses)
        await self._close_idle_retired()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_s)
            await self.refresh()

    async def _close_idle_retired(self) -> None:
        idle = [e for e in self._retired if e.inflight == 0]
        self._retired = [e for e in self._retired if e.inflight > 0]
        for e in idle:
            if e.channel is not None:
                await e.channel.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for e in [*self.router.endpoints, *self._retired]:
            if e.channel is not None:
                await e.channel.close()
