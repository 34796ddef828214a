set -x
. .fa3/activate
git rev-parse --short HEAD
python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())"
nvidia-smi topo -m
F=$(python3 -c "import torch._inductor.async_compile as a; print(a.__file__)")
grep -n "daemon\|def _process_pool_allowed" $F | head
python3 -c "import torch._inductor.config as c; print('start', c.worker_start_method, 'threads', c.compile_threads)"
export NANOVLLM_WORKER_LOG_LEVEL=INFO
time timeout 330 python3 scripts/tp_check.py --tp 2 > $OUT/tp_check_06b.log 2>&1
tail -40 $OUT/tp_check_06b.log
time timeout 200 python3 bench.py --model configs/Qwen3-8B --load-format dummy -tp 2 > $OUT/bench_8b_tp2.log 2>&1
tail -20 $OUT/bench_8b_tp2.log
