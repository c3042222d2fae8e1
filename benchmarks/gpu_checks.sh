#!/usr/bin/env bash
# The GPU checks of one device lease, in one run, each part under its own time limit so that a
# part that fails or hangs leaves the others their time:
#   env        the device, driver and package versions;
#   gpu_lane   pytest -m gpu (tests/test_gpu.py; the several-GPU tests skip on one GPU);
#   bench_mfu  benchmarks/bench_mfu.py: ~1.2B GPT-2 and ~1B Llama shapes, bf16, mfu and ratio vs
#              transformers, plus our step's top kernels per model (--profile);
#   bench_mfu_fused  the same with --fused-kernels (compiled RMSNorm and SwiGLU in ours);
#   bench_lora benchmarks/bench_lora.py --size 1b --device cuda --dtype bfloat16: tokens/s and peak
#              GPU memory of our LoRA step and transformers + PEFT's.
# Logs and profiles go to $OUT (default ./gpu_out). GPU_CHECKS_BUDGET_S (default 540) bounds the
# whole run; a part starts only with 20 s left and gets at most what is left.
# GPU_CHECKS_PARTS="a b" runs only the parts named (default: all).
# Wheels under .whl/ (packages the device's image lacks, e.g. blake3) are installed first.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECKS_BUDGET_S:-540}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

part() {  # part NAME LIMIT_S COMMAND...: run COMMAND into $OUT/NAME.log under min(LIMIT_S, time left)
    local name=$1 limit=$2 left=$((BUDGET - SECONDS))
    shift 2
    if [[ -n ${GPU_CHECKS_PARTS:-} && " $GPU_CHECKS_PARTS " != *" $name "* ]]; then
        return
    fi
    if ((left < 20)); then
        echo "== $name: skipped, $left s of the budget left"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name: start at ${SECONDS}s, limit ${limit}s"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: rc $? at ${SECONDS}s"
    tail -n 4 "$OUT/$name.log"
}

part env 30 bash -c 'nvidia-smi; python3 -c "import sys, torch, transformers, peft; print(sys.version);
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print(transformers.__version__, peft.__version__)"'
part gpu_lane 150 python3 -m pytest -p no:cacheprovider -rs -m gpu tests/test_gpu.py
part bench_mfu 170 python3 benchmarks/bench_mfu.py --profile "$OUT"
part bench_mfu_fused 200 python3 benchmarks/bench_mfu.py --fused-kernels --profile "$OUT/fused"
part bench_lora 200 python3 -m benchmarks.bench_lora --size 1b --device cuda --dtype bfloat16 \
    --batch 4 --seq 2048 --steps 12 --warmup 2 --fused-kernels off
echo "== done at ${SECONDS}s"
