"""A spawned child (a tensor-parallel worker, a data-parallel replica) that must not outlive its parent."""

import os
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
