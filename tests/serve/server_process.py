"""A real server (`python -m nanovllm.serve`, uvicorn on 127.0.0.1 and a free port) in a subprocess,
for the server tests (once per module) and scripts/bench_serve.py; SIGTERM stops it, and
`terminate()` says whether it exited cleanly; `engine_pids()` and `descendants()` find the processes
it started."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "sk-test-key"
# Loading a model on a busy 2-core machine can take a while.
STARTUP_TIMEOUT_S = 120


def children(pid: int) -> list[int]:
    """pid's child processes, from /proc."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(child) for child in f.read().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found


def descendants(pid: int) -> list[int]:
    """The processes below pid: its children, theirs, and so on."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def is_running(pid: int) -> bool:
    """Whether pid is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *options: str, api_key: str | None = API_KEY,
                 startup_timeout: float = STARTUP_TIMEOUT_S, log_level: str = "warning",
                 cpu: bool = True, launcher: tuple[str, ...] = ("-m", "nanovllm.serve"),
                 executable: str = sys.executable) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"nanovllm-serve-{self.port}.log")
        self.log = open(self.log_path, "w")
        # executable + launcher: what runs `nanovllm serve`'s CLI (scripts/serve_overhead.py puts a
        # stand-in model step under it; the console script test runs `nanovllm serve`).
        args = [executable, *launcher, model, "--port", str(self.port),
                "--log-level", log_level,
                "--graceful-timeout", "5", *options]
        if api_key:
            args += ["--api-key", api_key]
        # This checkout first, then whatever path the caller had (e.g. packages carried to a GPU machine).
        path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start in {startup_timeout}s:\n{self.output()}")
            time.sleep(0.2)

    def engine_pids(self) -> list[int]:
        """The server's engine processes: its spawned children (not multiprocessing's resource tracker,
        nor the tokenizer process)."""
        pids = []
        for pid in children(self.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/comm", "rb") as comm:
                if b"spawn_main" in f.read() and not comm.read().startswith(b"nanovllm-tokenz"):
                    pids.append(pid)
        return pids

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """The vllm:* and nanovllm:* samples of /metrics, by name plus labels other than model_name
        (`vllm:request_success_total{finished_reason="abort"}`, `..._bucket{le="0.1"}`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith(("vllm:", "nanovllm:")):
                name, value = line.rsplit(" ", 1)
                base, _, labels = name.partition("{")
                kept = [label for label in labels.rstrip("}").split(",")
                        if label and not label.startswith("model_name=")]
                values[base + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
        return values

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM; returns the exit code (the test fails if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the server ignored SIGTERM for {timeout}s:\n{self.output()}") from None
        self.log.close()
        return self.proc.returncode
