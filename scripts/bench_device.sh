#!/usr/bin/env bash
# Run benches/step.py on the GPU machine, one torchrun per system and link setting, then print the
# Markdown table of the results file.
#
#   bash scripts/bench_device.sh PRESET NPROC OUTFILE [SYSTEM ...]
#
#   PRESET   any step.py preset: 1b, 7b, tiny (benches/llama.py), hf_llama_1b, hf_gpt2_xl,
#            hf_llama_tiny, hf_gpt2_tiny (transformers models, benches/hf_models.py)
#   NPROC    GPUs (ranks) per run
#   OUTFILE  JSON-lines file the results are appended to, e.g. benches/results/h200x2.jsonl
#   SYSTEM   default: zrs zrs_eager fsdp2_eager fsdp2_compile single, then deepspeed_zero3 and
#            deepcompile when deepspeed imports
#
# Every sharded system runs twice: over NVLink (tag "") and with NCCL_P2P_DISABLE=1 (tag
# "nop2p", bandwidth-limited). "single" and "single_amp" run on one GPU, under each tag but the nop2p ones
# (a variant such as "flash" gets its bound). Each run is bounded by BENCH_TIMEOUT seconds
# (default 420, under the device tool's 600 s a call); a run that dies or times out without
# writing its line gets an error line here. The first tag's run of each system starts from empty
# inductor/Triton caches, and for zrs and zrs_eager an empty torch extensions folder, so their copy
# kernels build inside the run (warmup_s is a cold start; BENCH_CACHE=cold in its record); later
# tags reuse that system's cache (BENCH_CACHE=warm). NVLink multicast stays off throughout
# (KINDS.md: it can take the host's GPUs out of service).
#
# Environment knobs: BENCH_TIMEOUT, BENCH_TAGS (default "nvlink nop2p"; any tag that starts with
# "nop2p" runs with NCCL_P2P_DISABLE=1, e.g. "nop2p_bf16rs" for a variant), BENCH_ARGS (extra
# arguments for step.py, e.g. "--warmup 10 --steps 20" or "--varlen"), BENCH_LOG_DIR (default
# /tmp/bench_logs), BENCH_WARM=1 (keep the caches of an earlier call on this machine: no cold run).
# An NCCL setting for every run goes before the command, with a tag that names it, e.g.
# NCCL_MAX_CTAS=8 BENCH_TAGS=ctas8 ...; the records' "env" shows it (benches/harness/run.py).
# On the device tool's machine ($OUT set to a folder), OUTFILE and a tarball of the logs are
# copied into $OUT at the end, so that they come back.
set -uo pipefail

if [[ $# -lt 3 ]]; then
    sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
PRESET=$1 NPROC=$2 RESULTS=$3
shift 3

cd "$(dirname "$0")/.."

# Device-side setup first: scripts/device_setup.sh installs the carried wheels (.whl/: zrs, and
# DeepSpeed with its missing dependencies) and sets the NCCL variables (no kernel prebuild), and
# then execs this script again. BENCH_SKIP_SETUP=1 skips it (the python3 environment as is).
if [[ -z ${BENCH_SETUP_DONE:-} && -z ${BENCH_SKIP_SETUP:-} ]]; then
    if [[ -f scripts/device_setup.sh ]]; then
        # No kernel prebuild: the zrs runs build them in their own cache (below).
        ZRS_SKIP_PREBUILD=1 exec bash scripts/device_setup.sh env BENCH_SETUP_DONE=1 \
            bash scripts/bench_device.sh \
            "$PRESET" "$NPROC" "$RESULTS" "$@"
    fi
    echo "bench_device.sh: scripts/device_setup.sh not found; using the python3 environment as is" >&2
fi
# Whatever the setup did: NVLink multicast off in NCCL, PyTorch and NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's JIT ops parse it: "9.0a" (set on some machines) fails
export PYTHONUNBUFFERED=1

# DeepSpeed, if carried as wheels in .whl/ (see benches/README.md) and still not importable.
if ! python3 -c 'import deepspeed' 2>/dev/null && compgen -G '.whl/deepspeed-*.whl' >/dev/null; then
    ds_wheels=()
    for w in .whl/*.whl; do [[ $(basename "$w") == zrs-* ]] || ds_wheels+=("$w"); done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-ds "${ds_wheels[@]}" &&
        export PYTHONPATH=/tmp/site-ds${PYTHONPATH:+:$PYTHONPATH}
fi

HAVE_DS=0
if python3 -c 'import deepspeed' 2>/dev/null; then HAVE_DS=1; fi
if [[ $# -gt 0 ]]; then
    SYSTEMS=("$@")
else
    SYSTEMS=(zrs zrs_eager fsdp2_eager fsdp2_compile single)
    if [[ $HAVE_DS == 1 ]]; then SYSTEMS+=(deepspeed_zero3 deepcompile); fi
fi

# Build DeepCompile's op once, before the timed runs, so that warm-up times exclude it (its build
# time is printed here).
for s in "${SYSTEMS[@]}"; do
    if [[ $s == deepcompile && $HAVE_DS == 1 ]]; then
        t0=$(date +%s)
        python3 -c 'from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load()' \
            >/dev/null 2>&1 && echo "bench_device.sh: DeepCompile op built in $(($(date +%s) - t0)) s" \
            || echo "bench_device.sh: DeepCompile op build failed; the run will try again" >&2
    fi
done

TIMEOUT=${BENCH_TIMEOUT:-420}
read -r -a TAGS <<<"${BENCH_TAGS:-nvlink nop2p}"
read -r -a EXTRA <<<"${BENCH_ARGS:-}"
LOG_DIR=${BENCH_LOG_DIR:-/tmp/bench_logs}
mkdir -p "$(dirname "$RESULTS")" "$LOG_DIR"
touch "$RESULTS"
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null || true

run() {  # run SYSTEM TAG NPROC COLD
    local system=$1 tag=$2 nproc=$3 cold=$4 before after rc log
    local cache=/tmp/bench_cache/${PRESET}_${system}_${nproc} state=warm
    if [[ $cold == 1 && -z ${BENCH_WARM:-} ]]; then rm -rf "$cache"; state=cold; fi
    local -a env_vars=()
    [[ $tag == nop2p* ]] && env_vars=(NCCL_P2P_DISABLE=1)
    env_vars+=(TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"
        BENCH_CACHE=$state)
    # zrs's copy kernels too (zrs, zrs_eager): a cold run's warmup_s includes their build, as on a
    # fresh machine.
    [[ $system == zrs* ]] && env_vars+=(TORCH_EXTENSIONS_DIR="$cache/torch_extensions")
    local -a cmd=(torchrun --standalone --nproc-per-node "$nproc" benches/step.py
        --preset "$PRESET" --systems "$system" --tag "$tag" --out "$RESULTS" "${EXTRA[@]}")
    local shown p2p=""
    [[ $tag == nop2p* ]] && p2p="NCCL_P2P_DISABLE=1 "
    shown="$p2p$(printf '%q ' "${cmd[@]}")"
    shown=${shown% }
    log="$LOG_DIR/${PRESET}_${system}_${tag:-nvlink}_${nproc}.log"
    echo "=== $shown  (log: $log)"
    before=$(wc -l <"$RESULTS")
    env "${env_vars[@]}" timeout --kill-after=30 "$TIMEOUT" "${cmd[@]}" --command "$shown" \
        >"$log" 2>&1
    rc=$?
    after=$(wc -l <"$RESULTS")
    grep -E '^\{' "$log" | tail -n 1 || true
    if [[ $rc != 0 && $after == "$before" ]]; then
        local why="exit status $rc"
        [[ $rc == 124 || $rc == 137 ]] && why="timed out after ${TIMEOUT} s"
        python3 -c 'import json, sys; s, p, t, w, e, c = sys.argv[1:]
print(json.dumps({"system": s, "preset": p, "tag": t, "world": int(w), "error": e, "command": c}))' \
            "$system" "$PRESET" "$tag" "$nproc" "$why (no result line; log $log)" "$shown" |
            tee -a "$RESULTS"
        tail -n 20 "$log" >&2
    fi
}

first=1
for tag in "${TAGS[@]}"; do
    [[ $tag == nvlink ]] && tag=""
    for s in "${SYSTEMS[@]}"; do
        if [[ $s == single* ]]; then
            # compute-only bounds: no links involved, so not under the nop2p tags
            [[ $tag != nop2p* ]] && run "$s" "$tag" 1 1
            continue
        fi
        run "$s" "$tag" "$NPROC" "$first"
    done
    first=0
done

echo
python3 benches/step.py --table "$RESULTS"
if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then  # the device tool's folder: bring the results back
    [[ $(realpath "$(dirname "$RESULTS")") == $(realpath "$OUT") ]] || cp "$RESULTS" "$OUT/"
    tar -czf "$OUT/bench_logs_${PRESET}_${NPROC}.tar.gz" -C "$LOG_DIR" .
fi
