"""Settings shared by every service (pydantic-settings; each service adds its own prefix)."""

from __future__ import annotations

import json

from pydantic import Field, SecretStr
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
    # Several processes on one port (splitvl up --replicas gateway=N): the kernel spreads
    # new connections over them. Off, a second process on a port in use fails to start
    # instead of silently sharing it (grpc's own default is on).
    reuse_port: bool = Field(
        False,
        description="Bind the port with SO_REUSEPORT, so that several processes share it "
        "(the HTTP front's port too).",
    )
    instance_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="A second gRPC port of this process alone, beside a shared --port: "
        "health probes and calls that must reach this very process; 0 = none.",
    )
    # One Qwen3-VL-2B image of 1,024 tokens is 16 MiB of bf16 embeddings (FACTS.md), far
    # over gRPC's 4 MiB default; 256 MiB admits a request with several large images.
    max_message_bytes: int = Field(256 * MiB, ge=4 * MiB, description="Max gRPC message, bytes.")
    # Keepalive pings detect dead peers behind NATs and meshes within ~1 minute.
    keepalive_time_s: float = Field(30.0, gt=0, description="Keepalive ping interval, seconds.")
    keepalive_timeout_s: float = Field(10.0, gt=0, description="Keepalive ack timeout, seconds.")
    grace_s: float = Field(10.0, ge=0, description="Graceful shutdown grace period, seconds.")
    gc_freeze: bool = Field(
        True,
        description="Once started, move the startup heap (models, libraries) into the garbage "
        "collector's permanent generation, as vLLM's API server does, so a full collection "
        "(which stalls every stream) walks only what serving allocated.",
    )
    # Bounded connection age: clients on a headless Service re-resolve DNS when a connection
    # ends, so new replicas start taking calls within this time after a scale-up. Streams in
    # flight when the age is reached keep running for max_connection_age_grace_s.
    max_connection_age_s: float = Field(
        300.0, ge=0, description="Close client connections after this age, seconds; 0 = never."
    )
    max_connection_age_grace_s: float = Field(
        600.0, ge=0, description="Time a closing connection's streams may still run, seconds."
    )
    # Admission control (vlcommon.admission.AdmissionInterceptor): health and reflection are
    # exempt so a busy service still passes its probes.
    max_concurrent_rpcs: int = Field(
        256,
        ge=1,
        description="RPCs (streams until their last message) served at once; more get "
        "RESOURCE_EXHAUSTED at once with a RetryInfo hint.",
    )
    retry_after_ms: int = Field(
        1000, ge=0, description="Retry hint sent with RESOURCE_EXHAUSTED (RetryInfo), ms."
    )
    # Transport security (docs/security.md). Server side: TLS when cert and key are set;
    # mTLS when a client CA is set too (clients without a certificate from it fail the
    # handshake).
    tls_cert_file: str = Field("", description="PEM certificate chain of this server.")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    tls_client_ca_file: str = Field(
        "", description="PEM CA that must sign client certificates (mTLS); empty = no mTLS."
    )
    # Client side: how this service reaches the services it calls (the gateway's hops).
    client_tls_ca_file: str = Field(
        "", description="PEM CA that signs the called services' certificates; set = TLS."
    )
    client_tls_cert_file: str = Field("", description="PEM client certificate (mTLS).")
    client_tls_key_file: str = Field("", description="PEM private key of the client cert.")
    client_tls_server_name: str = Field(
        "", description="Name checked against the called services' certificates."
    )
    # Tokens. auth_tokens: bearer tokens this service requires ("authorization: Bearer
    # <t>"), meant for the gateway's public API. internal_token: the cluster's shared
    # secret, sent on every service-to-service call and required by the internal services
    # (encoder, cache, decoder) on every call they serve, so that only splitvl's own
    # services can hand embeddings to the decoder.
    auth_tokens: SecretStr = Field(
        SecretStr(""), description="Comma-separated accepted bearer tokens; empty = no auth."
    )
    auth_token_file: str = Field("", description="File of accepted bearer tokens, one a line.")
    internal_token: SecretStr = Field(
        SecretStr(""), description="Shared secret of service-to-service calls; empty = none."
    )


class HoldingSettings(ServerSettings):
    """Settings of a service that holds embeddings for readers (encoder, cache): see
    :mod:`vlcommon.handoff`."""

    handoff_address: str = Field(
        "",
        description="host:port readers use to reach this service's HandoffService; empty = "
        "the bind host and port (a wildcard bind: this host's name). In Kubernetes set it "
        "from the downward API, e.g. $(POD_IP):50052.",
    )
    handoff_ttl_s: float = Field(
        120.0, gt=0, description="Seconds held embeddings wait for their readers at most."
    )
    handoff_max_bytes: int = Field(
        4096 * MiB,
        ge=MiB,
        description="Bytes of embeddings held for readers at once; more get RESOURCE_EXHAUSTED.",
    )


def server_options(
    settings: ServerSettings, reuse_port: bool | None = None
) -> list[tuple[str, int]]:
    """grpc server options: explicit message limits, keepalive and connection age;
    ``SO_REUSEPORT`` per ``reuse_port`` (default: ``settings.reuse_port``)."""
    if reuse_port is None:
        reuse_port = settings.reuse_port
    options = [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        # Clients ping at keepalive_time_s; allow that rate instead of GOAWAY(too_many_pings).
        ("grpc.http2.min_ping_interval_without_data_ms", int(settings.keepalive_time_s * 500)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]
    if settings.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(settings.max_connection_age_grace_s * 1000)),
        ]
    return options


# Calls that may be repeated as they are: a repeat returns the same answer and changes
# nothing (a lookup, an encode, the stats). Generate (tokens stream out) and Put (it stores)
# are left to their callers.
IDEMPOTENT_METHODS: dict[str, tuple[str, ...]] = {
    "qwenvl.encoder.v1.EncoderService": ("Encode",),
    "qwenvl.cache.v1.CacheService": ("Lookup", "GetStats"),
    # A read sends nothing until the held bytes are found, so a retry repeats nothing.
    "qwenvl.handoff.v1.HandoffService": ("ReadEmbedding",),
}


def retry_service_config(max_attempts: int = 3) -> str:
    """gRPC's default service config for internal channels, as JSON (gRFC A6 retries).

    The idempotent methods (:data:`IDEMPOTENT_METHODS`) are retried on UNAVAILABLE (a
    replica killed or restarting, a connection reset) up to ``max_attempts`` attempts in
    all, 50..500 ms apart, each attempt within the call's own deadline; with round_robin a
    retry goes to another replica when one is left. Nothing else is retried.

    Client-side health checking (gRFC A17, ``healthCheckConfig``): round_robin picks only
    replicas whose ``grpc.health.v1`` status is SERVING, watched on each connection. A
    replica that is up but still loading its model, or draining after SIGTERM, reports
    NOT_SERVING (vlcommon.server) and gets no new calls; without this, round robin kept
    sending it a share of them and a retry could land on it again (``splitvl faults``:
    94 of 5,825 calls failed "encoder is starting" while a killed encoder replica came
    back, 186 in a rolling restart).
    """
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": ""},
            "methodConfig": [
                {
                    "name": [
                        {"service": service, "method": method}
                        for service, methods in IDEMPOTENT_METHODS.items()
                        for method in methods
                    ],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": "0.05s",
                        "maxBackoff": "0.5s",
                        "backoffMultiplier": 2,
                        # CANCELLED received (not our own cancel, which is never
                        # retried): the replica cancelled the call as it shut down.
                        "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
                    },
                }
            ],
        }
    )


def channel_options(
    max_message_bytes: int = 256 * MiB, keepalive_time_s: float = 30.0
) -> list[tuple[str, int | str]]:
    """grpc channel options for service-to-service calls: the same explicit limits.

    ``round_robin`` spreads calls over every address a target resolves to, so a
    ``dns:///encoder.<ns>.svc:50052`` target on a headless Service balances across pods
    (gRPC's default, pick_first, pins one connection to one pod). With a single address it
    behaves like pick_first. Idempotent calls are retried on UNAVAILABLE by grpc's own retry
    policy (:func:`retry_service_config`); a retry needs the request kept until the answer
    starts, so the retry buffers are as large as a message may be (gRPC's 256 KiB default
    would leave any Encode with an image's pixels unretried).
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Fail fast instead of waiting out a long reconnect backoff after a restart.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", retry_service_config()),
        ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
        ("grpc.retry_buffer_size", 4 * max_message_bytes),
    ]
