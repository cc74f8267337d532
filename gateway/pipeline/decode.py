"""The decode stage: ``DecoderService/Generate``, its chunks streamed as they come."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

import grpc
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc

from gateway import metrics
from gateway.pipeline.types import release
from vlcommon import handoff
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, error_info, from_rpc_error

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


class DecodeStage:
    """The decode stage: ``DecoderService/Generate``, its chunks streamed as they come.

    The decoder takes over the refs of its request: it reads each or releases those it
    will not read, and answers with a status of its own. A call that fails without one (the
    decoder was never reached) leaves them to this stage, which releases them.

    Args:
        decoder: The decoder's stub (Generate streams tokens: never retried).
        releaser: Releases the refs of a request the decoder never received.
    """

    def __init__(
        self,
        decoder: decoder_service_pb2_grpc.DecoderServiceStub,
        releaser: handoff.Reader | None = None,
    ) -> None:
        self.decoder = decoder
        self.releaser = releaser

    async def stream(
        self,
        request: decoder_service_pb2.GenerateRequest,
        deadline: Deadline,
    ) -> AsyncGenerator[decoder_service_pb2.GenerateResponse, None]:
        """The decoder's chunks for ``request``, within the request's deadline; observes
        the inter-token latency (``splitvl_gateway_inter_token_latency_seconds``).

        Closing the iterator (the client went away) cancels the decoder call, which
        aborts the vLLM request.

        Raises:
            RefsLost: the decoder could not read a held ref, before any chunk.
            ServiceError: the decoder's status otherwise, naming it as the dependency.
        """
        call = self.decoder.Generate(request, timeout=deadline.remaining())
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
            error = from_rpc_error(err, dependency="decoder")
            info = error_info(err)
            if info is None and first:  # never reached the decoder's servicer
                embeddings = [*request.images, *(v.embedding for v in request.videos)]
                release(self.releaser, embeddings)
            if first and info is not None and info.reason in REF_LOST_REASONS:
                raise RefsLost(error) from err
            raise error from err
        finally:
            if not call.done():
                call.cancel()
