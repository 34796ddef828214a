"""The lifetime of a spawned child (a tensor-parallel worker, a data-parallel replica, a server's engine
process): which signals it leaves to its parent, that it never outlives the parent, and that it exits
quickly once its engine is released."""

import gc
import os
import signal
import sys
import threading
from multiprocessing import parent_process
from multiprocessing.connection import wait


def exit_with_parent(role: str) -> None:
    """Leave as soon as the parent process is gone, whatever this process is doing (even waiting inside
    a collective for a rank that died with it). `role` names the child in the assertion and the thread."""
    parent = parent_process()
    assert parent is not None, f"a {role} must be a spawned child"

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    name = f"nanovllm-{role.replace(' ', '-')}-parent-watch"
    threading.Thread(target=watch, name=name, daemon=True).start()


def _unwind_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds through the engine's shutdown, unlike the default action


def become_engine_child(role: str) -> None:
    """Set up a child that owns an engine (a data-parallel replica, a server's engine process): Ctrl-C,
    which reaches the whole process group, is the parent's to handle; SIGTERM unwinds through the
    engine's shutdown; and the child leaves when its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _unwind_on_sigterm)
    exit_with_parent(role)


def exit_released(exit_code: int) -> None:
    """End the process once its engine is released (the caller has dropped its last reference):
    collect the engine's last objects so that their finalizers run (multiprocessing unlinks the
    tensor-parallel channel's semaphores then), and leave without the interpreter's teardown of torch,
    which takes seconds and frees nothing the OS does not."""
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
