"""The decode stage: ``DecoderService/Generate``, its chunks streamed as they come."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import NoReturn

import grpc
from opentelemetry import trace
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc

from gateway import metrics
from gateway.pipeline.route import AFFINITY_HEADER, DecoderRouter, Endpoint
from gateway.pipeline.types import release
from vlcommon import handoff
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, error_info
from vlcommon.refusals import Refusal
from vlcommon.relay import from_rpc_error

log = logging.getLogger(__name__)

# The decoder could not read an image's held embeddings: their holder lost them (restart,
# expiry) or could not be reached. Encoding again (a new holder) can still answer.
REF_LOST_REASONS = frozenset({Refusal.EMBEDDING_REF_GONE, Refusal.EMBEDDING_HOLDER_UNAVAILABLE})


class RefsLost(Exception):
    """The decoder could not read a held ref before its first token (``REF_LOST_REASONS``).

    Attributes:
        error: The decoder's status as the gateway would answer it (UNAVAILABLE naming
            the image and its holder), for when encoding again is not tried.
    """

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


# A decoder's own statuses that mean "this replica cannot go on with the answer, another
# can": it handed the stream back as it stopped, or its vLLM engine died.
MOVE_REASONS = {Refusal.DECODER_DRAINING: "draining", Refusal.ENGINE_DEAD: "engine_dead"}

# Builds the decoder request again with fresh refs to the same embeddings (the first
# decoder read and released the ones it had): Pipeline._refs_again.
Renew = Callable[
    [decoder_service_pb2.GenerateRequest], Awaitable[decoder_service_pb2.GenerateRequest]
]


class _Lost(Exception):
    """The decoder of an answer in progress cannot go on with it (killed, unreachable,
    draining, its engine dead): the answer may move to another replica.

    Attributes:
        error: What the client gets when it does not move (UNAVAILABLE
            ``DECODER_LOST_MID_STREAM``).
        reason: ``lost``, ``draining`` or ``engine_dead``.
    """

    def __init__(self, error: ServiceError, endpoint: Endpoint, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.endpoint = endpoint
        self.reason = reason


class _Answer:
    """The tokens and text of an answer the caller received so far, kept (up to
    ``max_len`` tokens) for a move to another replica."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.token_ids: list[int] | None = []
        self.tokens = 0
        self.text_chars = 0

    def add(self, chunk: decoder_service_pb2.GenerateResponse) -> None:
        self.tokens += len(chunk.token_ids)
        self.text_chars += len(chunk.text)
        if self.token_ids is not None:
            if self.tokens > self.max_len:
                self.token_ids = None  # no longer movable
            else:
                self.token_ids.extend(chunk.token_ids)


def _check_continued(chunk: decoder_service_pb2.GenerateResponse, answer: _Answer) -> None:
    """The first chunk of a moved answer must confirm the continuation: a decoder that
    predates ``continued_tokens`` ignores the field and would start the answer over.

    Raises:
        ServiceError: FAILED_PRECONDITION when it does not (the answer then ends as lost).
    """
    if chunk.continued_tokens != answer.tokens:
        raise Refusal.CONTINUATION_NOT_CONFIRMED.error(
            f"the decoder continued from {chunk.continued_tokens} tokens, not "
            f"{answer.tokens} (a decoder without request migration?)"
        )


def _deadline_exceeded(err: ServiceError | RefsLost) -> bool:
    """Whether ``err`` is the request's deadline passing (never a reason to move again)."""
    return isinstance(err, ServiceError) and err.code == grpc.StatusCode.DEADLINE_EXCEEDED


def _move_again_or_raise(err: ServiceError | RefsLost, moved: _Lost) -> None:
    """The replica meant to continue an answer moved from ``moved`` failed before its
    first chunk: return when the refs of the move were gone (a replica that refused the
    call first had released them), so the answer moves again with fresh ones.

    Raises:
        ServiceError: ``moved.error`` (from ``err``) when that replica refused the
            answer: the answer ends as it would have without a move (counted as
            ``refused`` in ``splitvl_gateway_migration_failures_total``).
    """
    if isinstance(err, RefsLost):
        return
    metrics.MIGRATION_FAILURES.labels(reason="refused").inc()
    log.warning("the answer from %s could not continue elsewhere: %s", moved.endpoint.address, err)
    raise moved.error from err


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
    endpoint of the key's ring order, and that replica is passed over for a while; with
    one endpoint (a proxy in front of the replicas) the second try goes through it again.

    Request migration: once chunks have reached the caller, a decoder that cannot go on
    (killed or unreachable: no status of its own; or its own UNAVAILABLE
    ``DECODER_DRAINING`` or ``ENGINE_DEAD``) has its answer moved to the next replica,
    which continues it from the tokens sent so far (``GenerateRequest.continuation``, with
    fresh refs to the same embeddings from ``renew``); the caller sees one answer, no
    token repeated or lost. At most ``migration_limit`` moves per answer, and only while
    it is at most ``migration_max_seq_len`` tokens long; otherwise the failure is final
    (UNAVAILABLE ``DECODER_LOST_MID_STREAM``), never a replay that would repeat tokens.

    The decoder takes over the refs of its request: it reads each or releases those it
    will not read, and answers with a status of its own. A call that fails without one (the
    decoder was never reached) leaves them to this stage, which releases them once no
    replica is left to try.

    Args:
        decoder: The router over the decoder endpoints, or one decoder's stub.
        releaser: Releases the refs of a request no decoder received.
        migration_limit: Moves of one answer (``GATEWAY_MIGRATION_LIMIT``; 0 = off).
        migration_max_seq_len: Tokens an answer may have and still move.
    """

    def __init__(
        self,
        decoder: decoder_service_pb2_grpc.DecoderServiceStub | DecoderRouter,
        releaser: handoff.Reader | None = None,
        migration_limit: int = 0,
        migration_max_seq_len: int = 8192,
    ) -> None:
        self.router = (
            decoder if isinstance(decoder, DecoderRouter) else DecoderRouter.single(decoder)
        )
        self.releaser = releaser
        self.migration_limit = migration_limit
        self.migration_max_seq_len = migration_max_seq_len

    async def stream(
        self,
        request: decoder_service_pb2.GenerateRequest,
        deadline: Deadline,
        affinity: str | None = None,
        renew: Renew | None = None,
    ) -> AsyncGenerator[decoder_service_pb2.GenerateResponse, None]:
        """The decoder's chunks for ``request``, within the request's deadline; observes
        the inter-token latency (``splitvl_gateway_inter_token_latency_seconds``).

        Args:
            affinity: The request's affinity key (the identity of its first image or
                video served), sent as the ``x-splitvl-affinity`` header; None routes to
                the least loaded endpoint.
            renew: Builds the request again with fresh refs to its embeddings, for a move
                to another replica; None: answers do not move.

        Closing the iterator (the client went away) cancels the decoder call, which
        aborts the vLLM request.

        Raises:
            RefsLost: the decoder could not read a held ref, before any chunk.
            ServiceError: the decoder's status otherwise, naming it as the dependency;
                UNAVAILABLE when every replica failed before a chunk;
                UNAVAILABLE ``DECODER_LOST_MID_STREAM`` when the answer's decoder was lost
                and it could not move.
        """
        metadata = ((AFFINITY_HEADER, affinity),) if affinity else None
        answer = _Answer(self.migration_max_seq_len)
        moves = 0
        moved: _Lost | None = None
        while True:
            endpoints, how = self._candidates(affinity)
            got = False  # a chunk of this call reached the caller
            try:
                # aclosing: the caller closing this stream closes the call at once.
                async with contextlib.aclosing(
                    self._attempts(
                        endpoints, how, request, deadline, metadata, moved, answer.tokens
                    )
                ) as attempts:
                    async for chunk in attempts:
                        if moved is not None and not got:
                            _check_continued(chunk, answer)
                        got = True
                        answer.add(chunk)
                        yield chunk
                return
            except _Lost as lost:
                self.router.mark_down(lost.endpoint)
                moved = lost
            except (ServiceError, RefsLost) as err:
                # Only the call meant to continue a moved answer, failing before its first
                # chunk, may move it again; any other failure is the caller's as it is.
                if moved is None or got or _deadline_exceeded(err):
                    raise
                _move_again_or_raise(err, moved)
            request = await self._move(renew, request, deadline, answer, moved, moves)
            moves += 1

    def _candidates(self, affinity: str | None) -> tuple[list[Endpoint], str]:
        """The endpoints to try for one call, in order, and how they were chosen (the
        ``splitvl_gateway_decoder_routes_total`` label of the first)."""
        endpoints, how = self.router.candidates(affinity)
        if len(endpoints) == 1:
            # One endpoint: a proxy in front of the replicas (GATEWAY_DECODER_ROUTING=
            # proxy; HAProxy re-dispatches a call whose server is gone) or a channel
            # over several addresses. A second try goes through it to another replica.
            endpoints = endpoints * 2
        return endpoints, how

    async def _move(
        self,
        renew: Renew | None,
        request: decoder_service_pb2.GenerateRequest,
        deadline: Deadline,
        answer: _Answer,
        moved: _Lost,
        moves: int,
    ) -> decoder_service_pb2.GenerateRequest:
        """The request that continues ``answer`` on another replica, after its decoder
        ``moved`` could not go on (``moves``: the answer's moves so far).

        Raises:
            ServiceError: ``moved.error`` (UNAVAILABLE ``DECODER_LOST_MID_STREAM``) when
                the answer cannot move (counted in
                ``splitvl_gateway_migration_failures_total`` by reason) or its refs cannot
                be had again; DEADLINE_EXCEEDED when the request's deadline has passed.
        """
        why_not = self._why_not(moves, answer, renew)
        if why_not:
            metrics.MIGRATION_FAILURES.labels(reason=why_not).inc()
            raise moved.error
        assert renew is not None  # else _why_not said "off"
        deadline.check(what="its answer moved to another decoder replica")
        return await self._continuation(renew, request, answer, moved)

    def _why_not(self, moves: int, answer: _Answer, renew: Renew | None) -> str:
        """Why an answer cannot move (a ``splitvl_gateway_migration_failures_total``
        reason), or "" when it can."""
        if renew is None or self.migration_limit == 0:
            return "off"
        if moves >= self.migration_limit:
            return "limit"
        if answer.token_ids is None:
            return "too_long"
        return ""

    async def _continuation(
        self,
        renew: Renew,
        request: decoder_service_pb2.GenerateRequest,
        answer: _Answer,
        lost: _Lost,
    ) -> decoder_service_pb2.GenerateRequest:
        """``request`` with fresh refs and the answer so far as its continuation.

        Raises:
            ServiceError: ``lost.error`` when the refs cannot be had again.
        """
        assert answer.token_ids is not None
        log.warning(
            "decoder %s cannot go on with an answer (%s, %d tokens sent): moving it",
            lost.endpoint.address,
            lost.reason,
            answer.tokens,
        )
        try:
            fresh = await renew(request)
        except (ServiceError, RefsLost) as err:
            metrics.MIGRATION_FAILURES.labels(reason="refused").inc()
            log.warning("no embeddings to move the answer with: %s", err)
            raise lost.error from err
        fresh.continuation.Clear()
        fresh.continuation.token_ids.extend(answer.token_ids)
        fresh.continuation.text_chars = answer.text_chars
        metrics.MIGRATIONS.labels(reason=lost.reason).inc()
        return fresh

    async def _attempts(
        self,
        endpoints: list[Endpoint],
        how: str,
        request: decoder_service_pb2.GenerateRequest,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...] | None,
        moved: _Lost | None,
        sent: int,
    ) -> AsyncGenerator[decoder_service_pb2.GenerateResponse, None]:
        """The endpoints in turn until one answers (a replay before its first chunk).

        ``moved``: the replica this answer moves from (``sent`` tokens already sent), for
        the route's label and the span event naming both.
        """
        for attempt, endpoint in enumerate(endpoints):
            last = attempt == len(endpoints) - 1
            label = "migrated" if moved is not None else how if attempt == 0 else "failover"
            metrics.DECODER_ROUTES.labels(how=label).inc()
            if moved is not None:
                trace.get_current_span().add_event(
                    "decoder.migrated",
                    {
                        "splitvl.migration.from": moved.endpoint.address,
                        "splitvl.migration.to": endpoint.address,
                        "splitvl.migration.reason": moved.reason,
                        "splitvl.migration.tokens": sent,
                    },
                )
            try:
                call = self._attempt(endpoint, request, deadline, metadata, last)
                async with contextlib.aclosing(call) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except _Replay as replay:
                self.router.mark_down(endpoint)
                log.warning(
                    "decoder %s failed before its first token (%s); replaying on another",
                    endpoint.address,
                    replay.err.code().name,
                )
        if not endpoints:  # no call made: the refs are still this stage's to release
            release(self.releaser, [*request.images, *(v.embedding for v in request.videos)])
        raise Refusal.DECODER_UNAVAILABLE.error(
            "no decoder endpoint is in service", dependency="decoder"
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
            _Lost: its decoder cannot go on with the answer after its first chunk.
            RefsLost, ServiceError: as :meth:`stream`.
        """
        gauge = metrics.DECODER_INFLIGHT.labels(endpoint=endpoint.address)
        with self.router.track(endpoint), gauge.track_inprogress():
            call = endpoint.stub.Generate(request, timeout=deadline.remaining(), metadata=metadata)
            first = True
            finished = False
            t_last = time.perf_counter()
            try:
                async for chunk in call:
                    now = time.perf_counter()
                    if chunk.token_ids and not first:
                        metrics.ITL.observe((now - t_last) / len(chunk.token_ids))
                    t_last, first = now, False
                    finished = chunk.finish_reason != 0
                    yield chunk
            except grpc.aio.AioRpcError as err:
                if finished:
                    # The answer was whole (its last chunk came) and only the status was
                    # lost: nothing to replay or move.
                    log.info("decoder %s lost after the last chunk", endpoint.address)
                    return
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
        move = MOVE_REASONS.get(info.reason) if info is not None else None
        if not first and (gone or move):
            why = info.reason if info is not None else err.details() or err.code().name
            raise _Lost(
                Refusal.DECODER_LOST_MID_STREAM.error(
                    f"decoder {endpoint.address} became unavailable after the answer had "
                    f"started ({why}); the answer is incomplete and could not continue on "
                    "another replica: retry the request",
                    dependency="decoder",
                    endpoint=endpoint.address,
                ),
                endpoint,
                move or "lost",
            ) from err
        raise error from err
