"""The CPU threads policy: "auto" runs on the cores other processes leave free, a number is fixed,
and the Config field takes its default from NANOVLLM_CPU_THREADS."""

import pytest
import torch

from nanovllm.config import ENV_DEFAULTS, Config
from nanovllm.utils.cpu_threads import REEVALUATE_S, CpuThreadPolicy, threads_for

CPU_THREADS_ENV_VAR = ENV_DEFAULTS["cpu_threads"]


@pytest.mark.parametrize("cores, others, expected", [
    (2, 0.0, 2), (2, 0.3, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.0, 1), (2, 5.0, 1),
    (8, 1.0, 7), (8, 2.4, 6), (8, 2.5, 5), (1, 0.0, 1),
])
def test_threads_use_the_cores_others_leave_free(cores, others, expected):
    assert threads_for(cores, others) == expected


class FakeMachine:
    """A clock, the machine's busy CPU seconds and ours, advanced by the test."""

    def __init__(self):
        self.now, self.machine_busy, self.own = 0.0, 0.0, 0.0

    def run(self, seconds: float, others_cores: float, own_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.machine_busy += (others_cores + own_cores) * seconds

    def policy(self, setting, load_average=0.0) -> CpuThreadPolicy:
        return CpuThreadPolicy(setting, cores=2, machine_busy_s=lambda: self.machine_busy,
                               own_cpu_s=lambda: self.own, clock=lambda: self.now,
                               load_average=lambda: load_average)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_auto_follows_a_busy_process_coming_and_going(restore_threads):
    machine = FakeMachine()
    policy = machine.policy("auto")
    assert policy.apply() == 2  # idle machine: every core
    machine.run(REEVALUATE_S, others_cores=0.67, own_cores=1.33)  # a busy loop starts beside us
    assert policy.apply() == 1 and torch.get_num_threads() == 1
    machine.run(REEVALUATE_S / 2, others_cores=0.0, own_cores=1.0)
    assert policy.apply() == 1  # too soon to look again
    machine.run(REEVALUATE_S, others_cores=0.0, own_cores=2.0)  # it ended
    assert policy.apply() == 2 and torch.get_num_threads() == 2


def test_auto_starts_from_the_load_average(restore_threads):
    # Loading the model counts one; 2.2 - 1 leaves another process on one core.
    assert FakeMachine().policy("auto", load_average=2.2).num_threads == 1
    assert FakeMachine().policy("auto", load_average=0.9).num_threads == 2


def test_auto_without_proc_stat_uses_the_load_average(restore_threads):
    machine = FakeMachine()
    policy = CpuThreadPolicy("auto", cores=2, machine_busy_s=lambda: None, own_cpu_s=lambda: 0.0,
                             clock=lambda: machine.now, load_average=lambda: 3.0)
    machine.now += REEVALUATE_S
    assert policy.apply() == 1


def test_a_fixed_count_is_kept_whatever_the_load(restore_threads):
    machine = FakeMachine()
    policy = machine.policy(2, load_average=9.0)
    machine.run(REEVALUATE_S, others_cores=2.0, own_cores=1.0)
    assert policy.apply() == 2 and torch.get_num_threads() == 2


def test_config_default_comes_from_the_environment(monkeypatch, qwen3_dir):
    monkeypatch.setenv(CPU_THREADS_ENV_VAR, "3")
    assert Config(qwen3_dir).cpu_threads == 3
    monkeypatch.delenv(CPU_THREADS_ENV_VAR)
    assert Config(qwen3_dir).cpu_threads == "auto"
    assert Config(qwen3_dir, cpu_threads=1).cpu_threads == 1


@pytest.mark.parametrize("bad", [0, -1, "many"])
def test_bad_cpu_threads_is_rejected(qwen3_dir, bad):
    with pytest.raises(ValueError, match="cpu_threads must be 'auto' or a positive integer"):
        Config(qwen3_dir, cpu_threads=bad)


@pytest.mark.parametrize("bad", [1.5, True])
def test_cpu_threads_of_the_wrong_type_is_rejected(qwen3_dir, bad):
    with pytest.raises(TypeError, match="cpu_threads"):
        Config(qwen3_dir, cpu_threads=bad)
