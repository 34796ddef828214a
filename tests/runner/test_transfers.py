"""runner/transfers.py: a step's reservations reach the device as written, whatever slot they use and
however many steps reuse the slots; past a slot's capacity they still arrive (on the compute stream).
On the CPU a reservation is a plain tensor; the stream and slot logic runs on CUDA only."""

import pytest
import torch

from nanovllm.runner.transfers import ALIGN, Uploads

CUDA = torch.cuda.is_available()


def test_on_the_cpu_a_reservation_is_the_tensor_itself():
    uploads = Uploads(torch.device("cpu"), 0)
    uploads.begin()
    host, dev = uploads.reserve(3, torch.int32)
    host[:] = [4, 5, 6]
    seeds = uploads.put([2**63 - 1, 7], torch.int64)
    uploads.flush()
    assert dev.tolist() == [4, 5, 6] and seeds.tolist() == [2**63 - 1, 7]


def test_values_that_do_not_fit_the_dtype_raise():
    uploads = Uploads(torch.device("cpu"), 0)
    uploads.begin()
    with pytest.raises(OverflowError):
        uploads.put([10**400], torch.float32)


@pytest.mark.skipif(not CUDA, reason="the copy stream and its slots need CUDA")
def test_steps_read_their_own_inputs_while_the_slots_are_reused():
    device = torch.device("cuda")
    uploads = Uploads(device, capacity=64 * ALIGN)
    results = []
    for step in range(12):
        uploads.begin()
        ids = uploads.put(list(range(step, step + 5)), torch.int32)
        temps = uploads.put([0.5 * step] * 3, torch.float32)
        big = uploads.put([step] * 1000, torch.int64)  # past the slot: copied on the compute stream
        uploads.flush()
        torch.cuda._sleep(200_000)  # the compute stream lags, as under overlap scheduling
        results.append((ids * 2, temps + 1, big.sum()))
    torch.cuda.synchronize()
    for step, (ids, temps, total) in enumerate(results):
        assert ids.tolist() == [2 * i for i in range(step, step + 5)]
        assert temps.tolist() == [0.5 * step + 1] * 3
        assert total.item() == 1000 * step
    uploads.release()
