"""Prometheus metrics of the encoder service (prometheus-client, default registry).

RPC counts and durations (``splitvl_encoder_requests_total{method,code}``, ...) come from
the shared interceptor in ``vlcommon.metrics``. Names: docs/observability.md.
"""

from prometheus_client import Counter, Gauge, Histogram

IMAGES = Counter("splitvl_encoder_images_total", "Images received by Encode.")
DEDUPLICATED = Counter(
    "splitvl_encoder_deduplicated_images_total", "Images shared with an identical in-flight one."
)
QUEUED_IMAGES = Gauge(
    "splitvl_encoder_queued_images", "Queue depth: images waiting for a ViT batch."
)
QUEUE_WAIT = Histogram(
    "splitvl_encoder_queue_wait_seconds", "Time an image waited before its batch started."
)
BATCH_SECONDS = Histogram(
    "splitvl_encoder_batch_duration_seconds", "Wall time of one packed ViT call."
)
BATCH_IMAGES = Histogram(
    "splitvl_encoder_batch_images",
    "Batch size: images per ViT call.",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
BATCH_PATCHES = Histogram(
    "splitvl_encoder_batch_patches",
    "Patches (sum of t*h*w) per ViT call.",
    buckets=(256, 1024, 4096, 16384, 65536, 262144),
)
OOM_SPLITS = Counter(
    "splitvl_encoder_oom_splits_total", "ViT calls that ran out of memory and were split."
)
EMBEDDING_SENT_BYTES = Counter(
    "splitvl_encoder_embedding_sent_bytes_total", "Embedding tensor bytes returned by Encode."
)
DROPPED = Counter(
    "splitvl_encoder_dropped_images_total",
    "Images dropped before their ViT batch ran: every caller had cancelled or passed its "
    "deadline (the ViT never ran for them).",
)
