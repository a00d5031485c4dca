#!/bin/bash
# Context parallelism on a machine with (at least) two GPUs, in phases that each fit one device
# call. Every phase builds (incremental when the machine still holds the last call's build).
#   PHASE=test   the distributed GPU tests, attention alone at CP=1 vs CP=2
#   PHASE=train  packed SFT at CP=1 vs CP=2 at the same tokens per GPU
#   PHASE=long   the longest row at CP=2
#   PHASE=short  the tests, attention alone and one SFT comparison in one call
#   PHASE=examples       training_examples/sft_packed.py and dpo_packed.py at CP=2 on rows of 128K tokens
#                        (random-init 0.5b preset, shipped JSONL data): tokens/s and peak memory per GPU
#   PHASE=sharequestion  attention alone, share question at 512K and 1M tokens, CP=1 vs CP=2
# bench_cp.py appends to $OUT/cp/{attn,train}.csv, so the invocations of a phase share one table.
set -o pipefail
export FLASHMASK_ARCHS=90 FLASHMASK_HEAD_DIMS=64,128 FLASHMASK_DTYPES=fp16,bf16 MAX_JOBS=${MAX_JOBS:-32}
export PYTHONWARNINGS=ignore
OUT=${OUT:-$PWD/device_out}
CP="python3 benchmarks/bench_cp.py"
case "${PHASE:-test}" in
test)
    export TESTS="tests/test_distributed_gpu.py" TEST_TIMEOUT=200
    export BENCH="timeout 120 torchrun --nproc-per-node 2 benchmarks/bench_cp.py attn --families causal_document --seqlens 128k,256k,512k,1024k --out $OUT/cp; timeout 100 torchrun --nproc-per-node 2 benchmarks/bench_cp.py attn --families share_question --seqlens 128k,256k --out $OUT/cp" ;;
train)
    export BENCH="timeout 200 $CP train --cp 1 --seqlens 128k,256k --steps 3 --warmup-steps 1 --out $OUT/cp; timeout 250 torchrun --nproc-per-node 2 benchmarks/bench_cp.py train --cp 2 --seqlens 256k,512k --steps 3 --warmup-steps 1 --out $OUT/cp" ;;
short)
    export TESTS="tests/test_distributed_gpu.py" TEST_TIMEOUT=150
    export BENCH="timeout 90 torchrun --nproc-per-node 2 benchmarks/bench_cp.py attn --families causal_document --seqlens 128k,256k,512k,1024k --out $OUT/cp; timeout 70 torchrun --nproc-per-node 2 benchmarks/bench_cp.py attn --families share_question --seqlens 128k,256k --out $OUT/cp; timeout 80 $CP train --cp 1 --seqlens 128k --steps 3 --warmup-steps 1 --out $OUT/cp; timeout 100 torchrun --nproc-per-node 2 benchmarks/bench_cp.py train --cp 2 --seqlens 256k --steps 3 --warmup-steps 1 --out $OUT/cp" ;;
examples)
    # 5 steps each (the first, warm-up, is left out of tokens/s); rows padded to 128K, split over the 2 GPUs
    EX="--cp 2 --model-size 0.5b --max-length 131072 --batch-size 1 --steps 5 --gradient-checkpointing --progress off"
    export BENCH="echo '== sft_packed CP=2 128K'; timeout 180 torchrun --nproc-per-node 2 training_examples/sft_packed.py $EX --lr 1e-5; echo \"[exit \$?]\"; echo '== dpo_packed CP=2 128K'; timeout 200 torchrun --nproc-per-node 2 training_examples/dpo_packed.py $EX --lr 1e-6; echo \"[exit \$?]\"" ;;
sharequestion)
    export BENCH="timeout 400 torchrun --nproc-per-node 2 benchmarks/bench_cp.py attn --families share_question --seqlens 512k,1024k --out $OUT/cp; echo \"[exit \$?]\"" ;;
long)
    export BENCH="timeout 500 torchrun --nproc-per-node 2 benchmarks/bench_cp.py train --cp 2 --seqlens 2m --offload auto --steps 2 --warmup-steps 1 --out $OUT/cp" ;;
esac
bash scripts/device_check.sh
