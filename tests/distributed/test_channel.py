"""The step channel: messages arrive whole and in order, rank 0 waits until the previous message
was taken, and closing removes the shared memory."""

import multiprocessing
import os

import pytest

from nanovllm.distributed.channel import StepChannel


@pytest.fixture
def channel():
    sender = StepChannel.create(num_workers=2, size=4096, ctx=multiprocessing.get_context("spawn"))
    workers = [StepChannel.attach(sender.handle(i)) for i in range(2)]
    yield sender, workers
    for w in workers:
        w.close()
    sender.close()


def test_every_worker_receives_each_message(channel):
    sender, workers = channel
    assert sender.name.startswith(f"nanovllm-{os.getpid()}-")
    sender.send("run", {"tokens": [1, 2, 3]})
    assert [w.receive() for w in workers] == [("run", ({"tokens": [1, 2, 3]},))] * 2
    sender.send("exit")
    assert [w.receive() for w in workers] == [("exit", ())] * 2


def test_send_waits_until_every_worker_took_the_previous_message(channel):
    sender, workers = channel
    sender.send("run", 1)
    workers[0].receive()  # workers[1] has not taken it yet

    class StillWaiting(Exception):
        pass

    def give_up():
        raise StillWaiting

    with pytest.raises(StillWaiting):
        sender.send("run", 2, check=give_up)
    assert workers[1].receive() == ("run", (1,))
    sender.send("run", 2, check=give_up)  # now nothing to wait for
    assert [w.receive() for w in workers] == [("run", (2,))] * 2


def test_close_unlinks_the_segment_and_is_idempotent():
    sender = StepChannel.create(num_workers=1, size=64, ctx=multiprocessing.get_context("spawn"))
    worker = StepChannel.attach(sender.handle(0))
    path = f"/dev/shm/{sender.name}"
    assert os.path.exists(path)
    worker.close()
    assert os.path.exists(path)  # only rank 0 removes it
    sender.close()
    sender.close()
    assert not os.path.exists(path)
