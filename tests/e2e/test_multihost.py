"""The four services on four "hosts" (network namespaces on a bridge), crossing a real network.

Topology (tests/netns.py; addresses from one /28 of 198.51.100.0/24, shown for block 0)::

    root namespace: bridge 198.51.100.1 (this test: client, OTLP receiver, counters)
      host A 198.51.100.11: gateway + encoder
      host B 198.51.100.12: cache
      host C 198.51.100.13: decoder
      host D 198.51.100.14: decoder

Every service binds its host's address (so each holder advertises a routable one) and
has its own empty /dev/shm: the gateway asks for shared-memory hand-offs (``splitvl up``'s
``GATEWAY_EMBEDDING_TRANSPORT=shm``), and a reader on another host, finding no segment,
reads the same ticket over gRPC from the holder (``vlcommon.handoff``). The gateway routes
decoder calls itself over ``ipv4:C:port,D:port`` by image affinity.

Shown here: the tokens equal transformers' on the raw image (the reference the one-host
cluster is held to, tests/e2e/test_e2e.py); a repeat is an exact hit served from host B's
cache; one request is one OTLP trace with spans from all four hosts; the embedding bytes
cross each link once per flow (a miss: encoder host -> decoder host, and encoder host ->
cache host for the put, off the critical path; a hit: cache host -> decoder host; never
through the gateway as a payload), by the veths' counters and per TCP socket; two images
whose affinity keys have different homes reach different decoder hosts, and a repeat
reaches the same one; host D cut off under load (its link down) ends its calls with a
clear status by their deadline while host C answers its own, and D answers again once the
link is back.

Runs as root only (CI does), with ``ip`` and ``unshare``; skips elsewhere with the reason.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitvl.client import Result, build_request, generate
from splitvl.launcher import (
    PACKAGES,
    checkpoint_dtype,
    cpu_placement,
    decoder_default_args,
    health_status,
)
from tests import netns
from tests.conftest import OtlpReceiver, photo, png_bytes, rgb
from vlcommon.lifeline import LAUNCHER_PID_ENV
from vlcommon.model_info import load_vision_spec

pytestmark = pytest.mark.skipif(netns.missing() is not None, reason=str(netns.missing()))

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Describe this image."
MAX_TOKENS = 16
# Each namespace has its own ports: fixed ones collide with nothing.
GRPC_PORT = {"gateway": 50051, "encoder": 50052, "cache": 50053, "decoder": 50054}
METRICS_PORT = {"gateway": 9401, "encoder": 9402, "cache": 9403, "decoder": 9404}
# Where each service runs (the decoder on both C and D), in the order they start: the
# decoders first, as the launcher does (vLLM's engine takes longest to come up).
PLACES = [("decoder", "c"), ("decoder", "d"), ("encoder", "a"), ("cache", "b"), ("gateway", "a")]
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
ROOT_SPAN = "/qwenvl.gateway.v1.GatewayService/Generate"


@dataclass
class MultiHost:
    """The running services: ``net`` (hosts, counters), the OTLP ``receiver`` on the
    bridge, the log folder, and where each service answers."""

    net: netns.Network
    receiver: OtlpReceiver
    log_dir: Path
    model: Path

    def address(self, service: str, host: str) -> str:
        return f"{self.net[host].address}:{GRPC_PORT[service]}"

    def metric(self, service: str, host: str, name: str, **labels: str) -> float:
        """Sum of one Prometheus sample of a service (0 when absent)."""
        url = f"http://{self.net[host].address}:{METRICS_PORT[service]}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def metric_inside(self, service: str, host: str, name: str, **labels: str) -> float:
        """:meth:`metric` read from inside ``host``'s namespace (its loopback end of the
        service's metrics port is reachable while its link is down)."""
        import subprocess
        import sys

        code = (
            "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen("
            f"'http://{self.net[host].address}:{METRICS_PORT[service]}/metrics',"
            " timeout=5).read().decode())"
        )
        ns = self.net.hosts[host].netns
        text = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def decoder_requests(self) -> dict[str, float]:
        """Generate calls each decoder host has answered."""
        return {
            host: self.metric(
                "decoder", host, "splitvl_decoder_requests_total", method="Generate", code="OK"
            )
            for host in ("c", "d")
        }

    def ask(self, image: bytes, max_tokens: int = MAX_TOKENS) -> Result:
        request = build_request([image], PROMPT, max_tokens=max_tokens, ignore_eos=True)
        return generate(self.address("gateway", "a"), request, timeout_s=120)

    def home(self, key: str) -> str:
        """The decoder host the gateway's ring picks for ``key`` when nothing is in flight."""
        from gateway.pipeline.route import DecoderRouter, Endpoint

        router = DecoderRouter()
        router.set_endpoints([Endpoint(self.address("decoder", h), None) for h in ("c", "d")])
        first = router.candidates(key)[0][0].address
        return next(h for h in ("c", "d") if self.address("decoder", h) == first)


def _command(service: str, host: str, net: netns.Network, model: Path) -> list[str]:
    address = net[host].address
    argv = [
        sys.executable,
        "-m",
        PACKAGES[service],
        "--host",
        address,
        "--port",
        str(GRPC_PORT[service]),
        "--metrics-port",
        str(METRICS_PORT[service]),
    ]
    if service == "gateway":
        decoders = ",".join(f"{net[h].address}:{GRPC_PORT['decoder']}" for h in ("c", "d"))
        return [
            *argv,
            "--model",
            str(model),
            "--encoder-address",
            f"{net['a'].address}:{GRPC_PORT['encoder']}",
            "--cache-address",
            f"{net['b'].address}:{GRPC_PORT['cache']}",
            "--decoder-address",
            f"ipv4:{decoders}",
        ]
    if service == "encoder":
        dtype = checkpoint_dtype(str(model))
        return [*argv, "--model", str(model), *(("--dtype", dtype) if dtype else ())]
    if service == "decoder":
        return [*argv, "--model", str(model), *decoder_default_args(str(model))]
    return argv


def _environment(service: str, host: str, otlp: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_SERVICE_NAME": f"splitvl-{service}@{host}",
        # Shared memory asked for, as on one host: every reader is on another host here,
        # finds no segment and reads the ticket over gRPC from the holder.
        "GATEWAY_EMBEDDING_TRANSPORT": "shm",
        # The services' watchdog ends them if this process dies without its teardown.
        LAUNCHER_PID_ENV: str(os.getpid()),
    }
    # One decoder's vLLM worker per core, the encoder beside D's at a lower priority (as
    # `splitvl up` places one decoder and the encoder).
    placement = cpu_placement(env)
    if placement:
        other = placement["encoder"]["ENCODER_CPUS"]
        if service == "encoder":
            env.update(placement["encoder"])
        elif service == "decoder":
            env["VLLM_CPU_OMP_THREADS_BIND"] = (
                placement["decoder"]["VLLM_CPU_OMP_THREADS_BIND"] if host == "c" else other
            )
    return env


@pytest.fixture(scope="module")
def multihost(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHost]:
    log_dir = tmp_path_factory.mktemp("multihost")
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(netns.Network(["a", "b", "c", "d"]))
        receiver = OtlpReceiver(host=net.gateway_address)
        stack.callback(receiver.stop)
        stack.callback(net.close)  # the services first, while their exporters' receiver lives
        otlp = f"http://{net.gateway_address}:{receiver.port}"
        procs = {}
        for service, host in PLACES:
            log = stack.enter_context((log_dir / f"{service}-{host}.log").open("wb"))
            procs[(service, host)] = net.popen(
                host,
                _command(service, host, net, tiny_model),
                log=log,
                env=_environment(service, host, otlp),
                cwd=ROOT,  # `python -m` puts the working directory first on sys.path
            )
        cluster = MultiHost(net, receiver, log_dir, tiny_model)
        deadline = time.monotonic() + 300
        for (service, host), proc in procs.items():
            while health_status(cluster.address(service, host)) != "SERVING":
                log_file = log_dir / f"{service}-{host}.log"
                tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
                assert proc.poll() is None, f"{service} on {host} exited:\n{tail}"
                assert time.monotonic() < deadline, f"{service} on {host} not SERVING:\n{tail}"
                time.sleep(0.5)
        yield cluster


def _reference(model: Path, images: list[bytes]) -> list[list[int]]:
    """transformers' greedy tokens on each raw image (float32, eos ignored)."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(model)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32)
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = []
    for image in images:
        pil = Image.open(io.BytesIO(image)).convert("RGB")
        inputs = proc(text=[prompt], images=[pil], return_tensors="pt")
        with torch.inference_mode():
            ids = hf.generate(  # type: ignore[misc]  # transformers' annotation of self
                **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
            )
        out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def _payload(model: Path, tokens: int) -> int:
    """Embedding bytes of one image: tokens x width (pooler + deepstack) x itemsize."""
    width = load_vision_spec(model).embedding_width
    return tokens * width * ITEMSIZE[checkpoint_dtype(str(model)) or "float32"]


def _measure(
    cluster: MultiHost, image: bytes, settled: Callable[[], bool]
) -> tuple[Result, netns.LinkBytes, dict[tuple[str, str], int]]:
    """Send one request; return it with the link and per-socket bytes it moved, read
    once ``settled()`` holds (work off the critical path, such as the cache's read of a
    put, ends after the response) and half a second more (the last spans' export), or
    after 15 s."""
    links, sockets = cluster.net.link_bytes(), cluster.net.tcp_bytes()
    result = cluster.ask(image)
    deadline = time.monotonic() + 15
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    return (
        result,
        cluster.net.link_bytes() - links,
        netns.tcp_delta(cluster.net.tcp_bytes(), sockets),
    )


def _spans(cluster: MultiHost, name: str) -> list[dict[str, Any]]:
    return [s for s in cluster.receiver.snapshot() if s["name"] == name]


def _put_bytes(cluster: MultiHost, seen: int) -> int:
    """The size of the Put message after the first ``seen`` (its gateway span's
    ``splitvl.transfer_bytes``), waiting up to 10 s for the span."""
    deadline = time.monotonic() + 10
    while len(puts := _spans(cluster, "gateway.cache_put")) <= seen:
        assert time.monotonic() < deadline, "no gateway.cache_put span arrived"
        time.sleep(0.2)
    return int(puts[seen]["attributes"]["splitvl.transfer_bytes"].int_value)


def _prefix_hits(cluster: MultiHost, host: str) -> float:
    """Prompt tokens vLLM found in the prefix cache of the decoder on ``host``."""
    return cluster.metric("decoder", host, "splitvl_decoder_engine_prefix_cache_hit_tokens_total")


def _report(what: str, payload: int, links: netns.LinkBytes, tcp: dict[Any, int]) -> str:
    rows = [f"{what}: payload {payload} B"]
    rows += [
        f"  link {h}: sent {links.sent[h]} B, received {links.received[h]} B" for h in links.sent
    ]
    rows += [f"  tcp {src}->{dst}: {n} B" for (src, dst), n in sorted(tcp.items())]
    return "\n".join(rows)


def test_a_miss_and_a_hit_cross_each_link_once_and_decode_the_one_host_tokens(
    multihost: MultiHost,
) -> None:
    """Astronaut (64 tokens): a miss, then the same file again, an exact hit from host B.
    The embedding payload crosses A->C (and A->B for the put) once on the miss, B->C once
    on the hit, and never leaves host A on the hit; both decode transformers' tokens on
    the raw image on the same decoder host (the image's affinity home)."""
    cluster = multihost
    image = photo("astronaut.png")
    [expected] = _reference(cluster.model, [image])
    calls = cluster.decoder_requests()

    puts_before = len(_spans(cluster, "gateway.cache_put"))
    # The gateway's put span ends when the cache has answered, after reading the payload.
    miss, miss_links, miss_tcp = _measure(
        cluster, image, lambda: len(_spans(cluster, "gateway.cache_put")) > puts_before
    )
    # The Put message itself (key, descriptor, verification image, the ref) also goes A->B.
    put_bytes = _put_bytes(cluster, puts_before)
    payload = _payload(cluster.model, miss.images[0]["tokens"])
    print(_report("miss", payload, miss_links, miss_tcp), f"\n  Put message: {put_bytes} B")
    assert miss.images[0]["tier"] == "miss"
    assert miss.images[0]["tokens"] == 64 and payload == 64 * 384 * 4  # fp32, 128 x (1 + 2)
    assert miss.token_ids == expected

    prefix_hits = {h: _prefix_hits(cluster, h) for h in ("c", "d")}
    hit, hit_links, hit_tcp = _measure(cluster, image, lambda: True)
    print(_report("hit", payload, hit_links, hit_tcp))
    assert hit.images[0]["tier"] == "exact"
    assert hit.images[0]["key"] == miss.images[0]["key"]
    assert hit.token_ids == expected

    # The same image twice: the same decoder host, its key's home on the ring.
    home = cluster.home(miss.images[0]["key"])
    other = "d" if home == "c" else "c"
    after = cluster.decoder_requests()
    assert after[home] - calls[home] == 2 and after[other] == calls[other], (calls, after)
    # There, vLLM's prefix cache had the image's KV (the point of routing by image).
    deadline = time.monotonic() + 5
    while _prefix_hits(cluster, home) == prefix_hits[home] and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"prefix-cache hit tokens on {home}: {_prefix_hits(cluster, home) - prefix_hits[home]}")
    assert _prefix_hits(cluster, home) > prefix_hits[home]
    assert _prefix_hits(cluster, other) == prefix_hits[other]

    # A miss: the payload once from the encoder's host to the decoder's, and once to the
    # cache's (the put's read); nothing of it to the other decoder host.
    assert payload <= miss_tcp.get(("a", home), 0) < 1.5 * payload, miss_tcp
    assert payload <= miss_links.received[home] < 1.5 * payload, miss_links
    # A->B: the Lookup and the Put messages (about put_bytes each: both carry the
    # verification image) and the payload once, read by the cache beside the decode.
    assert payload + put_bytes <= miss_tcp.get(("a", "b"), 0), miss_tcp
    assert miss_tcp[("a", "b")] < 1.5 * payload + 2 * put_bytes, miss_tcp
    assert miss_links.received[other] < 0.05 * payload, miss_links
    # A hit: the payload once from the cache's host to the decoder's; host A (gateway,
    # encoder) sends only references and metadata.
    assert payload <= hit_tcp.get(("b", home), 0) < 1.5 * payload, hit_tcp
    assert payload <= hit_links.received[home] < 1.5 * payload, hit_links
    assert payload <= hit_links.sent["b"] < 1.5 * payload, hit_links
    assert hit_links.sent["a"] < 0.25 * payload, hit_links
    assert hit_tcp.get(("a", home), 0) < 0.1 * payload, hit_tcp
    assert hit_links.received[other] < 0.05 * payload, hit_links


def test_one_request_is_one_trace_across_the_four_hosts(multihost: MultiHost) -> None:
    """An unseen image (looked up, encoded, stored, decoded): one trace id holds spans of
    the gateway and encoder (host A), the cache (host B) and a decoder (C or D); the
    decoder and the cache read the embeddings over gRPC, their shared-memory segment
    being on another host."""
    cluster = multihost
    image = png_bytes(rgb("chelsea.png").crop((11, 7, 411, 307)))
    seen = {s["span_id"] for s in cluster.receiver.snapshot() if s["name"] == ROOT_SPAN}
    result = cluster.ask(image, max_tokens=4)
    assert result.images[0]["tier"] == "miss"
    home = cluster.home(result.images[0]["key"])

    want = {"splitvl-gateway@a", "splitvl-encoder@a", "splitvl-cache@b", f"splitvl-decoder@{home}"}
    deadline = time.monotonic() + 20
    while True:
        spans: list[dict[str, Any]] = cluster.receiver.snapshot()
        roots = [s for s in spans if s["name"] == ROOT_SPAN and s["span_id"] not in seen]
        trace = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]
        services = {str(s["service"]) for s in trace}
        fetches = [s for s in trace if s["name"] == "embedding.fetch"]
        if (want <= services and len(fetches) >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert len(roots) == 1
    assert services == want, sorted(services)  # the other decoder host took no part
    by_reader = {
        s["service"]: s["attributes"]["splitvl.embedding.transport"].string_value for s in fetches
    }
    assert by_reader == {f"splitvl-decoder@{home}": "grpc", "splitvl-cache@b": "grpc"}


def test_images_with_different_homes_reach_different_decoder_hosts(
    multihost: MultiHost,
) -> None:
    """Unseen crops until one's affinity key has the other decoder host as its home (the
    ring depends on the addresses, which depend on the /28 this run got): each request
    reaches its key's home, so two images reach both hosts, and the first again reaches
    the same host (its repeat, an exact hit)."""
    cluster = multihost
    source = rgb("coffee.png")
    crops = [png_bytes(source.crop((3 * i, 2 * i, 3 * i + 400, 2 * i + 300))) for i in range(16)]
    reached: dict[str, str] = {}
    first_key = ""
    for crop in crops:
        before = cluster.decoder_requests()
        result = cluster.ask(crop, max_tokens=2)
        after = cluster.decoder_requests()
        served = [h for h in before if after[h] - before[h] == 1]
        assert len(served) == 1 and sum(after.values()) - sum(before.values()) == 1
        key = result.images[0]["key"]
        assert served[0] == cluster.home(key), (key, served)
        first_key = first_key or key
        reached.setdefault(served[0], key)
        if len(reached) == 2:
            break
    assert set(reached) == {"c", "d"}, f"all {len(crops)} keys had one home: {reached}"

    before = cluster.decoder_requests()
    again = cluster.ask(crops[0], max_tokens=2)
    after = cluster.decoder_requests()
    assert again.images[0]["tier"] == "exact" and again.images[0]["key"] == first_key
    home = cluster.home(first_key)
    assert {h: after[h] - before[h] for h in after} == {
        home: 1,
        ("d" if home == "c" else "c"): 0,
    }


PARTITION_DEADLINE_S = 30.0
PARTITION_S = 25.0


def test_a_partitioned_decoder_host_ends_its_calls_in_time_and_serves_again_once_healed(
    multihost: MultiHost,
) -> None:
    """Host D cut off (its link down: packets dropped, no reset) for 25 s under load of 8
    workers, half of whose images have D as their affinity home, each call with a 30 s
    deadline: every call ends OK or with a clear status (DEADLINE_EXCEEDED: D never
    answered; UNAVAILABLE: the connection was declared dead after tokens had come), none
    past its deadline; calls homed on C are answered all along; once the link is back, D
    answers its keys again, with nothing restarted."""
    cluster = multihost
    source = rgb("astronaut.png")
    crops = [png_bytes(source.crop((7 * i, 5 * i, 7 * i + 224, 5 * i + 224))) for i in range(16)]
    homes: dict[str, list[bytes]] = {"c": [], "d": []}
    for crop in crops:
        homes[cluster.home(cluster.ask(crop, max_tokens=2).images[0]["key"])].append(crop)
    assert homes["c"] and homes["d"], {h: len(v) for h, v in homes.items()}

    calls: list[tuple[str, str, str, float]] = []  # (home, phase at the end, code, seconds)
    phase = "before"
    stop = False

    def worker(home: str) -> None:
        n = 0
        while not stop:
            image = homes[home][n % len(homes[home])]
            n += 1
            request = build_request([image], PROMPT, max_tokens=4, ignore_eos=True)
            t0 = time.monotonic()
            try:
                generate(cluster.address("gateway", "a"), request, timeout_s=PARTITION_DEADLINE_S)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
            calls.append((home, phase, code, time.monotonic() - t0))

    threads = [threading.Thread(target=worker, args=("cd"[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(5)
        served_d = cluster.decoder_requests()["d"]
        with cluster.net.partitioned("d"):
            phase = "partitioned"
            time.sleep(2)  # the calls D had in flight at the cut end (4 tokens each)
            # The cut is real: D, read from inside, takes no call while its link is down.
            generate_calls = "splitvl_decoder_requests_total"
            during = cluster.metric_inside("decoder", "d", generate_calls, method="Generate")
            # A call D took just before the cut may still be reading its embeddings from
            # the other hosts (until its deadline): it ends during the cut, nothing begins.
            stuck = "splitvl_decoder_in_flight_requests"
            held = cluster.metric_inside("decoder", "d", stuck, method="Generate")
            time.sleep(PARTITION_S - 2)
            after = cluster.metric_inside("decoder", "d", generate_calls, method="Generate")
        phase = "healed"
        deadline = time.monotonic() + 90
        while cluster.decoder_requests()["d"] <= served_d and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(5)
    finally:
        stop = True
        for t in threads:
            t.join(timeout=PARTITION_DEADLINE_S + 30)
    summary: dict[tuple[str, str], dict[str, int]] = {}
    for home, at, code, _ in calls:
        summary.setdefault((home, at), {}).setdefault(code, 0)
        summary[(home, at)][code] += 1
    print("calls by (home, phase they ended in):", summary)
    assert {code for _, _, code, _ in calls} <= {"OK", "DEADLINE_EXCEEDED", "UNAVAILABLE"}
    assert max(s for *_, s in calls) <= PARTITION_DEADLINE_S + 2
    # C's keys were answered all along; D's only before and after the cut.
    assert set(summary[("c", "partitioned")]) == {"OK"}
    # D's counter flat while cut off: at most the calls it held at the cut ended.
    assert during <= after <= during + held, (during, after, held)
    assert summary[("d", "before")] == {"OK": summary[("d", "before")]["OK"]}
    assert cluster.decoder_requests()["d"] > served_d  # D answered again once healed
    assert summary.get(("d", "healed"), {}).get("OK", 0) > 0
