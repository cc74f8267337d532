"""Multi-turn TTFT: turns 2 and 3 of a conversation with images against turn 1, and
splitvl's OpenAI front against ``vllm serve`` on the same conversations.

Each conversation is three turns, as clients send them (the whole history every turn,
earlier images included, the assistant's answers as text): turn 1 a new image and a
question, turn 2 a second new image, turn 3 text only. Streaming, greedy, ``ignore_eos``;
TTFT is the first token's chunk at the client (the first chunk after the role chunk,
its text possibly empty). The systems run one at a time (vLLM's
CPU worker spins while idle, so two up at once slow each other), alternating by round
(round r starts with splitvl when r is even); every conversation has fresh images (its
turn 1 is a miss for both), and each system first answers one warm-up conversation.

Usage::

    python scripts/measure_multiturn.py [--model DIR] [--rounds 2] [--conversations 4]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

QUESTIONS = ("Describe this image.", "And this one?", "Which of the two is brighter?")


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def conversations(n: int, side: int, seed: int) -> Iterator[tuple[bytes, bytes]]:
    """``n`` pairs of fresh images (turn 1's, turn 2's)."""
    from splitvl_tools.workload import ImageFactory, png

    factory = ImageFactory(side=side, seed=seed)
    for _ in range(n):
        yield png(factory.make()), png(factory.make())


def turn(
    client: Any, model: str, messages: list[dict[str, Any]], max_tokens: int
) -> tuple[float, str]:
    """One streamed turn: (TTFT in ms, the answer's text)."""
    t0 = time.perf_counter()
    ttft = None
    text = []
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        # The first token's chunk, even when its text is empty (a random-weight model's
        # tokens often decode to nothing): a chunk after the role chunk with content set.
        if delta.content is not None and not delta.role:
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1000
            text.append(delta.content)
    return ttft if ttft is not None else float("nan"), "".join(text)


def conversation(
    client: Any, model: str, images: tuple[bytes, bytes], max_tokens: int
) -> list[float]:
    """The three turns of one conversation; their TTFTs (ms)."""
    messages: list[dict[str, Any]] = []
    ttfts = []
    for i, question in enumerate(QUESTIONS):
        content: list[dict[str, Any]] = []
        if i < 2:
            content.append({"type": "image_url", "image_url": {"url": data_url(images[i])}})
        content.append({"type": "text", "text": question})
        messages.append({"role": "user", "content": content})
        ttft, answer = turn(client, model, messages, max_tokens)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})
    return ttfts


def _log(line: str) -> None:
    """Progress to stderr: stdout is the JSON."""
    print(line, file=sys.stderr, flush=True)


def system(name: str, model: str, log_dir: Path) -> AbstractContextManager[str]:
    from splitvl.ports import free_port
    from splitvl_tools.openai_bench import splitvl_front, vllm_serve

    if name == "splitvl":
        return splitvl_front(model, log_dir / "splitvl", _log, images_per_prompt=2)
    return vllm_serve(model, free_port(), log_dir / "vllm-serve.log", 32, images_per_prompt=2)


def main() -> int:
    import openai

    from splitvl_tools.cluster import bench_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--conversations", type=int, default=4, help="per system per round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--image-side", type=int, default=448)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args()
    model = args.model or str(bench_model())
    log_dir = Path(tempfile.mkdtemp(prefix="multiturn-"))
    (log_dir / "splitvl").mkdir()
    ttfts: dict[str, list[list[float]]] = {"splitvl": [], "vllm_serve": []}
    seed = 100
    for r in range(args.rounds):
        order = ("splitvl", "vllm_serve") if r % 2 == 0 else ("vllm_serve", "splitvl")
        for name in order:
            with system(name, model, log_dir) as base_url:
                client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
                served = client.models.list().data[0].id
                for warm in conversations(1, args.image_side, seed=9000 + r):
                    conversation(client, served, warm, args.max_tokens)
                for images in conversations(args.conversations, args.image_side, seed):
                    ttfts[name].append(conversation(client, served, images, args.max_tokens))
                    seed += 1
                print(f"round {r} {name}: {ttfts[name][-args.conversations :]}", file=sys.stderr)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "model": model, "systems": {}}
    for name, rows in ttfts.items():
        per_turn = [statistics.median(row[t] for row in rows) for t in range(3)]
        report["systems"][name] = {
            "ttft_ms_median_by_turn": [round(v, 1) for v in per_turn],
            "ttft_ms_range_by_turn": [
                [round(min(row[t] for row in rows), 1), round(max(row[t] for row in rows), 1)]
                for t in range(3)
            ],
            "turn2_over_turn1": round(per_turn[1] / per_turn[0], 3),
            "turn3_over_turn1": round(per_turn[2] / per_turn[0], 3),
            "conversations": len(rows),
        }
    s, v = report["systems"]["splitvl"], report["systems"]["vllm_serve"]
    report["splitvl_over_vllm_serve_by_turn"] = [
        round(a / b, 3)
        for a, b in zip(s["ttft_ms_median_by_turn"], v["ttft_ms_median_by_turn"], strict=True)
    ]
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
