"""`python -m nanovllm.serve MODEL [options]`: the same as `nanovllm serve MODEL [options]`."""

import sys

from nanovllm.serve.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
