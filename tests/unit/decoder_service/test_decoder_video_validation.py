"""The decoder's checks on video embeddings before the engine (a wrong shape kills vLLM's
engine for every later request, FACTS.md): grid, rows, width, timestamps, references."""

from __future__ import annotations

import grpc
import pytest
import torch
from qwenvl.common.v1 import tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as pb

from decoder_service.validation import check_video, video_order
from vlcommon import tensors
from vlcommon.errors import ServiceError
from vlcommon.model_info import VisionSpec

SPEC = VisionSpec(16, 2, 2, 4096, 65536, 128, 2, (0.5,) * 3, (0.5,) * 3)  # type: ignore[arg-type]


def video(t: int, h: int, w: int, rows: int | None = None, width: int = 384, stamps=None):  # type: ignore[no-untyped-def]
    rows = t * h * w // 4 if rows is None else rows
    emb = tensor_pb2.ImageEmbedding(
        embeddings=tensors.from_torch(torch.zeros(rows, width)),
        grid=tensor_pb2.GridTHW(t=t, h=h, w=w),
        key="k",
    )
    return pb.VideoEmbedding(
        embedding=emb, timestamps=[0.5 + i for i in range(t)] if stamps is None else stamps
    )


def refused(msg: pb.VideoEmbedding) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        check_video(msg, 1, SPEC, max_tokens=10_000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.metadata["field"].startswith("videos[1]")
    return info.value


def test_a_good_video_passes_with_its_timestamps() -> None:
    v = check_video(video(3, 6, 8), 0, SPEC, max_tokens=10_000)
    assert v.grid == (3, 6, 8) and tuple(v.embeddings.shape) == (36, 384)
    assert v.timestamps == (0.5, 1.5, 2.5)
    # vLLM's identity of the content is a digest of its bytes, never the caller's key:
    # the same key with other bytes is another identity, other keys on the same bytes one.
    assert v.uuid is not None and v.uuid.endswith(":FP32:3x6x8")
    forged = video(3, 6, 8)
    forged.embedding.embeddings.CopyFrom(tensors.from_torch(torch.ones(36, 384)))
    assert check_video(forged, 0, SPEC, max_tokens=10_000).uuid != v.uuid
    renamed = video(3, 6, 8)
    renamed.embedding.key = "another"
    assert check_video(renamed, 0, SPEC, max_tokens=10_000).uuid == v.uuid


def test_shapes_grids_and_timestamps_are_checked() -> None:
    err = refused(video(3, 6, 8, rows=35))
    assert err.reason == "EMBEDDING_SHAPE_MISMATCH" and "[36, 384]" in err.message
    err = refused(video(3, 6, 8, width=128))  # no deepstack features
    assert err.reason == "EMBEDDING_SHAPE_MISMATCH"
    assert refused(video(0, 6, 8)).reason == "GRID_INVALID"
    assert refused(video(2, 5, 8)).reason == "GRID_INVALID"  # h not a multiple of merge 2
    err = refused(video(3, 6, 8, stamps=[0.5, 1.5]))
    assert err.reason == "VIDEO_TIMESTAMPS_MISMATCH" and "needs 3" in err.message
    assert refused(video(2, 6, 8, stamps=[0.0, float("nan")])).reason == (
        "VIDEO_TIMESTAMPS_INVALID"
    )
    with pytest.raises(ServiceError) as info:
        check_video(video(3, 6, 8), 0, SPEC, max_tokens=35)
    assert info.value.reason == "IMAGE_TOO_MANY_TOKENS"


def test_video_references_are_checked() -> None:
    r = pb.GenerateRequest()
    r.videos.append(video(1, 2, 2))
    r.videos.append(video(1, 2, 2))
    m = r.messages.add(role="user")
    m.parts.add(video_index=1)
    m.parts.add(video_index=0)
    assert video_order(r, max_videos=2) == [1, 0]
    with pytest.raises(ServiceError) as info:
        video_order(r, max_videos=1)
    assert info.value.reason == "TOO_MANY_VIDEOS"
    m.parts.add(video_index=1)
    with pytest.raises(ServiceError) as info:
        video_order(r, max_videos=2)
    assert info.value.reason == "VIDEO_INDEX_REUSED"
    del m.parts[2]
    del m.parts[1]
    with pytest.raises(ServiceError) as info:
        video_order(r, max_videos=2)
    assert info.value.reason == "VIDEO_UNUSED"
    m.parts.add(video_index=5)
    with pytest.raises(ServiceError) as info:
        video_order(r, max_videos=8)
    assert info.value.reason == "VIDEO_INDEX_INVALID"
