"""The end-to-end tests of tests/unit/splitvl/test_up_replicas.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import redis

from splitvl.launcher import (
    free_base,
    free_port,
    health_status,
)
from tests.unit.splitvl.test_up_replicas import _alive, _refused, assert_needs_password

LAYOUT_ROW = re.compile(
    r"^\s+(gateway|encoder|cache|decoder|redis)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)$"
)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _up_until_serving(argv: list[str], limit_s: float = 400) -> tuple[subprocess.Popen[str], str]:
    """Start ``splitvl up ARGV``; return it and its output once it says SERVING."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitvl.cli", "up", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not any("is SERVING" in ln for ln in lines):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    return proc, "".join(lines)


def _metric_sum(port: int, name: str) -> float:
    """The sum of ``name``'s samples on the Prometheus endpoint at ``port``."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith(name + " ") or ("{" not in name and ln.startswith(name + "{"))
    )


def _flag(proc: psutil.Process, flag: str) -> str:
    argv = proc.cmdline()
    return argv[argv.index(flag) + 1]


def _calls_per_gateway(address: str, metrics_ports: list[int], n: int) -> list[float]:
    """``n`` text requests to ``address``, each on a connection of its own (as ``n``
    clients would; grpc shares one connection between the channels of a process unless
    each has its own subchannel pool): how many Generate calls each gateway process
    answered OK."""
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.client import build_request, consume

    def answered() -> list[float]:
        name = 'splitvl_gateway_requests_total{code="OK",method="Generate"}'
        return [_metric_sum(p, name) for p in metrics_ports]

    before = answered()
    for i in range(n):
        request = build_request([], f"Count {i}.", max_tokens=2, ignore_eos=True)
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(address, options=options) as channel:
            call = pb_grpc.GatewayServiceStub(channel).Generate(request, timeout=120)
            assert len(consume(call, None).token_ids) == 2
    return [a - b for a, b in zip(answered(), before, strict=True)]


def _same_images_through_two_gateways(gateways: list[str], encoders: list[psutil.Process]) -> None:
    """Several callers send the same new images to both gateways at once: every caller of
    an image gets the same tokens, and the encoders run the ViT once per image (the first
    gateway to miss an image claims it in the store; the others wait for its Put)."""
    from concurrent.futures import ThreadPoolExecutor

    from splitvl.client import build_request, generate
    from tests.conftest import photo

    images = ["rocket.jpg", "chelsea.png", "hubble_deep_field.jpg"]
    ports = [int(_flag(p, "--metrics-port")) for p in encoders]
    vit = "splitvl_encoder_batch_images_sum"
    before = sum(_metric_sum(p, vit) for p in ports)

    def call(i: int) -> tuple[str, list[int]]:
        name = images[i % len(images)]
        request = build_request([photo(name)], "Describe.", max_tokens=6, ignore_eos=True)
        return name, list(generate(gateways[i // len(images) % 2], request).token_ids)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(call, range(12)))  # each image: 2 callers per gateway
    for name in images:
        tokens = [t for n, t in answers if n == name]
        assert len(tokens) == 4 and all(t == tokens[0] and len(t) == 6 for t in tokens), name
    assert sum(_metric_sum(p, vit) for p in ports) - before == len(images)


def _embedding_bytes(model: Path, tokens: int) -> int:
    """The fewest bytes an image of ``tokens`` tokens' embeddings take (bf16): each token
    is ``out_hidden_size`` wide per level, the merged one and each deepstack level."""
    vision = json.loads((model / "config.json").read_text())["vision_config"]
    width = vision["out_hidden_size"] * (1 + len(vision["deepstack_visual_indexes"]))
    return tokens * width * 2


def _a_repeat_is_read_from_the_store_by_the_cache_that_did_not_put_it(
    gateway: str, caches: list[int], model: Path
) -> None:
    """One new image, then the same pixels in other PNG files (they differ in a text chunk
    only). Each file is routed to the cache replica its digest hashes to, so the repeats
    reach both replicas; the first that reaches the replica which did not put the image
    is an exact hit it reads from the store: it has put nothing, and its reads from the
    store grew by at least the image's embeddings (a replica's own copy is served with no
    such read)."""
    import io

    from PIL import Image, PngImagePlugin

    from splitvl.client import build_request, generate
    from tests.conftest import rgb

    image = rgb("motorcycle_left.png").resize((160, 120), Image.Resampling.BICUBIC)

    def variant(i: int) -> bytes:
        info = PngImagePlugin.PngInfo()
        info.add_text("splitvl-test", f"copy {i}")
        buf = io.BytesIO()
        image.save(buf, format="PNG", pnginfo=info)
        return buf.getvalue()

    def ask(i: int) -> dict[str, object]:
        request = build_request([variant(i)], "Describe.", max_tokens=2, ignore_eos=True)
        return generate(gateway, request, timeout_s=120).images[0]

    def counts(name: str) -> list[float]:
        return [_metric_sum(p, name) for p in caches]

    puts, exact = "splitvl_cache_puts_total", 'splitvl_cache_lookups_total{tier="exact"}'
    read = 'splitvl_cache_store_bytes_total{direction="read"}'
    puts0, exact0, read0 = counts(puts), counts(exact), counts(read)
    first = ask(0)
    assert first["tier"] == "miss", first
    deadline = time.monotonic() + 30  # the put runs beside the decode
    while sum(counts(puts)) == sum(puts0):
        assert time.monotonic() < deadline, "the new image was never put"
        time.sleep(0.1)
    put = [a - b for a, b in zip(counts(puts), puts0, strict=True)]
    assert sorted(put) == [0, 1], put
    other = put.index(0)
    for i in range(1, 17):  # each copy's replica is a coin toss: 2^-16 to miss it
        again = ask(i)
        assert (again["tier"], again["key"]) == ("exact", first["key"]), again
        if counts(exact)[other] > exact0[other]:
            break
    else:
        raise AssertionError("no copy reached the cache that did not put the image")
    assert counts(puts)[other] == puts0[other]  # it put nothing: the entry came from redis
    tokens = first["tokens"]
    assert isinstance(tokens, int) and tokens > 0
    assert counts(read)[other] - read0[other] >= _embedding_bytes(model, tokens)


@pytest.mark.e2e
def test_up_with_two_of_everything_and_caches_on_redis_serves_and_stops_everything(
    tiny_model: Path, tmp_path: Path
) -> None:
    from splitvl.client import build_request, generate
    from tests.conftest import photo

    base, log_dir, http = free_base(50), tmp_path / "logs", free_port()
    # A loaded 2-core host must not turn a slow Lookup into a second encode.
    waits = {"GATEWAY_CACHE_TIMEOUT_S": "30", "GATEWAY_CACHE_CLAIM_WAIT_S": "60"}
    os.environ.update(waits, CACHE_CLAIM_TTL_S="60")
    try:
        proc, out = _up_until_serving(
            ["--model", str(tiny_model), "--replicas", "gateway=2,decoder=2,cache=2,encoder=2"]
            + ["--store", "redis", "--base-port", str(base)]
            + ["--metrics-base-port", str(base + 30), "--http-port", str(http)]
            + ["--log-dir", str(log_dir)]
        )
    finally:
        for name in (*waits, "CACHE_CLAIM_TTL_S"):
            del os.environ[name]
    try:
        assert "is SERVING" in out, out
        rows = {
            (m[1], int(m[2])): (int(m[3]), m[5])
            for ln in out.splitlines()
            if (m := LAYOUT_ROW.match(ln))
        }
        redis_port = rows.pop(("redis", 1))[0]
        assert f"  gateway  all      {base}  -        (shared, SO_REUSEPORT)" in out, out
        assert rows == {
            ("gateway", 1): (base + 4, "gateway-1.log"),
            ("gateway", 2): (base + 14, "gateway-2.log"),
            ("encoder", 1): (base + 1, "encoder-1.log"),
            ("encoder", 2): (base + 11, "encoder-2.log"),
            ("cache", 1): (base + 2, "cache-1.log"),
            ("cache", 2): (base + 12, "cache-2.log"),
            ("decoder", 1): (base + 3, "decoder-1.log"),
            ("decoder", 2): (base + 13, "decoder-2.log"),
        }, out
        for (service, replica), (port, log) in rows.items():
            assert health_status(f"127.0.0.1:{port}") == "SERVING", (service, replica)
            assert (log_dir / log).exists()
        # The store: the URL every cache got, which answers PING only with its password.
        url = (log_dir / "redis" / "url").read_text().strip()
        assert url.startswith("redis://:") and url.endswith(f"@127.0.0.1:{redis_port}/0")
        password = url.removeprefix("redis://:").rpartition("@")[0]
        assert redis.Redis(port=redis_port, password=password).ping() is True
        assert_needs_password(redis_port)
        tree = _descendants(proc.pid)
        commands = {p.pid: " ".join(p.cmdline()) for p in tree}
        assert any(f"redis-server 127.0.0.1:{redis_port}" in c for c in commands.values())
        caches = [p for p in tree if "cache_service" in p.cmdline()]
        assert [p.environ().get("CACHE_STORE") for p in caches] == [url, url]
        # One generated store secret, shared by both caches through a 0600 file.
        secret_file = log_dir / "store-secret"
        assert [p.environ().get("CACHE_STORE_SECRET_FILE") for p in caches] == [
            str(secret_file)
        ] * 2
        assert secret_file.stat().st_mode & 0o777 == 0o600
        secret = secret_file.read_text().strip()
        assert len(secret) >= 43 and all(secret not in " ".join(p.cmdline()) for p in tree)
        for image in ("astronaut.png", "coffee.png"):
            request = build_request([photo(image)], "Describe.", max_tokens=4, ignore_eos=True)
            assert len(generate(f"127.0.0.1:{base}", request, timeout_s=120).token_ids) == 4
        encoders = [p for p in tree if "encoder_service" in p.cmdline()]
        # Each gateway through its own port: the claims hold across gateways.
        own = [f"127.0.0.1:{base + 4}", f"127.0.0.1:{base + 14}"]
        _same_images_through_two_gateways(own, encoders)
        cache_metrics = [int(_flag(p, "--metrics-port")) for p in caches]
        decoder_metrics = [
            int(_flag(p, "--metrics-port")) for p in tree if "decoder_service" in p.cmdline()
        ]
        _a_repeat_is_read_from_the_store_by_the_cache_that_did_not_put_it(
            own[0], cache_metrics, tiny_model
        )
        # The shared ports: both gateways listen on the gRPC and the HTTP one ...
        gateways = sorted(
            (p for p in tree if "gateway" in p.cmdline()),
            key=lambda p: int(_flag(p, "--metrics-port")),
        )
        assert len(gateways) == 2
        for port in (base, http):
            listeners = {
                c.pid
                for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            }
            assert listeners == {p.pid for p in gateways}, port
        # ... and the kernel hands new connections to both.
        metrics = [base + 30, base + 40]
        assert [int(_flag(p, "--metrics-port")) for p in gateways] == metrics
        counts = _calls_per_gateway(f"127.0.0.1:{base}", metrics, 16)
        assert sum(counts) == 16 and min(counts) >= 1, counts
        # A gateway killed: the other takes every call on the shared port, and `up`
        # restarts the killed one, which takes calls again.
        gateways[0].kill()
        gateways[0].wait(timeout=10)
        assert _calls_per_gateway(f"127.0.0.1:{base}", metrics[1:], 6) == [6]
        deadline = time.monotonic() + 300
        while health_status(own[0]) != "SERVING":
            assert time.monotonic() < deadline, "gateway-1 was not restarted"
            time.sleep(0.5)
        counts = _calls_per_gateway(f"127.0.0.1:{base}", metrics, 16)
        assert sum(counts) == 16 and min(counts) >= 1, counts
        # Every decoder and cache replica answered calls, by its own count.
        served = {
            "decoder": [
                _metric_sum(port, 'splitvl_decoder_requests_total{code="OK",method="Generate"}')
                for port in decoder_metrics
            ],
            "cache": [
                _metric_sum(port, 'splitvl_cache_requests_total{code="OK",method="Lookup"}')
                for port in cache_metrics
            ],
        }
        assert [len(v) for v in served.values()] == [2, 2], served
        assert all(n >= 1 for v in served.values() for n in v), served
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "gateway-1 exited with code -9; restarting it" in rest, rest
    assert (
        "stopped: {'gateway-1': 0, 'gateway-2': 0, 'decoder-1': 0, 'decoder-2': 0, "
        "'encoder-1': 0, 'encoder-2': 0, 'cache-1': 0, 'cache-2': 0, 'redis': 0}" in rest
    ), rest
    left = {pid: cmd for pid, cmd in commands.items() if _alive(pid)}
    assert left == {}  # the services, vLLM's processes, the redis-server
    assert _refused(redis_port)
    for port, _ in rows.values():
        assert health_status(f"127.0.0.1:{port}") == "UNREACHABLE"
