"""Draw one request's trace as a Gantt chart (matplotlib), from real spans.

Usage::

    # start the four services (tiny checkpoint), send one request, receive its spans over
    # OTLP/gRPC in process, and draw them:
    .venv/bin/python scripts/render_trace.py --live --out docs/img/trace.png

    # or draw spans saved as JSON (e.g. SPLITVL_TRACE_JSON=spans.json by tests/e2e/test_traces.py):
    .venv/bin/python scripts/render_trace.py --spans spans.json --out trace.png

A span is a dict with ``service``, ``name``, ``trace_id``, ``span_id``, ``parent``,
``start_ns``, ``end_ns``, ``attributes`` (plain values), ``links`` ([trace_id, span_id])
and ``events`` ([name, time_ns]), the shape tests/conftest.py's OtlpReceiver records.
One row per span in tree order (children by start time); bars are coloured by service;
events are diamonds; a link (the ViT batch span to the request span it served) is a
dashed line. Jaeger shows the same trace when the services export to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

COLOURS = {
    "splitvl-gateway": "#4C72B0",
    "splitvl-cache": "#55A868",
    "splitvl-encoder": "#C44E52",
    "splitvl-decoder": "#8172B2",
}
# Attributes worth printing beside a bar (short ones only).
SHOWN = (
    "splitvl.image.grid_thw",
    "splitvl.cache.tiers",
    "splitvl.cache.tier",
    "splitvl.cache.similarity",
    "splitvl.batch.size",
    "splitvl.batch.patches",
    "splitvl.encoder.queue_wait_ms",
    "splitvl.embedding.bytes",
    "splitvl.usage.prompt_tokens",
    "splitvl.usage.completion_tokens",
)


def tree_order(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span) in depth-first order, children by start time; orphans become roots."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    roots = []
    for s in spans:
        if s["parent"] and s["parent"] in ids:
            children.setdefault(s["parent"], []).append(s)
        else:
            roots.append(s)
    out: list[tuple[int, dict[str, Any]]] = []

    def visit(span: dict[str, Any], depth: int) -> None:
        out.append((depth, span))
        for child in sorted(children.get(span["span_id"], []), key=lambda c: c["start_ns"]):
            visit(child, depth + 1)

    for root in sorted(roots, key=lambda r: r["start_ns"]):
        visit(root, 0)
    return out


def _label(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + ",".join(_label(v) for v in value) + "]"
    return str(value)


def render(spans: list[dict[str, Any]], out: Path, title: str | None = None) -> Path:
    """Write the Gantt chart of ``spans`` (one trace) to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = tree_order(spans)
    t0 = min(s["start_ns"] for s in spans)
    t_end = max(s["end_ns"] for s in spans)
    total_ms = (t_end - t0) / 1e6
    height = max(3.0, 0.34 * len(rows) + 1.4)
    fig, ax = plt.subplots(figsize=(15, height))
    y_of: dict[str, int] = {}
    for y, (_depth, s) in enumerate(rows):
        y_of[s["span_id"]] = y
        start, dur = (s["start_ns"] - t0) / 1e6, (s["end_ns"] - s["start_ns"]) / 1e6
        colour = COLOURS.get(s["service"], "#888888")
        ax.barh(y, max(dur, total_ms * 0.002), left=start, height=0.6, color=colour)
        attrs = s.get("attributes", {})
        shown = [k for k in SHOWN if k in attrs][:3]  # keep the line inside the figure
        notes = " ".join(f"{k.removeprefix('splitvl.')}={_label(attrs[k])}" for k in shown)
        ax.text(
            start + max(dur, 0) + total_ms * 0.005,
            y,
            f"{dur:.1f} ms  {notes}",
            va="center",
            fontsize=7,
        )
        for _name, t_ns in s.get("events", []):
            ax.plot((t_ns - t0) / 1e6, y, marker="D", color="black", markersize=4)
    for s in spans:
        for _trace, span_id in s.get("links", []):
            if span_id in y_of and s["span_id"] in y_of:
                x = (s["start_ns"] - t0) / 1e6
                ax.plot(
                    [x, x], [y_of[s["span_id"]], y_of[span_id]], "k--", linewidth=0.8, alpha=0.6
                )
    labels = [
        "  " * depth + f"{s['service'].removeprefix('splitvl-')}: {s['name']}" for depth, s in rows
    ]
    ax.set_yticks(range(len(rows)), labels, fontsize=8, fontfamily="monospace")
    ax.invert_yaxis()
    ax.set_xlim(0, total_ms * 1.75)
    ax.set_xlabel("milliseconds since the request's first span")
    trace_id = spans[0]["trace_id"]
    ax.set_title(title or f"one Generate request, trace {trace_id[:16]}…  ({total_ms:.0f} ms)")
    ax.legend(
        handles=[Patch(color=c, label=n.removeprefix("splitvl-")) for n, c in COLOURS.items()]
        + [
            plt.Line2D([], [], marker="D", color="black", linestyle="", label="event"),
            plt.Line2D([], [], color="black", linestyle="--", label="span link"),
        ],
        loc="lower right",
        fontsize=8,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# -- live: start the services, send one request, receive its spans ---------------------------
class Receiver:
    """OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) keeping plain dicts."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.spans: list[dict[str, Any]] = []
        lock = self.lock = threading.Lock()
        spans = self.spans

        def plain(v: Any) -> Any:
            kind = v.WhichOneof("value")
            if kind == "array_value":
                return [plain(x) for x in v.array_value.values]
            return getattr(v, kind) if kind else None

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with lock:
                    for rs in request.resource_spans:
                        res = {a.key: plain(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for span in ss.spans:
                                spans.append(
                                    {
                                        "service": res.get("service.name", ""),
                                        "name": span.name,
                                        "trace_id": span.trace_id.hex(),
                                        "span_id": span.span_id.hex(),
                                        "parent": span.parent_span_id.hex(),
                                        "start_ns": span.start_time_unix_nano,
                                        "end_ns": span.end_time_unix_nano,
                                        "attributes": {
                                            a.key: plain(a.value) for a in span.attributes
                                        },
                                        "links": [
                                            [ln.trace_id.hex(), ln.span_id.hex()]
                                            for ln in span.links
                                        ],
                                        "events": [[e.name, e.time_unix_nano] for e in span.events],
                                    }
                                )
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


def live(model: str | None, image: Path | None, max_tokens: int) -> list[dict[str, Any]]:
    """Spans of one real request through freshly started services."""
    from splitvl.client import build_request, generate
    from splitvl.launcher import Cluster, Ports
    from splitvl.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="splitvl-trace-"))
    model = model or str(make_tiny_model(work / "model"))
    if image is None:
        import skimage

        image = Path(skimage.__file__).parent / "data" / "astronaut.png"  # 512x512
    receiver = Receiver()
    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=work / "logs",
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    )
    root = "/qwenvl.gateway.v1.GatewayService/Generate"
    with cluster:
        print("services up; sending one request", file=sys.stderr)
        # A warm-up request first, so the drawn one is not vLLM's first (compile, caches);
        # with a different photo, so the drawn image is unseen and takes the full path
        # (lookup miss, encode, put), not a similarity hit.
        import skimage

        warm_image = Path(skimage.__file__).parent / "data" / "coffee.png"
        warm = build_request([warm_image.read_bytes()], "Hello.", max_tokens=2, ignore_eos=True)
        generate(cluster.ports.address("gateway"), warm, timeout_s=300)
        time.sleep(1.0)
        with receiver.lock:
            seen = {s["trace_id"] for s in receiver.spans}
        fresh = image.read_bytes()
        request = build_request([fresh], "Describe this image.", max_tokens=max_tokens)
        request.sampling.ignore_eos = True
        generate(cluster.ports.address("gateway"), request, timeout_s=300)
        deadline = time.monotonic() + 20
        spans: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            with receiver.lock:
                ids = [
                    s["trace_id"]
                    for s in receiver.spans
                    if s["name"] == root and s["trace_id"] not in seen
                ]
            if ids:
                spans = receiver.trace(ids[-1])
                if {"vit.batch", "decoder.generation", "gateway.cache_put"} <= {
                    s["name"] for s in spans
                }:
                    time.sleep(0.5)
                    spans = receiver.trace(ids[-1])
                    break
            time.sleep(0.3)
    receiver.server.stop(0)
    if not spans:
        raise SystemExit("no trace received")
    return spans


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--spans", type=Path, help="JSON list of spans (one trace)")
    src.add_argument("--live", action="store_true", help="start the services, trace a request")
    parser.add_argument("--out", type=Path, default=Path("docs/img/trace.png"))
    parser.add_argument("--save-spans", type=Path, help="also write the spans as JSON")
    parser.add_argument("--model", help="checkpoint (default: build the tiny one)")
    parser.add_argument("--image", type=Path, help="image to send (default: astronaut.png)")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if args.live:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        spans = live(args.model, args.image, args.max_tokens)
    else:
        spans = json.loads(args.spans.read_text())
    if args.save_spans:
        args.save_spans.write_text(json.dumps(spans, indent=1))
    print(render(spans, args.out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
