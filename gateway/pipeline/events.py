"""What :meth:`gateway.pipeline.Pipeline.generate` yields, for the fronts to render."""

from __future__ import annotations

from dataclasses import dataclass, field

from qwenvl.common.v1 import generation_pb2
from qwenvl.gateway.v1 import gateway_service_pb2 as pb


@dataclass
class GenerateEvent:
    """One step of the decoder's stream: the tokens it made, and on the first and last
    event what only they carry.

    Attributes:
        token_ids: New token ids of this step (may be empty on the last event).
        text: Their text (empty while a byte-level token ends inside a UTF-8 character).
        finish_reason: A ``FinishReason`` value; UNSPECIFIED until the last event.
        images: On the first event only: per image, the tier it was served from (with its
            cosine similarity), the grid the language model got, its tokens and key.
        videos: On the first event only: per video, its tier, grid, frames and timestamps.
        usage: On the last event: prompt and completion tokens.
        timings: On the last event: each stage's duration, ms.
    """

    token_ids: list[int]
    text: str
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED
    images: list[pb.ImageInfo] = field(default_factory=list)
    videos: list[pb.VideoInfo] = field(default_factory=list)
    usage: generation_pb2.Usage | None = None
    timings: pb.StageTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
