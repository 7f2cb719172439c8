#!/usr/bin/env bash
# The one command for a GPU machine (H100/H200): the GPU test suite, a compute-sanitizer memcheck pass over a
# representative subset, a time-bounded CUDA fuzz campaign in parallel processes (run beside the tests), the
# benchmark's quick mode (run alone, for clean timings) and the model zoo at realistic sizes. Writes its logs and
# summary.txt under $OUT when that is set (else a temporary directory, printed). Exits non-zero when any part
# fails. Every change that touches CUDA code ends with this command passing on a GPU.
#
# Knobs: FUSER_TEST_SEED (the tests' seed; default: fresh, printed), FUSER_FUZZ_SEED (default: fresh, printed),
# FUSER_GPU_FUZZ_SECONDS (default 200), FUSER_GPU_FUZZ_JOBS (default: cores - 4), GPU_CHECK_SKIP (a list of
# parts to leave out: tests memcheck fuzz bench models), GPU_CHECK_TESTS (which GPU tests: all, the default; gpu_py,
# tests/test_gpu.py alone; others, every other file). The whole takes more than 10 minutes (the test stage alone
# took more than 570 s on an H100 on 2026-11-25), so where calls are limited to 10 minutes it runs as four calls:
#   GPU_CHECK_TESTS=gpu_py GPU_CHECK_SKIP="memcheck fuzz bench models"
#   GPU_CHECK_TESTS=others GPU_CHECK_SKIP="memcheck fuzz bench models"
#   GPU_CHECK_SKIP="tests bench models"
#   GPU_CHECK_SKIP="tests memcheck fuzz"
# GPU_CHECK_OVERLAP=1 runs memcheck and racecheck in the background beside the test stage. H200, 2026-12-01, with
# GPU_CHECK_JOBS=6, FUSER_GPU_FUZZ_SECONDS=100, GPU_CHECK_SKIP=bench: tests 288 s beside memcheck 283 s, then
# racecheck 138 s (the sanitizers done about 421 s in), the fuzz beside them; the model zoo, after them, was cut by
# a 580 s limit in its sixth model of 6: a 10-minute call holds every part but the models and the bench.
# GPU_CHECK_JOBS=N runs the test stage in N processes sharing the GPU (pytest-xdist, --dist loadfile), where xdist
# imports; the device machines lack it, and a session can put a copy of pytest-xdist and execnet (with their
# dist-info) in an untracked folder it carries and names in PYTHONPATH. H200, 2026-11-29, six processes: the whole
# test stage (1,137 tests) in 247 s, where gpu_py and others took about 128 + 457 s one process each.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d -t fuser-gpu-check-XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export FUSER_TEST_SEED=${FUSER_TEST_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) ))}
FUZZ_SEED=${FUSER_FUZZ_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) ))}
FUZZ_SECONDS=${FUSER_GPU_FUZZ_SECONDS:-200}
CORES=$(nproc)
FUZZ_JOBS=${FUSER_GPU_FUZZ_JOBS:-$(( CORES > 6 ? CORES - 4 : 2 ))}
SKIP=" ${GPU_CHECK_SKIP:-} "
SUMMARY="$OUT/summary.txt"
T0=$(date +%s)
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }
skipped() { [[ "$SKIP" == *" $1 "* ]]; }

sanitizers() {
  local status=0 rc t
  # 3. memcheck over a representative subset: the native hot path's launches (forward, training, row kernels), the
  # tiled path (both forms) and eager's output layouts, every layout class, cat outputs, random ops, chunk views, both
  # index widths' kernels, and one op of each shape of the table in a reduced dtype. Reports about cuGetProcAddress (the
  # runtime probing for driver entry points) are not errors of ours and are filtered out.
  if ! skipped memcheck; then
    if command -v compute-sanitizer > /dev/null; then
      t=$(date +%s)
      compute-sanitizer --tool memcheck --leak-check no --print-limit 200 \
        "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_native.py tests/test_layouts.py tests/test_normalizations.py tests/test_outer_reductions.py tests/test_staged_rows.py tests/test_chunked_calls.py tests/test_grad_sums.py -p no:cacheprovider -x -k \
        "test_native or several_trips_in_its_row_kernel or chunked_call or cuda_row_kernel_matches_eager or staged_rows_on_the_gpu or column_vectors_on_the_gpu or cuda_column_kernel_is_deterministic or gpu_tiled or gpu_outputs_have_eagers_strides or layouts or concat_on_cuda or rand_like_on_cuda or lstm_cell_with_chunk or signed_zero or mixed_dtypes or cheap_walking or side_stream or (op_cuda_vs_eager and float16 and (add-Tensor or where-self or clamp-Tensor or lerp-Tensor or addcmul or sigmoid or pow-Tensor_Scalar))" \
        > "$OUT/memcheck.log" 2>&1
      rc=$?
      errors=$("$PY" - "$OUT/memcheck.log" <<'EOF'
import re, sys
text = open(sys.argv[1], errors="replace").read().splitlines()
errors, block = [], []
for line in text + ["========= "]:
    if line.startswith("========= ") and not line.startswith("=========  ") and block:
        errors.append("\n".join(block)); block = []
    if re.match(r"========= (Invalid|Program hit|Out-of-range|Misaligned|Race|Uninitialized|Barrier|Error)", line):
        block = [line]
    elif block and line.startswith("========="):
        block.append(line)
ours = [e for e in errors if "cuGetProcAddress" not in e]
print(len(ours), len(errors) - len(ours))
EOF
  )
      read -r ours probes <<< "$errors"
      tests=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/memcheck.log" | tail -1)
      note "memcheck: rc=$rc, $(( $(date +%s) - t ))s, $ours errors ($probes cuGetProcAddress reports filtered): $tests"
      { [ "$ours" = 0 ] && [ $rc -eq 0 ]; } || status=1
    else
      note "memcheck: compute-sanitizer not found"
      status=1
    fi
  fi

  # 3b. racecheck over the row kernels (their shared memory between the warps of a row)
  if ! skipped memcheck; then
    if command -v compute-sanitizer > /dev/null; then
      t=$(date +%s)
      compute-sanitizer --tool racecheck "$PY" -m pytest -q -m gpu tests/test_normalizations.py -p no:cacheprovider -x \
        -k "cuda_row_kernel_matches_eager and (softmax or layer_norm)" > "$OUT/racecheck.log" 2>&1
      rc=$?
      # ... and the norms' backward row kernels that sum the weight/bias gradients in partial rows, with their second
      # kernel (shared memory across its warps); the small shapes (racecheck is slow)
      compute-sanitizer --tool racecheck "$PY" -m pytest -q -m gpu tests/test_row_partial_sums.py -p no:cacheprovider -x \
        -k "sums_in_the_row_kernel_on_the_gpu and in_row and (7x32 or 300x36 or 4096x1024 or 300x33)" \
        >> "$OUT/racecheck.log" 2>&1
      rc=$(( rc > $? ? rc : $? ))
      # rows kept in shared memory (fuser/rows/shape.py's staged_inputs)
      compute-sanitizer --tool racecheck "$PY" -m pytest -q -m gpu tests/test_staged_rows.py -p no:cacheprovider -x \
        -k "staged_rows_on_the_gpu and (softmax-16392 or layer_norm_block-16392)" >> "$OUT/racecheck.log" 2>&1
      rc=$(( rc > $? ? rc : $? ))
      summary=$(grep -E "RACECHECK SUMMARY" "$OUT/racecheck.log" | tr -s ' ' | paste -sd ';')
      note "racecheck: rc=$rc, $(( $(date +%s) - t ))s: $summary"
      { [ $rc -eq 0 ] && [ "$(grep -c "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" "$OUT/racecheck.log")" = 3 ]; } || status=1
    fi
  fi
  return $status
}

: > "$SUMMARY"
note "fuser gpu_check $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+changes'), $(date -u +%FT%TZ)"
note "$("$PY" -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__)' 2>&1 | tail -1)"
note "FUSER_TEST_SEED=$FUSER_TEST_SEED FUSER_FUZZ_SEED=$FUZZ_SEED, fuzz ${FUZZ_SECONDS}s x $FUZZ_JOBS processes"

# which GPU tests (checked before anything starts in the background)
case "${GPU_CHECK_TESTS:-all}" in
  all) which=(tests) ;;
  gpu_py) which=(tests/test_gpu.py) ;;
  others) which=(tests --ignore=tests/test_gpu.py) ;;
  *) echo "GPU_CHECK_TESTS: all, gpu_py or others" >&2; exit 2 ;;
esac

# 1. the CUDA fuzz campaign, in the background on most cores
fuzz_pid=
if ! skipped fuzz; then
  "$PY" -m fuser.fuzz --device cuda --seed "$FUZZ_SEED" --graphs 1000000 --time-budget "$FUZZ_SECONDS" \
    --jobs "$FUZZ_JOBS" --out "$OUT/fuzz_failures" --max-shrink "${FUSER_GPU_FUZZ_SHRINK:-4}" --shrink-budget 40 > "$OUT/fuzz.log" 2>&1 &
  fuzz_pid=$!
fi

# the sanitizers beside the tests (GPU_CHECK_OVERLAP=1: one GPU shared by both, their logs apart), else after them
san_pid=
if [ "${GPU_CHECK_OVERLAP:-0}" = 1 ] && ! skipped memcheck; then
  sanitizers &
  san_pid=$!
fi

# 2. the GPU test suite
if ! skipped tests; then
  t=$(date +%s)
  par=()
  if [ "${GPU_CHECK_JOBS:-1}" -gt 1 ] && "$PY" -c "import xdist" 2> /dev/null; then
    par=(-n "$GPU_CHECK_JOBS" --dist loadfile)
  fi
  "$PY" -m pytest -q -m gpu "${which[@]}" "${par[@]}" -p no:cacheprovider > "$OUT/tests.log" 2>&1
  rc=$?
  note "tests (${GPU_CHECK_TESTS:-all}${par:+, $GPU_CHECK_JOBS processes}): rc=$rc, $(( $(date +%s) - t ))s: $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$OUT/tests.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
fi


if [ -n "$san_pid" ]; then
  wait "$san_pid" || status=1
elif ! skipped memcheck; then
  sanitizers || status=1
fi

# 4. wait for the campaign
if [ -n "$fuzz_pid" ]; then
  wait "$fuzz_pid"
  rc=$?
  note "fuzz: rc=$rc: $(grep -E '^seed .* graphs|  fused [0-9]+ of|  mismatches:' "$OUT/fuzz.log" | tr -s ' ' | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
  if [ -d "$OUT/fuzz_failures" ]; then
    # the reproducers (.py); their large inputs (.pt) stay out, to keep the archive small
    (cd "$OUT" && tar czf fuzz_failures.tgz --exclude="*.pt" fuzz_failures) && rm -rf "$OUT/fuzz_failures"
  fi
fi

# 5. the benchmark's quick mode, alone on the GPU
if ! skipped bench; then
  t=$(date +%s)
  "$PY" -m fuser.bench --quick --json "$OUT/bench_quick.json" --png "$OUT/bench_quick.png" > "$OUT/bench.txt" 2>&1
  rc=$?
  note "bench --quick: rc=$rc, $(( $(date +%s) - t ))s"
  [ $rc -eq 0 ] || status=1
fi

# 6. the model zoo at realistic sizes (GPT-2 small, BERT base, ViT-B/16, ConvNeXt-T, ResNet-50, MobileNetV2; batch 8),
# traced under every system, each first call checked against eager and timed in interleaved rounds (about 180 s on an
# H200): fails when a system raised on a model
if ! skipped models; then
  t=$(date +%s)
  "$PY" -m fuser.bench --models --json "$OUT/models.json" > "$OUT/models.txt" 2>&1
  rc=$?
  note "bench --models: rc=$rc, $(( $(date +%s) - t ))s"
  sed -n '/^model /,/^total/p' "$OUT/models.txt" | tee -a "$SUMMARY"
  [ $rc -eq 0 ] || status=1
fi

note "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED) in $(( $(date +%s) - T0 ))s (logs in $OUT)"
exit $status
