"""CPU placement: the encoder never shares the cores of vLLM's CPU worker."""

from __future__ import annotations

import os
import subprocess
import sys

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
        "encoder": {"ENCODER_CPUS": "3", "ENCODER_NICE": "5"},
    }
    assert cpu_placement({"ENCODER_NICE": "0"})["encoder"]["ENCODER_NICE"] == "0"
    assert cpu_placement({"ENCODER_CPUS": "0"}) == {}


def test_encoder_nice_and_cpus_reach_the_threads_started_before_and_after_them() -> None:
    # Linux keeps a niceness and a CPU mask per thread: setting only the calling thread's
    # would leave the lifeline watchdog (started before) as it was; the OpenMP and grpc
    # threads started after inherit the main thread's.
    code = """
import os, threading
from encoder_service.__main__ import pin_cpus
from encoder_service.settings import EncoderSettings
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
cpu = sorted(os.sched_getaffinity(0))[-1]
pin_cpus(EncoderSettings(nice=5, cpus=str(cpu)))
threading.Thread(target=stop.wait, daemon=True).start()
tasks = os.listdir("/proc/self/task")
masks = {tuple(sorted(os.sched_getaffinity(int(t)))) == (cpu,) for t in tasks}
print(len(tasks), masks, sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in tasks}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODER_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    count, masks, nices = out.stdout.split(" ", 2)
    assert int(count) >= 3 and masks == "{True}" and nices.strip() == "[5]"


def test_encoder_nice_never_lowers_the_niceness_it_started_with() -> None:
    # Under `nice -n 10 splitvl up` the encoder starts at 10; going back to 5 would need
    # CAP_SYS_NICE and fail the start as an unprivileged user. It keeps 10.
    code = """
import os
os.setpriority(os.PRIO_PROCESS, 0, 10)
from encoder_service.__main__ import pin_cpus
from encoder_service.settings import EncoderSettings
pin_cpus(EncoderSettings(nice=5))
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODER_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[10]"
