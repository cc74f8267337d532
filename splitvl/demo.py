"""``splitvl demo``: start the services, ask about real photos, show the cache at work.

Photos come from scikit-image's bundled data (astronaut, chelsea, coffee). The astronaut
is asked about again (an exact cache hit: no ViT) and once more as a JPEG re-encode of the
same picture (a similarity hit when its cosine similarity clears the threshold and its
grid is equal). Then a 3-second MP4 panning over the coffee photo (made with PyAV,
:mod:`splitvl.video_clips`) is asked about twice: the gateway samples it at 2 fps and the
second ask is an exact hit (no ViT). Each answer is printed with its token ids, cache tier
and stage timings. Last, the astronaut goes once more through the OpenAI-compatible HTTP
front with the official ``openai`` client (an exact hit again; its stage timings from the
response's ``splitvl`` extension field, and whether its text equals the gRPC answer's:
``same_text_as_grpc`` in ``--json``), unless ``--http-port 0``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import grpc
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from splitvl.client import build_request, generate
from vlcommon.tls import sync_channel

PROMPT = "Describe this image."


def photo_bytes(name: str) -> bytes:
    """The file of one of scikit-image's bundled photos."""
    import skimage

    return (Path(skimage.__file__).parent / "data" / name).read_bytes()


def jpeg_copy(data: bytes, quality: int = 95) -> bytes:
    """The same picture re-encoded as JPEG (different bytes, nearly the same pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def workload() -> list[tuple[str, bytes | pb.VideoInput]]:
    """What the demo asks about, in order: photos, then a video twice."""
    from splitvl.video_clips import pan_clip

    astronaut = photo_bytes("astronaut.png")
    clip = pb.VideoInput(
        file=pb.VideoFile(data=pan_clip("coffee.png", seconds=3, fps=10, size=(128, 160)))
    )
    return [
        ("astronaut.png", astronaut),
        ("chelsea.png", photo_bytes("chelsea.png")),
        ("coffee.png", photo_bytes("coffee.png")),
        ("astronaut.png (again)", astronaut),
        ("astronaut.png as JPEG q95", jpeg_copy(astronaut)),
        ("pan over coffee.png, 3 s MP4", clip),
        ("pan over coffee.png, 3 s MP4 (again)", clip),
    ]


def openai_question(port: int, model: str, max_tokens: int, say: Any) -> dict[str, object]:
    """The first photo once more, through the OpenAI-compatible front with the official
    ``openai`` client, as code written for ``vllm serve`` would send it."""
    import base64

    import openai

    url = f"http://127.0.0.1:{port}/v1"
    data_url = "data:image/png;base64," + base64.b64encode(photo_bytes("astronaut.png")).decode()
    entry: dict[str, object] = {"image": "astronaut.png via /v1/chat/completions"}
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    try:
        out = client.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url}},
                        {"type": "text", "text": PROMPT},
                    ],
                }
            ],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    except openai.APIError as err:
        entry["error"] = {"message": str(err)}
        say(f"[{entry['image']}] {entry['error']}")
        return entry
    # splitvl's extension field (OpenAI clients ignore it): the tiers and stage timings.
    ext = (out.model_extra or {}).get("splitvl", {})
    image = ext.get("images", [{}])[0]
    timings = ext.get("timings", {})
    entry.update(tier=image.get("tier"), text=out.choices[0].message.content, timings=timings)
    say(
        f"[astronaut.png, OpenAI-compatible front {url}] tier={image.get('tier')} "
        f"similarity={image.get('similarity', 0.0):.6f} grid={image.get('grid')}"
    )
    say(f"  answer:    {out.choices[0].message.content!r}")
    if out.usage is not None:
        say(
            f"  usage:     {out.usage.prompt_tokens} prompt tokens, "
            f"{out.usage.completion_tokens} completion tokens"
        )
    say(
        "  stages:    "
        + ", ".join(f"{k.removesuffix('_ms')} {v:.1f} ms" for k, v in timings.items())
    )
    return entry


def run_demo(args: argparse.Namespace) -> int:
    from splitvl.home import cluster_from_args

    cluster = cluster_from_args(args)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    cluster.progress = lambda line: say(line)
    say(f"starting the four services (model {cluster.model}; logs in {cluster.log_dir}) ...")
    results, ok = [], 0
    with cluster:
        say(f"all four SERVING; gateway at {cluster.ports.address('gateway')}")
        say(f"prompts {PROMPT!r} / 'Describe this video.', {args.max_tokens} greedy tokens each")
        if not args.model:
            say("(the tiny checkpoint's weights are random: its answers are not words; the")
            say(" cache tier, the token ids and the stage times are what the demo shows)")
        say("")
        for name, data in workload():
            kind = "video" if isinstance(data, pb.VideoInput) else "image"
            prompt = f"Describe this {kind}."
            request = build_request([data], prompt, max_tokens=args.max_tokens, ignore_eos=True)
            entry: dict[str, object] = {kind: name, "prompt": prompt}
            try:
                r = generate(
                    cluster.ports.address("gateway"),
                    request,
                    timeout_s=120,
                    security=cluster.security(),
                )
            except grpc.RpcError as err:
                entry["error"] = {
                    "code": err.code().name,  # type: ignore[attr-defined]
                    "message": err.details(),
                }  # type: ignore[attr-defined]
                say(f"{name}: {entry['error']}")
                results.append(entry)
                continue
            ok += 1
            entry.update(text=r.text, token_ids=r.token_ids, timings=r.timings)
            if r.videos:
                video = r.videos[0]
                entry.update(
                    tier=video["tier"],
                    grid=video["grid"],
                    frames=video["frames"],
                    timestamps=video["timestamps"],
                )
                stamps = ", ".join(f"{t:.1f}" for t in video["timestamps"])
                say(
                    f"[{name}] tier={video['tier']} grid={video['grid']} "
                    f"({video['tokens']} video tokens; {video['frames']} frames kept at "
                    f"{stamps} s)"
                )
            else:
                image = r.images[0]
                entry.update(tier=image["tier"], similarity=image["similarity"], grid=image["grid"])
                say(
                    f"[{name}] tier={image['tier']} similarity={image['similarity']:.6f} "
                    f"grid={image['grid']} ({image['tokens']} image tokens)"
                )
            results.append(entry)
            say(f"  answer:    {r.text!r}")
            say(f"  token ids: {r.token_ids}")
            say(
                "  stages:    "
                + ", ".join(f"{k.removesuffix('_ms')} {v:.1f} ms" for k, v in r.timings.items())
                + "\n"
            )
        if cluster.ports.http:
            entry = openai_question(cluster.ports.http, cluster.model, args.max_tokens, say)
            # One pipeline behind both fronts: the same greedy text as the gRPC answer.
            grpc_text = next(
                (r.get("text") for r in results if r.get("image") == "astronaut.png"), None
            )
            if "error" not in entry and grpc_text is not None:
                entry["same_text_as_grpc"] = entry["text"] == grpc_text
                same = entry["same_text_as_grpc"]
                say(f"  same text as the gRPC answer for astronaut.png: {same}\n")
            results.append(entry)
            ok += "error" not in entry
        # The cache is internal: TLS and the internal token as the cluster runs them.
        security = cluster.security()
        with sync_channel(cluster.ports.address("cache"), security) as ch:
            stats = cache_service_pb2_grpc.CacheServiceStub(ch).GetStats(
                cache_service_pb2.GetStatsRequest(),
                timeout=10,
                metadata=security.metadata() or None,
            )
    cache = {
        "exact_hits": stats.exact_hits,
        "similar_hits": stats.similar_hits,
        "misses": stats.misses,
        "entries": stats.entries,
        "bytes": stats.bytes,
    }
    say(f"cache: {cache}")
    say("services stopped")
    if args.json:
        print(json.dumps({"requests": len(results), "ok": ok, "cache": cache, "results": results}))
    return 0 if ok == len(results) else 1
