"""Prometheus metrics of the decoder service."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("splitvl_decoder_requests_total", "Generate RPCs by gRPC status.", ["code"])
ABORTED = Counter("splitvl_decoder_aborted_requests_total", "vLLM requests aborted on cancel.")
RUNNING = Gauge(
    "splitvl_decoder_engine_unfinished_requests",
    "Requests the vLLM engine has not finished (running or waiting).",
)
TTFT = Histogram(
    "splitvl_decoder_time_to_first_token_seconds",
    "Time to first token (TTFT).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ITL = Histogram(
    "splitvl_decoder_inter_token_latency_seconds",
    "Inter-token latency (ITL).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
OUTPUT_TOKENS = Counter("splitvl_decoder_output_tokens_total", "Generated tokens.")
EMBEDDING_BYTES = Counter(
    "splitvl_decoder_embedding_bytes_total", "Image embedding bytes received."
)
