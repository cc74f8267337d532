"""One request contract: the gateway, the cache and the decoder refuse the same inputs with
the same words (vlcommon.request_rules, vlcommon.sampling), so that no request passes one
hop and breaks at the next."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.servicer import POLICIES, TIERS, _grid
from decoder_service.validation import check_image
from gateway.openai_protocol import to_generate_request
from vlcommon import tensors
from vlcommon.errors import ServiceError
from vlcommon.model_info import VisionSpec
from vlcommon.request_rules import CACHE_POLICIES, CACHE_TIERS, TIER_NAMES, forbidden_tokens
from vlcommon.sampling import check_max_tokens

SPEC = VisionSpec(
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, min_pixels=1024,
    max_pixels=65536, out_hidden_size=4, n_deepstack=1, image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)  # fmt: skip


def refusal(call, *args, **kw) -> ServiceError:  # type: ignore[no-untyped-def]
    with pytest.raises(ServiceError) as exc:
        call(*args, **kw)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return exc.value


@pytest.mark.parametrize(
    ("grid", "video"),
    [((2, 4, 4), False), ((1, 3, 4), False), ((0, 4, 4), True), ((1, 4, 0), False)],
)
def test_the_cache_and_the_decoder_refuse_a_grid_with_the_same_words(grid, video) -> None:
    """An image with t = 2 (the cache used to store it; the decoder refused it, and vLLM's
    engine died on it), an odd h, or a zero entry: one message at both hops."""
    msg = tensor_pb2.GridTHW(t=grid[0], h=grid[1], w=grid[2])
    at_cache = refusal(_grid, msg, "images[0].grid", 2, video=video)
    rows = max(1, grid[0] * grid[1] * grid[2] // 4)
    embedding = tensor_pb2.ImageEmbedding(
        grid=msg, embeddings=tensors.from_numpy(np.zeros((rows, SPEC.embedding_width), np.float32))
    )
    at_decoder = refusal(check_image, embedding, 0, SPEC, 1024, video=video)
    assert at_cache.reason == at_decoder.reason == "GRID_INVALID"
    assert at_cache.message == at_decoder.message
    assert at_cache.message.startswith(f"images[0].grid is {list(grid)}; ")


@pytest.mark.parametrize("grid", [(1, 2**32, 2**32), (2**40, 2**12, 2**12), (1, 4096, 4098)])
def test_a_grid_past_the_patch_limit_is_refused_at_both_hops(grid) -> None:  # type: ignore[no-untyped-def]
    """int64 fields: a forged grid's product had no bound. 4096 x 4098 is the smallest
    h x w past 2**24 with even sides."""
    from vlcommon.request_rules import MAX_GRID_PATCHES

    msg = tensor_pb2.GridTHW(t=grid[0], h=grid[1], w=grid[2])
    at_cache = refusal(_grid, msg, "images[0].grid", 2, video=True)
    embedding = tensor_pb2.ImageEmbedding(
        grid=msg, embeddings=tensors.from_numpy(np.zeros((1, SPEC.embedding_width), np.float32))
    )
    at_decoder = refusal(check_image, embedding, 0, SPEC, 1024, video=True)
    assert at_cache.reason == at_decoder.reason == "GRID_TOO_LARGE"
    assert at_cache.metadata["limit"] == str(MAX_GRID_PATCHES) == "16777216"
    assert f"{grid[0] * grid[1] * grid[2]} patches; the limit is 16777216" in at_decoder.message
    # Just under the limit passes the grid rule (4096 x 4096 = 2**24).
    ok = tensor_pb2.GridTHW(t=1, h=4096, w=4096)
    assert _grid(ok, "images[0].grid", 2) == (1, 4096, 4096)


def test_a_video_grid_may_have_t_above_1_at_both_hops() -> None:
    msg = tensor_pb2.GridTHW(t=3, h=4, w=4)
    assert _grid(msg, "videos[0].grid", 2, video=True) == (3, 4, 4)
    embedding = tensor_pb2.ImageEmbedding(
        grid=msg, embeddings=tensors.from_numpy(np.zeros((12, SPEC.embedding_width), np.float32))
    )
    assert check_image(embedding, 0, SPEC, 1024, video=True).grid == (3, 4, 4)


def test_the_gateway_and_the_decoder_forbid_every_added_token(tiny_model) -> None:
    """The gateway reads its forbidden tokens from the checkpoint's files; the decoder's
    tokenizer reports its added vocabulary. Every token the decoder would refuse, the
    gateway refuses first (else a request passes the gateway and fails at the decoder)."""
    from transformers import AutoTokenizer

    shared = forbidden_tokens(tiny_model)
    added = AutoTokenizer.from_pretrained(tiny_model).get_added_vocab()
    assert set(added) <= set(shared), set(added) - set(shared)
    assert {"<|image_pad|>", "<|video_pad|>", "<|im_start|>"} <= set(shared)
    assert [len(t) for t in shared] == sorted((len(t) for t in shared), reverse=True)


def test_max_tokens_is_one_rule_in_the_grpc_and_the_openai_front() -> None:
    """The same limit and words at the gateway's gRPC API, its OpenAI front (naming the
    OpenAI field) and the decoder."""
    assert check_max_tokens(16, 16) == 16
    grpc_side = refusal(check_max_tokens, 17, 16)
    assert grpc_side.message == "sampling.max_tokens is 17; allowed 1..16"
    assert refusal(check_max_tokens, 0, 16).reason == "MAX_TOKENS_OUT_OF_RANGE"
    from gateway.openai_protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 17}
    )
    front = refusal(to_generate_request, body, ["m"], max_tokens_limit=16)
    assert front.reason == grpc_side.reason
    assert front.message == "max_tokens is 17; allowed 1..16"


def test_tier_and_policy_names_are_one_table() -> None:
    assert TIERS is CACHE_TIERS and POLICIES is CACHE_POLICIES
    assert {TIER_NAMES[v] for v in CACHE_TIERS.values()} == set(CACHE_TIERS)
    assert set(CACHE_POLICIES.values()) | {generation_pb2.CACHE_POLICY_UNSPECIFIED} == set(
        generation_pb2.CachePolicy.values()
    )
    assert set(CACHE_TIERS.values()) | {generation_pb2.CACHE_TIER_UNSPECIFIED} == set(
        generation_pb2.CacheTier.values()
    )
