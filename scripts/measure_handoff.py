"""The data path of one image's embeddings, from the encoder's memory to a torch tensor in
the decoder, three ways, in three processes on loopback (issue 14):

- ``inline (via gateway)``: the path before references: the holder answers the bytes
  inside an ``ImageEmbedding``, a relay process (the gateway) parses it and sends it on in
  its own message, the reader parses, checks (``tensors.validate``) and builds the tensor.
- ``ref shm``: the holder copies the bytes into a /dev/shm segment and answers a ref
  (``vlcommon.handoff.Holder``); the reader reads the segment (``handoff.Reader``).
- ``ref grpc``: the same ref held for ``HandoffService/ReadEmbedding``: one raw-bytes
  stream from the holder to the reader.

The three alternate request by request; each row is the median of the trials with its
min-max, and the ratio is against the inline path measured in the same run.

    python scripts/measure_handoff.py [--tokens 1024 --width 8192 --trials 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc
import torch
from qwenvl.common.v1 import tensor_pb2

from vlcommon import handoff, tensors
from vlcommon.settings import ServerSettings, channel_options, server_options

SERVICE = "bench.Holder"


def _handler(fn):  # type: ignore[no-untyped-def]
    return grpc.unary_unary_rpc_method_handler(fn)  # raw bytes in and out


async def holder_main(port_out: str, tokens: int, width: int) -> None:
    """The encoder's side: embeddings in memory; Hold (shm or grpc) or Inline."""
    emb = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0)).bfloat16()
    holder = handoff.Holder("bench")
    server = grpc.aio.server(options=server_options(ServerSettings()))

    async def hold(request: bytes, context: object) -> bytes:
        dtype, data = tensors.torch_payload(emb)
        ref = holder.hold(data, dtype, tuple(emb.shape), transport=int(request.decode()))
        msg = tensor_pb2.ImageEmbedding(key="k", grid=tensor_pb2.GridTHW(t=1, h=32, w=32))
        msg.embeddings.dtype, msg.embeddings.shape[:] = dtype, list(emb.shape)
        msg.ref.CopyFrom(ref)
        return msg.SerializeToString()

    async def inline(request: bytes, context: object) -> bytes:
        msg = tensor_pb2.ImageEmbedding(
            key="k", grid=tensor_pb2.GridTHW(t=1, h=32, w=32), embeddings=tensors.from_torch(emb)
        )
        return msg.SerializeToString()

    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Hold": _handler(hold), "Inline": _handler(inline)}
            ),
        )
    )
    handoff.register_holder(holder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    holder.address = f"127.0.0.1:{port}"
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def relay_main(holder_port: str) -> None:
    """The gateway of the old path: receives the bytes and sends them on."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{holder_port}", options=channel_options())
    get = channel.unary_unary(f"/{SERVICE}/Inline")
    server = grpc.aio.server(options=server_options(ServerSettings()))

    async def relay(request: bytes, context: object) -> bytes:
        got = tensor_pb2.ImageEmbedding.FromString(await get(b""))
        out = tensor_pb2.ImageEmbedding()  # the decoder request's copy of it
        out.CopyFrom(got)
        return out.SerializeToString()

    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Relay", {"Get": _handler(relay)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def reader_main(holder_port: int, relay_port: int, trials: int) -> dict[str, list[float]]:
    opts = channel_options()
    h = grpc.aio.insecure_channel(f"127.0.0.1:{holder_port}", options=opts)
    r = grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}", options=opts)
    hold = h.unary_unary(f"/{SERVICE}/Hold")
    relay = r.unary_unary("/bench.Relay/Get")
    reader = handoff.Reader()
    times: dict[str, list[float]] = {"inline (via gateway)": [], "ref shm": [], "ref grpc": []}

    async def inline() -> torch.Tensor:
        msg = tensor_pb2.ImageEmbedding.FromString(await relay(b""))
        data = tensors.validate(msg.embeddings, field="images[0].embeddings", ndim=2)
        return tensors.to_torch(msg.embeddings, data)

    async def by_ref(transport: int) -> torch.Tensor:
        msg = tensor_pb2.ImageEmbedding.FromString(await hold(str(transport).encode()))
        got = await reader.fetch(msg, field="images[0]", timeout=30)
        data = tensors.validate(msg.embeddings, field="images[0].embeddings", ndim=2, data=got.data)
        return tensors.to_torch(msg.embeddings, data)

    runs = {
        "inline (via gateway)": inline,
        "ref shm": lambda: by_ref(tensor_pb2.TRANSPORT_SHM),
        "ref grpc": lambda: by_ref(tensor_pb2.TRANSPORT_GRPC),
    }
    reference = None
    for trial in range(trials + 2):  # two warm-up rounds
        for name, run in runs.items():
            t0 = time.perf_counter()
            out = await run()
            elapsed = (time.perf_counter() - t0) * 1000
            if reference is None:
                reference = out
            assert torch.equal(out, reference), name
            if trial >= 2:
                times[name].append(elapsed)
    await reader.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--width", type=int, default=8192, help="out_hidden * (1 + deepstack)")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--role", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "holder":
        asyncio.run(holder_main(args.port, args.tokens, args.width))
        return
    if args.role == "relay":
        asyncio.run(relay_main(args.port))
        return
    me = [sys.executable, __file__, "--tokens", str(args.tokens), "--width", str(args.width)]
    holder = subprocess.Popen([*me, "--role", "holder"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    holder_port = int(holder.stdout.readline())
    relay = subprocess.Popen(
        [*me, "--role", "relay", "--port", str(holder_port)], stdout=subprocess.PIPE, text=True
    )
    assert relay.stdout is not None
    relay_port = int(relay.stdout.readline())
    try:
        times = asyncio.run(reader_main(holder_port, relay_port, args.trials))
    finally:
        holder.kill()
        relay.kill()
    mib = args.tokens * args.width * 2 / 2**20
    base = statistics.median(times["inline (via gateway)"])
    print(
        f"{args.tokens} tokens x {args.width} bf16 = {mib:.1f} MiB per image, {args.trials} trials"
    )
    print("| path | median ms | min-max ms | ratio vs inline |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f}-{max(ts):.2f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
