"""Run the gateway: ``python -m gateway --model DIR --port 50051``.

Settings come from ``GATEWAY_*`` environment variables; flags override them.
"""

from __future__ import annotations

import logging

import grpc
from qwenvl.cache.v1 import cache_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2, gateway_service_pb2_grpc

from gateway.openai_front import HttpFront, create_app
from gateway.pipeline import Downstream, Pipeline
from gateway.pipeline.endpoints import DecoderEndpoints
from gateway.pipeline.route import DecoderRouter
from gateway.reasoning import ReasoningParser
from gateway.servicer import GatewayServicer
from gateway.settings import GatewaySettings
from vlcommon import handoff, telemetry
from vlcommon.admission import AdmissionInterceptor
from vlcommon.auth import auth_settings
from vlcommon.model_info import load_vision_spec, model_revision, resolve_model_dir
from vlcommon.request_rules import forbidden_tokens
from vlcommon.server import limit_torch_threads, serve
from vlcommon.service_main import service_main
from vlcommon.settings import channel_options
from vlcommon.tls import ClientSecurity, aio_channel

log = logging.getLogger("gateway")
SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def channel(address: str, security: ClientSecurity | None = None) -> grpc.aio.Channel:
    """A channel to a dependency: TLS/mTLS and the internal token per ``GATEWAY_CLIENT_*``."""
    return aio_channel(
        address,
        security,
        options=channel_options(),
        interceptors=telemetry.client_interceptors(),
    )


def connect(
    settings: GatewaySettings,
) -> tuple[Downstream, list[grpc.aio.Channel], list[DecoderEndpoints]]:
    """The downstream services: one channel to the encoders (round robin over their
    replicas), one per cache and per decoder replica behind their affinity routers (their
    endpoints open at :meth:`DecoderEndpoints.start`)."""
    security = ClientSecurity.from_settings(settings)
    channels = [channel(settings.encoder_address, security)]
    endpoints = []
    caches = None
    if settings.cache_address:
        caches = DecoderRouter(epsilon=settings.affinity_epsilon)
        endpoints.append(
            DecoderEndpoints(
                settings.cache_address,
                lambda address, name: channel(address, security.named(name)),
                caches,
                proxy=settings.cache_routing == "proxy",
                resolve_s=settings.decoder_resolve_s,
                stub=cache_service_pb2_grpc.CacheServiceStub,
                what="cache",
            )
        )
    router = DecoderRouter(epsilon=settings.affinity_epsilon)
    decoders = DecoderEndpoints(
        settings.decoder_address,
        lambda address, name: channel(address, security.named(name)),
        router,
        proxy=settings.decoder_routing == "proxy",
        resolve_s=settings.decoder_resolve_s,
    )
    endpoints.append(decoders)
    downstream = Downstream(
        encoder=encoder_service_pb2_grpc.EncoderServiceStub(channels[0]),
        decoder=router,
        cache=caches,
        # Releases held embeddings that no reader will read (a request that failed before
        # the decoder took them over), at their holders, with the internal channels' TLS.
        releaser=handoff.Reader(security),
    )
    return downstream, channels, endpoints


async def main_async(settings: GatewaySettings) -> None:
    # Import the resize implementation now, not inside the first request (seconds of imports).
    from transformers.models.qwen2_vl import image_processing_qwen2_vl  # noqa: F401

    model_dir = resolve_model_dir(settings.model)
    spec = load_vision_spec(model_dir)
    revision = settings.model_revision or model_revision(model_dir)
    telemetry.setup_tracing("splitvl-gateway")
    downstream, channels, endpoints = connect(settings)
    pipeline = Pipeline(settings, spec, revision, forbidden_tokens(model_dir), downstream)
    servicer = GatewayServicer(pipeline)
    log.info("model %s revision %s", model_dir, revision)
    reasoning = None
    if settings.reasoning_parser:
        reasoning = ReasoningParser.load(settings.reasoning_parser, model_dir)
        log.info(
            "reasoning parser %s (marker token ids %s)",
            reasoning.name,
            dict(reasoning.marker_ids) or "none: matched as text",
        )

    admission = AdmissionInterceptor(settings.max_concurrent_rpcs, settings.retry_after_ms)
    http = None
    if settings.http_port:
        bearer_tokens, _ = auth_settings(settings, public=True)
        app = create_app(
            pipeline,
            served_model_name=settings.served_model_name or settings.model,
            bearer_tokens=bearer_tokens,
            admission=admission,
            timeout_s=settings.http_timeout_s,
            max_tokens_limit=settings.max_tokens_limit,
            max_body_bytes=settings.max_message_bytes,
            body_read_timeout_s=settings.http_body_timeout_s,
            reasoning=reasoning,
        )
        http = HttpFront(
            app,
            settings.host,
            settings.http_port,
            (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file),
            reuse_port=settings.reuse_port,
        )

    async def startup() -> None:
        for e in endpoints:
            await e.start()
        # No cold first request: the preprocess threads, codecs and resize run once first.
        await pipeline.warm_up()
        if http is not None:
            await http.start()

    async def shutdown() -> None:
        if http is not None:
            await http.stop()
        for ch in channels:
            await ch.close()
        for e in endpoints:
            await e.close()
        assert downstream.releaser is not None
        await downstream.releaser.close()
        pipeline.close()

    await serve(
        service_name="gateway",
        service_full_names=[SERVICE],
        settings=settings,
        register=lambda server: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(
            servicer, server
        ),
        startup=startup,
        shutdown=shutdown,
        public=True,
        admission=admission,
        on_drain=http.stop_accepting if http is not None else None,
    )


def main(argv: list[str] | None = None) -> None:
    service_main(
        "gateway",
        GatewaySettings,
        flags=(
            "model",
            "host",
            "port",
            "instance_port",
            "reuse_port",
            "metrics_port",
            "encoder_address",
            "cache_address",
            "decoder_address",
            "http_port",
            "served_model_name",
            "reasoning_parser",
        ),
        serve=lambda settings, _: main_async(settings),
        argv=argv,
        doc=__doc__,
        prepare=lambda _: limit_torch_threads(),
    )


if __name__ == "__main__":
    main()
