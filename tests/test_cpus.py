"""CPU placement: the encoder never shares the cores of vLLM's CPU worker."""

from __future__ import annotations

import pytest

from splitvl.launcher import cpu_placement
from vlcommon.cpus import format_cpu_list, parse_cpu_list, split_cpus


def test_parse_and_format_round_trip() -> None:
    assert parse_cpu_list("0-2,5, 7-8") == [0, 1, 2, 5, 7, 8]
    assert format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


@pytest.mark.parametrize(
    ("n", "decoder", "encoder"),
    [(2, [0], [1]), (4, [0, 1, 2], [3]), (16, list(range(12)), [12, 13, 14, 15])],
)
def test_split_gives_disjoint_sets(n, decoder, encoder) -> None:
    assert split_cpus(list(range(n))) == (decoder, encoder)


def test_one_core_is_not_split_and_user_choice_wins(monkeypatch) -> None:
    assert split_cpus([0]) is None
    monkeypatch.setattr("splitvl.launcher.shutil.which", lambda _: None)
    monkeypatch.setattr("splitvl.launcher.available_cpus", lambda: [0, 1, 2, 3])
    assert cpu_placement({}) == {
        "decoder": {"VLLM_CPU_OMP_THREADS_BIND": "0-2"},
        "encoder": {"ENCODER_CPUS": "3"},
    }
    assert cpu_placement({"ENCODER_CPUS": "0"}) == {}
