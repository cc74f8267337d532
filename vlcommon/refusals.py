"""The registry of refusals: every ErrorInfo reason splitvl sends, with its gRPC status.

One :class:`Refusal` member per reason, in the style of TGI's ``ValidationError`` enum
(``router/src/validation.rs``): the member is the reason (a ``StrEnum``: it equals its
string, so ErrorInfo on the wire is what it was), and carries the gRPC status it is raised
with, the field it names (or the metadata key it carries) and a one-line meaning. A
service builds its error from the member, so a reason cannot be raised with two statuses::

    raise Refusal.IMAGE_DECODE_FAILED.error(
        f"{field} could not be decoded: {why}", field=field
    )

A rule has one owner (a function in ``vlcommon.sampling``, ``vlcommon.request_rules``,
``gateway.media``, ...) that every front calls; the registry says which reasons exist.
Relays are the one exception to "one status": a service passing on a dependency's refusal
keeps its reason under the status its own caller should see
(:func:`vlcommon.relay.from_rpc_error`; the cache's ``Put`` answers a ref it could not
read with FAILED_PRECONDITION).

The table of ``docs/api.md``'s "Errors" section is generated from here
(``tests/unit/vlcommon/test_refusals.py`` fails when it drifts)::

    python -m vlcommon.refusals --write-docs docs/api.md
"""

from __future__ import annotations

import argparse
import sys
from enum import StrEnum, auto
from pathlib import Path

import grpc

from vlcommon.errors import ServiceError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
_DENIED = grpc.StatusCode.PERMISSION_DENIED
#: An error of the OpenAI front's HTTP layer itself (a 404 path, a stalled body): it has no
#: gRPC status; ``http_status`` is the answer's.
_HTTP_ONLY = None


class Refusal(StrEnum):
    """Every ErrorInfo reason (and OpenAI error ``code``), with its status.

    Attributes:
        status: The gRPC status it is raised with; None for an error of the OpenAI front's
            HTTP layer only (see ``http_status``).
        field: The ErrorInfo ``field`` it names (``images[i]``: one per image), or the
            metadata it carries instead (``service=...``); empty when it carries none.
        meaning: What it refuses, in one line.
        http_status: The HTTP status of an HTTP-only error, else None (a gRPC status maps
            to HTTP in ``gateway.openai_protocol``).
    """

    status: grpc.StatusCode | None
    field: str
    meaning: str
    http_status: int | None

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list[str]) -> str:
        return name  # the reason is the member's name, as sent (StrEnum's auto() lowercases)

    def __new__(
        cls,
        value: str,
        status: grpc.StatusCode | None,
        field: str,
        meaning: str,
        http_status: int | None = None,
    ) -> Refusal:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.field = field
        member.meaning = meaning
        member.http_status = http_status
        return member

    def error(
        self, message: str, *, retry_after_ms: int | None = None, **metadata: object
    ) -> ServiceError:
        """The ServiceError of this refusal, with the registry's status.

        Args:
            message: Human-readable, naming the field and, where one applies, the limit.
            retry_after_ms: A retry hint (over-capacity answers): RetryInfo and
                ``retry-after-ms``.
            **metadata: ErrorInfo metadata, in order: ``field=...``, ``limit=...`` (or
                ``service=...``), then any others; values are sent as strings.

        Raises:
            TypeError: For an HTTP-only refusal, which has no gRPC status.
        """
        if self.status is None:
            raise TypeError(f"{self.name} is an HTTP-only refusal; it has no gRPC status")
        return ServiceError(
            self.status,
            self,
            message,
            {k: str(v) for k, v in metadata.items()},
            retry_after_ms=retry_after_ms,
        )

    # One member per line or two (the meaning wrapped): the registry reads as a table.
    # fmt: off
    # -- shared request rules (gateway gRPC and OpenAI fronts, decoder) ---------------------
    MESSAGES_EMPTY = auto(), _INVALID, "messages", "a request without messages"
    TOO_MANY_MESSAGES = auto(), _INVALID, "messages", (
        "more messages than the limit (GATEWAY_MAX_MESSAGES, DECODER_MAX_MESSAGES)"
    )
    PARTS_EMPTY = auto(), _INVALID, "messages[i].parts", "a message without content parts"
    PART_EMPTY = auto(), _INVALID, "messages[i].parts[j]", (
        "a content part with none of text, image, video"
    )
    TOO_MANY_PARTS = auto(), _INVALID, "messages", (
        "more content parts over all messages than the limit (GATEWAY_MAX_PARTS)"
    )
    TEXT_TOO_LONG = auto(), _INVALID, "messages", (
        "more characters of text over all messages than GATEWAY_MAX_TEXT_CHARS"
    )
    ROLE_INVALID = auto(), _INVALID, "messages[i].role", "a role other than system, user, assistant"
    REASONING_CONTENT_NOT_ASSISTANT = auto(), _INVALID, "messages[i].reasoning_content", (
        "reasoning_content on a message that is not the assistant's"
    )
    TEXT_CONTAINS_SPECIAL_TOKEN = auto(), _INVALID, "messages[i].parts[j].text", (
        "text that holds, or across parts forms, a control token such as <|image_pad|>"
    )
    TOO_MANY_IMAGES = auto(), _INVALID, "images", (
        "more images in one request than the limit (GATEWAY_MAX_IMAGES, per prompt at the "
        "decoder, per call at the encoder)"
    )
    TOO_MANY_VIDEOS = auto(), _INVALID, "videos", (
        "more videos in one request than the limit (GATEWAY_MAX_VIDEOS, per prompt)"
    )
    # -- sampling (vlcommon.sampling) -------------------------------------------------------
    MAX_TOKENS_OUT_OF_RANGE = auto(), _INVALID, "sampling.max_tokens", (
        "max_tokens outside 1..the limit (GATEWAY_MAX_TOKENS_LIMIT, DECODER_MAX_TOKENS_LIMIT)"
    )
    TEMPERATURE_OUT_OF_RANGE = auto(), _INVALID, "sampling.temperature", (
        "temperature outside 0..2, not finite, or (OpenAI front) not a 32-bit float"
    )
    TOP_P_OUT_OF_RANGE = auto(), _INVALID, "sampling.top_p", (
        "top_p set outside (0, 1] (0 included, as vLLM refuses it) or not a 32-bit float"
    )
    STOP_INVALID = auto(), _INVALID, "sampling.stop[k]", (
        "more than 16 stop strings, or one empty or over 256 characters"
    )
    SAMPLING_INVALID = auto(), _INVALID, "sampling", (
        "sampling parameters vLLM's SamplingParams refuses (decoder)"
    )
    # -- the gateway's request --------------------------------------------------------------
    CACHE_POLICY_INVALID = auto(), _INVALID, "cache_policy", (
        "a cache policy that is not a CachePolicy value (gateway, cache Lookup)"
    )
    PIXEL_BUDGET_INVALID = auto(), _INVALID, "pixel_budget", (
        "min_pixels under (patch_size x merge)^2, or max_pixels under min_pixels or over the "
        "model's"
    )
    REQUEST_UNDECODABLE = auto(), _INVALID, "request", (
        "request bytes that do not parse as the RPC's protobuf message"
    )
    # -- the OpenAI front -------------------------------------------------------------------
    REQUEST_INVALID = auto(), _INVALID, "body, or the field", (
        "a body that is not JSON, or does not match the chat completion request's schema"
    )
    REQUEST_TOO_LARGE = auto(), _EXHAUSTED, "body", (
        "a body over GATEWAY_MAX_MESSAGE_BYTES (HTTP 413)"
    )
    PARAMETER_UNSUPPORTED = auto(), _INVALID, "the parameter", (
        "a parameter or value the front does not serve (n > 1, tools, logprobs, ...)"
    )
    MODEL_NOT_FOUND = auto(), _NOT_FOUND, "model", "a model this server does not serve"
    PRIORITY_OUT_OF_RANGE = auto(), _INVALID, "priority", "a priority outside the 32-bit range"
    SEED_OUT_OF_RANGE = auto(), _INVALID, "seed", "a seed outside the 64-bit range"
    TEXT_NOT_UTF8 = auto(), _INVALID, "messages[i].content", (
        "text holding a lone surrogate (\\ud800-\\udfff), which UTF-8 cannot carry"
    )
    NOT_FOUND = auto(), _HTTP_ONLY, "", "a path the front does not serve (HTTP 404)", 404
    METHOD_NOT_ALLOWED = auto(), _HTTP_ONLY, "", (
        "an HTTP method the path does not take (HTTP 405)"
    ), 405
    BODY_READ_TIMEOUT = auto(), _HTTP_ONLY, "body", (
        "a body that stopped arriving for GATEWAY_HTTP_BODY_TIMEOUT_S (HTTP 408)"
    ), 408
    CONTENT_ENCODING_UNSUPPORTED = auto(), _HTTP_ONLY, "body", (
        "a compressed body (Content-Encoding other than identity; HTTP 415)"
    ), 415
    # -- images -----------------------------------------------------------------------------
    IMAGE_SOURCE_MISSING = auto(), _INVALID, "images[i]", (
        "an image with none of data, data_url, url"
    )
    DATA_URL_INVALID = auto(), _INVALID, "images[i].data_url", (
        "not a base64 data URL, or not of the part's media type (image/*, video/*)"
    )
    IMAGE_BYTES_TOO_LARGE = auto(), _EXHAUSTED, "images[i]", (
        "an image's encoded bytes over GATEWAY_MAX_IMAGE_BYTES (by value, data URL or URL)"
    )
    IMAGE_DECODE_FAILED = auto(), _INVALID, "images[i]", (
        "bytes that are empty or not an image Pillow decodes"
    )
    IMAGE_TOO_LARGE = auto(), _EXHAUSTED, "images[i]", (
        "an image of more decoded pixels than GATEWAY_MAX_DECODED_PIXELS (read from its "
        "header)"
    )
    IMAGE_ASPECT_RATIO_TOO_LARGE = auto(), _INVALID, "images[i]", (
        "an aspect ratio over 200 (qwen-vl-utils' MAX_RATIO)"
    )
    REQUEST_PIXELS_TOO_LARGE = auto(), _EXHAUSTED, "images", (
        "the request's images hold more decoded pixels together than "
        "GATEWAY_MAX_REQUEST_PIXELS"
    )
    # -- URLs (gateway.fetch) ---------------------------------------------------------------
    IMAGE_URLS_DISABLED = auto(), _PRECONDITION, "images[i].url", (
        "an image URL on a server with GATEWAY_ALLOW_URLS off"
    )
    VIDEO_URLS_DISABLED = auto(), _PRECONDITION, "videos[i].url", (
        "a video URL on a server with GATEWAY_ALLOW_URLS off"
    )
    URL_INVALID = auto(), _INVALID, "images[i].url", (
        "not an http(s) URL with a valid host (or a redirect to one that is not)"
    )
    URL_TOO_LONG = auto(), _INVALID, "images[i].url", "a URL over GATEWAY_URL_MAX_CHARS"
    URL_ADDRESS_FORBIDDEN = auto(), _INVALID, "images[i].url", (
        "a host that resolves to a private, loopback or reserved address (SSRF guard)"
    )
    URL_TOO_MANY_REDIRECTS = auto(), _INVALID, "images[i].url", (
        "more redirects than GATEWAY_URL_MAX_REDIRECTS"
    )
    URL_FETCH_REJECTED = auto(), _INVALID, "images[i].url", (
        "the host answered 4xx, or a redirect without a Location"
    )
    URL_FETCH_FAILED = auto(), _UNAVAILABLE, "images[i].url", (
        "the host could not be reached, answered 5xx, or the fetches outlasted "
        "GATEWAY_URL_TOTAL_TIMEOUT_S"
    )
    URL_FETCHES_BUSY = auto(), _EXHAUSTED, "images", (
        "more URL fetches in flight than GATEWAY_URL_MAX_INFLIGHT (with a retry hint)"
    )
    # -- videos (gateway.video, gateway.request) --------------------------------------------
    VIDEO_NOT_SUPPORTED = auto(), _UNIMPLEMENTED, "messages[i].parts[j].video", (
        "a video on a server without the checkpoint's video processor config"
    )
    VIDEO_SOURCE_MISSING = auto(), _INVALID, "videos[i]", (
        "a video file with none of data, data_url, url"
    )
    VIDEO_SOURCE_AMBIGUOUS = auto(), _INVALID, "messages[i].parts[j].video", (
        "a video with both a file and frames"
    )
    VIDEO_TOO_FEW_FRAMES = auto(), _INVALID, "messages[i].parts[j].video.frames", (
        "a video with neither a file nor frames"
    )
    VIDEO_TOO_MANY_FRAMES = auto(), _EXHAUSTED, "messages[i].parts[j].video.frames", (
        "a video sent as more frames than GATEWAY_VIDEO_MAX_FRAMES"
    )
    VIDEO_FRAME_URL = auto(), _INVALID, "messages[i].parts[j].video.frames[k]", (
        "a video frame given by URL (frames go by value, a video file may be a URL)"
    )
    VIDEO_FPS_OUT_OF_RANGE = auto(), _INVALID, "messages[i].parts[j].video.sample_fps", (
        "sample_fps outside 0..GATEWAY_VIDEO_MAX_FPS, or a frames video's fps negative or not"
        " finite"
    )
    VIDEO_MAX_FRAMES_OUT_OF_RANGE = auto(), _INVALID, "messages[i].parts[j].video.max_frames", (
        "max_frames outside 0..GATEWAY_VIDEO_MAX_FRAMES"
    )
    VIDEO_MAX_PIXELS_OUT_OF_RANGE = auto(), _INVALID, "messages[i].parts[j].video.max_pixels", (
        "max_pixels outside the video processor's bounds"
    )
    VIDEO_BYTES_TOO_LARGE = auto(), _EXHAUSTED, "videos[i]", (
        "a video file's bytes over GATEWAY_MAX_VIDEO_BYTES (by value, data URL or URL)"
    )
    VIDEO_UNDECODABLE = auto(), _INVALID, "videos[i]", (
        "an empty file, or not a container FFmpeg reads"
    )
    VIDEO_NO_VIDEO_STREAM = auto(), _INVALID, "videos[i]", (
        "a container without a video stream (audio only)"
    )
    VIDEO_IS_AN_IMAGE = auto(), _INVALID, "videos[i]", "a still image sent as a video"
    VIDEO_TRUNCATED = auto(), _INVALID, "videos[i]", (
        "a video whose frames stop before its index says"
    )
    VIDEO_TOO_LONG = auto(), _EXHAUSTED, "videos[i]", (
        "a video longer than GATEWAY_MAX_VIDEO_DURATION_S"
    )
    VIDEO_FRAME_TOO_LARGE = auto(), _EXHAUSTED, "videos[i]", (
        "frames of more pixels than GATEWAY_VIDEO_MAX_DECODED_PIXELS"
    )
    VIDEO_FRAME_SIZE_MISMATCH = auto(), _INVALID, "videos[i]", "a video whose frames change size"
    VIDEO_ASPECT_RATIO_TOO_LARGE = auto(), _INVALID, "videos[i]", (
        "a frame aspect ratio over 200 (qwen-vl-utils' MAX_RATIO)"
    )
    VIDEO_TOKENS_TOO_MANY = auto(), _EXHAUSTED, "videos[i]", (
        "a video needing more tokens than the request has left of GATEWAY_MAX_VIDEO_TOKENS"
    )
    # -- tensors, grids, embeddings (internal contracts) ------------------------------------
    TENSOR_DTYPE_UNSUPPORTED = auto(), _INVALID, "<tensor>.dtype", (
        "a tensor dtype the field does not take"
    )
    TENSOR_SHAPE_INVALID = auto(), _INVALID, "<tensor>.shape", (
        "a tensor of the wrong rank, too many dimensions or a negative one"
    )
    TENSOR_SIZE_MISMATCH = auto(), _INVALID, "<tensor>.data", (
        "a tensor whose bytes are not its shape times its dtype's size"
    )
    GRID_MISSING = auto(), _INVALID, "images[i].grid", (
        "an image without its image_grid_thw (decoder)"
    )
    GRID_INVALID = auto(), _INVALID, "images[i].grid", (
        "a grid that is not [t, h, w] with h, w positive multiples of spatial_merge_size"
    )
    GRID_TOO_LARGE = auto(), _INVALID, "images[i].grid", (
        "a grid of more patches than the limit (t*h*w)"
    )
    EMBEDDINGS_MISSING = auto(), _INVALID, "images[i].embeddings", (
        "an image without its embeddings (decoder)"
    )
    EMBEDDING_SHAPE_MISMATCH = auto(), _INVALID, "images[i].embeddings", (
        "embeddings whose rows are not the grid's tokens, or whose width is not the model's"
    )
    EMBEDDING_NOT_FINITE = auto(), _INVALID, "images[i].embeddings", (
        "embeddings holding NaN or inf (decoder, cache Put)"
    )
    IMAGE_TOO_MANY_TOKENS = auto(), _INVALID, "images[i]", (
        "an image of more tokens than the decoder takes per image"
    )
    EMBEDDING_REF_INVALID = auto(), _INVALID, "images[i].ref", (
        "an embedding ref without holder or ticket, or whose size or segment disagrees"
    )
    EMBEDDING_REF_TOO_LARGE = auto(), _INVALID, "images[i].ref", (
        "an embedding ref of more bytes than one ref may hold"
    )
    EMBEDDING_REF_GONE = auto(), _UNAVAILABLE, "images[i].ref", (
        "the holder of an embedding ref no longer has its bytes (released, expired, "
        "restarted); encode again"
    )
    EMBEDDING_HOLDER_UNAVAILABLE = auto(), _UNAVAILABLE, "images[i].ref", (
        "the holder of an embedding ref could not be read in time"
    )
    TICKET_INVALID = auto(), _INVALID, "ticket", (
        "a ReadEmbedding or ReleaseEmbedding ticket of the wrong length"
    )
    TICKET_UNKNOWN = auto(), _NOT_FOUND, "ticket", (
        "a ticket the holder has no embeddings for (ReadEmbedding; its reader answers "
        "EMBEDDING_REF_GONE)"
    )
    HANDOFF_FULL = auto(), _EXHAUSTED, "images", (
        "the embeddings held for readers are at their byte budget (with a retry hint)"
    )
    TRANSPORT_UNSUPPORTED = auto(), _INVALID, "transport", (
        "a transport that is not a Transport value (encoder, cache)"
    )
    # -- the cache --------------------------------------------------------------------------
    KEY_MISSING = auto(), _INVALID, "queries[i].key", "an empty key"
    KEY_TOO_LONG = auto(), _INVALID, "queries[i].key", "a key over the key length limit"
    REVISION_TOO_LONG = auto(), _INVALID, "entries[i].revision", (
        "a model revision over the revision length limit (it is stored beside the entry)"
    )
    KEY_GRID_CONFLICT = auto(), _INVALID, "entries[i].embedding.grid", (
        "an entry whose key is already stored with another grid"
    )
    DESCRIPTOR_SHAPE_INVALID = auto(), _INVALID, "queries[i].descriptor.shape", (
        "a similarity descriptor that is not of the cache's dimension"
    )
    VIDEO_NOT_EXACT = auto(), _INVALID, "queries[i]", (
        "a similarity field on a video (videos are found by their exact key only)"
    )
    TOO_MANY_ITEMS = auto(), _INVALID, "queries", (
        "more queries or entries in one call than the cache's limit"
    )
    TOO_MANY_REUSABLE_GRIDS = auto(), _INVALID, "queries[i].reusable_grids", (
        "more reusable grids on one query than the limit"
    )
    VERIFICATION_SHAPE_INVALID = auto(), _INVALID, "entries[i].verification.shape", (
        "a verification image of an empty or too large shape, or chroma of the wrong size"
    )
    VERIFICATION_JPEG_INVALID = auto(), _INVALID, "entries[i].verification", (
        "a verification image's JPEG description (tables, clipped pixels) that is incomplete "
        "or out of range"
    )
    LOOKUP_RESPONSE_TOO_LARGE = auto(), _EXHAUSTED, "queries", (
        "the hits' embeddings would pass the response size limit"
    )
    ENTRY_TOO_LARGE = auto(), _EXHAUSTED, "entries[i].embedding", (
        "an entry larger than the cache's whole byte budget"
    )
    PUT_TOO_LARGE = auto(), _EXHAUSTED, "entries", (
        "a Put whose entries sent by reference hold more than the cache's byte budget together"
    )
    CACHE_FULL_LEASED = auto(), _EXHAUSTED, "entries[i]", (
        "no room: the cache's bytes are leased to lookups in flight (with a retry hint)"
    )
    # -- the encoder ------------------------------------------------------------------------
    IMAGES_EMPTY = auto(), _INVALID, "images", "an Encode call without images"
    OUTPUT_DTYPE_UNSUPPORTED = auto(), _INVALID, "output_dtype", (
        "an output dtype other than FP32 or BF16"
    )
    READERS_OUT_OF_RANGE = auto(), _INVALID, "readers", "a readers count outside 0..the limit"
    PIXELS_SHAPE_INVALID = auto(), _INVALID, "images[i].pixels.shape", (
        "pixels that are not [h, w, 3] or [frames, h, w, 3] of the plan's size"
    )
    RESIZE_PLAN_INVALID = auto(), _INVALID, "images[i]", (
        "a resize plan not of multiples of patch_size x merge, over the aspect ratio limit, "
        "or whose grid disagrees"
    )
    VIDEO_FRAMES_INVALID = auto(), _INVALID, "images[i]", (
        "a video whose frame count is not a multiple of the temporal patch size"
    )
    IMAGE_TOO_MANY_PATCHES = auto(), _EXHAUSTED, "images[i]", (
        "an image of more patches than the encoder takes"
    )
    VIDEO_TOO_MANY_PATCHES = auto(), _EXHAUSTED, "images[i]", (
        "a video of more patches than the encoder takes"
    )
    ENCODER_QUEUE_FULL = auto(), _EXHAUSTED, "images", (
        "the encoder's queue is full (with a retry hint)"
    )
    IMAGE_OUT_OF_MEMORY = auto(), _EXHAUSTED, "images", (
        "an image too large for the encoder's accelerator memory even alone"
    )
    ENCODER_LOADING = auto(), _UNAVAILABLE, "", "the encoder is still loading its model"
    # -- the decoder ------------------------------------------------------------------------
    IMAGE_INDEX_INVALID = auto(), _INVALID, "messages[i].parts[j].image_index", (
        "an image_index outside the request's images"
    )
    IMAGE_INDEX_REUSED = auto(), _INVALID, "messages[i].parts[j].image_index", (
        "one image referenced by two parts"
    )
    IMAGE_UNUSED = auto(), _INVALID, "images", "an image no part references"
    VIDEO_INDEX_INVALID = auto(), _INVALID, "messages[i].parts[j].video_index", (
        "a video_index outside the request's videos"
    )
    VIDEO_INDEX_REUSED = auto(), _INVALID, "messages[i].parts[j].video_index", (
        "one video referenced by two parts"
    )
    VIDEO_UNUSED = auto(), _INVALID, "videos", "a video no part references"
    VIDEO_TIMESTAMPS_INVALID = auto(), _INVALID, "videos[i].timestamps", (
        "a negative or non-finite timestamp"
    )
    VIDEO_TIMESTAMPS_MISMATCH = auto(), _INVALID, "videos[i].timestamps", (
        "not one timestamp per temporal patch of the grid"
    )
    PROMPT_TOO_LONG = auto(), _INVALID, "messages", (
        "the prompt (images included), or it plus max_tokens, over max_model_len"
    )
    CONTINUATION_INVALID = auto(), _INVALID, "continuation.token_ids", (
        "a migration's continuation with no tokens, too many, an id outside the vocabulary or"
        " a placeholder token, or text_chars past its text"
    )
    ENGINE_REJECTED = auto(), _INVALID, "request", "vLLM refused the request"
    ENGINE_NOT_READY = auto(), _UNAVAILABLE, "", "the decoder's engine is not ready yet"
    ENGINE_DEAD = auto(), _UNAVAILABLE, "", "the decoder's vLLM engine died; the decoder restarts"
    DECODER_DRAINING = auto(), _UNAVAILABLE, "", (
        "the decoder is stopping and hands its streams back (they move to another replica)"
    )
    # -- the gateway's pipeline and its dependencies -----------------------------------------
    PREPROCESS_BUSY = auto(), _EXHAUSTED, "images", (
        "more requests preparing images than GATEWAY_PREPROCESS_THREADS + _QUEUE (with a "
        "retry hint)"
    )
    ENCODER_BAD_RESPONSE = auto(), _UNAVAILABLE, "dependency=encoder", (
        "the encoder answered another number of embeddings than images"
    )
    ENCODER_UNAVAILABLE = auto(), _UNAVAILABLE, "dependency=encoder", (
        "the encoder could not be reached (or failed) and sent no reason of its own"
    )
    ENCODER_DEADLINE_EXCEEDED = auto(), _DEADLINE, "dependency=encoder", (
        "the encoder did not answer within the request's deadline"
    )
    ENCODER_RESOURCE_EXHAUSTED = auto(), _EXHAUSTED, "dependency=encoder", (
        "gRPC refused a message to or from the encoder as over its size limit"
    )
    ENCODER_UNIMPLEMENTED = auto(), _UNIMPLEMENTED, "dependency=encoder", (
        "the encoder does not serve the method (another version)"
    )
    ENCODER_PERMISSION_DENIED = auto(), _DENIED, "dependency=encoder", (
        "a proxy or mesh in front of the encoder denied the call (its authorization policy)"
    )
    ENCODER_UNAUTHENTICATED = auto(), _UNAUTHENTICATED, "dependency=encoder", (
        "a proxy or mesh in front of the encoder refused the call's credentials"
    )
    DECODER_UNAVAILABLE = auto(), _UNAVAILABLE, "dependency=decoder", (
        "no decoder is in service, or it could not be reached and sent no reason of its own"
    )
    DECODER_DEADLINE_EXCEEDED = auto(), _DEADLINE, "dependency=decoder", (
        "the decoder did not answer within the request's deadline"
    )
    DECODER_RESOURCE_EXHAUSTED = auto(), _EXHAUSTED, "dependency=decoder", (
        "gRPC refused a message to or from the decoder as over its size limit"
    )
    DECODER_UNIMPLEMENTED = auto(), _UNIMPLEMENTED, "dependency=decoder", (
        "the decoder does not serve the method (another version)"
    )
    DECODER_PERMISSION_DENIED = auto(), _DENIED, "dependency=decoder", (
        "a proxy or mesh in front of the decoder denied the call (its authorization policy)"
    )
    DECODER_UNAUTHENTICATED = auto(), _UNAUTHENTICATED, "dependency=decoder", (
        "a proxy or mesh in front of the decoder refused the call's credentials"
    )
    DECODER_LOST_MID_STREAM = auto(), _UNAVAILABLE, "dependency=decoder, endpoint", (
        "the decoder was lost after the first token and the answer could not move; retry"
    )
    CONTINUATION_NOT_CONFIRMED = auto(), _PRECONDITION, "", (
        "a decoder did not confirm a migrated answer's continuation (never shown to clients)"
    )
    INTERNAL = auto(), grpc.StatusCode.INTERNAL, "", "a bug; the service's log has the trace"
    # -- every service ----------------------------------------------------------------------
    SERVICE_STARTING = auto(), _UNAVAILABLE, "service=<name>", (
        "the service is loading its engine; retry shortly"
    )
    TOO_MANY_REQUESTS = auto(), _EXHAUSTED, "max_concurrent_rpcs", (
        "the service is at its concurrent-request limit (with a retry hint)"
    )
    DEADLINE_EXCEEDED = auto(), _DEADLINE, "", "the request's deadline passed"
    CANCELLED = auto(), grpc.StatusCode.CANCELLED, "", "the client went away or cancelled"
    AUTH_TOKEN_MISSING = auto(), _UNAUTHENTICATED, "authorization", (
        "no 'authorization: Bearer <token>' metadata on a server with GATEWAY_AUTH_TOKENS"
    )
    AUTH_TOKEN_INVALID = auto(), _UNAUTHENTICATED, "authorization", (
        "a bearer token the server does not accept"
    )
    INTERNAL_TOKEN_MISSING = auto(), _UNAUTHENTICATED, "x-splitvl-internal-token", (
        "a call to an internal service without the cluster's token"
    )
    INTERNAL_TOKEN_INVALID = auto(), _UNAUTHENTICATED, "x-splitvl-internal-token", (
        "a call to an internal service with another cluster's token"
    )
    # fmt: on


DOCS_START = (
    "<!-- refusals:start: generated from vlcommon/refusals.py by "
    "`python -m vlcommon.refusals --write-docs docs/api.md`; edit the registry, not here -->"
)
DOCS_END = "<!-- refusals:end -->"


def docs_table() -> str:
    """The Markdown table of every refusal: reason, gRPC status, field, meaning."""
    rows = [
        "| Reason | gRPC status | Field | Meaning |",
        "| --- | --- | --- | --- |",
    ]
    for r in Refusal:
        status = f"`{r.status.name}`" if r.status is not None else f"none (HTTP {r.http_status})"
        field = f"`{r.field}`" if r.field else ""
        meaning = r.meaning.replace("|", "\\|")
        rows.append(f"| `{r.value}` | {status} | {field} | {meaning} |")
    return "\n".join(rows) + "\n"


def with_docs_table(text: str) -> str:
    """``text`` (a Markdown page) with the table between its refusal markers replaced.

    Raises:
        ValueError: When the page lacks the markers.
    """
    start, end = text.find(DOCS_START), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"the page lacks {DOCS_START!r} ... {DOCS_END!r}")
    head = text[: start + len(DOCS_START)]
    return f"{head}\n{docs_table()}{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    """``--write-docs PAGE`` rewrites the page's table; ``--check-docs PAGE`` exits 1 when
    it differs from the registry; neither prints the table."""
    parser = argparse.ArgumentParser(prog="python -m vlcommon.refusals", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write-docs", metavar="PAGE", type=Path)
    group.add_argument("--check-docs", metavar="PAGE", type=Path)
    args = parser.parse_args(argv)
    if args.write_docs is None and args.check_docs is None:
        sys.stdout.write(docs_table())
        return 0
    page: Path = args.write_docs or args.check_docs
    text = page.read_text(encoding="utf-8")
    wanted = with_docs_table(text)
    if args.check_docs is not None:
        if wanted != text:
            print(f"{page}: the refusals table differs from vlcommon.refusals", file=sys.stderr)
            return 1
        return 0
    if wanted != text:
        page.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
