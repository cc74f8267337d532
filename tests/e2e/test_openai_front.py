"""The end-to-end tests of tests/unit/gateway/test_openai_front.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from tests.conftest import photo
from tests.unit.gateway.test_openai_front import _client


@pytest.fixture(scope="module")
def front(cluster: Any) -> Iterator[tuple[openai.OpenAI, Any]]:
    """The official client on the session cluster's HTTP front, and the cluster."""
    url = f"http://127.0.0.1:{cluster.ports.http}/v1"
    yield _client(url), cluster


# -- e2e: the four services ---------------------------------------------------------------
def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _astronaut_png() -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(photo("astronaut.png"))).convert("RGB").resize((160, 160)).save(
        buf, format="PNG"
    )
    return buf.getvalue()


@pytest.mark.e2e
def test_the_front_answers_as_the_grpc_path_does(front: tuple[openai.OpenAI, Any]) -> None:
    from splitvl.client import build_request, generate

    client, cluster = front
    [model] = [m.id for m in client.models.list().data]
    assert model == cluster.model  # named as `vllm serve --model DIR` names it
    image = _astronaut_png()
    grpc_result = generate(
        cluster.ports.address("gateway"),
        build_request([image], "Describe this image.", max_tokens=8, ignore_eos=True),
    )
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _data_url(image)}},
                {"type": "text", "text": "Describe this image."},
            ],
        }
    ]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.content == grpc_result.text
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.model_extra["splitvl"]["images"][0]["tier"] == "exact"  # type: ignore[index]
    streamed = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_result.text
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    text_only = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert text_only.usage is not None and 1 <= text_only.usage.completion_tokens <= 4
    assert text_only.model_extra["splitvl"]["images"] == []  # type: ignore[index]


@pytest.mark.e2e
def test_a_bad_image_is_400_in_openais_shape(front: tuple[openai.OpenAI, Any]) -> None:
    client, cluster = front
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=cluster.model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _data_url(b"not a png")}},
                        {"type": "text", "text": "?"},
                    ],
                }
            ],
            max_tokens=2,
        )
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    # The gRPC path names the field `images[0]`; the front maps it to the OpenAI part it came from.
    assert body["param"] == "messages[0].content[0].image_url.url"
    assert "could not be decoded" in body["message"]


@pytest.mark.e2e
def test_a_traceparent_header_joins_the_callers_trace(
    front: tuple[openai.OpenAI, Any], otlp_receiver: Any
) -> None:
    """The front's server span is a child of the caller's span, and the pipeline's spans in
    the four services (preprocess, lookup, ViT batch, generation) are in the caller's trace."""
    import secrets

    from tests.e2e.test_traces import attrs, collect_trace

    client, cluster = front
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    source = Image.open(io.BytesIO(photo("coffee.png"))).convert("RGB").resize((150, 120))
    buf = io.BytesIO()
    source.save(buf, format="PNG")  # unseen: a miss, so every service does work
    reply = client.chat.completions.create(
        model=cluster.model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(buf.getvalue())}},
                    {"type": "text", "text": "?"},
                ],
            }
        ],
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert reply.choices[0].message.content is not None
    wanted = {
        "POST /v1/chat/completions",
        "gateway.preprocess",
        "cache.lookup",
        "vit.batch",
        "decoder.generation",
    }
    spans = collect_trace(otlp_receiver, trace_id, lambda ss: wanted <= {s["name"] for s in ss})
    names = {s["name"] for s in spans}
    assert wanted <= names, wanted - names
    [server] = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert server["parent"] == parent_id and server["service"] == "splitvl-gateway"
    assert attrs(server)["splitvl.front"] == "openai"
    services = {s["service"] for s in spans}
    assert {"splitvl-gateway", "splitvl-cache", "splitvl-encoder", "splitvl-decoder"} <= services


def _aborted(cluster: Any) -> float:
    text = httpx.get(f"http://127.0.0.1:{cluster.ports.metrics['decoder']}/metrics").text
    for line in text.splitlines():
        if line.startswith("splitvl_decoder_aborted_requests_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.e2e
def test_a_disconnect_mid_stream_aborts_the_vllm_request(front: tuple[openai.OpenAI, Any]) -> None:
    from tests.conftest import LONG_STREAM_TOKENS

    client, cluster = front
    before = _aborted(cluster)
    stream = client.chat.completions.create(
        model=cluster.model,
        messages=[{"role": "user", "content": "Count."}],
        max_tokens=LONG_STREAM_TOKENS // 2,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while _aborted(cluster) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborted(cluster) == before + 1


@pytest.mark.e2e
def test_vllms_benchmark_client_completes_against_the_front(
    front: tuple[openai.OpenAI, Any], tmp_path: Any
) -> None:
    """vLLM's own client (vllm.benchmarks.serve, backend openai-chat, dataset random-mm)."""

    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _, cluster = front
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai-chat",
            "--base-url",
            f"http://127.0.0.1:{cluster.ports.http}",
            "--endpoint",
            "/v1/chat/completions",
            "--model",
            cluster.model,
            "--tokenizer",
            cluster.model,
            "--dataset-name",
            "random-mm",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--random-mm-base-items-per-request",
            "1",
            "--random-mm-limit-mm-per-prompt",
            '{"image": 1, "video": 0}',
            "--random-mm-bucket-config",
            "{(64, 64, 1): 1.0}",
            "--ignore-eos",
            "--temperature",
            "0",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "front.json",
            "--disable-tqdm",
        ]
    )
    main(args)
    result = json.loads((tmp_path / "front.json").read_text())
    assert result["completed"] == 4
    assert result.get("failed", 0) == 0
    assert result["total_output_tokens"] == 16
