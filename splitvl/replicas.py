"""``splitvl up --replicas decoder=2,cache=2,encoder=2 [--store redis | redis://...]``.

Several replicas of the gateway, encoder, cache and decoder on one host:

* ports and logs follow the layout of :mod:`splitvl.ports` (replica r of a service:
  :data:`~splitvl.ports.PORT_STRIDE` x (r - 1) above replica 1; logs ``decoder-1.log``,
  ``decoder-2.log``), which :func:`layout_lines` prints at start;
* the gateway replicas share the base port and the HTTP port (``SO_REUSEPORT``), each
  with a port of its own for its health probe (:mod:`splitvl.ports`); every one builds
  the same affinity rings, so an image's calls go to the same decoder and cache whichever
  gateway takes them;
* the gateway gets each replicated service as grpc's address list
  (``--decoder-address ipv4:127.0.0.1:P1,127.0.0.1:P2``, :meth:`Ports.target`);
* the cache replicas share a store (``CACHE_STORE``): two caches with their own in-process
  entries would each miss what the other holds, so ``cache=2`` without a shared store is
  refused (:func:`check_store`); ``--store redis`` starts a local ``redis-server``
  (:mod:`splitvl.redis_server`), ``--store redis://...`` names one that runs elsewhere;
* on a CPU host the decoders' vLLM workers are bound to cores of their own where there
  are enough (:func:`decoder_cores`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from splitvl import private_file
from splitvl.errors import LaunchConfigError
from splitvl.ports import REPLICATED, SERVICES, Ports, service_of
from splitvl.redis_server import DEFAULT_MAXMEMORY, RedisServer, redis_binary
from vlcommon.cpus import format_cpu_list, parse_cpu_list

#: ``--store`` values that are not URLs: the cache's own in-process store (the default),
#: and a local redis-server that ``up`` starts.
STORE_MEMORY = "memory"
STORE_LOCAL_REDIS = "redis"


def parse_replicas(text: str) -> dict[str, int]:
    """``--replicas``: ``decoder=2,cache=2,encoder=2`` -> ``{"decoder": 2, ...}``.

    Raises:
        argparse.ArgumentTypeError: an unknown or repeated service, or a count that is
            not an integer >= 1.
    """
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.partition("=")
        name = name.strip()
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not SERVICE=COUNT")
        if name not in SERVICES:
            raise argparse.ArgumentTypeError(
                f"{name!r} is not a service that takes replicas ({', '.join(SERVICES)})"
            )
        if name in out:
            raise argparse.ArgumentTypeError(f"{name} is given twice")
        try:
            value = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={count}: not an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name}={value}: at least 1")
        out[name] = value
    if not out:
        raise argparse.ArgumentTypeError("no SERVICE=COUNT given")
    return out


def store_spec(text: str) -> str:
    """``--store``: ``memory``, ``redis`` or a store URL (``redis://``, ``rediss://``,
    ``redis+cluster://``, ... passed to the caches as it is; the cache checks its scheme).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip()
    if value in (STORE_MEMORY, STORE_LOCAL_REDIS) or "://" in value:
        return value
    raise argparse.ArgumentTypeError(
        f"{text!r}: give memory, redis (a local redis-server) or a URL such as "
        "redis://:PASSWORD@HOST:6379/0"
    )


def check_store(replicas: Mapping[str, int], store: str) -> None:
    """Refuse several cache replicas without a store they share.

    Raises:
        LaunchConfigError: ``cache`` >= 2 with ``store`` ``memory``, saying why.
    """
    caches = replicas.get("cache", 1)
    if caches >= 2 and store == STORE_MEMORY:
        raise LaunchConfigError(
            f"--replicas cache={caches} needs a shared store: with --store memory (the "
            "default) each cache replica keeps its own entries, so a repeat that reaches "
            "another replica misses and is encoded again; add --store redis (a local "
            "redis-server) or --store redis://HOST:PORT/DB"
        )


def decoder_cores(
    decoder_share: Sequence[int], all_cores: Sequence[int], count: int
) -> list[list[int]]:
    """Cores for each of ``count`` decoder replicas' vLLM CPU workers.

    vLLM's CPU worker keeps the cores it is bound to busy even when idle (FACTS.md), so
    two workers on one core halve each other. The decoders' share of the host
    (:func:`vlcommon.cpus.split_cpus`) is cut into ``count`` runs when it has a core for
    each; otherwise each replica gets one core of the host in turn (on 2 cores: decoder-1
    core 0, decoder-2 core 1, beside the encoder, which runs at a lower priority).

    Returns:
        One list of core ids per replica, in replica order.
    """
    share = sorted(decoder_share)
    if len(share) >= count:
        size, extra = divmod(len(share), count)
        runs, start = [], 0
        for r in range(count):
            end = start + size + (1 if r < extra else 0)
            runs.append(share[start:end])
            start = end
        return runs
    cores = sorted(all_cores)
    return [[cores[r % len(cores)]] for r in range(count)]


def replica_env(
    name: str,
    ports: Ports,
    placement: Mapping[str, Mapping[str, str]],
    store: str | None,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment one instance gets from the launcher, beside the cluster-wide one.

    * its service's CPU placement (:func:`splitvl.launcher.cpu_placement`), with each
      decoder replica's own cores (:func:`decoder_cores`);
    * ``CACHE_STORE`` for the caches when ``store`` is set;
    * for the gateway, when a service it calls is replicated:
      ``GATEWAY_CLIENT_TLS_SERVER_NAME=127.0.0.1`` unless ``env`` names one. With TLS,
      grpc checks the certificate against the target's authority, which for an address
      list is the list itself (``127.0.0.1:P1,127.0.0.1:P2``) and matches no certificate
      (tried: "Hostname Verification Check failed"); one address checks ``127.0.0.1``, so
      the list is checked against the same name. Without TLS the variable is unused.
    """
    env = env or {}
    service = service_of(name)
    out = dict(placement.get(service, {}))
    decoders = ports.instances("decoder")
    bind = out.get("VLLM_CPU_OMP_THREADS_BIND")
    if service == "decoder" and len(decoders) > 1 and bind:
        share = parse_cpu_list(bind)
        host = share + parse_cpu_list(placement.get("encoder", {}).get("ENCODER_CPUS", ""))
        cores = decoder_cores(share, host, len(decoders))[decoders.index(name)]
        out["VLLM_CPU_OMP_THREADS_BIND"] = format_cpu_list(cores)
    if service == "cache" and store is not None:
        out["CACHE_STORE"] = store
    replicated = any(len(ports.instances(s)) > 1 for s in REPLICATED)
    named = env.get("SPLITVL_TLS_SERVER_NAME") or env.get("GATEWAY_CLIENT_TLS_SERVER_NAME")
    if service == "gateway" and replicated and not named:
        out["GATEWAY_CLIENT_TLS_SERVER_NAME"] = "127.0.0.1"
    return out


#: Variables that give the caches a store secret (SPLITVL_INTERNAL_TOKEN becomes theirs).
STORE_SECRET_VARS = (
    "CACHE_STORE_SECRET",
    "CACHE_STORE_SECRET_FILE",
    "CACHE_INTERNAL_TOKEN",
    "SPLITVL_INTERNAL_TOKEN",
    "CACHE_STORE_ALLOW_NO_SECRET",
)


# Values pydantic reads as false (CACHE_STORE_ALLOW_NO_SECRET=false gives no secret).
FALSE = ("", "0", "false", "off", "no", "n", "f")


def store_secret_env(store: str | None, env: Mapping[str, str], log_dir: Path) -> dict[str, str]:
    """``CACHE_STORE_SECRET_FILE`` for the caches when their store is shared (``store``,
    else ``$CACHE_STORE``, is not ``memory``) and the environment gives no secret: the
    file :func:`splitvl.private_file.store_secret` keeps in the log folder (256 bits, mode
    0600, made once and reused, never on a command line). A cache on a shared store
    without a secret refuses to start (cache_service/store_redis.py).

    Raises:
        LaunchConfigError: the secret file is unusable.
    """
    chosen = store or env.get("CACHE_STORE") or STORE_MEMORY
    given = [v for v in STORE_SECRET_VARS if env.get(v, "").strip().lower() not in FALSE]
    if chosen == STORE_MEMORY or given:
        return {}
    return {"CACHE_STORE_SECRET_FILE": str(private_file.store_secret(log_dir))}


def layout_lines(
    ports: Ports,
    log_dir: Path,
    store: str | None = None,
    server: RedisServer | None = None,
) -> list[str]:
    """The layout ``splitvl up`` prints before it starts anything: one line per instance
    (service, replica, gRPC port, metrics port, log file), the HTTP front, the store.

    Args:
        ports: The cluster's ports.
        log_dir: Its log folder (log files are named relative to it).
        store: The ``CACHE_STORE`` the caches get (None: the cache's default, memory).
        server: The local redis-server, when ``up`` runs one.
    """
    rows = [("service", "replica", "gRPC", "metrics", "log")]
    for service in SERVICES:
        names = ports.instances(service)
        for r, name in enumerate(names, 1):
            metrics = ports.metrics[name]
            rows.append(
                (service, str(r), str(ports.grpc[name]), str(metrics or "-"), f"{name}.log")
            )
    if server is not None:
        log = server.log_path
        rows.append(("redis", "1", str(server.port), "-", str(_relative(log, log_dir))))
    if ports.public:
        rows.insert(1, ("gateway", "all", str(ports.public), "-", "(shared, SO_REUSEPORT)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"layout (all on 127.0.0.1; logs in {log_dir}):"]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if ports.http:
        lines.append(f"  gateway OpenAI-compatible HTTP: http://127.0.0.1:{ports.http}/v1")
    if server is not None:
        lines.append(
            f"  cache store: {server.shown_url} (redis-server started here; its URL with the "
            f"password: {server.url_path})"
        )
    elif store is not None and store != STORE_MEMORY:
        lines.append(f"  cache store: {mask_password(store)}")
    else:
        lines.append("  cache store: memory (in the cache process)")
    return lines


def _relative(path: Path, folder: Path) -> Path:
    return path.relative_to(folder) if path.is_relative_to(folder) else path


def mask_password(url: str) -> str:
    """``redis://user:secret@host/0`` -> ``redis://user:***@host/0`` (printable)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


def plan_store(
    store: str | None,
    env: Mapping[str, str],
    replicas: Mapping[str, int],
    run_dir: Path,
    *,
    maxmemory: str | None = None,
    avoid: Sequence[int] = (),
) -> tuple[str | None, RedisServer | None]:
    """What the caches' store will be, from ``--store`` (else ``$CACHE_STORE``, else memory).

    Args:
        store: ``--store`` (None: not given).
        env: The launcher's environment.
        replicas: ``--replicas``.
        run_dir: Where a local redis-server keeps its config, data and log.
        maxmemory: ``--redis-maxmemory`` (None: :data:`~splitvl.redis_server.DEFAULT_MAXMEMORY`).
        avoid: The cluster's ports, which the local server's port must not take.

    Returns:
        ``(CACHE_STORE for the caches or None to leave it alone, the local server or None)``.

    Raises:
        LaunchConfigError: several caches and no shared store; ``--redis-maxmemory``
            without ``--store redis``; ``--store redis`` with no redis-server installed.
    """
    chosen = store or env.get("CACHE_STORE") or STORE_MEMORY
    check_store(replicas, chosen)
    if chosen != STORE_LOCAL_REDIS:
        if maxmemory is not None:
            raise LaunchConfigError(
                "--redis-maxmemory sizes the redis-server that --store redis starts; "
                f"the store here is {mask_password(chosen)}"
            )
        return store, None
    redis_binary()  # installed? (checked again when it starts)
    server = RedisServer.create(run_dir, maxmemory=maxmemory or DEFAULT_MAXMEMORY, avoid=avoid)
    return None, server
