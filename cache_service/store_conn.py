"""The connection to a shared store: its URL, the Redis client, and how failures are handled.

URLs (``CACHE_STORE`` / ``--store``; docs/scaling.md, "Store"):

* ``memory``: the in-process store (the default; nothing to start);
* ``redis://[user[:password]@]host:port[/db]``: one Redis server;
* ``rediss://...``: the same over TLS (``CACHE_STORE_TLS_CA_FILE``, and
  ``CACHE_STORE_TLS_CERT_FILE`` / ``..._KEY_FILE`` when Redis asks for client certificates);
* ``redis+cluster://host:port`` / ``rediss+cluster://host:port``: Redis Cluster through
  redis-py's ``RedisCluster`` (any node; the others are discovered).

The password may come from ``CACHE_STORE_PASSWORD`` instead of the URL, so it shows in no
command line. The client is redis-py's synchronous one with hiredis' parser: the servicer
already runs every store call on a worker thread (a similarity candidate's verification
costs up to ~90 ms of CPU, which must not hold the event loop), so a blocking client there
needs no hop back to the loop, and its connection pool is thread-safe.

Failures are told apart by what they mean (:func:`classify`):

* the store is unreachable (connection refused or reset, a timeout, a cluster that is down
  or moving its slots): :class:`StoreHealth` skips it for ``STORE_RETRY_S`` (a lookup is a
  miss at once instead of one more timeout each); when the window ends one caller probes
  it while the others keep skipping, and the probe's success closes it again;
* the store refuses a command (``OOM`` on a full Redis, ``READONLY`` on a replica,
  ``NOPERM`` from an ACL, ``WRONGTYPE`` when another program owns the key): the Put is
  dropped and counted by reason in ``splitvl_cache_store_refused_total``, and nothing is
  skipped: reads go on. The replica keeps the refused entry as a local copy it serves;
* a wrong password, ACL user or certificate: the service refuses to start
  (:func:`is_config_error`).

Every command has a bounded socket timeout (``CACHE_STORE_TIMEOUT_S``); a refused or reset
connection is retried twice with jittered exponential backoff (a pooled connection that died
with a restarted server, or that a NAT dropped: ``socket_keepalive`` and
``health_check_interval`` find those before a lookup does); a timeout is not retried.
Failures are logged at most once per operation every ``LOG_EVERY_S`` and counted in
``splitvl_cache_store_errors_total{op}``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from cache_service import metrics
from vlcommon.errors import ConfigError

log = logging.getLogger("cache_service.store")

SCHEMES = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
# After a failure the store is skipped this long (then one call tries it again, or the log
# follower's next read does).
STORE_RETRY_S = 1.0
# At most one log line per operation this often while the store keeps failing.
LOG_EVERY_S = 10.0
# A pooled connection idle this long is checked with a PING before it is used (one a NAT
# or a load balancer dropped silently would otherwise time out a lookup), seconds.
HEALTH_CHECK_INTERVAL_S = 30
# The TTL a volatile-* maxmemory-policy needs to evict entries at all, applied when
# CACHE_TTL_S is 0 (no TTL): one day, seconds.
VOLATILE_DEFAULT_TTL_S = 86_400.0
# Refusals counted by their reply's first word; any other is "other".
REFUSALS = ("OOM", "READONLY", "NOPERM", "WRONGTYPE", "BUSY")
_WRAPPED_REFUSALS = (
    ("used memory > 'maxmemory'", "oom"),
    ("READONLY", "readonly"),
    ("WRONGTYPE", "wrongtype"),
)
_REFUSAL_CLASSES = (
    (OutOfMemoryError, "oom"),
    (ReadOnlyError, "readonly"),
    (NoPermissionError, "noperm"),
)

RedisClient = redis.Redis | RedisCluster
# What a failing store raises: redis-py's errors, and its cluster client's own (not a
# RedisError) when no node of the cluster answers.
STORE_FAILURES: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
# Replies that no retry fixes (a wrong password or user, a refused certificate).
CONFIG_FAILURES = (
    "NOAUTH",
    "WRONGPASS",
    "NOPERM",
    "invalid username-password",
    "certificate verify failed",
)


@dataclass(frozen=True)
class StoreUrl:
    """A parsed ``CACHE_STORE`` URL.

    Attributes:
        url: What redis-py is given (``redis://`` or ``rediss://``).
        tls: ``rediss``.
        cluster: Redis Cluster.
        shown: The URL with its password replaced by ``***`` (for logs).
    """

    url: str
    tls: bool
    cluster: bool
    shown: str


def parse_store_url(text: str) -> StoreUrl | None:
    """None for ``memory``; else the URL.

    Raises:
        ValueError: another scheme, no host, or a database number on a cluster URL.
    """
    if text.strip() == "memory":
        return None
    parts = urlsplit(text.strip())
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"store {text.split(':', 1)[0]!r}:... is not memory, redis://, rediss://, "
            "redis+cluster:// or rediss+cluster://"
        )
    tls, cluster = SCHEMES[parts.scheme]
    if not parts.hostname:
        raise ValueError("the store URL names no host (redis://host:port/db)")
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0: drop the /db of the store URL")
    scheme = "rediss" if tls else "redis"
    url = urlunsplit((scheme, parts.netloc, parts.path, parts.query, ""))
    shown_netloc = parts.netloc
    if parts.password:
        shown_netloc = shown_netloc.replace(f":{parts.password}@", ":***@", 1)
    shown = urlunsplit((parts.scheme, shown_netloc, parts.path, "", ""))
    return StoreUrl(url, tls, cluster, shown)


@dataclass(frozen=True)
class StoreAccess:
    """How to reach the store: URL, credentials, TLS files, timeouts.

    Attributes:
        password: Used when the URL carries none.
        timeout_s: Connect and socket timeout of every command, seconds.
        tls_ca_file: PEM CA of the store's certificate; empty = the system's roots.
        tls_cert_file: PEM client certificate (Redis ``tls-auth-clients``); needs the key.
        tls_key_file: PEM key of ``tls_cert_file``.
    """

    url: StoreUrl
    password: str = ""
    timeout_s: float = 0.5
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def connect(self, blocking_s: float = 0.0) -> RedisClient:
        """A client (standalone: connects lazily; cluster: reads the slot map now);
        ``blocking_s``: the longest blocking command it sends, added to its socket timeout.

        Raises:
            redis.RedisError: a cluster node could not be reached.
        """
        kwargs: dict[str, Any] = {
            "socket_timeout": self.timeout_s + blocking_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(
                ExponentialWithJitterBackoff(base=0.005, cap=0.05),
                2,
                supported_errors=(redis.ConnectionError,),
            ),
            "client_name": "splitvl-cache",
            "socket_keepalive": True,
            "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        }
        if self.password and not urlsplit(self.url.url).password:
            kwargs["password"] = self.password
        if self.url.tls:
            kwargs["ssl_ca_certs"] = self.tls_ca_file or None
            kwargs["ssl_certfile"] = self.tls_cert_file or None
            kwargs["ssl_keyfile"] = self.tls_key_file or None
        if self.url.cluster:
            return RedisCluster.from_url(self.url.url, **kwargs)
        return redis.Redis.from_url(self.url.url, **kwargs)


def is_config_error(err: Exception) -> bool:
    """True for errors a retry cannot fix: a wrong password or ACL user, a store
    certificate the configured CA does not sign."""
    if isinstance(err, AuthenticationError):
        return True
    text = str(err)
    return any(marker in text for marker in CONFIG_FAILURES)


def classify(err: BaseException) -> tuple[str, str]:
    """What a store failure means (module docstring): ``("config", reason)``,
    ``("refused", reason)`` (a command the store answered with an error) or
    ``("unavailable", reason)``; the reason is a short lower-case word for metrics."""
    if isinstance(err, Exception) and is_config_error(err):
        return "config", "auth"
    if isinstance(err, (ClusterError, TryAgainError, RedisClusterException)):
        return "unavailable", "cluster"
    if isinstance(err, ResponseError):
        # redis-py strips the first word of the replies it has a class for.
        for cls, reason in _REFUSAL_CLASSES:
            if isinstance(err, cls):
                return "refused", reason
        text = str(err)
        word = text.split(" ", 1)[0].upper()
        if word in REFUSALS:
            return "refused", word.lower()
        # A command refused inside a transaction (EXEC) comes back wrapped in redis-py's
        # "Command # n (...) of pipeline caused error: ..." with the reason in words.
        for phrase, reason in _WRAPPED_REFUSALS:
            if phrase in text:
                return "refused", reason
        return "refused", "other"
    if isinstance(err, redis.TimeoutError):
        return "unavailable", "timeout"
    return "unavailable", "connection"


def eviction_policy(client: RedisClient, ttl_s: float, shown: str) -> tuple[float, list[str]]:
    """Check the store's byte budget on every primary through ``INFO memory`` (which
    managed services answer; ``CONFIG`` they refuse).

    Sound: a ``maxmemory`` with an ``allkeys-*`` policy, or a ``volatile-*`` one while
    entries carry a TTL. A ``volatile-*`` policy with ``ttl_s`` 0 would never evict an
    entry (a full store then refuses every Put): entries get
    :data:`VOLATILE_DEFAULT_TTL_S` instead, and a warning says so.

    Returns:
        ``(the TTL entries get, seconds, warnings)``.

    Raises:
        ConfigError: ``maxmemory`` with ``noeviction``: once full, the store refuses every
            Put for good; the message names the setting to change.
    """
    try:
        raw: Any = client.info("memory", **_primaries(client))
    except redis.RedisError as err:
        return ttl_s, [f"could not read INFO memory ({err}); the eviction policy is not checked"]
    nodes = list(raw.values()) if raw and isinstance(next(iter(raw.values())), dict) else [raw]
    warnings: set[str] = set()
    for node in nodes:
        policy = _text(node.get("maxmemory_policy", ""))
        maxmemory = int(node.get("maxmemory", 0) or 0)
        if maxmemory == 0:
            warnings.add(
                "the store has no maxmemory: it grows until its host runs out of memory; "
                "set maxmemory and maxmemory-policy allkeys-lru"
            )
        elif policy == "noeviction":
            raise ConfigError(
                f"the cache store {shown} has maxmemory-policy noeviction: once full it "
                "refuses every Put for good; set maxmemory-policy allkeys-lru (or "
                "volatile-lru with CACHE_TTL_S)"
            )
        elif policy.startswith("volatile-") and ttl_s <= 0:
            warnings.add(
                f"the store's maxmemory-policy is {policy}, which evicts only keys with a "
                f"TTL, and CACHE_TTL_S is 0: entries get a TTL of {VOLATILE_DEFAULT_TTL_S:.0f} s "
                "so they can be evicted (set CACHE_TTL_S, or use allkeys-lru)"
            )
            ttl_s = VOLATILE_DEFAULT_TTL_S
    return ttl_s, sorted(warnings)


def _primaries(client: RedisClient) -> dict[str, Any]:
    """``target_nodes`` for a command every primary of a cluster must answer."""
    return {"target_nodes": RedisCluster.PRIMARIES} if isinstance(client, RedisCluster) else {}


def as_bytes(value: object) -> bytes | None:
    """A reply of a client made with ``decode_responses=False``: bytes, or None."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"unexpected reply from the store: {type(value).__name__}")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StoreHealth:
    """Whether to try the store now, and the log lines and counts of its failures.

    Args:
        retry_s: Seconds the store is skipped after a failure.
        log_every_s: Seconds between two log lines about one operation.
        clock: Monotonic clock, seconds.
    """

    def __init__(
        self,
        retry_s: float = STORE_RETRY_S,
        log_every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retry_s = retry_s
        self.log_every_s = log_every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self._down = False
        self._logged: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._down

    def allow(self, op: str) -> bool:
        """True to try the store; False (counted as an error of ``op``) while it is
        skipped. When a skip window ends, one caller (the probe) gets True and the others
        keep skipping until the probe's answer, or for another window if it never comes."""
        if not self._down:
            return True
        with self._lock:
            now = self.clock()
            if now >= self._skip_until:
                self._skip_until = now + self.retry_s  # the probe's own window
                return True
        metrics.STORE_ERRORS.labels(op=op).inc()
        return False

    def failed(self, op: str, err: BaseException, *, skip: bool = True) -> str:
        """Count and log (rate-limited) a failure of ``op``; returns what it meant
        (:func:`classify`: ``unavailable``, ``refused`` or ``config``).

        Unavailable: the store is skipped for ``retry_s``, unless ``skip`` is False (the
        log follower's failures: a late blocking read on a loaded host says less about the
        store than a lookup's own failure; they are counted and logged only). Refused:
        the store answered, so it is up; counted by reason in
        ``splitvl_cache_store_refused_total``, nothing skipped."""
        kind, reason = classify(err)
        if kind == "refused":
            metrics.STORE_REFUSED.labels(op=op, reason=reason).inc()
            self._log(
                f"refused:{op}:{reason}",
                f"cache store refused {op} ({err}); dropped, counted in "
                f'splitvl_cache_store_refused_total{{reason="{reason}"}}; reads go on',
            )
            self.ok()
            return kind
        metrics.STORE_ERRORS.labels(op=op).inc()
        with self._lock:
            now = self.clock()
            self.failures += 1
            if skip:
                self._skip_until = now + self.retry_s
                self._down = True
            if now - self._logged.get(op, -1e18) < self.log_every_s:
                self._quiet[op] = self._quiet.get(op, 0) + 1
                quiet = -1
            else:
                self._logged[op] = now
                quiet = self._quiet.pop(op, 0)
        if skip:
            metrics.STORE_UP.set(0)
        if quiet >= 0:
            log.warning(
                "cache store %s failed (%s: %s)%s; %s",
                op,
                type(err).__name__,
                err,
                f" and {quiet} more since the last report" if quiet else "",
                "lookups answer misses and puts are dropped until it answers"
                if skip
                else "following resumes when it answers",
            )
        return kind

    def ok(self) -> None:
        """The store answered: use it again."""
        if not self._down:
            return
        with self._lock:
            if not self._down:
                return
            self._down = False
            self._skip_until = 0.0
            self._logged.clear()
            self._quiet.clear()
        metrics.STORE_UP.set(1)
        log.info("cache store answers again; caching resumes")

    def warn(self, what: str, message: str) -> None:
        """A log line about ``what`` (an integrity failure), at most one every
        ``log_every_s`` per ``what``."""
        self._log(what, message)

    def _log(self, what: str, message: str) -> None:
        with self._lock:
            now = self.clock()
            if now - self._logged.get(what, -1e18) < self.log_every_s:
                return
            self._logged[what] = now
        log.warning("%s", message)


def config_error(err: Exception, shown: str) -> ConfigError:
    """The ConfigError a service refuses to start with for ``err`` (see is_config_error)."""
    return ConfigError(f"the cache store {shown} refused this service: {err}")
