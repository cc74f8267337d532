"""The decode stage: ``DecoderService/Generate``, its chunks streamed as they come."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import NoReturn

import grpc
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc

from gateway import metrics
from gateway.pipeline.route import AFFINITY_HEADER, DecoderRouter, Endpoint
from gateway.pipeline.types import release
from vlcommon import handoff
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, error_info, from_rpc_error

log = logging.getLogger(__name__)

# The decoder could not read an image's held embeddings: their holder lost them (restart,
# expiry) or could not be reached. Encoding again (a new holder) can still answer.
REF_LOST_REASONS = frozenset({"EMBEDDING_REF_GONE", "EMBEDDING_HOLDER_UNAVAILABLE"})


class RefsLost(Exception):
    """The decoder could not read a held ref before its first token (``REF_LOST_REASONS``).

    Attributes:
        error: The decoder's status as the gateway would answer it (UNAVAILABLE naming
            the image and its holder), for when encoding again is not tried.
    """

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


class _Replay(Exception):
    """A call failed before its first chunk in a way another replica may not (the
    replica was unreachable or died): try the next endpoint."""

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        super().__init__(err.details())
        self.err = err


class DecodeStage:
    """The decode stage: ``DecoderService/Generate``, its chunks streamed as they come.

    The endpoint comes from the :class:`~gateway.pipeline.route.DecoderRouter` (image
    affinity with bounded loads). A call that fails with UNAVAILABLE before its first
    chunk (the replica unreachable, killed, its engine dead) is replayed on the next
    endpoint of the key's ring order, and that replica is passed over for a while; once a
    chunk has reached the caller a failure is final (UNAVAILABLE saying so), never a
    replay that would repeat tokens.

    The decoder takes over the refs of its request: it reads each or releases those it
    will not read, and answers with a status of its own. A call that fails without one (the
    decoder was never reached) leaves them to this stage, which releases them once no
    replica is left to try.

    Args:
        decoder: The router over the decoder endpoints, or one decoder's stub.
        releaser: Releases the refs of a request no decoder received.
    """

    def __init__(
        self,
        decoder: decoder_service_pb2_grpc.DecoderServiceStub | DecoderRouter,
        releaser: handoff.Reader | None = None,
    ) -> None:
        self.router = (
            decoder if isinstance(decoder, DecoderRouter) else DecoderRouter.single(decoder)
        )
        self.releaser = releaser

    async def stream(
        self,
        request: decoder_service_pb2.GenerateRequest,
        deadline: Deadline,
        affinity: str | None = None,
    ) -> AsyncGenerator[decoder_service_pb2.GenerateResponse, None]:
        """The decoder's chunks for ``request``, within the request's deadline; observes
        the inter-token latency (``splitvl_gateway_inter_token_latency_seconds``).

        Args:
            affinity: The request's affinity key (the identity of its first image or
                video served), sent as the ``x-splitvl-affinity`` header; None routes to
                the least loaded endpoint.

        Closing the iterator (the client went away) cancels the decoder call, which
        aborts the vLLM request.

        Raises:
            RefsLost: the decoder could not read a held ref, before any chunk.
            ServiceError: the decoder's status otherwise, naming it as the dependency;
                UNAVAILABLE when every replica failed before a chunk.
        """
        endpoints, how = self.router.candidates(affinity)
        metadata = ((AFFINITY_HEADER, affinity),) if affinity else None
        for attempt, endpoint in enumerate(endpoints):
            last = attempt == len(endpoints) - 1
            metrics.DECODER_ROUTES.labels(how=how if attempt == 0 else "failover").inc()
            try:
                async for chunk in self._attempt(endpoint, request, deadline, metadata, last):
                    yield chunk
                return
            except _Replay as replay:
                self.router.mark_down(endpoint)
                log.warning(
                    "decoder %s failed before its first token (%s); replaying on another",
                    endpoint.address,
                    replay.err.code().name,
                )
        raise ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            "DECODER_UNAVAILABLE",
            "no decoder endpoint is in service",
            {"dependency": "decoder"},
        )

    async def _attempt(
        self,
        endpoint: Endpoint,
        request: decoder_service_pb2.GenerateRequest,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...] | None,
        last: bool,
    ) -> AsyncGenerator[decoder_service_pb2.GenerateResponse, None]:
        """One call to ``endpoint``.

        Raises:
            _Replay: it failed before its first chunk and another endpoint is left.
            RefsLost, ServiceError: as :meth:`stream`.
        """
        gauge = metrics.DECODER_INFLIGHT.labels(endpoint=endpoint.address)
        with self.router.track(endpoint), gauge.track_inprogress():
            call = endpoint.stub.Generate(request, timeout=deadline.remaining(), metadata=metadata)
            first = True
            t_last = time.perf_counter()
            try:
                async for chunk in call:
                    now = time.perf_counter()
                    if chunk.token_ids and not first:
                        metrics.ITL.observe((now - t_last) / len(chunk.token_ids))
                    t_last, first = now, False
                    yield chunk
            except grpc.aio.AioRpcError as err:
                self._fail(err, request, endpoint, first, last)
            finally:
                if not call.done():
                    call.cancel()

    def _fail(
        self,
        err: grpc.aio.AioRpcError,
        request: decoder_service_pb2.GenerateRequest,
        endpoint: Endpoint,
        first: bool,
        last: bool,
    ) -> NoReturn:
        """Raise what a failed call means: a replay, lost refs, or the decoder's status."""
        info = error_info(err)
        lost = info is not None and info.reason in REF_LOST_REASONS
        # The replica itself gone (killed, unreachable, stopping): no status of the
        # decoder's own, UNAVAILABLE, UNKNOWN ("Stream removed" through a proxy) or
        # CANCELLED. Before a token, a decoder's own UNAVAILABLE (its engine dead) is
        # replayed too; lost refs are not (the pipeline encodes again).
        code = err.code()
        gone = info is None and code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.CANCELLED,  # cancelled by the replica as it stopped
        )
        if first and not last and not lost and (gone or code == grpc.StatusCode.UNAVAILABLE):
            raise _Replay(err) from err
        error = from_rpc_error(err, dependency="decoder")
        if info is None and first:  # never reached a decoder's servicer
            embeddings = [*request.images, *(v.embedding for v in request.videos)]
            release(self.releaser, embeddings)
        if first and lost:
            raise RefsLost(error) from err
        if not first and gone:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "DECODER_LOST_MID_STREAM",
                f"decoder {endpoint.address} became unavailable after the answer had "
                f"started ({err.details() or err.code().name}); the answer is incomplete "
                "and was not replayed: retry the request",
                {"dependency": "decoder", "endpoint": endpoint.address},
            ) from err
        raise error from err
