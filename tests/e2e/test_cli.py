"""The end-to-end tests of tests/unit/splitvl/test_cli.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.splitvl.test_cli import _splitvl, _up_argv


@pytest.mark.e2e
def test_up_with_a_broken_checkpoint_fails_with_one_line_naming_service_and_log(
    tmp_path,
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    log_dir = tmp_path / "logs"
    out = _splitvl(*_up_argv(broken, log_dir))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    service = lines[0].split(": ", 1)[1].split(" ", 1)[0]
    assert service in {"gateway", "encoder", "cache", "decoder"}, lines
    log = Path(lines[0].rsplit("see its log: ", 1)[1])
    assert log == log_dir / f"{service}.log" and log.stat().st_size > 0


@pytest.mark.e2e
def test_generate_sends_an_http_image_as_url_to_the_gateway(cluster) -> None:
    # The session cluster runs without GATEWAY_ALLOW_URLS: the gateway names the url field.
    out = _splitvl(
        "generate",
        "--image",
        "http://127.0.0.1:9/photo.png",
        "--prompt",
        "hi",
        "--address",
        cluster.ports.address("gateway"),
        "--timeout",
        "60",
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("FAILED_PRECONDITION:"), out.stderr
    assert "images[0].url" in out.stderr


@pytest.mark.e2e
def test_up_names_the_decoders_usage_error_when_it_refuses_its_arguments(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A decoder that exits 2 (argparse) puts its error in the launcher's one line."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("--block-size 16 is refused on CPU only")
    log_dir = tmp_path / "logs"
    out = _splitvl(*_up_argv(tiny_model, log_dir), "--decoder-arg=--block-size=16")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("splitvl up: decoder exited with code 2 while starting (")
    assert "--block-size must be a positive multiple of 32 on CPU" in lines[0]
    assert lines[0].endswith(f"see its log: {log_dir / 'decoder.log'}")
