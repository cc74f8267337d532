"""Gateway settings (environment prefix ``GATEWAY_``)."""

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.reasoning import PARSERS as REASONING_PARSERS
from vlcommon.settings import MiB, ServerSettings


class GatewaySettings(ServerSettings):
    """Settings of the gateway; e.g. ``GATEWAY_ENCODER_ADDRESS``, ``GATEWAY_MAX_IMAGES``."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    model: str = Field("", description="Checkpoint directory or hub id (for geometry and keys).")
    model_revision: str = Field("", description="Overrides the revision digest in cache keys.")
    encoder_address: str = Field("127.0.0.1:50052")
    cache_address: str = Field("127.0.0.1:50053", description="Empty disables the cache.")
    decoder_address: str = Field(
        "127.0.0.1:50054",
        description="host:port, an ipv4:/ipv6: list, or dns:///name:port (re-resolved): "
        "the decoder replicas (gateway.pipeline.endpoints).",
    )
    # affinity: the gateway picks each request's decoder replica by its first image's
    # identity (consistent hashing with bounded loads, gateway.pipeline.route), so a
    # repeated image meets the replica whose prefix cache holds it; proxy: one channel to
    # the address, and a proxy or mesh routes by the x-splitvl-affinity header.
    decoder_routing: Literal["affinity", "proxy"] = Field("affinity")
    # Request migration (gateway.pipeline.decode): an answer whose decoder is lost after
    # its first token, or hands it back as it stops, continues on another replica.
    migration_limit: int = Field(
        3, ge=0, description="Moves of one answer to another decoder replica; 0 = off."
    )
    migration_max_seq_len: int = Field(
        8192,
        ge=1,
        description="Generated tokens a stream keeps for a move; past them a lost decoder "
        "fails the answer (DECODER_LOST_MID_STREAM) as with migration off.",
    )
    affinity_epsilon: float = Field(
        0.25,
        ge=0,
        description="Bounded load: a replica takes a key's request while it carries fewer "
        "than ceil((1 + epsilon) * (in flight + 1) / replicas) of this gateway's calls.",
    )
    decoder_resolve_s: float = Field(
        5.0, gt=0, description="Seconds between DNS resolutions of a dns: decoder address."
    )
    cache_timeout_s: float = Field(
        1.0, gt=0, description="Lookup deadline; past it the request encodes instead."
    )
    # affinity: each Lookup and Put goes to the cache replica its first image's key hashes
    # to (the same bounded-load ring as the decoders), the one most likely to hold the
    # entry as a local copy; proxy: one channel, round robin over the address's replicas.
    cache_routing: Literal["affinity", "proxy"] = Field("affinity")
    # Each new image encoded once across gateways (cache_service/claims.py): the first
    # gateway to miss an image claims its key; the others wait for its Put, at most this
    # long (and half the request's remaining time), then encode it themselves.
    cache_claims: bool = Field(True, description="Claim missed images' keys in the cache.")
    cache_claim_wait_s: float = Field(
        5.0, ge=0, description="Longest wait for another gateway's encode of an image, seconds."
    )
    # Scheduling priority (gateway.priority, docs/api.md "Priority"): lower = sooner, as
    # vLLM's; the decoder runs vLLM with --scheduling-policy priority.
    priority_policy: Literal["fcfs", "short-first"] = Field(
        "fcfs",
        description="Class of a request that names none: fcfs 0; short-first from its "
        "expected cost (max_tokens + prompt and media tokens / 8), log2 buckets.",
    )
    priority_floor: int = Field(
        0,
        ge=-(2**31),
        le=2**31 - 1,
        description="The lowest (most urgent) class a caller may ask; lower asks are raised "
        "to it. Tokens in priority_grants may go lower.",
    )
    priority_grants: SecretStr = Field(
        SecretStr(""),
        description="Comma-separated TOKEN=FLOOR: bearer tokens (GATEWAY_AUTH_TOKENS) "
        "allowed classes down to FLOOR.",
    )
    priority_aging_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="Seconds of waiting one class is worth: a request is overtaken only by "
        "better classes arriving less than (class difference x this) after it.",
    )
    # The put runs beside or after the decode, off the request's critical path; at real
    # widths the cache reads 16 MiB per 1,024-token image (Qwen3-VL-2B, bf16) from the
    # encoder within it, which a loaded host does not always do within the lookup's 1 s
    # (docs/benchmarks.md, "wide").
    cache_put_timeout_s: float = Field(
        10.0, gt=0, description="Put deadline, seconds; past it the entry is not stored."
    )
    # A hung (not dead) encoder must not hang requests whose client set no deadline: the
    # encode call always has one. Streams to the decoder are bounded by the client's deadline
    # and by keepalive (a dead peer), since a legitimate generation can run for minutes.
    encode_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait for one Encode call, seconds."
    )
    # References, not payloads (docs/operations.md, "The embedding hand-off"): the encoder
    # and the cache hold each image's embeddings and the decoder reads them from there.
    # shm: through /dev/shm, for services on one host or in one pod (`splitvl up` sets it);
    # grpc: a raw-bytes stream from the holder, anywhere. A reader that cannot open a
    # segment reads over gRPC, so shm never fails where grpc would work.
    embedding_transport: Literal["shm", "grpc"] = Field(
        "grpc", description="How the decoder reads embeddings from the encoder and the cache."
    )
    default_cache_policy: str = Field("similar", pattern="^(exact_only|similar|off)$")
    # The grid-change bound (vlcommon.grid_reuse, docs/cache.md): a similarity hit may serve
    # a stored grid the request's image would get if resized by up to this much per side.
    grid_reuse_scale: float = Field(
        0.10,
        ge=0,
        le=0.25,
        description="Relative resize per side within which a similarity hit may serve the "
        "stored entry's grid; 0 = equal grids only.",
    )
    max_images: int = Field(8, ge=1, description="Images per request.")
    max_image_bytes: int = Field(20 * MiB, ge=1, description="Encoded bytes of one image.")
    max_decoded_pixels: int = Field(
        40_000_000, ge=1, description="Width*height of one decoded image (bombs refused)."
    )
    # Per request: 8 images just under max_decoded_pixels are ~7 s of decoding CPU; the sum
    # of width*height over a request's images (read from their headers) is capped too.
    max_request_pixels: int = Field(
        80_000_000,
        ge=1,
        description="Width*height summed over a request's images (from their headers, "
        "before decoding).",
    )
    # Videos (gateway/video.py). Sampling defaults come from the checkpoint's video processor.
    max_videos: int = Field(2, ge=0, description="Videos per request.")
    max_video_bytes: int = Field(64 * MiB, ge=1, description="Encoded bytes of one video file.")
    max_video_duration_s: float = Field(
        600.0, gt=0, description="Length of one video file, seconds (from its packets' times)."
    )
    video_max_frames: int = Field(
        768,
        ge=1,
        description="Most frames kept from one video (a request's max_frames may only lower it); "
        "also the most frames a video given as frames may have.",
    )
    video_max_fps: float = Field(8.0, gt=0, description="Highest sample_fps a request may ask.")
    video_max_decoded_pixels: int = Field(
        8_294_400, ge=1, description="Stored width*height of one video frame (3840x2160)."
    )
    # Qwen3-VL's reference budget (Qwen's blog and the vLLM recipe): 16,384 video tokens.
    max_video_tokens: int = Field(
        16384, ge=1, description="Video tokens summed over a request's videos."
    )
    max_text_chars: int = Field(65536, ge=1, description="Characters of text per request.")
    max_tokens_limit: int = Field(4096, ge=1)
    max_messages: int = Field(64, ge=1)
    max_parts: int = Field(256, ge=1, description="Content parts over all messages.")
    # Images by URL (gateway/fetch.py): off by default, since fetching makes the gateway a
    # client of whatever the caller names (SSRF); the guard checks every connected address.
    allow_urls: bool = Field(False, description="Accept ImageInput.url (http/https).")
    url_allow_private: bool = Field(
        False,
        description="Let URLs reach loopback/private/site-local/CGNAT addresses (tests, "
        "trusted networks); cloud-metadata and link-local addresses stay refused.",
    )
    url_max_chars: int = Field(8192, ge=16, description="Length of one image URL.")
    url_connect_timeout_s: float = Field(3.0, gt=0, description="TCP+TLS connect per hop.")
    url_read_timeout_s: float = Field(5.0, gt=0, description="Longest wait for the next bytes.")
    url_total_timeout_s: float = Field(
        15.0, gt=0, description="One fetch with its redirects (also capped by the deadline)."
    )
    url_max_redirects: int = Field(3, ge=0, description="Redirects followed per URL.")
    url_max_inflight: int = Field(
        32,
        ge=1,
        description="URL fetches in flight over all requests (each may hold max_image_bytes); "
        "past it a request gets RESOURCE_EXHAUSTED at once.",
    )
    url_ca_file: str = Field(
        "", description="Extra PEM CA bundle trusted for https image URLs (private PKI)."
    )
    preprocess_threads: int = Field(
        2, ge=1, description="Threads decoding and resizing images (bounds their memory)."
    )
    # As deep as admission control (max_concurrent_rpcs): a request admitted by the server
    # may wait here; abandoned ones stop between images, so the queue costs waiting, not CPU.
    preprocess_queue: int = Field(
        256,
        ge=0,
        description="Requests that may wait for a preprocess thread; past it RESOURCE_EXHAUSTED "
        "PREPROCESS_BUSY with a retry hint.",
    )

    # The OpenAI-compatible HTTP front (gateway/openai_front.py), on the same host.
    http_port: int = Field(
        0, ge=0, le=65535, description="OpenAI-compatible HTTP port (/v1/...); 0 = off."
    )
    served_model_name: str = Field(
        "", description="Model id of the HTTP front (/v1/models); empty = the --model argument."
    )
    http_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one HTTP chat completion, seconds."
    )
    http_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for the next byte of an HTTP request body still due, "
        "seconds; past it, 408 BODY_READ_TIMEOUT.",
    )
    # Thinking checkpoints (gateway/reasoning.py, docs/api.md "Thinking checkpoints").
    reasoning_parser: str = Field(
        "",
        description="qwen3: the OpenAI front returns the model's reasoning (before </think>) "
        "as reasoning / reasoning_content apart from content, as vLLM's --reasoning-parser "
        "qwen3; empty = off. The gRPC front returns the raw text either way.",
    )

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str) -> str:
        """Refuse a parser splitvl does not implement at start, naming the ones it does."""
        if value and value not in REASONING_PARSERS:
            raise ValueError(
                f"{value!r} is not a reasoning parser splitvl implements; use "
                f"{' or '.join(REASONING_PARSERS)} (vLLM's --reasoning-parser of that name, "
                "for the Qwen3-VL Thinking checkpoints) or leave it empty (off)"
            )
        return value

    @model_validator(mode="after")
    def _public_message_limit(self) -> "GatewaySettings":
        """The gateway's public server gets its own message limit (GATEWAY_MAX_MESSAGE_BYTES).

        The shared 256 MiB default suits internal hops (embeddings); a public client could
        make the gateway hold several times its message while it is parsed. Unless set, it
        is ``max_images * max_image_bytes + 1 MiB`` (room for text and framing), or
        ``max_videos * max_video_bytes + 1 MiB`` where larger (a request at both maxima is
        refused by size; send large videos by URL), at least
        the 4 MiB floor. Data URLs cost 4/3 of their image in base64. The gateway's channels
        to its own services keep vlcommon.settings.channel_options' 256 MiB.
        """
        if "max_message_bytes" not in self.model_fields_set:
            self.max_message_bytes = max(
                4 * MiB,
                self.max_images * self.max_image_bytes + MiB,
                self.max_videos * self.max_video_bytes + MiB,
            )
        return self
