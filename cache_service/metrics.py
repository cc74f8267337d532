"""Prometheus metrics of the cache service."""

from prometheus_client import Counter, Gauge, Histogram

LOOKUPS = Counter("splitvl_cache_lookups_total", "Images looked up, by tier.", ["tier"])
PUTS = Counter("splitvl_cache_puts_total", "Entries stored.")
EVICTIONS = Counter("splitvl_cache_evictions_total", "Entries evicted by the byte budget.")
ENTRIES = Gauge("splitvl_cache_entries", "Entries held.")
BYTES = Gauge("splitvl_cache_bytes", "Stored embedding bytes.")
LOOKUP_SECONDS = Histogram(
    "splitvl_cache_lookup_seconds",
    "Lookup RPC latency.",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
)
