"""Nothing a tensor-parallel engine opens listens beyond loopback: the rendezvous store (which torch
would bind to every interface, `::`) and gloo's connections both listen on 127.0.0.1 only."""

import os
import threading

import torch

from nanovllm.distributed.group import TPGroup, create_store

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket
LOOPBACK_V4 = "0100007F"  # 127.0.0.1, as /proc/net/tcp writes it (little-endian hex)


def listening_sockets() -> dict[str, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (address as /proc/net writes it, port)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the fd listdir itself used, already closed
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, port = fields[1].split(":")
                if fields[3] == LISTEN and f"socket:[{fields[9]}]" in mine:
                    found[fields[9]] = (address, int(port, 16))
    return found


def test_the_store_listens_on_loopback_only():
    before = listening_sockets()
    store = create_store(0, 2)
    new = {k: v for k, v in listening_sockets().items() if k not in before}
    assert [port for _, port in new.values()] == [store.port]
    assert [address for address, _ in new.values()] == [LOOPBACK_V4]
    client = create_store(1, 2, store.port)  # and the other ranks still reach it
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_gloo_listens_on_loopback_only():
    store = create_store(0, 2)
    before = listening_sockets()
    groups: dict[int, TPGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = TPGroup(store if rank == 0 else create_store(1, 2, store.port), rank, 2,
                               torch.device("cpu"))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(groups) == [0, 1]
    new = {k: v for k, v in listening_sockets().items() if k not in before}
    assert new, "gloo opened no listening socket: the test looks in the wrong place"
    assert {address for address, _ in new.values()} == {LOOPBACK_V4}
    for group in groups.values():
        group.destroy()
