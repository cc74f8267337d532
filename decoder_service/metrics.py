"""Prometheus metrics of the decoder service (prometheus-client, default registry).

RPC counts and durations (``splitvl_decoder_requests_total{method,code}``, ...) come from
the shared interceptor in ``vlcommon.metrics``; the ``engine_*`` gauges and prefix-cache
counters are fed by the stat logger of :func:`engine_stat_logger` from vLLM's own
scheduler stats. vLLM's ``vllm:*`` metrics share the registry. Names: docs/observability.md.
"""

from prometheus_client import Counter, Gauge, Histogram

ABORTED = Counter("splitvl_decoder_aborted_requests_total", "vLLM requests aborted on cancel.")
HANDED_OFF = Counter(
    "splitvl_decoder_handed_off_streams_total",
    "Streams in progress handed back to the gateway to move (DECODER_DRAINING) as the "
    "decoder stopped with its drain's grace nearly over.",
)
RUNNING = Gauge(
    "splitvl_decoder_engine_unfinished_requests",
    "Requests the vLLM engine has not finished (running or waiting).",
)
ENGINE_RUNNING = Gauge(
    "splitvl_decoder_engine_running_requests", "Requests in vLLM's running batch."
)
ENGINE_WAITING = Gauge(
    "splitvl_decoder_engine_waiting_requests",
    "Queue depth: requests waiting in vLLM's scheduler.",
)
KV_CACHE_USAGE = Gauge(
    "splitvl_decoder_engine_kv_cache_usage_ratio",
    "Fraction (0..1) of vLLM's KV-cache blocks in use.",
)
PREFIX_QUERIED = Counter(
    "splitvl_decoder_engine_prefix_cache_queried_tokens_total",
    "Prompt tokens vLLM looked up in its prefix cache.",
)
PREFIX_HITS = Counter(
    "splitvl_decoder_engine_prefix_cache_hit_tokens_total",
    "Prompt tokens found in vLLM's prefix cache (KV reused).",
)
TTFT = Histogram(
    "splitvl_decoder_time_to_first_token_seconds",
    "Time to first token (TTFT): submit to vLLM -> first token.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ITL = Histogram(
    "splitvl_decoder_inter_token_latency_seconds",
    "Inter-token latency (ITL).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
QUEUE_WAIT = Histogram(
    "splitvl_decoder_queue_wait_seconds",
    "Time a request waited in vLLM's scheduler queue (queued -> scheduled).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PREFILL_SECONDS = Histogram(
    "splitvl_decoder_prefill_duration_seconds",
    "Prefill: vLLM scheduled -> first token.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PROMPT_TOKENS = Counter(
    "splitvl_decoder_prompt_tokens_total", "Prompt tokens (images expanded) of finished requests."
)
OUTPUT_TOKENS = Counter("splitvl_decoder_output_tokens_total", "Generated tokens.")
EMBEDDING_RECEIVED_BYTES = Counter(
    "splitvl_decoder_embedding_received_bytes_total",
    "Image and video embedding bytes received, by transport (shm, grpc: read by reference "
    "from their holder; inline: inside the Generate request) and holder (encoder, cache; "
    "empty for inline).",
    ["transport", "holder"],
)


def engine_stat_logger() -> type:
    """A vLLM stat logger class (``AsyncLLM(stat_loggers=[...])``) feeding the engine gauges.

    vLLM calls ``record()`` in its output loop with each engine core's ``SchedulerStats``
    (running/waiting requests, ``kv_cache_usage`` in 0..1, prefix-cache token counts): the
    same numbers its own PrometheusStatLogger exports as ``vllm:kv_cache_usage_perc`` etc.
    With data parallelism the gauges are summed over engines (KV usage averaged).
    """
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class EngineStatLogger(AggregateStatLoggerBase):
        def __init__(self, vllm_config: object, engine_indexes: list[int]) -> None:
            self.last: dict[int, tuple[int, int, float]] = {}

        def record(
            self,
            scheduler_stats: object,
            iteration_stats: object,
            mm_cache_stats: object = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            s: object = scheduler_stats
            waiting = int(s.num_waiting_reqs) + int(s.num_skipped_waiting_reqs)  # type: ignore[attr-defined]
            self.last[engine_idx] = (
                int(s.num_running_reqs),  # type: ignore[attr-defined]
                waiting,
                float(s.kv_cache_usage),  # type: ignore[attr-defined]
            )
            ENGINE_RUNNING.set(sum(v[0] for v in self.last.values()))
            ENGINE_WAITING.set(sum(v[1] for v in self.last.values()))
            KV_CACHE_USAGE.set(sum(v[2] for v in self.last.values()) / len(self.last))
            prefix = s.prefix_cache_stats  # type: ignore[attr-defined]
            PREFIX_QUERIED.inc(max(int(prefix.queries), 0))
            PREFIX_HITS.inc(max(int(prefix.hits), 0))

        def log_engine_initialized(self) -> None:
            pass

    return EngineStatLogger
