"""Settings shared by every service (pydantic-settings; each service adds its own prefix)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class ServerSettings(BaseSettings):
    """gRPC server settings common to all four services.

    Environment variables carry the service's prefix, e.g. ``ENCODER_PORT``.
    """

    model_config = SettingsConfigDict(extra="ignore")

    host: str = Field("127.0.0.1", description="Address to bind; loopback by default.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics HTTP port; 0 disables it."
    )
    # One Qwen3-VL-2B image of 1,024 tokens is 16 MiB of bf16 embeddings (FACTS.md), far
    # over gRPC's 4 MiB default; 256 MiB admits a request with several large images.
    max_message_bytes: int = Field(256 * MiB, ge=4 * MiB, description="Max gRPC message, bytes.")
    # Keepalive pings detect dead peers behind NATs and meshes within ~1 minute.
    keepalive_time_s: float = Field(30.0, gt=0, description="Keepalive ping interval, seconds.")
    keepalive_timeout_s: float = Field(10.0, gt=0, description="Keepalive ack timeout, seconds.")
    grace_s: float = Field(10.0, ge=0, description="Graceful shutdown grace period, seconds.")
    max_concurrent_rpcs: int = Field(
        256, ge=1, description="RPCs served at once; more get RESOURCE_EXHAUSTED."
    )


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """grpc server options: explicit message limits and keepalive."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        # Clients ping at keepalive_time_s; allow that rate instead of GOAWAY(too_many_pings).
        ("grpc.http2.min_ping_interval_without_data_ms", int(settings.keepalive_time_s * 500)),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def channel_options(
    max_message_bytes: int = 256 * MiB, keepalive_time_s: float = 30.0
) -> list[tuple[str, int]]:
    """grpc channel options for service-to-service calls: the same explicit limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Fail fast instead of waiting out a long reconnect backoff after a restart.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
