"""How many CPU threads the model's operators use on the CPU, so that a busy machine slows
nanovllm down in proportion instead of collapsing.

Why: PyTorch starts one OpenMP thread per core, and those threads meet at a barrier after every
operator. When another process keeps one core busy, one of our threads waits for its time slice at
nearly every barrier (milliseconds each, hundreds of barriers per step): decoding on 2 cores beside
one busy process measured 20-30x slower than with a single thread. Using only the cores that other
processes leave free avoids the stall, and an idle machine still gets every core.

`cpu_threads="auto"` (the default): every `REEVALUATE_S` seconds the engine looks at how much CPU
time the rest of the machine used since the last look (busy time in /proc/stat minus this process's
own CPU time) and runs on the cores left over, at least one. Where /proc/stat does not exist (macOS)
the one-minute load average stands in for it. An integer fixes the thread count."""

import os
import time
from collections.abc import Callable

import torch

AUTO = "auto"
# Seconds between two looks at the machine's load: long enough that one bursty compile elsewhere
# does not flip the thread count every step, short enough to follow a build started in the
# background within a few seconds.
REEVALUATE_S = 2.0
# A core counts as taken by other processes once they keep it this busy on average: a core busy
# half the time already stalls our barriers at about every other operator.
BUSY_CORE_FRACTION = 0.5
PROC_STAT = "/proc/stat"


def num_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_for(cores: int, others_busy_cores: float) -> int:
    """The threads to use on `cores` cores when other processes keep `others_busy_cores` busy."""
    taken = int(others_busy_cores + (1.0 - BUSY_CORE_FRACTION))  # rounds at BUSY_CORE_FRACTION
    return max(1, min(cores, cores - taken))


def read_machine_busy_s() -> float | None:
    """Seconds of CPU time spent busy by all processes since boot (all cores summed), or None
    where /proc/stat does not exist."""
    try:
        with open(PROC_STAT) as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def read_own_cpu_s() -> float:
    """CPU time of this process, all threads, in seconds."""
    t = os.times()
    return t.user + t.system


class CpuThreadPolicy:
    """Sets torch's thread count before each CPU step: fixed, or by the "auto" rule above. The
    readers are arguments so that tests can stage a busy machine."""

    def __init__(self, setting: int | str, cores: int | None = None,
                 machine_busy_s: Callable[[], float | None] = read_machine_busy_s,
                 own_cpu_s: Callable[[], float] = read_own_cpu_s,
                 clock: Callable[[], float] = time.monotonic,
                 load_average: Callable[[], float] = lambda: os.getloadavg()[0]) -> None:
        self.setting = setting
        self.cores = cores or num_cores()
        self._machine_busy_s, self._own_cpu_s, self._clock = machine_busy_s, own_cpu_s, clock
        self._load_average = load_average
        self._last = self._sample()
        # When apply() next has something to look at (a fixed count: never); the runner skips the call
        # before then while torch's count is ours.
        self.next_look = self._last[0] + REEVALUATE_S if setting == AUTO else float("inf")
        # Until the first look, assume the machine is as loaded as its recent load average says,
        # less this process (which is loading the model now).
        if setting == AUTO:
            self.num_threads = threads_for(self.cores, max(0.0, self._safe_load_average() - 1.0))
        else:
            self.num_threads = int(setting)

    def _safe_load_average(self) -> float:
        try:
            return self._load_average()
        except OSError:  # not every platform has a load average
            return 0.0

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._machine_busy_s(), self._own_cpu_s()

    def others_busy_cores(self) -> float | None:
        """Cores other processes kept busy since the last look (None if too soon to tell)."""
        wall = self._clock() - self._last[0]
        if wall < REEVALUATE_S:  # checked first: this runs before every step
            return None
        now = self._sample()
        wall = now[0] - self._last[0]
        before, self._last = self._last, now
        self.next_look = now[0] + REEVALUATE_S
        if now[1] is None or before[1] is None:
            # No /proc/stat: the load average counts runnable threads, ours included.
            return max(0.0, self._safe_load_average() - self.num_threads)
        others = (now[1] - before[1]) - (now[2] - before[2])
        return max(0.0, others / wall)

    def apply(self) -> int:
        """Set torch's thread count for the next step; returns it."""
        if self.setting == AUTO:
            others = self.others_busy_cores()
            if others is not None:
                self.num_threads = threads_for(self.cores, others)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        return self.num_threads
