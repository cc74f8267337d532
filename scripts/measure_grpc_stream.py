"""The floor of a relay hop: grpc.aio's CPU per streamed message, server and client apart.

A server process streams ``--messages`` 8-byte messages per call and a client process
reads them, ``--calls`` times; each reports its own CPU (``getrusage``: user + system,
every thread, grpc's C-core and poller threads among them) per message. A relay that
passes each token on as a message of its own (splitvl's gateway, the decoder's
front-end) reads one and writes one per token, so the two figures together bound what
such a hop can cost per token in Python's grpc.aio, before any code of its own:

    python scripts/measure_grpc_stream.py --messages 4000 --calls 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def serve(messages: int) -> None:
    import grpc

    async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        for _ in range(messages):
            yield b"tokens:8"

    handler = grpc.method_handlers_generic_handler(
        "m.Stream",
        {
            "Tokens": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=bytes, response_serializer=bytes
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    # Each line on stdin asks for the CPU so far; EOF stops the server.
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps({"cpu_s": cpu_s(), "asked": line.strip()}), flush=True)
    await server.stop(0)


async def read(port: int, calls: int, messages: int, server: subprocess.Popen[str]) -> dict:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/m.Stream/Tokens", response_deserializer=bytes)
        async for _ in call(b""):  # first use, unmeasured
            pass

        def server_cpu() -> float:
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write("cpu\n")
            server.stdin.flush()
            return float(json.loads(server.stdout.readline())["cpu_s"])

        s0, c0, t0 = server_cpu(), cpu_s(), time.perf_counter()
        got = 0
        for _ in range(calls):
            async for _ in call(b""):
                got += 1
        c1, t1, s1 = cpu_s(), time.perf_counter(), server_cpu()
    assert got == calls * messages
    return {
        "server_us_per_message": 1e6 * (s1 - s0) / got,
        "client_us_per_message": 1e6 * (c1 - c0) / got,
        "wall_us_per_message": 1e6 * (t1 - t0) / got,
        "messages": got,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=4000, help="messages per call")
    parser.add_argument("--calls", type=int, default=3, help="measured calls")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.messages))
        return 0
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--messages", str(args.messages)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(json.loads(server.stdout.readline())["port"])
        result = asyncio.run(read(port, args.calls, args.messages, server))
    finally:
        server.kill()
        server.wait()
    print(json.dumps(result))
    write, read_ = result["server_us_per_message"], result["client_us_per_message"]
    print(
        f"grpc.aio per streamed message: server (write) {write:.0f} µs CPU, client (read) "
        f"{read_:.0f} µs CPU; a relay hop reads and writes each: {write + read_:.0f} µs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
