"""Server-side interception shared by the services: one handler-kind dispatch, and the
interceptors that map errors and gate on readiness.

grpc.aio runs a handler on the event loop only when it is a coroutine function or an async
generator function (a lambda returning a coroutine would go to a thread pool), so each
interceptor needs a named wrapper per handler kind. :func:`wrap_handler` writes those
wrappers once, around an async context manager that an interceptor supplies per call;
:class:`AroundInterceptor` is the base the project's interceptors (errors, readiness,
metrics, auth, admission) derive from.

* :class:`AroundChain`: several of them as one interceptor (one generator per streamed
  message instead of one per interceptor).
* :class:`ErrorInterceptor`: a :class:`~vlcommon.errors.ServiceError` raised by a handler
  becomes its status with ``google.rpc.ErrorInfo``; any other exception becomes INTERNAL
  naming the method (logged with its traceback), so handlers hold no try/except for either.
* :class:`ReadinessInterceptor`: until the service's engine has loaded, every call but
  health and reflection gets UNAVAILABLE ``<service> is starting`` at once, instead of
  waiting on an engine that is not there (a restarted decoder takes tens of seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from vlcommon.errors import ServiceError, abort
from vlcommon.refusals import Refusal

log = logging.getLogger(__name__)

#: Methods that never need a credential, never count against admission, and answer
#: before the engine is ready.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

#: Per-call context manager an interceptor wraps a handler in.
Around = Callable[[Any, grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]


def is_open_method(method: str) -> bool:
    """True for health checks and server reflection (no auth, no admission limit)."""
    return method.startswith(OPEN_METHOD_PREFIXES)


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """``handler`` with each call run inside ``around(request, context)``.

    For streaming responses the context spans the whole stream (until the last message, an
    error, or the consumer's cancellation at a ``yield``). For client-streaming kinds the
    ``request`` passed to ``around`` is the request iterator.
    """
    if handler.unary_unary is not None or handler.stream_unary is not None:
        kind = "unary_unary" if handler.unary_unary is not None else "stream_unary"
        inner = getattr(handler, kind)

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(request, context):
                return await inner(request, context)

        return handler._replace(**{kind: unary})  # type: ignore[attr-defined,no-any-return]

    kind = "unary_stream" if handler.unary_stream is not None else "stream_stream"
    inner_stream = getattr(handler, kind)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with around(request, context):
            async for item in inner_stream(request, context):
                yield item

    return handler._replace(**{kind: streaming})  # type: ignore[attr-defined,no-any-return]


class AroundInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Base for an interceptor that runs each call of a handler inside a context manager.

    Subclasses implement :meth:`around` (return None to leave a method untouched); health
    and reflection are left untouched unless ``open_methods_too`` is set.
    """

    open_methods_too = False

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around | None:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or (is_open_method(method) and not self.open_methods_too):
            return handler
        around = self.around(method, handler_call_details)
        return handler if around is None else wrap_handler(handler, around)


class AroundChain(AroundInterceptor):
    """Several :class:`AroundInterceptor` as one interceptor: each call runs inside every
    member's context, the first outermost, exactly as if each were its own interceptor.

    Each interceptor of a streaming method wraps the response stream in an async generator
    of its own, so every message (a token) passes once through each; a chain of five
    (metrics, auth, readiness, admission, errors) cost five generator hops per token in each
    service. As one interceptor, the contexts are entered once per call (an
    ``AsyncExitStack``, which nests them as ``async with`` statements would) and each
    message passes through one generator.
    """

    def __init__(self, members: list[AroundInterceptor]) -> None:
        self.members = members

    # Each member decides for itself whether it wraps health and reflection.
    open_methods_too = True

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around | None:
        is_open = is_open_method(method)
        arounds = [
            around
            for member in self.members
            if not is_open or member.open_methods_too
            if (around := member.around(method, handler_call_details)) is not None
        ]
        if len(arounds) <= 1:
            return arounds[0] if arounds else None

        @contextlib.asynccontextmanager
        async def nested(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            async with contextlib.AsyncExitStack() as stack:
                for around in arounds:
                    await stack.enter_async_context(around(request, context))
                yield

        return nested


class ErrorInterceptor(AroundInterceptor):
    """Maps what a handler raises to a status: ServiceError -> its code and ErrorInfo,
    anything else (a bug) -> INTERNAL naming the method, logged with its traceback.

    Cancellation (``CancelledError``, ``GeneratorExit``) and an abort already under way
    pass through untouched.
    """

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around:
        @contextlib.asynccontextmanager
        async def mapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            try:
                yield
            except ServiceError as err:
                await abort(context, err)
            except (asyncio.CancelledError, GeneratorExit, grpc.aio.AbortError):
                raise
            except Exception:
                log.exception("unexpected error in %s", method)
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"internal error in {method.rsplit('/', 1)[-1]} (see the service's log)",
                )

        return mapped


class ReadinessInterceptor(AroundInterceptor):
    """Answers UNAVAILABLE ``<service> is starting`` until :meth:`set_ready`.

    Args:
        service: The service's short name, named in the message (``decoder``).
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.ready = False

    def set_ready(self) -> None:
        self.ready = True

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around | None:
        if self.ready:
            return None
        service = self.service

        @contextlib.asynccontextmanager
        async def starting(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            await abort(
                context,
                Refusal.SERVICE_STARTING.error(
                    f"{service} is starting (its engine is loading); retry shortly", service=service
                ),
            )
            yield  # pragma: no cover - abort raises

        return starting
