#!/usr/bin/env bash
# Runs the GPU checks on a machine with a CUDA GPU: records the environment, runs the GPU tests, the offline compile
# report (tools.compile_report) and optionally a bench, each step under its own time limit (`timeout`), so a hung step
# cannot hold up the rest. Logs and the bench JSON are written under $OUT.
#   usage: OUT=dir tools/gpu_check.sh [tests=FILES] [k=EXPR] [jobs=N] [report=0] [bench="ARGS"] [tests_s=N] [bench_s=N]
#   tests=none skips the tests; k=EXPR selects tests as pytest -k does; report=0 skips the compile report;
#   bench="" (the default) skips the bench. jobs=N runs the selected GPU tests in N pytest processes at once: the
#   test ids are collected first and dealt round-robin, so a big file's tests spread over every process, and each
#   process gets cores / N BLAS threads -- the host references' fp64 products oversubscribe the cores otherwise
#   (notes/CONVENTIONS.md has the measurements). Each process logs to gpu-tests-<j>.log, joined into one
#   gpu-tests.log at the end (gpu-test-ids.txt holds the ids); a step that reaches its limit is interrupted (SIGINT),
#   so pytest still prints what passed. The last lines total the passed and failed tests and list the failures.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
tests="tests/"; k=""; jobs=1; report=1; bench=""; tests_s=300; bench_s=240
for arg in "$@"; do case $arg in
  tests=*) tests=${arg#tests=} ;; k=*) k=${arg#k=} ;; jobs=*) jobs=${arg#jobs=} ;; report=*) report=${arg#report=} ;;
  bench=*) bench=${arg#bench=} ;; tests_s=*) tests_s=${arg#tests_s=} ;; bench_s=*) bench_s=${arg#bench_s=} ;;
  *) echo "unknown argument $arg" >&2; exit 2 ;;
esac; done
case $jobs in ''|*[!0-9]*|0) echo "jobs must be a positive integer, got '$jobs'" >&2; exit 2 ;; esac
case $report in 0|1) ;; *) echo "report must be 0 or 1, got '$report'" >&2; exit 2 ;; esac
select=(-m gpu); [ -z "$k" ] || select+=(-k "$k")

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c 'import sys, numpy, cupy; print(sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__, "cuda rt", cupy.cuda.runtime.runtimeGetVersion())'
  python3 -m pip list 2>/dev/null | grep -iE "^(cupy|numba|numpy|rich|ml.dtypes|cuda-(bindings|core)|pytest) "
} 2>&1 | tee "$OUT/env.txt"

if [ "$tests" != "none" ] && [ "$jobs" -eq 1 ]; then
  # shellcheck disable=SC2086
  timeout -s INT "$tests_s" python3 -m pytest "${select[@]}" -q -p no:cacheprovider --durations=12 $tests 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -60
elif [ "$tests" != "none" ]; then
  threads=$(( $(nproc) / jobs )); [ "$threads" -ge 1 ] || threads=1
  export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
  rm -f "$OUT"/gpu-tests-*.log
  # shellcheck disable=SC2086
  python3 -m pytest "${select[@]}" -q -p no:cacheprovider --collect-only $tests 2>&1 | grep '::' > "$OUT/gpu-test-ids.txt"
  echo "$(wc -l < "$OUT/gpu-test-ids.txt") tests selected, dealt to $jobs processes"
  for ((j = 0; j < jobs; j++)); do
    mapfile -t ids < <(awk -v j="$j" -v n="$jobs" '(NR - 1) % n == j' "$OUT/gpu-test-ids.txt")
    [ "${#ids[@]}" -gt 0 ] || continue
    timeout -s INT "$tests_s" python3 -m pytest -q -p no:cacheprovider --durations=5 "${ids[@]}" \
      > "$OUT/gpu-tests-$j.log" 2>&1 &
  done
  wait
  logs=("$OUT"/gpu-tests-*.log); [ -e "${logs[0]}" ] || logs=(/dev/null)
  for log in "${logs[@]}"; do [ "$log" = /dev/null ] || echo "== $(basename "$log"): $(tail -n 1 "$log")"; done
  marks=$(cat "${logs[@]}" | grep -E '^[.FEsx]+( +\[ *[0-9]+%\])?$' | sed 's/ *\[.*//')
  passed=$(printf '%s' "$marks" | tr -cd '.' | wc -c)
  failed=$(printf '%s' "$marks" | tr -cd 'FE' | wc -c)
  echo "gpu tests: $passed passed, $failed failed or errors, of $(wc -l < "$OUT/gpu-test-ids.txt") selected"
  for log in "${logs[@]}"; do [ "$log" = /dev/null ] || { echo "== $(basename "$log")"; cat "$log"; }; done \
    > "$OUT/gpu-tests.log"
  rm -f "$OUT"/gpu-tests-[0-9]*.log
  grep -E "^(FAILED|ERROR) " "$OUT/gpu-tests.log" || true
fi
if [ "$report" -eq 1 ]; then
  timeout 90 python3 -m tools.compile_report > "$OUT/compile_report.txt" 2>&1 || echo "inspect failed (see compile_report.txt)"
fi
if [ -n "$bench" ]; then
  # shellcheck disable=SC2086
  timeout "$bench_s" python3 -m tools.bench $bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
