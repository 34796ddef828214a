"""Where data-parallel replicas run: replica i on its own devices, and only those."""

import os

import pytest

from nanovllm.dp.replica import Placement, replica_cpus, replica_devices, spawned_with_devices


def test_replica_i_gets_devices_i_times_t_onwards():
    visible = ["4", "5", "6", "7"]
    assert replica_devices(0, 2, visible) == ["4", "5"]
    assert replica_devices(1, 2, visible) == ["6", "7"]
    assert [replica_devices(i, 1, visible) for i in range(4)] == [["4"], ["5"], ["6"], ["7"]]


def test_cpu_replicas_get_disjoint_shares_of_the_cores():
    assert [replica_cpus(i, 2, [3, 0, 1, 2, 4]) for i in range(2)] == [[0, 1], [2, 3, 4]]
    assert [replica_cpus(i, 3, [0, 1]) for i in range(3)] == [[0], [1], [0]]  # fewer cores than replicas


def test_a_replica_refuses_a_cuda_view_that_is_not_its_own(monkeypatch):

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test: apply() sets it
    with pytest.raises(RuntimeError, match=r"should see the 1 GPUs \['3'\] but CUDA shows 0"):
        Placement(cuda_devices=["3"]).apply()


def test_the_devices_are_in_the_environment_only_while_a_replica_starts(monkeypatch):

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with spawned_with_devices(Placement(cuda_devices=["6", "7"])):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with spawned_with_devices(Placement(cuda_devices=["1"])):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
