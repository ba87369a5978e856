#!/usr/bin/env bash
# The GPU checks of ckpt in one run, for a device machine lent for minutes.
#
# Run from the repository root, on the device machine:
#     CKPT_COMMIT=<commit> bash benchmarks/device_check.sh
# CKPT_COMMIT names the commit measured (the tree is copied there without its .git).
# Everything is printed and written under $OUT (a temporary directory when unset):
#     device_check.log  all of it        test_cuda.log / test_cuda.xml  pytest tests/gpu/test_cuda.py
#     bench_cuda.log    the benchmark's tables (the figures for docs/benchmarks.md)
# Steps: the machine (nvidia-smi, torch, CUDA), ckpt importable (pip install -e . --no-deps
# only if not: nothing can be downloaded there), tests/gpu/test_cuda.py (TEST_TIMEOUT s, default
# 150), benchmarks/bench_cuda.py --sizes $BENCH_SIZES (default 1G,2G; BENCH_TIMEOUT s,
# default 300). Each step runs whatever the one before did; the exit status is the first
# failure's (0: all passed; 3: no CUDA device; 124: a timeout). At most about 8 minutes with
# the default timeouts; expected about 3 (tests ~1, benchmark ~2 on an H200).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}"
BENCH_SIZES="${BENCH_SIZES:-1G,2G}"
BENCH_REPS="${BENCH_REPS:-3}"
export CKPT_COMMIT="${CKPT_COMMIT:-unknown}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/device_check.log"
STATUS=0
START=$(date +%s)

say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

# step NAME FILE TIMEOUT COMMAND...: run it, its output to $OUT/FILE, the log and stdout;
# keep the first failure's status
step() {
    local name=$1 file=$2 limit=$3 rc t0
    shift 3
    say "$name: $*"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$file" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && say "$name: TIMED OUT after ${limit}s"
    say "$name: exit $rc after $(($(date +%s) - t0))s"
    [ "$STATUS" = 0 ] && [ "$rc" != 0 ] && STATUS=$rc
    return 0
}

say "ckpt device check, commit $CKPT_COMMIT, output in $OUT"
if command -v nvidia-smi >/dev/null; then
    step "nvidia-smi" nvidia-smi.log 30 nvidia-smi
else
    say "nvidia-smi: not found"
fi
step "versions" versions.log 60 "$PYTHON" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA",
      torch.version.cuda, "| cuDNN", torch.backends.cudnn.version(), "| CUDA available:",
      torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
for name in ("numpy", "safetensors", "fsspec", "tensorstore", "filelock", "xxhash", "pytest",
             "zstandard", "s3fs", "moto"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
if not torch.cuda.is_available():
    print("NO CUDA DEVICE visible to torch: the GPU tests will be skipped, nothing measured")
    raise SystemExit(3)
EOF

if ! "$PYTHON" -c "import ckpt" >>"$LOG" 2>&1; then
    say "import ckpt failed from the tree; installing it (no dependencies, no downloads)"
    step "install" install.log 120 "$PYTHON" -m pip install --no-deps --no-build-isolation \
        --no-index -e .
fi
step "import" import.log 60 "$PYTHON" -c \
    "import ckpt, storage_backends; print('ckpt', ckpt.__version__, 'from', ckpt.__file__)"

step "test_cuda" test_cuda.log "$TEST_TIMEOUT" "$PYTHON" -u -m pytest -q -rA -p no:cacheprovider \
    --junitxml="$OUT/test_cuda.xml" tests/gpu/test_cuda.py
step "bench_cuda" bench_cuda.log "$BENCH_TIMEOUT" "$PYTHON" -u benchmarks/bench_cuda.py \
    --sizes "$BENCH_SIZES" --reps "$BENCH_REPS" --quiet-wait 0

say "done in $(($(date +%s) - START))s, status $STATUS (0: every step passed)"
grep -E "^== .*: (exit|TIMED OUT)" "$LOG" | sed 's/^/   /' | tee -a "$LOG.summary"
cat "$LOG.summary" >>"$LOG" && rm -f "$LOG.summary"
exit "$STATUS"
