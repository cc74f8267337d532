"""The ``splitvl`` command's behaviour a user sees: --image sources, one-line errors, the
decoder pass-through, offline mode only for local checkpoints, defaults in --help."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from splitvl import cli
from splitvl.client import build_request, image_input
from splitvl.home import cluster_from_args
from splitvl.launcher import DECODER_DEFAULT_ARGS, Cluster, Ports, free_base, free_port
from splitvl_tools.cluster import keep_or_remove_logs

PNG_1X1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def test_image_input_sends_urls_as_url_data_urls_as_data_url_files_as_bytes(tmp_path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(PNG_1X1)
    data_url = "data:image/png;base64," + base64.b64encode(PNG_1X1).decode()

    assert image_input("https://example.com/a.png") == pb.ImageInput(
        url="https://example.com/a.png"
    )
    assert image_input("HTTP://example.com/b.jpg").url == "HTTP://example.com/b.jpg"
    assert image_input(data_url) == pb.ImageInput(data_url=data_url)
    assert image_input(str(path)) == pb.ImageInput(data=PNG_1X1)
    with pytest.raises(FileNotFoundError):
        image_input(str(tmp_path / "missing.png"))


def test_build_request_takes_bytes_and_image_inputs_in_order() -> None:
    request = build_request([PNG_1X1, pb.ImageInput(url="https://h/x.png")], "Describe.")
    parts = request.messages[0].parts
    assert [p.WhichOneof("part") for p in parts] == ["image", "image", "text"]
    assert parts[0].image.data == PNG_1X1
    assert parts[1].image.url == "https://h/x.png"
    assert parts[2].text == "Describe."
    assert not request.sampling.HasField("max_tokens")  # the decoder's default applies


def _splitvl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitvl.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def _up_argv(model: Path, log_dir: Path) -> list[str]:
    """`splitvl up` on free ports, Prometheus off, logs in ``log_dir``."""
    return [
        *("up", "--model", str(model), "--base-port", str(free_base())),
        *("--metrics-base-port", "0", "--http-port", "0", "--log-dir", str(log_dir)),
    ]


def test_generate_with_a_missing_file_is_one_line_and_exit_2(tmp_path) -> None:
    missing = tmp_path / "nope.png"
    out = _splitvl("generate", "--image", str(missing), "--prompt", "hi")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "No such file" in lines[0], lines


def test_generate_with_a_url_reaches_the_gateway_call(tmp_path) -> None:
    # Nothing listens on the port: the URL was accepted and the call made (UNAVAILABLE, exit 1).
    port = free_port()
    out = _splitvl(
        "generate",
        "--image",
        "https://example.com/a.png",
        "--prompt",
        "hi",
        "--address",
        f"127.0.0.1:{port}",
        "--timeout",
        "20",
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("UNAVAILABLE:"), out.stderr


def test_generate_help_shows_defaults() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["generate"].format_help()  # type: ignore[attr-defined]
    assert "(default: 300.0)" in text  # --timeout
    assert "(default: 127.0.0.1:50051)" in text  # --address
    assert "DECODER_MAX_TOKENS_DEFAULT (256)" in text


def test_bench_help_shows_defaults() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = " ".join(sub.choices["bench"].format_help().split())  # type: ignore[attr-defined]
    assert "closed-loop requests in flight (default: 32)" in text
    assert "output tokens per request (default: 32)" in text
    assert "(default: bench-out)" in text and "(default: 1,8,32)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_docstring_lists_every_subcommand() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = set(sub.choices)  # type: ignore[arg-type]
    assert names == {
        "make-tiny-model",
        "up",
        "demo",
        "bench",
        "cache-bench",
        "cache-eval",
        "load",
        "faults",
        "soak",
        "plan",
        "generate",
    }
    for name in names:
        assert f"splitvl {name}" in (cli.__doc__ or ""), name


def test_cache_bench_default_sizes_leave_out_the_million() -> None:
    args = cli.build_parser().parse_args(["cache-bench"])
    assert args.sizes == [10_000, 100_000]


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "10k"],
        ["--sizes", "0"],
        ["--sizes", ","],
        ["--sweep", "128"],
        ["--sweep", "128:0"],
        ["--sweep", "a:b"],
        ["--sweep", "1:2:3"],
    ],
)
def test_cache_bench_refuses_malformed_sizes_and_sweeps_with_a_usage_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["cache-bench", *argv])
    assert exit_info.value.code == 2  # argparse's usage error, not a traceback
    assert argv[0] in capsys.readouterr().err


def test_cache_bench_parses_sweeps_and_checks_sizes_against_queries(capsys) -> None:
    args = cli.build_parser().parse_args(["cache-bench", "--sweep", "128:8, 256:16,"])
    assert args.sweep == [(128, 8), (256, 16)]
    args = cli.build_parser().parse_args(["cache-bench", "--sizes", "100", "--queries", "1000"])
    with pytest.raises(SystemExit, match="every size must hold the 500 entries"):
        args.func(args)


def test_decoder_args_append_to_the_tiny_defaults_env_then_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITVL_DECODER_ARGS", "--max-model-len 8192 --dtype bfloat16")
    args = cli.build_parser().parse_args(
        [
            *_up_argv(tmp_path, tmp_path / "logs"),
            "--decoder-arg=--max-model-len=32768",
            "--decoder-arg",
            "--mm-processor-cache-gb 0",
        ]
    )
    command = cluster_from_args(args)._command("decoder")
    tail = command[command.index(str(tmp_path)) + 1 :]
    assert tail == [
        *DECODER_DEFAULT_ARGS,
        "--max-model-len",
        "8192",
        "--dtype",
        "bfloat16",
        "--max-model-len=32768",
        "--mm-processor-cache-gb",
        "0",
    ]


def test_each_base_port_has_its_own_default_log_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITVL_HOME", str(tmp_path))
    # The default ports by name, whether or not an instance (a demo) holds them now: the
    # port check has tests of its own (test_launcher.py).
    monkeypatch.setattr("splitvl.home.check_ports", lambda ports: None)
    dirs = [
        cluster_from_args(
            cli.build_parser().parse_args(["up", "--model", "m", "--http-port", "0", *extra])
        ).log_dir
        for extra in ([], ["--base-port", "61000"], ["--log-dir", str(tmp_path / "mine")])
    ]
    assert dirs == [tmp_path / "logs" / "50051", tmp_path / "logs" / "61000", tmp_path / "mine"]


def test_offline_mode_only_for_a_local_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    ports = Ports.from_base(50051, 0)
    assert Cluster(str(tmp_path), ports, tmp_path)._env()["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in Cluster("Qwen/Qwen3-VL-2B-Instruct", ports, tmp_path)._env()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert Cluster(str(tmp_path), ports, tmp_path)._env()["HF_HUB_OFFLINE"] == "0"


def test_temporary_logs_removed_after_a_pass_kept_otherwise(tmp_path) -> None:
    lines: list[str] = []
    passed, failed, users = tmp_path / "p", tmp_path / "f", tmp_path / "u"
    for d in (passed, failed, users):
        d.mkdir()
        (d / "gateway.log").write_text("x")
    keep_or_remove_logs(passed, own=True, ok=True, log=lines.append)
    keep_or_remove_logs(failed, own=True, ok=False, log=lines.append)
    keep_or_remove_logs(users, own=False, ok=True, log=lines.append)
    assert not passed.exists()
    assert (failed / "gateway.log").exists() and (users / "gateway.log").exists()
    assert lines == [f"service logs kept in {failed}", f"service logs kept in {users}"]


def test_generate_help_leaves_out_empty_defaults_but_shows_zero() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = " ".join(sub.choices["generate"].format_help().split())  # type: ignore[attr-defined]
    assert "0 = greedy (default: 0.0)" in text
    assert "(default: None)" not in text and "(default: [])" not in text
    assert "(default: False)" not in text


def test_cache_bench_measures_recall_and_sweeps_search_settings_on_one_graph() -> None:
    """A small real run of `splitvl cache-bench` (past the HNSW threshold): the approximate
    index never answers with an entry the exact index would not (scores are re-scored
    exactly); the sweep times other settings on the same graph and puts the service's
    defaults back."""
    import faiss

    from cache_service.index import VectorIndex
    from splitvl_tools.cache_bench import bench_size, default_config, table

    cfg = default_config()
    r = bench_size(3000, cfg, 200, sweep=[(16, 1), (256, 16)])
    assert r["index"] == "hnsw" and r["exact_hits"] > 50
    assert r["approx_hits_differing"] == 0 and r["recall"] == 1.0
    assert set(r["sweep"]) == {"ef16_k1", "ef256_k16"}
    assert all(0 <= x["recall"] <= 1 and x["p99_ms"] > 0 for x in r["sweep"].values())
    assert r["flat"]["bytes_per_entry"] == cfg.dim * 4 + 16
    summary = {"dim": cfg.dim, "threshold": cfg.threshold, "hnsw": {}, "faiss": "x"}
    summary |= {"cpus": 2, "load_average_1m_at_start": 0.0, "sizes": {"3000": r}}
    assert "ef256_k16" in table(summary)

    index = VectorIndex("hnsw", cfg.dim, cfg.params)
    index.tune_search(200, 3)
    refine = faiss.downcast_index(index.index.index)
    hnsw = faiss.downcast_index(faiss.downcast_index(refine.base_index).index)
    assert (hnsw.hnsw.efSearch, refine.k_factor) == (200, 3.0)
    with pytest.raises(ValueError, match="flat index"):
        VectorIndex("flat", cfg.dim, cfg.params).tune_search(200, 3)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--concurrency", "0"],  # used to wait forever on a zero-permit semaphore
        ["bench", "--reps", "0"],
        ["bench", "--rate", "-1"],
        ["bench", "--rate", "nan"],
        ["bench", "--requests", "-5"],
        ["bench", "--block-size", "0"],
        ["bench", "--openai", "--video"],  # two "instead" scenarios: one was picked silently
        ["bench", "--photos", "--wide-only"],
        ["load", "--concurrency", "0"],
        ["load", "--repeat-fraction", "1.5"],
        ["load", "--duration", "0"],
        ["soak", "--sample-every", "0"],
        ["soak", "--cache-mib", "inf"],
        ["cache-eval", "--threshold", "2"],
        ["cache-eval", "--max-pixels", "0"],
        ["cache-bench", "--queries", "0"],
        ["up", "--base-port", "65534"],
        ["up", "--metrics-base-port", "-1"],
        ["generate", "--prompt", "x", "--max-tokens", "0"],
        ["generate", "--prompt", "x", "--timeout", "0"],
    ],
)
def test_numeric_flags_out_of_range_are_usage_errors_naming_the_flag(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    flag = next(a for a in reversed(argv) if a.startswith("--") and a != "--prompt")
    assert f"argument {flag}" in err, err


def test_numeric_flags_accept_their_edges() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["load", "--repeat-fraction", "0", "--slack", "0"]).repeat_fraction == 0.0
    assert parse(["up", "--base-port", "65532", "--metrics-base-port", "0"]).base_port == 65532
    assert parse(["cache-eval", "--threshold", "-1"]).threshold == -1.0
    assert parse(["bench", "--requests", "0", "--rate", "0.5"]).rate == 0.5


# -- the decoder's own command line ------------------------------------------------------------
@pytest.fixture
def decoder_main(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``decoder_service.__main__.main``; it sets VLLM_CPU_KVCACHE_SPACE, restored after."""
    from decoder_service.__main__ import main

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return main


@pytest.mark.parametrize("size", [16, 48, 0, -32])
def test_decoder_refuses_a_block_size_vllms_cpu_attention_cannot_run(
    size: int, tiny_model: Path, capsys: pytest.CaptureFixture[str], decoder_main: Any
) -> None:
    from decoder_service.__main__ import _on_cpu

    if not _on_cpu():
        pytest.skip("the limit is vLLM's CPU attention's")
    with pytest.raises(SystemExit) as stop:
        decoder_main(["--model", str(tiny_model), "--block-size", str(size)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--block-size must be a positive multiple of 32 on CPU" in err
    assert f"got {size}" in err


def test_bench_refuses_a_block_size_vllms_cpu_attention_cannot_run(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the limit is vLLM's CPU attention's")
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["bench", "--block-size", "16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --block-size: must be a positive multiple of 32 on CPU" in err
    assert "got 16" in err
    assert cli.build_parser().parse_args(["bench", "--block-size", "64"]).block_size == 64


def test_decoder_refuses_a_block_larger_than_the_model_length(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], decoder_main: Any
) -> None:
    argv = ["--model", str(tiny_model), "--max-model-len", "4096", "--block-size", "1048576"]
    with pytest.raises(SystemExit) as stop:
        decoder_main(argv)
    assert stop.value.code == 2
    assert "--block-size 1048576 is larger than --max-model-len 4096" in capsys.readouterr().err


@pytest.mark.parametrize("size", [32, 64, 128, 256])  # 32: the decoder's CPU default
def test_block_sizes_vllms_cpu_attention_runs_are_accepted(size: int) -> None:
    from decoder_service.engine import cpu_block_size_error

    assert cpu_block_size_error(size) is None


def test_decoder_refuses_to_run_without_mm_embeds(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], decoder_main: Any
) -> None:
    with pytest.raises(SystemExit) as stop:
        decoder_main(["--model", str(tiny_model), "--no-enable-mm-embeds"])
    assert stop.value.code == 2
    assert "--enable-mm-embeds is required" in capsys.readouterr().err


# -- a service started alone with a --model it cannot load -------------------------------------
SERVICE_MAINS = ["gateway", "encoder_service", "decoder_service"]


@pytest.mark.parametrize("service", SERVICE_MAINS)
@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("/nonexistent/checkpoint", "no such checkpoint directory"),
        ("EMPTY_DIR", "the directory has no config.json"),
        ("not a hub id!", "not a directory, nor a resolvable hub id"),
    ],
)
def test_a_service_given_a_model_it_cannot_load_exits_with_a_usage_error(
    service: str,
    model: str,
    reason: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It used to bind its port, log "listening", then die in a huggingface_hub traceback."""
    import importlib

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the decoder's main() sets it
    if model == "EMPTY_DIR":
        model = str(tmp_path)
    main = importlib.import_module(f"{service}.__main__").main
    with pytest.raises(SystemExit) as stop:
        main(["--model", model])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--model {model!r}: {reason}" in err
    assert "Traceback" not in err and len(err.splitlines()) <= 8, err  # not vLLM's 250-line usage


def test_the_tiny_checkpoint_is_a_model_the_services_can_load(tiny_model: Path) -> None:
    from vlcommon.model_info import model_error

    assert model_error(str(tiny_model)) is None


# -- splitvl up: decoder arguments an operator got wrong ----------------------------------------
@pytest.mark.parametrize("source", ["--decoder-arg", "SPLITVL_DECODER_ARGS"])
def test_up_with_unbalanced_quotes_in_decoder_args_is_one_line_and_starts_nothing(
    source: str, tmp_path: Path, tiny_model: Path
) -> None:
    """shlex.split's ValueError used to end `up` in a traceback."""
    bad = "--block-size '16"
    log_dir = tmp_path / "logs"
    # Free ports: on the default ones a running instance (a demo) is refused first.
    argv = _up_argv(tiny_model, log_dir)
    if source == "--decoder-arg":
        out = _splitvl(*argv, f"--decoder-arg={bad}")
    else:
        out = _splitvl(*argv, env={"SPLITVL_DECODER_ARGS": bad})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"splitvl up: error: {source}: No closing quotation in {bad!r}"
    ]
    assert not list(log_dir.glob("*.log"))  # no service was started


def test_start_timeout_reaches_the_cluster(tmp_path, monkeypatch, capsys) -> None:
    """``--start-timeout`` is how long ``up``/``demo`` wait for SERVING (a cold first start
    on a busy 2-core host took over the old fixed 600 s); zero or less is a usage error."""
    monkeypatch.setenv("SPLITVL_HOME", str(tmp_path))
    monkeypatch.setattr("splitvl.home.check_ports", lambda ports: None)
    parse = cli.build_parser().parse_args
    base = ["--model", "m", "--http-port", "0"]
    assert cluster_from_args(parse(["up", *base])).start_timeout_s == 900.0
    assert cluster_from_args(parse(["demo", *base, "--start-timeout", "1500"])).start_timeout_s == (
        1500.0
    )
    with pytest.raises(SystemExit) as exit_:
        parse(["up", *base, "--start-timeout", "0"])
    assert exit_.value.code == 2
    assert "--start-timeout" in capsys.readouterr().err
