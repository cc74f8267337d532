"""``qwenvl.gateway.v1.GatewayService``: the gRPC front over :class:`gateway.pipeline.Pipeline`.

A thin adapter: it parses the request (:meth:`Pipeline.parse`, every rule there), runs the
pipeline and renders each :class:`~gateway.pipeline.GenerateEvent` as a
``GenerateResponse``. A :class:`~vlcommon.errors.ServiceError` raised by the pipeline
becomes the call's status with its ErrorInfo through the server's error interceptor
(``vlcommon.interceptors``); nothing is streamed before the decoder's first token, so bad
input always gets a status, never a partial stream. A cancelled call closes the pipeline,
which cancels the decoder call, which aborts the vLLM request.

Usage::

    pipeline = Pipeline(settings, spec, revision, forbidden_tokens, downstream)
    servicer = GatewayServicer(pipeline)
    gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from gateway.pipeline import GenerateEvent, Pipeline
from vlcommon.auth import bearer_token
from vlcommon.deadline import Deadline


def render(event: GenerateEvent) -> pb.GenerateResponse:
    """One event as the wire's ``GenerateResponse`` (images and videos on the first,
    usage and timings on the last)."""
    response = pb.GenerateResponse(
        token_ids=event.token_ids, text=event.text, finish_reason=event.finish_reason
    )
    response.images.extend(event.images)
    response.videos.extend(event.videos)
    if event.usage is not None:
        response.usage.CopyFrom(event.usage)
    if event.timings is not None:
        response.timings.CopyFrom(event.timings)
    return response


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    """Serves the public Generate RPC (server streaming).

    Args:
        pipeline: The gateway's request path, shared with the OpenAI front.
    """

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the answer to one request.

        Raises:
            ServiceError: INVALID_ARGUMENT / RESOURCE_EXHAUSTED / UNIMPLEMENTED /
                FAILED_PRECONDITION naming the field for bad input, UNAVAILABLE naming a
                dependency that is down, DEADLINE_EXCEEDED, CANCELLED (gateway.pipeline).
        """
        arrived = time.perf_counter()
        caller = bearer_token(context.invocation_metadata())  # its priority floor
        parsed = self.pipeline.parse(request, Deadline.of(context), arrived, caller)
        async with contextlib.aclosing(self.pipeline.generate(parsed)) as events:
            async for event in events:
                yield render(event)
