#!/usr/bin/env bash
# Runs the GPU checks on a machine with a CUDA GPU: records the environment, runs the GPU tests, the offline compile
# report (tools.compile_report) and optionally a bench, each step under its own time limit (`timeout`), so a hung step
# cannot hold up the rest. Logs and the bench JSON are written under $OUT.
#   usage: OUT=dir tools/gpu_check.sh [tests=FILES] [jobs=N] [bench="ARGS"] [tests_s=N] [bench_s=N]
#   tests=none skips the tests; bench="" (the default) skips the bench. jobs=N runs the test files in N pytest
#   processes at once (whole files dealt round-robin, each process's BLAS threads = cores / N; kernel compiles are
#   on the CPU, so 3-4 jobs on a 16-core machine finish the batched suite in about a third of the time), each log
#   gpu-tests-<j>.log. A step that reaches its limit is interrupted (SIGINT), so pytest still prints what passed.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
tests="tests/"; jobs=1; bench=""; tests_s=300; bench_s=240
for arg in "$@"; do case $arg in
  tests=*) tests=${arg#tests=} ;; jobs=*) jobs=${arg#jobs=} ;; bench=*) bench=${arg#bench=} ;;
  tests_s=*) tests_s=${arg#tests_s=} ;; bench_s=*) bench_s=${arg#bench_s=} ;;
  *) echo "unknown argument $arg" >&2; exit 2 ;;
esac; done
case $jobs in ''|*[!0-9]*|0) echo "jobs must be a positive integer, got '$jobs'" >&2; exit 2 ;; esac

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c 'import sys, numpy, cupy; print(sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__, "cuda rt", cupy.cuda.runtime.runtimeGetVersion())'
  python3 -m pip list 2>/dev/null | grep -iE "^(cupy|numba|numpy|rich|ml.dtypes|cuda-(bindings|core)|pytest) "
} 2>&1 | tee "$OUT/env.txt"

if [ "$tests" != "none" ] && [ "$jobs" -eq 1 ]; then
  # shellcheck disable=SC2086
  timeout -s INT "$tests_s" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12 $tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -60
elif [ "$tests" != "none" ]; then
  threads=$(( $(nproc) / jobs )); [ "$threads" -ge 1 ] || threads=1
  export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
  files=()
  # shellcheck disable=SC2086
  for t in $tests; do if [ -d "$t" ]; then files+=("$t"/test_*.py); else files+=("$t"); fi; done
  groups=()
  for i in "${!files[@]}"; do groups[i % jobs]+=" ${files[i]}"; done
  for j in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    timeout -s INT "$tests_s" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 ${groups[j]} \
      > "$OUT/gpu-tests-$j.log" 2>&1 &
  done
  wait
  for j in "${!groups[@]}"; do echo "== gpu-tests-$j:${groups[j]}"; tail -n 3 "$OUT/gpu-tests-$j.log"; done
fi
timeout 90 python3 -m tools.compile_report > "$OUT/compile_report.txt" 2>&1 || echo "inspect failed (see compile_report.txt)"
if [ -n "$bench" ]; then
  # shellcheck disable=SC2086
  timeout "$bench_s" python3 -m tools.bench $bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
