"""``splitvl load`` logic against the session cluster: a short run, its report's fields.

The full run (200 concurrent for 2 minutes) is documented in docs/robustness.md; here a
few seconds at modest concurrency check that the client counts every call, that no call
ends INTERNAL/UNKNOWN or hangs, and that the report adds up.
"""

from __future__ import annotations

import asyncio
import json

from splitvl_tools.load import HUNG, build_requests, print_table, run_load


def test_short_load_run_reports_every_call_and_no_internal(cluster) -> None:
    requests = build_requests(24, side=96, repeat_fraction=0.5, max_tokens=4, seed=3)
    report = asyncio.run(
        run_load(
            cluster.ports.address("gateway"),
            requests,
            concurrency=16,
            duration_s=8.0,
            deadline_s=60.0,
            slack_s=10.0,
        )
    )
    d = report.as_dict()
    json.dumps(d)  # the --json output must serialise
    assert d["requests"] == len(report.results) > 0
    assert sum(d["status_counts"].values()) + d["hung"] == d["requests"]
    assert d["hung"] == 0, d
    assert d["internal_or_unknown"] == 0, d
    assert d["status_counts"].get("INTERNAL", 0) == 0
    assert d["ok"] == d["status_counts"].get("OK", 0) > 0, d
    # Every OK call streamed exactly max_tokens tokens (ignore_eos) and one image tier.
    ok = [r for r in report.results if r.code == "OK"]
    assert all(r.tokens == 4 for r in ok)
    assert all(len(r.tiers) == 1 for r in ok)
    assert d["tokens_per_s"] == round(4 * d["ok"] / report.elapsed_s, 3)
    ttft, e2e = d["ttft_ms"], d["e2e_ms"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert 0 < e2e["p50"] <= e2e["p90"] <= e2e["p99"]
    assert ttft["p50"] <= e2e["p50"]
    # Designed repeats were served from the cache at least once.
    assert d["image_tiers"].get("miss", 0) > 0
    assert d["image_tiers"].get("exact", 0) + d["image_tiers"].get("similar", 0) > 0, d
    print_table(d)


def test_a_call_past_its_deadline_plus_slack_counts_as_hung() -> None:
    """A server that accepts the stream and never answers: the client's own bound fires."""
    import grpc
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl_tools.load import one_call

    class Silent(pb_grpc.GatewayServiceServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]
            await asyncio.sleep(3600)
            yield  # pragma: no cover

    async def main() -> tuple[str, str]:
        server = grpc.aio.server()
        pb_grpc.add_GatewayServiceServicer_to_server(Silent(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GatewayServiceStub(ch)
                (request,) = build_requests(1, side=64, repeat_fraction=0, max_tokens=1, seed=1)
                # A real deadline ends the call with DEADLINE_EXCEEDED, not HUNG ...
                bounded = await one_call(stub, request, deadline_s=0.5, slack_s=5.0)
                # ... a client bound that fires first (negative slack) stands in for a
                # call whose deadline never ends it: that call is counted HUNG.
                hung = await one_call(stub, request, deadline_s=0.5, slack_s=-0.3)
                return bounded.code, hung.code
        finally:
            await server.stop(0)

    bounded, hung = asyncio.run(main())
    assert bounded == "DEADLINE_EXCEEDED"
    assert hung == HUNG


def test_resource_exhausted_retry_hint_is_read() -> None:
    """The load client backs off by the server's RetryInfo delay (here 1.5 s)."""
    import grpc
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl_tools.load import one_call

    class Full(pb_grpc.GatewayServiceServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]
            detail = any_pb2.Any()
            detail.Pack(
                error_details_pb2.RetryInfo(
                    retry_delay=duration_pb2.Duration(nanos=5 * 10**8, seconds=1)
                )
            )
            status = rpc_status.to_status(
                status_pb2.Status(
                    code=code_pb2.RESOURCE_EXHAUSTED, message="full", details=[detail]
                )
            )
            await context.abort(status.code, status.details, status.trailing_metadata)
            yield  # pragma: no cover

    async def main():  # type: ignore[no-untyped-def]
        server = grpc.aio.server()
        pb_grpc.add_GatewayServiceServicer_to_server(Full(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                (request,) = build_requests(1, side=64, repeat_fraction=0, max_tokens=1, seed=1)
                return await one_call(pb_grpc.GatewayServiceStub(ch), request, 10.0, 5.0)
        finally:
            await server.stop(0)

    result = asyncio.run(main())
    assert result.code == "RESOURCE_EXHAUSTED"
    assert result.message == "full"
    assert result.retry_after_s == 1.5
