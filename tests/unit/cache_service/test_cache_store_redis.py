"""The cache's shared Redis store, one replica at a time: what it serves and what it refuses.

A real ``redis-server`` (Debian's) on a free loopback port with a password and a temporary
directory, no mocks: entries round-trip with their bytes, dtype, shape and grid; a byte
changed in Redis, an entry copied under another key's name, or one written under another
secret is a miss and a metric, never served; Redis holds no image, embedding or key in the
clear; a store needs a secret; Redis's TTL and its maxmemory eviction make misses and the
vector leaves the index; the eviction policy is read from INFO (noeviction refused), and a
full store's refused Puts are dropped while reads go on; a store that is down or hung
answers from the replica's own copies within its timeouts, a Put through the servicer is
dropped without an error, and caching resumes when the store returns.
tests/unit/cache_service/test_cache_store_redis_replicas.py covers several replicas.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY
from pydantic import ValidationError
from qwenvl.common.v1 import tensor_pb2

from cache_service.entries import KeyGridConflictError, StoreUnavailableError
from cache_service.settings import CacheSettings
from cache_service.store_codec import VERSION, StoreCodec
from cache_service.store_conn import VOLATILE_DEFAULT_TTL_S, StoreAccess, parse_store_url
from cache_service.store_redis import RedisStore
from vlcommon.errors import ConfigError
from vlcommon.verification import VerificationImage

DIM = 16
GRID = (1, 4, 4)  # 4 rows after the 2x2 merge
PASSWORD = "redis-test-password"
SECRET = "cluster-internal-token"
FP32 = tensor_pb2.DATA_TYPE_FP32
# A verification image that passes against itself (tests/unit/cache_service/test_cache_store.py's
# V).
V = VerificationImage(np.full((1, 4), 128, np.uint8), np.full((1, 2, 2), 128, np.uint8))
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 with ``requirepass``, its data in ``root``,
    stopped (and startable again on the same port) by the test."""

    def __init__(self, root: Path, *extra: str, password: str = PASSWORD) -> None:
        self.root = root
        self.port = free_port()
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        return [
            REDIS_SERVER,
            "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", self.password,
            "--dir", str(self.root), "--save", "", "--appendonly", "no",
            *self.extra,
        ]  # fmt: skip

    def start(self) -> RedisServer:
        log = open(self.root / "redis.log", "ab")  # noqa: SIM115 - the server writes it
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError((self.root / "redis.log").read_text()[-2000:]) from None
                time.sleep(0.02)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@contextlib.contextmanager
def redis_server(root: Path, *extra: str) -> Iterator[RedisServer]:
    server = RedisServer(root, *extra).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the module; each test keys its entries under its own prefix."""
    with redis_server(tmp_path_factory.mktemp("redis")) as s:
        yield s


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"t-{request.node.name}:"


STORES: list[RedisStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while STORES:
        STORES.pop().close()


def replica(
    server: RedisServer,
    prefix: str,
    *,
    follow: bool = True,
    secret: str = SECRET,
    url: str = "",
    **kw: object,
) -> RedisStore:
    """A started replica's store (closed after the test)."""
    args: dict[str, object] = {"descriptor_dim": DIM, "capacity_bytes": 10**7, "prefix": prefix}
    timeout_s = float(kw.pop("timeout_s", 1.0))  # type: ignore[arg-type]
    tls = {k: str(kw.pop(k)) for k in ("tls_ca_file", "tls_cert_file", "tls_key_file") if k in kw}
    args.update(kw)
    access = StoreAccess(parse_store_url(url or server.url), timeout_s=timeout_s, **tls)  # type: ignore[arg-type]
    store = RedisStore(access, secret=secret, **args)  # type: ignore[arg-type]
    STORES.append(store)
    store.start(follow=follow)
    return store


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, seed: int = 99) -> np.ndarray:
    """A unit vector with cosine similarity ~0.99 to ``v``."""
    r = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    r -= r.dot(v) * v
    r /= np.linalg.norm(r)
    return (0.99 * v + np.sqrt(1 - 0.99**2) * r).astype(np.float32)


def payload(i: int, rows: int = 4, width: int = 4) -> bytes:
    """Entry i's embeddings: every value encodes i, so a mixed-up read shows."""
    return (
        np.full((rows, width), float(i), np.float32) + np.arange(width, dtype=np.float32)
    ).tobytes()


def put(store: RedisStore, i: int, *, key: str = "", **kw: object) -> int:
    return store.put(
        key or f"k{i}",
        unit(i),
        GRID,
        FP32,
        (4, 4),
        payload(i),
        verification=V,
        **kw,  # type: ignore[arg-type]
    )


def exact(store: RedisStore, key: str, grid: tuple[int, int, int] = GRID) -> bytes | None:
    m = store.lookup(key, None, grid, similar=False)
    return None if m.entry is None else m.entry.data


def similar(store: RedisStore, i: int, revision: str = "") -> str | None:
    m = store.lookup("query", near(unit(i)), GRID, similar=True, verification=V, revision=revision)
    return None if m.entry is None else m.entry.key


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def integrity(reason: str) -> float:
    return metric("splitvl_cache_store_integrity_failures_total", reason=reason)


def test_memory_is_the_default_and_store_urls_parse() -> None:
    from cache_service.__main__ import build_store
    from cache_service.store import EmbeddingStore

    assert CacheSettings().store == "memory"
    assert type(build_store(CacheSettings(descriptor_dim=DIM))) is EmbeddingStore
    url = parse_store_url("rediss://cache:s3cret@redis.internal:6380/2")
    assert url is not None and url.tls and not url.cluster
    assert url.url == "rediss://cache:s3cret@redis.internal:6380/2"
    assert "s3cret" not in url.shown and ":***@" in url.shown
    cluster = parse_store_url("redis+cluster://10.0.0.5:7000")
    assert cluster is not None and cluster.cluster and cluster.url == "redis://10.0.0.5:7000"
    for bad in ("mooncake://x:1", "redis://", "redis+cluster://h:1/3", "memcached://h:1"):
        with pytest.raises(ValidationError):
            CacheSettings(store=bad)


def test_a_fresh_replica_serves_exact_alias_and_similar_hits_from_the_store(
    server: RedisServer, prefix: str
) -> None:
    a = replica(server, prefix, follow=False)
    assert put(a, 1, alias="file-digest-1") == 0
    put(a, 2)
    c = replica(server, prefix, follow=False)  # its index comes from the scan alone
    assert len(c.catalog) == 2
    read = metric("splitvl_cache_store_bytes_total", direction="read")
    m = c.lookup("k1", None, GRID, similar=False)
    assert m.tier == "exact" and m.entry is not None
    assert (m.entry.data, m.entry.dtype, m.entry.shape, m.entry.grid) == (
        payload(1),
        FP32,
        (4, 4),
        GRID,
    )
    first_read = metric("splitvl_cache_store_bytes_total", direction="read") - read
    assert first_read >= len(payload(1))
    assert exact(c, "k1") == payload(1)  # again: from its local copy, the header only
    assert metric("splitvl_cache_store_bytes_total", direction="read") - read == first_read
    assert exact(c, "file-digest-1") == payload(1)  # the alias
    assert exact(c, "k1", grid=(1, 4, 8)) is None  # another grid: never another plan's
    assert similar(c, 2) == "k2" and similar(c, 1) == "k1"
    assert similar(c, 2, revision="another checkpoint") is None
    assert exact(c, "k3") is None and similar(c, 3) is None
    c.check_invariants()


def tamper(server: RedisServer, prefix: str, key: str, field: str, at: int = -1) -> None:
    """Flip one byte of an entry's field (``p``: its payload string) in Redis."""
    codec, client = StoreCodec(SECRET, prefix), server.client()
    if field == "p":
        name = codec.payload(key)
        value = bytearray(client.get(name))  # type: ignore[arg-type]
        value[at] ^= 0x01
        client.set(name, bytes(value))
        return
    name = codec.entry(key)
    value = bytearray(client.hget(name, field))  # type: ignore[arg-type]
    value[at] ^= 0x01
    client.hset(name, field, bytes(value))


@pytest.mark.parametrize(
    ("field", "at", "reason", "tier", "counted"),
    [
        ("p", -1, "field", "exact", 1),  # the embeddings: refused at the hit (read twice)
        ("h", 30, "mac", "exact", 2),  # the header: by the scan, then the hit
        ("h", 9, "mac", "exact", 2),  # the write id in its clear prefix: the same
        ("v", -1, "field", "similar", 1),  # the verification image: at the candidate
        ("d", 0, "field", "scan", 1),  # the descriptor: by the scan
    ],
)
def test_one_tampered_byte_is_a_miss_and_a_metric_never_served(
    server: RedisServer, prefix: str, field: str, at: int, reason: str, tier: str, counted: int
) -> None:
    a = replica(server, prefix, follow=False)
    put(a, 1)
    tamper(server, prefix, "k1", field, at)
    before = integrity(reason)
    c = replica(server, prefix, follow=False)  # no local copy: it reads the store
    if tier == "scan":  # the scan refuses to index it; the exact tier reads h and p only
        assert len(c.catalog) == 0 and similar(c, 1) is None
    elif tier == "exact":
        assert exact(c, "k1") is None and similar(c, 1) is None
    else:
        assert similar(c, 1) is None and len(c.catalog) == 0  # it left the index
    assert integrity(reason) == before + counted
    if field == "h":  # the replica that wrote it (with a local copy) refuses it too
        assert exact(a, "k1") is None
    put(a, 1)  # a Put of the key writes it again: served again
    assert exact(c, "k1") == payload(1)


def test_an_entry_under_another_keys_name_is_a_key_collision_and_a_miss(
    server: RedisServer, prefix: str
) -> None:
    a = replica(server, prefix, follow=False)
    put(a, 1, alias="alias-1")
    client, keys = server.client(), StoreCodec(SECRET, prefix)
    # What a collision of two keys' store names, or an attacker moving entries, looks like.
    client.hset(keys.entry("k2"), mapping=client.hgetall(keys.entry("k1")))  # type: ignore[arg-type]
    client.set(keys.alias("alias-2"), client.get(keys.alias("alias-1")))  # type: ignore[arg-type]
    before, mac = integrity("key"), integrity("mac")
    c = replica(server, prefix, follow=False)
    assert integrity("key") == before + 1  # the scan found k1's entry under k2's name
    assert len(c.catalog) == 1
    assert exact(c, "k2") is None and exact(c, "alias-2") is None
    assert integrity("key") == before + 2
    assert integrity("mac") == mac + 1  # an alias record opens only under its own name
    assert exact(c, "k1") == payload(1) and exact(c, "alias-1") == payload(1)


def test_redis_holds_no_image_embedding_or_key_in_the_clear_and_forgeries_are_misses(
    server: RedisServer, prefix: str
) -> None:
    a = replica(server, prefix, follow=False)
    rng = np.random.default_rng(7)
    luma = rng.integers(0, 256, (32, 48), dtype=np.uint8)
    image = VerificationImage(luma, rng.integers(0, 256, (16, 24, 2), dtype=np.uint8))
    data = rng.standard_normal((4, 4)).astype(np.float32).tobytes()
    key = "0f" * 32
    a.put(key, unit(1), GRID, FP32, (4, 4), data, verification=image, alias="alias-of-" + key)
    client = server.client()
    names = [n for n in client.keys(f"{prefix}*")]  # type: ignore[union-attr]
    assert len(names) == 4  # the entry, its payload, the alias, the log
    dump = b"".join(client.dump(n) or b"" for n in names)  # type: ignore[misc]
    for n in names:
        if client.type(n) == b"hash":
            dump += b"".join(k + v for k, v in client.hgetall(n).items())  # type: ignore[union-attr]
    for secret_bytes in (data, data[:16], luma.tobytes()[:16], unit(1).tobytes()[:16]):
        assert secret_bytes not in dump
    assert key.encode() not in dump and b"alias-of" not in dump
    codec = StoreCodec(SECRET, prefix)
    sealed: bytes = client.hget(codec.entry(key), "h")  # type: ignore[assignment]
    assert sealed[0] == VERSION and sealed[1:5] == codec.key_id
    assert codec.open_header(sealed, key).grid == GRID
    # Whoever holds the Redis password but not the secret: another key id, other names.
    forger = StoreCodec("a guess at the secret", prefix)
    assert forger.entry(key) != codec.entry(key) and forger.key_id != codec.key_id
    _, fields = forger.seal(
        key="k9", revision="", grid=GRID, dtype=FP32, shape=(4, 4), payload=payload(9),
        descriptor=unit(9), verification=V, written_ms=0,
    )  # fmt: skip
    client.hset(codec.entry("k9"), mapping=fields)  # planted under the name it would need
    forged_kid = bytes([VERSION]) + codec.key_id + fields["h"][5:]  # the right key id
    client.hset(codec.entry("k8"), mapping={**fields, "h": forged_kid})
    before = integrity("mac")
    c = replica(server, prefix, follow=False)
    assert len(c.catalog) == 1  # the scan indexed only the real entry
    assert exact(c, "k9") is None and exact(c, "k8") is None
    assert similar(c, 9) is None
    assert integrity("mac") >= before + 2  # k8 (scan, then lookup); k9 is another key id
    other = replica(server, prefix, follow=False, secret="another cluster's secret")
    assert len(other.catalog) == 0 and exact(other, key) is None and similar(other, 1) is None
    assert exact(c, key) == data


def test_a_store_needs_a_secret_unless_the_development_opt_in(
    server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    for secret in ("", "  "):
        with pytest.raises(ConfigError, match="CACHE_STORE_SECRET"):
            replica(server, prefix, follow=False, secret=secret)
    open_store = replica(server, prefix, follow=False, secret="", allow_no_secret=True)
    put(open_store, 1)
    assert exact(open_store, "k1") == payload(1)
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    settings = CacheSettings(store=server.url, store_secret_file=str(path), internal_token="t")
    assert settings.secret() == "from-a-file"
    assert CacheSettings(store=server.url, internal_token="t").secret() == "t"
    with pytest.raises(ConfigError, match="CACHE_STORE_SECRET_FILE"):
        CacheSettings(store=server.url, store_secret_file=str(tmp_path / "none")).secret()


def test_ttl_expiry_is_a_miss_and_the_vector_leaves_the_index(
    server: RedisServer, prefix: str
) -> None:
    a = replica(server, prefix, follow=False, ttl_s=0.4)
    put(a, 1, alias="alias-1")
    client = server.client()
    assert 0 < client.pttl(StoreCodec(SECRET, prefix).entry("k1")) <= 400  # type: ignore[operator]
    assert 0 < client.pttl(StoreCodec(SECRET, prefix).alias("alias-1")) <= 400  # type: ignore[operator]
    assert exact(a, "k1") == payload(1) and similar(a, 1) == "k1"
    time.sleep(0.5)
    dropped = metric("splitvl_cache_store_dropped_total", found="read")
    assert len(a.catalog) == 1
    assert exact(a, "k1") is None and exact(a, "alias-1") is None  # the local copy too
    assert similar(a, 1) is None  # no error: a miss, and the vector is gone
    assert len(a.catalog) == 0 and len(a.local) == 0
    assert metric("splitvl_cache_store_dropped_total", found="read") == dropped + 1
    a.check_invariants()


def test_entries_redis_evicts_become_misses_and_leave_the_index(tmp_path: Path) -> None:
    with redis_server(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru") as s:
        a = replica(s, "ev:", follow=False)
        rows, n = 8192, 24  # 128 KiB entries: 3 MiB in all, over what 4 MiB leaves
        for i in range(n):
            a.put(f"k{i}", unit(i), GRID, FP32, (rows, 4), payload(i, rows), verification=V)
        codec = StoreCodec(SECRET, "ev:")
        held = [
            i
            for i in range(n)
            if s.client().exists(codec.entry(f"k{i}"), codec.payload(f"k{i}")) == 2
        ]
        assert 0 < len(held) < n, held  # Redis evicted some (hash, payload or both)
        c = replica(s, "ev:", follow=False)  # a replica that has no local copies
        for i in range(n):  # every lookup is a hit with the right bytes or a miss
            m = c.lookup(f"k{i}", None, GRID, similar=False)
            assert (m.entry.data if m.entry else None) == (
                payload(i, rows) if i in held else None
            ), i
        gone = next(i for i in range(n) if i not in held)
        assert f"k{gone}" in a.catalog
        assert similar(a, gone) in (None, *(f"k{i}" for i in held))
        assert f"k{gone}" not in a.catalog  # left at its first failed read
        a.follower.sync(a.client())  # the scan removes the rest
        assert sorted(a.catalog.keys()) == sorted(f"k{i}" for i in held)
        a.check_invariants()


def test_a_key_held_with_another_grid_is_refused_and_kept(server: RedisServer, prefix: str) -> None:
    a = replica(server, prefix, follow=False)
    put(a, 1)
    with pytest.raises(KeyGridConflictError) as err:
        a.put("k1", unit(1), (1, 4, 8), FP32, (8, 4), payload(1, 8))
    assert err.value.stored_grid == GRID
    c = replica(server, prefix, follow=False)
    assert exact(c, "k1") == payload(1)


def test_a_wrong_password_refuses_to_start(server: RedisServer, prefix: str) -> None:
    url = server.url.replace(PASSWORD, "wrong")
    with pytest.raises(ConfigError, match="WRONGPASS|invalid|password"):
        replica(server, prefix, url=url)


def test_the_eviction_policy_is_read_from_info_and_noeviction_refused(
    server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cache_service.store")
    replica(server, prefix, follow=False)
    assert "no maxmemory" in caplog.text
    client = server.client()
    client.config_set("maxmemory", "512mb")
    try:
        with pytest.raises(ConfigError, match="maxmemory-policy noeviction"):
            replica(server, prefix, follow=False)
        client.config_set("maxmemory-policy", "volatile-lru")
        caplog.clear()
        store = replica(server, prefix, follow=False)
        assert "volatile-lru" in caplog.text and store.ttl_s == VOLATILE_DEFAULT_TTL_S
        put(store, 1)
        assert 0 < client.pttl(StoreCodec(SECRET, prefix).entry("k1")) / 1000 <= store.ttl_s  # type: ignore[operator]
        assert replica(server, prefix, follow=False, ttl_s=60.0).ttl_s == 60.0
        client.config_set("maxmemory-policy", "allkeys-lru")
        caplog.clear()
        assert replica(server, prefix, follow=False).ttl_s == 0
        assert "maxmemory" not in caplog.text
    finally:
        client.config_set("maxmemory", "0")
        client.config_set("maxmemory-policy", "noeviction")


def test_a_full_managed_redis_refuses_puts_and_repeats_still_hit(tmp_path: Path) -> None:
    """A managed Redis: volatile-lru, a small maxmemory, CONFIG renamed away, filled past its
    limit by another tenant's keys (no TTL: never evicted). Every Put is refused with OOM:
    dropped and counted, reads go on, and each replica serves the copies it kept."""
    args = ("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru")
    with redis_server(tmp_path, *args, "--rename-command", "CONFIG", '""') as s:
        client = s.client()
        with pytest.raises(redis.ResponseError):
            client.config_get("maxmemory")
        a = replica(s, "full:", follow=False)
        assert a.ttl_s == VOLATILE_DEFAULT_TTL_S  # read from INFO memory, not CONFIG
        put(a, 1)
        assert exact(replica(s, "full:", follow=False), "k1") == payload(1)
        codec = StoreCodec(SECRET, "full:")
        # An entry that does not open, which the next Put of its key replaces.
        client.hset(codec.entry("k2"), mapping={"h": b"not an entry"})
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):  # another tenant, without TTLs
                client.set(f"tenant:{i}", b"x" * 4096)
        oom = metric("splitvl_cache_store_refused_total", op="put", reason="oom")
        errors = metric("splitvl_cache_store_errors_total", op="lookup")
        rows = 4096
        for i in range(2, 6):
            a.put(f"k{i}", unit(i), GRID, FP32, (rows, 4), payload(i, rows), verification=V)
        assert metric("splitvl_cache_store_refused_total", op="put", reason="oom") >= oom + 3
        # Refused, not written past maxmemory (a replacing write included).
        assert not any(client.exists(codec.entry(f"k{i}")) for i in range(3, 6))
        assert client.hget(codec.entry("k2"), "p") is None
        assert not a.health.down
        for i in range(2, 6):  # the repeats: exact hits from the copies a kept
            assert exact(a, f"k{i}") == payload(i, rows), i
        b = replica(s, "full:", follow=False)  # a replica without those copies: misses
        assert exact(b, "k2") is None and not b.health.down
        assert metric("splitvl_cache_store_errors_total", op="lookup") == errors
        a.check_invariants()


def test_a_store_down_or_hung_is_misses_then_caching_resumes(tmp_path: Path) -> None:
    s = RedisServer(tmp_path).start()
    try:
        a = replica(s, "down:", timeout_s=0.3)
        put(a, 1)
        errors = metric("splitvl_cache_store_errors_total", op="lookup")
        s.stop()
        for i in range(3):  # within the 0.3 s timeout (then skipped at once): the copy
            t0 = time.perf_counter()  # this replica put is served, nothing else
            assert exact(a, "k1") == payload(1) and similar(a, 1) is None
            assert exact(a, "k9") is None
            assert time.perf_counter() - t0 < 0.7, i
        with pytest.raises(StoreUnavailableError):
            put(a, 2)
        assert metric("splitvl_cache_store_errors_total", op="lookup") >= errors + 9
        assert metric("splitvl_cache_store_up") == 0
        s.start()  # the same port, empty (no persistence): caching resumes, no restart
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(StoreUnavailableError):
                put(a, 2)
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert exact(a, "k2") == payload(2) and similar(a, 2) == "k2"
        assert exact(a, "k1") is None  # the restarted store lost it: a miss, it left the index
        assert "k1" not in a.catalog
        assert metric("splitvl_cache_store_up") == 1
        os.kill(s.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]  # hung, not dead
        try:
            t0 = time.perf_counter()
            assert exact(a, "k3") is None
            assert time.perf_counter() - t0 < 1.0
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    finally:
        s.stop()


def test_the_minimal_acl_user_of_docs_security_is_enough(server: RedisServer, prefix: str) -> None:
    """docs/security.md's ACL user: every store operation works with those commands on the
    prefix's keys, and a command it lacks is a refusal counted, never a stopped read."""
    import re

    text = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text()
    rule = re.search(r"`ACL SETUSER splitvl on >PASSWORD (.*?)`", text, re.S)
    assert rule is not None
    rules = rule.group(1).split()
    rules = [r.replace("~splitvl:*", f"~{prefix}*") for r in rules]
    client = server.client()
    client.execute_command("ACL", "SETUSER", "splitvl", "reset", "on", ">acl-pass", *rules)
    url = f"redis://splitvl:acl-pass@127.0.0.1:{server.port}/0"
    a, b = replica(server, prefix, url=url), replica(server, prefix, url=url)
    put(a, 1, alias="alias-1")
    put(b, 1)  # the second write of a key: a refresh
    assert exact(b, "k1") == payload(1) and exact(b, "alias-1") == payload(1)
    deadline = time.monotonic() + 5
    while similar(b, 1) != "k1":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert replica(server, prefix, url=url, follow=False).catalog.keys() == ["k1"]
    client.execute_command("ACL", "SETUSER", "splitvl", "-hset")  # one command less
    refused = metric("splitvl_cache_store_refused_total", op="put", reason="noperm")
    put(a, 2)
    assert metric("splitvl_cache_store_refused_total", op="put", reason="noperm") == refused + 1
    assert exact(a, "k2") == payload(2) and exact(b, "k1") == payload(1)
    assert not a.health.down


def test_what_is_not_an_entry_of_this_secret_is_skipped_not_read_or_counted(
    server: RedisServer, prefix: str
) -> None:
    """Keys the scan meets that are no entry of this secret: another type under an entry's
    name (another program, or a cluster whose prefix extends this one), entries of
    another secret or of the previous format. The scan skips each alone, indexes the rest,
    and counts no integrity failure for keys it was never meant to read."""
    a = replica(server, prefix, follow=False)
    put(a, 1)
    codec, client = StoreCodec(SECRET, prefix), server.client()
    client.set(codec.entry("junk-string"), b"x")
    client.xadd(codec.entry("junk-stream"), {"n": b"x"})
    client.hset(f"{prefix}e:{'0' * 32}", mapping={"h": b"an entry of the old format"})
    other = StoreCodec("another cluster's secret", prefix)
    _, fields = other.seal(
        key="k2", revision="", grid=GRID, dtype=FP32, shape=(4, 4), payload=payload(2),
        descriptor=unit(2), verification=V, written_ms=0,
    )  # fmt: skip
    client.hset(other.entry("k2"), mapping=fields)
    counted = {r: integrity(r) for r in ("mac", "key_id", "key", "field", "format")}
    b = replica(server, prefix)  # the scan at start, then the log
    assert b.catalog.keys() == ["k1"] and not b.health.down
    put(a, 3)
    deadline = time.monotonic() + 5
    while similar(b, 3) != "k3":  # following the log goes on
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert {r: integrity(r) for r in counted} == counted
    client.xadd(codec.log, {"n": b"\xff\xfe not a name"})  # a log message not ours
    put(a, 4)
    deadline = time.monotonic() + 5
    while similar(b, 4) != "k4":
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_payload_redis_evicted_alone_is_a_miss_and_written_again(
    server: RedisServer, prefix: str
) -> None:
    """Under allkeys-lru Redis may evict an entry's payload string and keep its hash: a
    miss (no integrity failure), the rest dropped, and the next Put writes it again."""
    a = replica(server, prefix, follow=False)
    put(a, 1)
    codec = StoreCodec(SECRET, prefix)
    server.client().delete(codec.payload("k1"))
    counted = {r: integrity(r) for r in ("mac", "field", "key", "format")}
    c = replica(server, prefix, follow=False)
    assert exact(c, "k1") is None
    assert {r: integrity(r) for r in counted} == counted
    assert not server.client().exists(codec.entry("k1"))  # dropped: the next Put writes
    put(a, 1)
    assert exact(c, "k1") == payload(1)


def test_an_alias_is_written_once_and_a_short_secret_refused(
    server: RedisServer, prefix: str
) -> None:
    a = replica(server, prefix, follow=False)
    put(a, 1, alias="alias-1")
    name = StoreCodec(SECRET, prefix).alias("alias-1")
    record = server.client().get(name)
    c = replica(server, prefix, follow=False)
    for _ in range(3):  # hits with the alias as the query's alias: no rewrite
        m = c.lookup("k1", None, GRID, similar=False, alias="alias-1")
        assert m.entry is not None
    assert server.client().get(name) == record
    with pytest.raises(ConfigError, match="at least 16"):
        replica(server, prefix, follow=False, secret="short-secret")


def test_a_command_refused_at_start_refuses_the_start(server: RedisServer, prefix: str) -> None:
    client = server.client()
    client.execute_command(
        "ACL", "SETUSER", "no-client", "reset", "on", ">pw", f"~{prefix}*", "+@all", "-client"
    )
    url = f"redis://no-client:pw@127.0.0.1:{server.port}/0"
    with pytest.raises(ConfigError, match="refused this service"):
        replica(server, prefix, url=url)
