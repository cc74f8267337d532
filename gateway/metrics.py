"""Prometheus metrics of the gateway (prometheus-client, default registry).

RPC counts and durations (``splitvl_gateway_requests_total{method,code}``, ...) come from
the shared interceptor in ``vlcommon.metrics``. Names: docs/observability.md.
"""

from prometheus_client import Counter, Gauge, Histogram

IMAGES = Counter("splitvl_gateway_images_total", "Images in requests that passed preprocessing.")
IMAGES_DECODED = Counter(
    "splitvl_gateway_images_decoded_total",
    "Images decoded by the preprocess threads (including those of requests that then failed).",
)
SAME_FILE_WAITS = Counter(
    "splitvl_gateway_same_file_waits_total",
    "Images that waited for another request's encode of the same file bytes instead of "
    "decoding, by what their lookup after the wait found (hit, miss).",
    ["outcome"],
)
PREPROCESS_STOPPED = Counter(
    "splitvl_gateway_preprocess_stopped_total",
    "Requests whose image preparation stopped early, by reason (cancelled, deadline).",
    ["reason"],
)
CACHE_LOOKUPS = Counter(
    "splitvl_gateway_cache_lookups_total",
    "Images the cache answered for, by tier (exact, similar, miss).",
    ["tier"],
)
CACHE_FAILURES = Counter(
    "splitvl_gateway_cache_failures_total",
    "Cache calls that failed or timed out (served by encoding), or unusable hits.",
    ["op"],
)
STAGE_SECONDS = Histogram(
    "splitvl_gateway_stage_duration_seconds", "Wall time per stage of Generate.", ["stage"]
)
TTFT = Histogram(
    "splitvl_gateway_time_to_first_token_seconds",
    "Time to first token (TTFT) as the client sees it: request arrival -> first token.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ITL = Histogram(
    "splitvl_gateway_inter_token_latency_seconds",
    "Inter-token latency (ITL) of the streamed response.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
EMBEDDING_RECEIVED_BYTES = Counter(
    "splitvl_gateway_embedding_received_bytes_total",
    "Image embedding tensor bytes received, by source (encoder, cache).",
    ["source"],
)
EMBEDDING_SENT_BYTES = Counter(
    "splitvl_gateway_embedding_sent_bytes_total",
    "Image embedding tensor bytes sent, by destination (decoder, cache).",
    ["destination"],
)
VIDEOS = Counter("splitvl_gateway_videos_total", "Videos in requests that passed preprocessing.")
VIDEO_FRAMES = Counter(
    "splitvl_gateway_video_frames_total", "Video frames kept by sampling (decoded and resized)."
)
VIDEO_DECODE_SECONDS = Histogram(
    "splitvl_gateway_video_decode_seconds",
    "Wall time to demux, decode the kept frames of, and resize one video.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CLAIM_WAITS = Counter(
    "splitvl_gateway_claim_waits_total",
    "Images another gateway was encoding (its claim in the cache) that this one waited "
    "for: hit (its Put landed in time) or miss (encoded here after all).",
    ["outcome"],
)
for _outcome in ("hit", "miss"):
    CLAIM_WAITS.labels(outcome=_outcome)
REENCODED = Counter(
    "splitvl_gateway_reencoded_requests_total",
    "Requests whose held embeddings the decoder could not read (holder restarted, entry "
    "expired), encoded again and decoded once more.",
)
MIGRATIONS = Counter(
    "splitvl_gateway_migrations_total",
    "Answers moved to another decoder replica after their first token, by why: lost (the "
    "replica killed or unreachable), draining (it handed the stream back as it stopped), "
    "engine_dead (its vLLM engine died).",
    ["reason"],
)
MIGRATION_FAILURES = Counter(
    "splitvl_gateway_migration_failures_total",
    "Answers a lost decoder ended because they could not move, by why: off "
    "(GATEWAY_MIGRATION_LIMIT=0), limit (moved that often already), too_long (past "
    "GATEWAY_MIGRATION_MAX_SEQ_LEN), refused (no replica continued it).",
    ["reason"],
)
DECODER_ROUTES = Counter(
    "splitvl_gateway_decoder_routes_total",
    "Decoder calls by how their endpoint was chosen: home (the affinity key's own replica), "
    "spilled (the next on the ring: the home one over its bounded load or down), "
    "least_loaded (no image or video), failover (replayed after a replica failed before "
    "its first token).",
    ["how"],
)
DECODER_INFLIGHT = Gauge(
    "splitvl_gateway_decoder_inflight",
    "This gateway's decoder calls in flight, by decoder endpoint (host:port).",
    ["endpoint"],
)
PRIORITY_REQUESTS = Counter(
    "splitvl_gateway_priority_requests_total",
    "Decoder requests by where their priority class came from: asked (the client's), "
    "raised (the client's, below its floor: raised to it), fcfs or short-first (the "
    "gateway's policy, the client named none).",
    ["source"],
)
