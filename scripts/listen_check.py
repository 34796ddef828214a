"""Which TCP sockets a tensor-parallel engine listens on, rank 0 and its workers together; every one
should be on 127.0.0.1. On a GPU host this covers NCCL's bootstrap sockets too (which the CPU tests
cannot see):

    python scripts/listen_check.py                          # TP=2, configs/Qwen3-0.6B, dummy weights
    python scripts/listen_check.py --tp 4 --model configs/Qwen3-8B

Prints one row per listening socket and exits 1 if any is not on loopback."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from nanovllm import LLM, SamplingParams  # noqa: E402

LISTEN = "0A"
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1, as /proc/net writes them


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    owner = {inode: pid for pid in pids for inode in socket_inodes(pid)}
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN and fields[9] in owner:
                    address, port = fields[1].split(":")
                    rows.append((owner[fields[9]], address, int(port, 16)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/Qwen3-0.6B")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    with LLM(args.model, tensor_parallel_size=args.tp, load_format="dummy", skip_tokenizer_init=True,
             max_model_len=256, max_num_seqs=8, enforce_eager=True) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # collectives have run
        pids = [os.getpid(), *(p.pid for p in llm.engine.executor.workers.processes)]
        rows = listening(pids)
    bad = [row for row in rows if row[1] not in LOOPBACK]
    print(f"{'pid':>8}  {'address (/proc/net hex)':<34}{'port':>6}  loopback")
    for pid, address, port in rows:
        print(f"{pid:>8}  {address:<34}{port:>6}  {'yes' if address in LOOPBACK else 'NO'}")
    print(f"{len(rows)} listening sockets, {len(bad)} beyond loopback")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
