#!/usr/bin/env bash
# The GPU checks of one short lease, in one command:
#
#   bash scripts/gpu_check.sh OUTDIR [PART ...]
#
# PARTs (default: env tests+train accel oracle, in this order): env,
# tests+train (the fast tests on 6 workers while the default config trains
# and its one-seed study runs beside them; GPU_CHECK_TESTS=all runs the whole
# suite instead, on 8 workers, within GPU_CHECK_TESTS_LIMIT seconds, default
# 200), accel (benchmarks/accelerator_benchmark.py, alone), oracle (the 16-head
# `wide` oracle of the workdir runs/wide, alone, when it is there). Not in
# the default: tests (the tests alone, selected as in tests+train, on
# GPU_CHECK_WORKERS workers, default 14, within GPU_CHECK_TESTS_LIMIT
# seconds, default 200, or 450 for the whole suite), determinism
# (benchmarks/determinism_check.py: two runs and a resumed one, bitwise or not,
# without and with XLA_FLAGS=--xla_gpu_deterministic_ops=true). Each part has
# its own time limit, so one that hangs costs only its own minutes; all of
# them take about 8 minutes on an H100 (2026-11-26). Logs and JSON go to
# OUTDIR; the last lines printed are a summary. The device tool brings back
# at most 8 files: tar OUTDIR into one.
#
# Missing Python packages travel as wheels in .whl/ (docs/performance.md,
# "On a GPU"); they are installed first when that folder exists.
set -u
out="${1:?usage: gpu_check.sh OUTDIR [PART ...]}"
shift
parts="${*:-env tests+train accel oracle}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
work="$(mktemp -d)"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

timed() {  # timed NAME LIMIT_S COMMAND...: run, log to OUTDIR/NAME.log
  local name="$1" limit="$2" t0 rc ms
  shift 2
  t0=$(date +%s%N)
  # SIGINT at the limit, so that pytest still prints the tracebacks and the
  # summary of what ran (the second lease lost them to a plain kill), and
  # SIGKILL 30 s later.
  timeout -s INT -k 30 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  note "$name: rc=$rc, $((ms / 1000)).$(( (ms % 1000) / 100 )) s"
  return $rc
}

for part in $parts; do
  case "$part" in
    env)
      { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
        python3 -c "import jax, jaxlib, flax, optax, orbax.checkpoint, numpy; \
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'numpy', numpy.__version__); print(jax.devices())"
        nproc; } >"$out/env.log" 2>&1
      note "env: $(tail -2 "$out/env.log" | head -1)"
      ;;
    tests)
      # The whole suite took 303 s on 14 workers of an H100 machine.
      if [ "${GPU_CHECK_TESTS:-fast}" = all ]; then
        select=(-n "${GPU_CHECK_WORKERS:-14}") limit=450
      else
        select=(-m "not slow" -n "${GPU_CHECK_WORKERS:-14}") limit=200
      fi
      timed tests "${GPU_CHECK_TESTS_LIMIT:-$limit}" python3 -m pytest -v --tb=short --durations=25 \
        "${select[@]}" -p no:cacheprovider \
        -o addopts="-ra --dist loadfile -p no:hypothesispytest -p no:benchmark"
      grep -E "^(FAILED|ERROR) |^=+ .*(passed|failed)" "$out/tests.log" | tail -40 | sed 's/^/  /' | tee -a "$summary"
      ;;
    determinism)
      timed determinism 180 python3 benchmarks/determinism_check.py \
        --out "$out/determinism.json"
      grep -E "^backend|vs the first" "$out/determinism.log" | sed 's/^/  /' | tee -a "$summary"
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true" \
        timed determinism_ops 180 python3 benchmarks/determinism_check.py \
        --out "$out/determinism_ops.json"
      grep -E "^backend|vs the first" "$out/determinism_ops.log" | sed 's/^/  /' | tee -a "$summary"
      ;;
    tests+train)
      # The fast tests on 6 workers (in-process tests run on the GPU; the
      # entry points they start as subprocesses run on the CPU, as in CI).
      if [ "${GPU_CHECK_TESTS:-fast}" = all ]; then
        select=(-n 8)
      else
        select=(-m "not slow" -n 6)
      fi
      timed tests "${GPU_CHECK_TESTS_LIMIT:-200}" python3 -m pytest -v --tb=short --durations=15 \
        "${select[@]}" -p no:cacheprovider \
        -o addopts="-ra --dist loadfile -p no:hypothesispytest -p no:benchmark" &
      tests_pid=$!
      timed train 120 python3 train.py --workdir "$work/reverse" \
        && grep -E "test|exact" "$out/train.log" | tail -3 | sed 's/^/  /' | tee -a "$summary"
      timed study 120 python3 scripts/prune_heads.py --workdir "$work/reverse" --num_seeds 1
      tail -4 "$out/study.log" | sed 's/^/  /' | tee -a "$summary"
      cp "$work/reverse/pruning/results.json" "$out/study_results.json" 2>/dev/null
      wait "$tests_pid"
      grep -E "^(FAILED|ERROR) |^=+ .*(passed|failed)" "$out/tests.log" | tail -40 | sed 's/^/  /' | tee -a "$summary"
      ;;
    accel)
      # 5 repeats: the plan's 20 did not finish in 180 s on an H100 (5 took
      # about 260 s, compiles included).
      timed accel 300 python3 benchmarks/accelerator_benchmark.py --repeats 5 \
        --out "$out/accel.json"
      tail -45 "$out/accel.log" | sed 's/^/  /' >>"$summary"
      ;;
    oracle)
      if [ -d runs/wide ]; then
        timed oracle 75 python3 benchmarks/oracle_benchmark.py --workdir runs/wide \
          --rounds 1 --nobaseline --out "$out/oracle.json"
        tail -6 "$out/oracle.log" | sed 's/^/  /' | tee -a "$summary"
      else
        note "oracle: skipped (no runs/wide)"
      fi
      ;;
    *) note "unknown part $part" ;;
  esac
done
echo "== summary"
cat "$summary"
