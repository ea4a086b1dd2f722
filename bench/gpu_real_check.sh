#!/usr/bin/env bash
# gpu_real_check.sh: GPU memory per process from the driver's own calls, checked against a real
# NVIDIA driver, without BPF. Builds bench/nvrecord.c (an LD_PRELOAD library that records every
# ioctl on /dev/nvidia* with its parameter blocks) and a program that allocates 1, 4 and 16 GiB
# and frees the 4 GiB one (PyTorch when `import torch` works, else bench/cuda_alloc.c on the CUDA
# driver API). While the program holds: NVML's per-process used memory (nvidia-smi), and
# `ghostgpu snapshot -o json`. Then bench/gpu_real_decode.py decodes the recording with
# tracer/memcall_decode.py and the accountant (tracer/gpu_memory.py), compares (goal: within 5%),
# checks CARD_INFO's minors against the device instances, prints a table and writes
# bench/results/gpu_real.json. Needs: the NVIDIA driver (with nvidia-smi and libcuda.so.1),
# python3, gcc or cc. Run from anywhere; about a minute (the program must hold within
# PROGRAM_DEADLINE_S, 4 min).
#
#   bash bench/gpu_real_check.sh [--cuda-c] [--gib 1,4,16] [--free 4] [--device N] [--out FILE]
#        [--keep DIR]   # DIR gets the recording (gzip), nvidia-smi's CSVs, the snapshot, the program's output
#   bash bench/gpu_real_check.sh --recording REC.jsonl (--truth STATE.json | --nvml-apps CSV)
#        [--driver VERSION] [--driver-label TEXT] [--pid PID]     # decode only, no GPU needed
#   bash bench/gpu_real_check.sh --fake          # record through the FUSE fake driver (root, venv)
#   bash bench/gpu_real_check.sh --prepare-pydeps
#        # copies protobuf and pynvml (3 MB) from the project venv to bench/build/pydeps, for a GPU
#        # machine whose python3 has neither: `ghostgpu snapshot` then runs from this checkout
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/bench/results/gpu_real.json"
BUILD="$ROOT/bench/build/gpu_real"
GIB_LIST="1,4,16"
FREE_LIST="4"
DEVICE=0
MODE=gpu
FORCE_C=0
RECORDING="" TRUTH="" NVML_APPS="" DRIVER="" DRIVER_LABEL="" PID_ARG="" KEEP=""
PROGRAM_DEADLINE_S=240

die() { echo "gpu_real_check: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --recording) MODE=recording; RECORDING="$2"; shift 2 ;;
        --truth) TRUTH="$2"; shift 2 ;;
        --nvml-apps) NVML_APPS="$2"; shift 2 ;;
        --driver) DRIVER="$2"; shift 2 ;;
        --driver-label) DRIVER_LABEL="$2"; shift 2 ;;
        --pid) PID_ARG="$2"; shift 2 ;;
        --fake) MODE=fake; shift ;;
        --prepare-pydeps) MODE=pydeps; shift ;;
        --cuda-c) FORCE_C=1; shift ;;
        --gib) GIB_LIST="$2"; shift 2 ;;
        --free) FREE_LIST="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --keep) KEEP="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

# Sizes in GiB, comma-separated; each --free size one of the --gib sizes, written the same way (or
# "none"): checked here, before anything is built or allocated.
NUMBER='[0-9]+([.][0-9]+)?'
[[ "$GIB_LIST" =~ ^$NUMBER(,$NUMBER)*$ ]] || die "--gib $GIB_LIST: give sizes in GiB separated by commas, e.g. --gib 1,4,16"
if [ "$FREE_LIST" != none ]; then
    [[ "$FREE_LIST" =~ ^$NUMBER(,$NUMBER)*$ ]] \
        || die "--free $FREE_LIST: give sizes from --gib separated by commas, e.g. --free 4, or --free none"
    for f in ${FREE_LIST//,/ }; do
        [[ ",$GIB_LIST," == *",$f,"* ]] || die "--free $f is not one of --gib $GIB_LIST: free only what was allocated"
    done
fi
[[ "$DEVICE" =~ ^[0-9]+$ ]] || die "--device $DEVICE: give the GPU's index, e.g. --device 0"

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "no python3: install python3 (3.11 or newer)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$("$PY" --version 2>&1) is too old: ghostgpu needs python3 3.11 or newer (set PYTHON=/path/to/python3.11)"
WORK="$(mktemp -d /tmp/gpu_real.XXXXXX)"
cleanup() {
    if [ -n "${HOLDER_PID:-}" ] && kill -0 "$HOLDER_PID" 2>/dev/null; then
        kill "$HOLDER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

decode_args=()
[ -n "$DRIVER" ] && decode_args+=(--driver "$DRIVER")
[ -n "$DRIVER_LABEL" ] && decode_args+=(--driver-label "$DRIVER_LABEL")
[ -n "$PID_ARG" ] && decode_args+=(--pid "$PID_ARG")

compiler() {
    if command -v gcc >/dev/null; then echo gcc
    elif command -v cc >/dev/null; then echo cc
    else die "no C compiler (gcc or cc) to build bench/nvrecord.c: install gcc, or decode a recording made elsewhere with --recording FILE"
    fi
}

build_nvrecord() {
    local cc; cc="$(compiler)"
    mkdir -p "$BUILD"
    "$cc" -O2 -shared -fPIC -o "$BUILD/nvrecord.so" "$ROOT/bench/nvrecord.c" -ldl -lpthread \
        || die "building bench/nvrecord.c failed (see above)"
}

if [ "$MODE" = pydeps ]; then
    site="$(ls -d "$ROOT"/.venv/lib/python3*/site-packages 2>/dev/null | head -1)"
    [ -n "$site" ] && [ -d "$site/google/protobuf" ] && [ -f "$site/pynvml.py" ] \
        || die "no project venv with protobuf and nvidia-ml-py: bash scripts/bootstrap.sh install"
    rm -rf "$ROOT/bench/build/pydeps"
    mkdir -p "$ROOT/bench/build/pydeps"
    cp -r "$site/google" "$site/pynvml.py" "$ROOT/bench/build/pydeps/"
    echo "bench/build/pydeps: $(du -sh "$ROOT/bench/build/pydeps" | cut -f1)"
    exit 0
fi

if [ "$MODE" = recording ]; then
    [ -f "$RECORDING" ] || die "no recording at $RECORDING"
    [ -n "$TRUTH" ] && decode_args+=(--truth "$TRUTH")
    [ -n "$NVML_APPS" ] && decode_args+=(--nvml-apps "$NVML_APPS")
    [ -n "$TRUTH$NVML_APPS" ] || die "--recording needs --truth STATE.json (fake driver) or --nvml-apps CSV (NVML)"
    exec "$PY" "$ROOT/bench/gpu_real_decode.py" decode --recording "$RECORDING" --program "recording" \
        --out "$OUT" "${decode_args[@]}"
fi

if [ "$MODE" = fake ]; then
    # The FUSE fake driver's run: rmplan makes cudaMalloc's calls for 1, 4 and 16 GiB and frees
    # the 4 GiB one, under nvrecord; the driver's state file is the truth. Needs the project venv
    # (the fake driver's wrapper lives in tests/helpers) and root. Where BPF can load, the
    # tracer's kernel side watches too, and the JSON says whether it reported the same MemCalls.
    [ "$(id -u)" = 0 ] || die "--fake needs root (FUSE mount, private /dev)"
    VENV_PY="$ROOT/.venv/bin/python"
    [ -x "$VENV_PY" ] || die "--fake needs the project venv: bash scripts/bootstrap.sh install"
    build_nvrecord
    (cd "$ROOT" && "$VENV_PY" bench/gpu_real_decode.py fake-record --out-dir "$WORK" --nvrecord "$BUILD/nvrecord.so") \
        || die "recording through the fake driver failed (see above)"
    exec "$VENV_PY" "$ROOT/bench/gpu_real_decode.py" decode --recording "$WORK/recording.jsonl" \
        --truth "$WORK/truth.json" --driver-label "fake (FUSE)" \
        --program "$(cat "$WORK/program.txt")" --requested "$(cat "$WORK/requested.json")" --out "$OUT" \
        --kernel-check "$WORK/kernel_check.json" \
        "${decode_args[@]}"
fi

# --- a real GPU ---------------------------------------------------------------------------------
[ -r /proc/driver/nvidia/version ] \
    || die "no NVIDIA driver (/proc/driver/nvidia/version is missing): run on a machine with an NVIDIA GPU, or decode a recording with --recording FILE"
command -v nvidia-smi >/dev/null || die "no nvidia-smi: it ships with the NVIDIA driver; install the driver's utilities"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi lists no GPU: $(nvidia-smi -L 2>&1 | head -1)"
build_nvrecord

REC="$WORK/recording.jsonl"
PROGRAM_OUT="$WORK/program.out"
mkfifo "$WORK/stdin"
REQUESTED="{\"alloc_gib\": [$GIB_LIST], \"free_gib\": [$( [ "$FREE_LIST" = none ] || echo "$FREE_LIST")]}"
if [ "$FORCE_C" = 0 ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PROGRAM="PyTorch $("$PY" -c 'import torch; print(torch.__version__)') (torch.empty on cuda; empty_cache() after del)"
    # The caching allocator keeps a freed block reserved (cudaFree is not called) until
    # torch.cuda.empty_cache(): without it the 4 GiB would still be held in the driver's figure.
    cmd=("$PY" -c "
import os, sys, torch
torch.cuda.set_device($DEVICE)
gib, free = [float(x) for x in '$GIB_LIST'.split(',')], [float(x) for x in '$FREE_LIST'.split(',') if x != 'none']
held = {}
for g in gib:
    held.setdefault(g, []).append(torch.empty(int(g * (1 << 30)), dtype=torch.uint8, device='cuda'))
for g in free:
    held[g].pop()
torch.cuda.empty_cache()
torch.cuda.synchronize()
print('holding', os.getpid(), flush=True)
sys.stdin.readline()
")
else
    cc="$(compiler)"
    "$cc" -O2 -o "$BUILD/cuda_alloc" "$ROOT/bench/cuda_alloc.c" -ldl || die "building bench/cuda_alloc.c failed (see above)"
    PROGRAM="bench/cuda_alloc.c (CUDA driver API: cuMemAlloc_v2 / cuMemFree_v2)"
    cmd=("$BUILD/cuda_alloc" --device "$DEVICE" --gib "$GIB_LIST" --free "$FREE_LIST")
fi

NVRECORD_OUT="$REC" LD_PRELOAD="$BUILD/nvrecord.so" "${cmd[@]}" <"$WORK/stdin" >"$PROGRAM_OUT" 2>"$WORK/program.err" &
HOLDER_PID=$!
exec 3>"$WORK/stdin"  # held open: the program waits on a line from it

deadline=$((SECONDS + PROGRAM_DEADLINE_S))
until grep -q '^holding ' "$PROGRAM_OUT" 2>/dev/null; do
    if ! kill -0 "$HOLDER_PID" 2>/dev/null; then
        die "the program exited before holding: $(tail -1 "$WORK/program.err" 2>/dev/null)"
    fi
    [ "$SECONDS" -lt "$deadline" ] || die "the program did not hold within ${PROGRAM_DEADLINE_S}s"
    sleep 0.2
done
PID="$(awk '/^holding /{print $2; exit}' "$PROGRAM_OUT")"
cp "$REC" "$WORK/recording.hold.jsonl"  # every call up to the hold is in it: nvrecord writes before returning

nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader,nounits >"$WORK/apps.csv"
nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,memory.used,memory.total,driver_version \
    --format=csv,noheader,nounits >"$WORK/gpus.csv"

# ghostgpu snapshot -o json: the installed command, the project venv, or this checkout mapped in.
SNAP_ERR=""
if command -v ghostgpu >/dev/null; then snap=(ghostgpu snapshot -o json)
elif [ -x "$ROOT/.venv/bin/ghostgpu" ]; then snap=("$ROOT/.venv/bin/ghostgpu" snapshot -o json)
else snap=("$PY" "$ROOT/bench/gpu_real_decode.py" snapshot)
fi
snap_env=()
if [ -d "$ROOT/bench/build/pydeps" ]; then
    # The pure-Python protobuf: the copied C extension may be for another python3 version.
    snap_env=(PYTHONPATH="$ROOT/bench/build/pydeps${PYTHONPATH:+:$PYTHONPATH}" PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python)
fi
if ! env "${snap_env[@]}" timeout 120 "${snap[@]}" >"$WORK/snapshot.json" 2>"$WORK/snapshot.err"; then
    SNAP_ERR="$(grep -v '^ghostgpu: .*notice' "$WORK/snapshot.err" | tail -1)"
    SNAP_ERR="${SNAP_ERR:-ghostgpu snapshot failed}"
fi

if [ -n "$KEEP" ]; then
    mkdir -p "$KEEP"
    gzip -c "$WORK/recording.hold.jsonl" >"$KEEP/gpu_real_recording.jsonl.gz"
    cp "$WORK/apps.csv" "$WORK/gpus.csv" "$WORK/snapshot.json" "$WORK/snapshot.err" "$PROGRAM_OUT" \
        "$WORK/program.err" "$KEEP/" 2>/dev/null || true
fi

echo >&3  # let the program go: it frees the rest and exits
exec 3>&-
wait "$HOLDER_PID" || echo "gpu_real_check: the program exited with $? after the hold" >&2
HOLDER_PID=""

"$PY" "$ROOT/bench/gpu_real_decode.py" decode --recording "$WORK/recording.hold.jsonl" --pid "$PID" \
    --nvml-apps "$WORK/apps.csv" --nvml-gpus "$WORK/gpus.csv" --snapshot "$WORK/snapshot.json" \
    --snapshot-error "$SNAP_ERR" --program "$PROGRAM" --requested "$REQUESTED" --out "$OUT" "${decode_args[@]}"
