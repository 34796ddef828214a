. .fa3/activate
git rev-parse --short HEAD
export NANOVLLM_WORKER_LOG_LEVEL=WARNING
run() { name=$1; t=$2; shift 2; s=$(date +%s); timeout $t "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s"; grep -E "Throughput|TP=|first token|Timeout|Error|error" $OUT/$name.log | head -20; }
run tpcheck_06b 150 python3 scripts/tp_check.py --tp 2
run bench_06b_tp1 90 python3 bench.py --model configs/Qwen3-0.6B --load-format dummy -tp 1
run bench_06b_tp2 90 python3 bench.py --model configs/Qwen3-0.6B --load-format dummy -tp 2
run bench_8b_tp1 120 python3 bench.py --model configs/Qwen3-8B --load-format dummy -tp 1
run bench_8b_tp2 100 python3 bench.py --model configs/Qwen3-8B --load-format dummy -tp 2
run tpcheck_8b 120 python3 scripts/tp_check.py --tp 2 --model configs/Qwen3-8B
