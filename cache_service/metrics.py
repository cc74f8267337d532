"""Prometheus metrics of the cache service (names follow Prometheus conventions and
/work/notes/metrics_names.md: ``_total`` counters, base units ``_bytes``, ``_seconds``,
``_ratio``; the shared interceptor adds ``splitvl_cache_requests_total{method,code}``).

Hit rate: ``splitvl_cache_hit_ratio`` is hits / lookups since start; over a window use
``sum(rate(splitvl_cache_hits_total[5m])) / sum(rate(splitvl_cache_lookups_total[5m]))``.
A query that misses the exact tier counts one ``misses_total{tier="exact"}``; when the
similarity tier is then consulted and misses too, one ``misses_total{tier="similar"}``.
"""

from prometheus_client import Counter, Gauge, Histogram

LOOKUPS = Counter(
    "splitvl_cache_lookups_total", "Images looked up, by outcome tier.", ["tier"]
)  # tier = exact | similar | miss
HITS = Counter("splitvl_cache_hits_total", "Lookups answered, by tier.", ["tier"])
MISSES = Counter("splitvl_cache_misses_total", "Lookups a tier could not answer.", ["tier"])
# Every known label exported from the start (as 0): a rate() over a series that appears
# only at its first increment misses that increment, and dashboards see no series at all.
for _tier in ("exact", "similar", "miss"):
    LOOKUPS.labels(tier=_tier)
for _tier in ("exact", "similar"):
    HITS.labels(tier=_tier)
    MISSES.labels(tier=_tier)
HIT_RATIO = Gauge("splitvl_cache_hit_ratio", "Hits / lookups since start (both tiers).")
PUTS = Counter("splitvl_cache_puts_total", "Entries stored (new or refreshed).")
PUTS_REFUSED = Counter(
    "splitvl_cache_puts_refused_total", "Entries refused by Put, by reason.", ["reason"]
)  # reason = too_large | leased
for _reason in ("too_large", "leased"):
    PUTS_REFUSED.labels(reason=_reason)
EVICTIONS = Counter(
    "splitvl_cache_evictions_total", "Entries removed, by reason.", ["reason"]
)  # reason = lru (byte budget) | ttl (expired)
for _reason in ("lru", "ttl"):
    EVICTIONS.labels(reason=_reason)
ENTRIES = Gauge("splitvl_cache_entries", "Entries held.")
BYTES = Gauge("splitvl_cache_stored_bytes", "Embedding bytes held.")
CAPACITY_BYTES = Gauge("splitvl_cache_capacity_bytes", "Byte budget of stored embeddings.")
LEASED = Gauge("splitvl_cache_leased_entries", "Entries leased by lookups in flight.")
INDEX_VECTORS = Gauge(
    "splitvl_cache_index_vectors", "Vectors in the similarity index (tombstones included)."
)
INDEX_TOMBSTONES = Gauge(
    "splitvl_cache_index_tombstones", "Removed ids still in an index that cannot remove_ids."
)
INDEX_REBUILDS = Counter(
    "splitvl_cache_index_rebuilds_total", "Similarity index rebuilds, by resulting kind.", ["kind"]
)  # kind = flat | hnsw | gpu_flat
LOOKUP_SECONDS = Histogram(
    "splitvl_cache_lookup_duration_seconds",
    "Lookup RPC latency (whole batch, server side).",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5),
)

# A shared store (CACHE_STORE=redis://...; docs/scaling.md, "Store"). With the default
# in-process store these stay at 0 (and store_up at 1).
STORE_ERRORS = Counter(
    "splitvl_cache_store_errors_total",
    "Shared-store operations that failed, or were skipped while it was down; a lookup then "
    "answers a miss and a put is dropped.",
    ["op"],
)  # op = lookup | put | alias | follow | sync | start | claim
for _op in ("lookup", "put", "alias", "follow", "sync", "start", "claim"):
    STORE_ERRORS.labels(op=_op)
STORE_REFUSED = Counter(
    "splitvl_cache_store_refused_total",
    "Shared-store commands the store answered with an error (OOM when full, READONLY, "
    "NOPERM, WRONGTYPE, ...): a put is dropped and kept as this replica's local copy; "
    "reads go on.",
    ["op", "reason"],
)  # reason = oom | readonly | noperm | wrongtype | busy | other
STORE_INTEGRITY_FAILURES = Counter(
    "splitvl_cache_store_integrity_failures_total",
    "Entries or aliases read from the shared store and refused (never served), by reason.",
    ["reason"],
)  # reason = mac (header does not open) | key_id (another secret) | key (another key's
# entry) | field (a body field does not open: tampered or torn) | format
for _reason in ("mac", "key_id", "key", "field", "format"):
    STORE_INTEGRITY_FAILURES.labels(reason=_reason)
STORE_DROPPED = Counter(
    "splitvl_cache_store_dropped_total",
    "Entries removed from this replica's index because the store no longer holds them "
    "(TTL, maxmemory eviction), by where that was noticed.",
    ["found"],
)  # found = read (a lookup's read) | sync (the periodic scan)
for _found in ("read", "sync"):
    STORE_DROPPED.labels(found=_found)
STORE_FOLLOWED = Counter(
    "splitvl_cache_store_followed_total",
    "Entries put through other replicas that this replica added to its index, by source.",
    ["source"],
)  # source = log (the Redis Stream) | scan (the startup and periodic scan)
for _source in ("log", "scan"):
    STORE_FOLLOWED.labels(source=_source)
STORE_BYTES = Counter(
    "splitvl_cache_store_bytes_total",
    "Bytes of entry fields written to and read from the shared store.",
    ["direction"],
)  # direction = write | read
for _direction in ("write", "read"):
    STORE_BYTES.labels(direction=_direction)
STORE_UP = Gauge(
    "splitvl_cache_store_up",
    "1 while the shared store answers (always with the in-process store), 0 from a failure "
    "until it answers again.",
)
STORE_UP.set(1)
