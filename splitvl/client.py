"""A small Python client for ``GatewayService/Generate`` (used by the CLI, demo and tests)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenvl.common.v1 import generation_pb2
from qwenvl.gateway.v1 import gateway_service_pb2 as pb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from vlcommon.request_rules import TIER_NAMES
from vlcommon.settings import channel_options
from vlcommon.tls import ClientSecurity, sync_channel


@dataclass
class Result:
    """Everything one streamed Generate returned."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    videos: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    client_ttft_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "images": self.images,
            "videos": self.videos,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "timings": self.timings,
        }


def image_input(source: str) -> pb.ImageInput:
    """An ``ImageInput`` from what a user typed after ``--image``.

    Args:
        source: An ``http://`` or ``https://`` URL (sent as ``url``: the gateway fetches it,
            only when it runs with ``GATEWAY_ALLOW_URLS=true``), an RFC 2397 ``data:`` URL
            (sent as ``data_url``), or a file path (its bytes sent as ``data``).

    Raises:
        OSError: the file cannot be read (e.g. ``FileNotFoundError``).
    """
    if source.lower().startswith(("http://", "https://")):
        return pb.ImageInput(url=source)
    if source.lower().startswith("data:"):
        return pb.ImageInput(data_url=source)
    return pb.ImageInput(data=Path(source).read_bytes())


def video_input(source: str, *, sample_fps: float = 0.0, max_frames: int = 0) -> pb.VideoInput:
    """A ``VideoInput`` (an encoded file) from what a user typed after ``--video``.

    Args:
        source: A URL (``url``, fetched by the gateway when GATEWAY_ALLOW_URLS is on), a
            ``data:`` URL, or a file path (its bytes).
        sample_fps: Frames per second to sample; 0 = the server's default (2).
        max_frames: Most frames to keep; 0 = the server's default.

    Raises:
        OSError: the file cannot be read.
    """
    if source.lower().startswith(("http://", "https://")):
        file = pb.VideoFile(url=source)
    elif source.lower().startswith("data:"):
        file = pb.VideoFile(data_url=source)
    else:
        file = pb.VideoFile(data=Path(source).read_bytes())
    return pb.VideoInput(file=file, sample_fps=sample_fps, max_frames=max_frames)


def build_request(
    images: Sequence[bytes | pb.ImageInput | pb.VideoInput],
    prompt: str,
    *,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    cache_policy: int = generation_pb2.CACHE_POLICY_UNSPECIFIED,
    seed: int | None = None,
) -> pb.GenerateRequest:
    """One user message: the images first, then the prompt text (greedy by default).

    Args:
        images: Encoded image files (bytes, sent as ``ImageInput.data``) or ready
            ``ImageInput`` messages (e.g. from ``image_input``, for URLs), and videos
            (``VideoInput``, e.g. from ``video_input``), in the order given.
        max_tokens: Output token limit; None leaves it unset (the decoder's
            ``DECODER_MAX_TOKENS_DEFAULT``, 256).
    """
    request = pb.GenerateRequest(cache_policy=cache_policy)
    message = request.messages.add(role="user")
    for image in images:
        if isinstance(image, pb.VideoInput):
            message.parts.add(video=image)
        elif isinstance(image, pb.ImageInput):
            message.parts.add(image=image)
        else:
            message.parts.add(image=pb.ImageInput(data=image))
    if prompt:
        message.parts.add(text=prompt)
    request.sampling.temperature = temperature
    request.sampling.ignore_eos = ignore_eos
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    if seed is not None:
        request.sampling.seed = seed
    return request


def consume(responses: Any, on_text: Callable[[str], None] | None = None) -> Result:
    """Collect a Generate stream (a sync iterator of GenerateResponse)."""
    result = Result()
    t0 = time.perf_counter()
    for chunk in responses:
        if chunk.images:
            result.client_ttft_ms = (time.perf_counter() - t0) * 1000
            result.images = [
                {
                    "index": im.index,
                    "tier": TIER_NAMES.get(im.tier, "unspecified"),
                    "similarity": round(float(im.similarity), 6),
                    "grid": [im.grid.t, im.grid.h, im.grid.w],
                    # A similarity hit may serve the stored entry's grid (docs/cache.md).
                    "served_grid": [im.served_grid.t, im.served_grid.h, im.served_grid.w],
                    "requested_grid": [
                        im.requested_grid.t,
                        im.requested_grid.h,
                        im.requested_grid.w,
                    ],
                    "tokens": im.tokens,
                    "key": im.key,
                    # False: answered by the file's digest, its pixels never decoded.
                    "decoded": im.decoded,
                }
                for im in chunk.images
            ]
        if chunk.videos:
            result.videos = [
                {
                    "index": v.index,
                    "tier": TIER_NAMES.get(v.tier, "unspecified"),
                    "grid": [v.grid.t, v.grid.h, v.grid.w],
                    "tokens": v.tokens,
                    "frames": v.frames,
                    "timestamps": [round(t, 6) for t in v.timestamps],
                    "frame_indices": list(v.frame_indices),
                    "source_frames": v.source_frames,
                    "key": v.key,
                }
                for v in chunk.videos
            ]
        result.token_ids.extend(chunk.token_ids)
        result.text += chunk.text
        if on_text is not None and chunk.text:
            on_text(chunk.text)
        if chunk.finish_reason:
            result.finish_reason = (
                generation_pb2.FinishReason.Name(chunk.finish_reason)
                .removeprefix("FINISH_REASON_")
                .lower()
            )
            result.usage = {
                "prompt_tokens": chunk.usage.prompt_tokens,
                "completion_tokens": chunk.usage.completion_tokens,
            }
            t = chunk.timings
            result.timings = {
                name: round(getattr(t, name), 3)
                for name in (
                    "preprocess_ms",
                    "lookup_ms",
                    "encode_ms",
                    "put_ms",
                    "ttft_ms",
                    "decode_ms",
                    "total_ms",
                )
            }
    return result


def generate(
    address: str,
    request: pb.GenerateRequest,
    *,
    timeout_s: float | None = 300.0,
    on_text: Callable[[str], None] | None = None,
    security: ClientSecurity | None = None,
) -> Result:
    """Call Generate and collect the stream.

    Args:
        security: TLS roots, client certificate and bearer token; by default from the
            ``SPLITVL_TLS_*`` and ``SPLITVL_AUTH_TOKEN`` environment (docs/security.md).

    Raises:
        grpc.RpcError: the call failed (``.code()`` and ``.details()`` say why).
    """
    security = security or ClientSecurity.from_env()
    with sync_channel(address, security, options=channel_options()) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        call = stub.Generate(request, timeout=timeout_s, metadata=security.metadata() or None)
        return consume(call, on_text)
