"""Prometheus metrics of the encoder service (prometheus-client, default registry)."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("splitvl_encoder_requests_total", "Encode RPCs by gRPC status.", ["code"])
IMAGES = Counter("splitvl_encoder_images_total", "Images received by Encode.")
DEDUPLICATED = Counter(
    "splitvl_encoder_deduplicated_images_total", "Images shared with an identical in-flight one."
)
QUEUE_DEPTH = Gauge("splitvl_encoder_queue_depth", "Images waiting for the ViT.")
QUEUE_WAIT = Histogram("splitvl_encoder_queue_wait_seconds", "Time an image waited for a batch.")
ENCODE_SECONDS = Histogram("splitvl_encoder_batch_seconds", "Wall time of one ViT call.")
BATCH_IMAGES = Histogram(
    "splitvl_encoder_batch_images", "Images per ViT call.", buckets=(1, 2, 4, 8, 16, 32, 64)
)
BATCH_PATCHES = Histogram(
    "splitvl_encoder_batch_patches",
    "Patches per ViT call.",
    buckets=(256, 1024, 4096, 16384, 65536, 262144),
)
OOM_SPLITS = Counter(
    "splitvl_encoder_oom_splits_total", "ViT calls that ran out of memory and were split."
)
