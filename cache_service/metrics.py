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
