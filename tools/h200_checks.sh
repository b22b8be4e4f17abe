#!/usr/bin/env bash
# The GPU checks of a kernel change, in one call on the H200 (docs/kernels.md, "Running the
# checks on a GPU"). Build here, carry the outputs, run the steps there:
#
#   cmake -S . -B .dev/build -G Ninja -DJAX_DSPARK_CUDA=ON -DJAX_DSPARK_BUILD_DRIVER=ON && ninja -C .dev/build
#   tools/h200_checks.sh memcheck driver-bench prep-tests bench-prep          # on the GPU machine
#
# Steps (in the order given; each logs to $OUT/checks.log and stops at its own timeout):
#   memcheck        kernel_driver edge cases under compute-sanitizer memcheck (+ --wgmma)
#   racecheck       kernel_driver --wgmma under compute-sanitizer racecheck
#   driver-bench    kernel_driver bench --wgmma and bench-prep: CUDA-event device times
#   prep-tests      pytest -m gpu tests/test_kernels_prep.py
#   gpu-tests       pytest -m gpu tests (every GPU test)
#   ws-fp8          the warp-specialised kernel's FP8 producers (first run 2026-12-05): kernel_driver
#                   --wgmma-ws edge cases under timeout, memcheck, racecheck, then bench fp8
#                   with --wgmma-lockstep and --wgmma-ws alternating
#   prep-half       the half-warp-per-row prep layout (written 2026-12-05, not yet run):
#                   kernel_driver --prep-half edge cases, memcheck, then bench-prep with and
#                   without --prep-half alternating
#   cluster         split partials merged in a cluster (dispatched since 2026-12-06 where its
#                   CTAs fit in as few waves as a plain launch's): kernel_driver --wgmma-cluster
#                   edge cases under timeout, memcheck, racecheck, then bench of the split cases
#                   (CSA decode, HCA, dense 16k) with --wgmma, --wgmma-combine and --wgmma-cluster
#   ab              the attention kernels against an older kernel_driver ($OLD_DRIVER, one built
#                   before the change): bench of $AB_CASES (a case-name filter, default all ten;
#                   about 50 s for all) with --wgmma-lockstep and --wgmma-ws, old and new
#                   alternating twice (CUDA events, same run); $AB_FLAGS go to both (e.g.
#                   --rope: the inverse-RoPE epilogue; the old driver must know the flag)
#   timeline        per-CTA phases of every bench case (kernel_driver --timeline) with
#                   $TIMELINE_DRIVER (default .dev/build_tl/kernel_driver, a build configured with
#                   -DJAX_DSPARK_ATTENTION_TIMELINE=ON): one JSON line a case (docs/kernels.md,
#                   "Per-CTA timelines")
#   persistent      the persistent lockstep CTAs (dispatched for one-split bf16 launches of more
#                   items than SMs from the morning to the evening of 2026-12-07, now for their
#                   empty lists only): kernel_driver --wgmma-persistent edge cases, memcheck,
#                   racecheck, then the DSpark blocks under --wgmma-lockstep, --wgmma (both pool
#                   kinds persistent warp-specialised) and --wgmma-persistent, alternating twice
#   late-start      the persistent kernel with its CTAs of one item fewer starting late (kernel_driver
#                   --late-start CYCLES, $TIMELINE_DRIVER's build: 0, 6000, 12000, 24000 cycles), the
#                   DSpark blocks under --wgmma and --wgmma-persistent, twice: whether loads spread
#                   over time make the items shorter (docs/kernels.md Next steps 1a)
#   ws-persistent   the persistent warp-specialised CTAs (dispatched for one-split launches of more
#                   items than SMs, FP8 pools and bf16 lists of a tile or more, since 2026-12-07):
#                   kernel_driver --wgmma-ws-persistent edge cases, memcheck, racecheck, then the
#                   DSpark blocks under --wgmma-persistent (the lockstep persistent kernel) and
#                   --wgmma (dispatched) alternating twice
#   epilogue        the epilogue experiments (written 2026-12-07 and -08, not yet run;
#                   docs/kernels.md "The H100 bench of d3be25c" and "No machine lent"): kernel_driver
#                   builds configured with -DCMAKE_CUDA_FLAGS= -DJAX_DSPARK_ATTENTION_SPREAD_STORES
#                   (.dev/build_sp), -DJAX_DSPARK_ATTENTION_ASYNC_CONSTANTS (.dev/build_ac),
#                   -DJAX_DSPARK_ATTENTION_ROPE_SPLIT_STAGING (.dev/build_rs) and all three
#                   (.dev/build_all): the last one's edge cases and memcheck under --wgmma, then
#                   `--wgmma --rope bench DSpark` with $DRIVER and the four, alternating twice,
#                   their table (tools/ab_summary.py), and the DSpark timelines of $TIMELINE_DRIVER
#                   and $TIMELINE_ALL_DRIVER (default .dev/build_tlall: a timeline build with all
#                   three options) when those drivers are there
#   ncu             Nsight Compute (--set full, clocks left alone) of the fourth launch of kernel
#                   $NCU_KERNEL (a regex, default wgmma_ws_kernel) in `$NCU_DRIVER --wgmma --rope bench
#                   "$NCU_CASE"` (defaults: .dev/build_li/kernel_driver, a build configured with
#                   -DCMAKE_CUDA_FLAGS=-lineinfo; "V4-Pro HCA"): $OUT/ncu_details.txt and
#                   $OUT/ncu_sass.csv, which tools/ncu_source_lines.py joins with `nvdisasm -gi` of
#                   the same driver here (docs/kernels.md, "Every GPU test with the persistent
#                   kernel's library")
#   probes          where the lockstep kernel's time goes, on $PROBE_CASES (default "dense 16k"):
#                   kernel_driver bench with the real kernel, its gather alone (1 and 2 tiles
#                   in flight) and its compute alone (AttnProbe in attention/params.h)
#   ws-sweep        bench-shape over K at H 128 (B 16, S 1), both schedules: where the
#                   warp-specialised schedule starts to win (use_warp_specialised's threshold)
#   moe-configs     moe_driver: the grouped GEMMs (FP8 and BF16) under each CUTLASS configuration
#                   of grouped_probes, checked against a host reference and timed beside a copy
#   bench-prep | bench-attention | bench-moe   jax-dspark bench <what> --out $OUT
#   bench-prep-cb | bench-attention-cb         the same with --command-buffers
#   h200:STEP       STEP only if the GPU is an H200, else logged as skipped: a call naming the
#                   H200 may be given an H100, whose A/B steps still count but whose benchmark
#                   JSON is not the one docs/benchmarks/attention.json must come from
# Environment: BUILD (default .dev/build: libjax_dspark_ffi.so, kernel_driver, moe_driver), COMMIT (the
# commit the build is of, recorded in the benchmark JSON), OUT (where logs and JSON go).
set -uo pipefail
BUILD=${BUILD:-.dev/build}
OUT=${OUT:-/tmp/h200_checks}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
LOG=$OUT/checks.log
export PYTHONUNBUFFERED=1 JAX_DSPARK_FFI_LIB=$PWD/$BUILD/libjax_dspark_ffi.so
DRIVER=$BUILD/kernel_driver
TIMELINE_DRIVER=${TIMELINE_DRIVER:-.dev/build_tl/kernel_driver}
status=0
last=0

run() {  # run <seconds> <command...>: log it, keep the first failure's status
  local limit=$1
  shift
  echo "== $* (limit ${limit} s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  last=$rc
  [ "$rc" -ne 0 ] && echo "== exit $rc" | tee -a "$LOG" && [ "$status" -eq 0 ] && status=$rc
  return 0
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv 2>&1 | tee -a "$LOG"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
for step in "$@"; do
  if [ "${step#h200:}" != "$step" ]; then
    step=${step#h200:}
    case $gpu_name in
      *H200*) ;;
      *) echo "== $step skipped: the GPU is ${gpu_name:-unknown}, not an H200" | tee -a "$LOG"; continue ;;
    esac
  fi
  case $step in
    memcheck)
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER"
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER" --wgmma ;;
    racecheck) run 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$DRIVER" --wgmma ;;
    driver-bench)
      run 120 "$DRIVER" --wgmma bench
      run 60 "$DRIVER" bench-prep ;;
    ws-fp8)
      run 60 "$DRIVER" --wgmma-ws
      [ "$last" -ne 0 ] && echo "== ws-fp8: edge cases failed or hung; the rest of the step skipped" | tee -a "$LOG" && continue
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER" --wgmma-ws
      run 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$DRIVER" --wgmma-ws
      for schedule in --wgmma-lockstep --wgmma-ws --wgmma-lockstep --wgmma-ws; do
        run 150 "$DRIVER" "$schedule" bench fp8
      done ;;
    prep-half)
      run 60 "$DRIVER" --prep-half
      [ "$last" -ne 0 ] && echo "== prep-half: edge cases failed or hung; the rest of the step skipped" | tee -a "$LOG" && continue
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER" --prep-half
      for i in 1 2; do
        run 60 "$DRIVER" bench-prep
        run 60 "$DRIVER" --prep-half bench-prep
      done ;;
    cluster)
      run 60 "$DRIVER" --wgmma-cluster
      [ "$last" -ne 0 ] && echo "== cluster: edge cases failed or hung; the rest of the step skipped" | tee -a "$LOG" && continue
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER" --wgmma-cluster
      run 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$DRIVER" --wgmma-cluster
      for schedule in --wgmma --wgmma-combine --wgmma-cluster --wgmma --wgmma-combine --wgmma-cluster; do
        for c in "CSA decode" "HCA" "dense 16k"; do
          run 60 "$DRIVER" "$schedule" bench "$c"
        done
      done ;;
    timeline) run 120 "$TIMELINE_DRIVER" --wgmma --rope --timeline bench ;;
    ws-persistent)
      run 60 "$DRIVER" --wgmma-ws-persistent
      [ "$last" -ne 0 ] && echo "== ws-persistent: edge cases failed or hung; the rest of the step skipped" | tee -a "$LOG" && continue
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER" --wgmma-ws-persistent
      run 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$DRIVER" --wgmma-ws-persistent
      for i in 1 2; do
        for schedule in --wgmma-persistent --wgmma; do
          run 60 "$DRIVER" "$schedule" --rope bench DSpark
        done
      done ;;
    late-start)
      for i in 1 2; do
        for n in 0 6000 12000 24000; do
          for schedule in --wgmma --wgmma-persistent; do
            run 60 "$TIMELINE_DRIVER" "$schedule" --rope --timeline --late-start "$n" bench DSpark
          done
        done
      done ;;
    persistent)
      run 60 "$DRIVER" --wgmma-persistent
      [ "$last" -ne 0 ] && echo "== persistent: edge cases failed or hung; the rest of the step skipped" | tee -a "$LOG" && continue
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$DRIVER" --wgmma-persistent
      run 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$DRIVER" --wgmma-persistent
      for i in 1 2; do
        for schedule in --wgmma-lockstep --wgmma --wgmma-persistent; do
          run 60 "$DRIVER" "$schedule" --rope bench DSpark
        done
      done ;;
    ab)
      for schedule in --wgmma-lockstep --wgmma-ws; do
        for i in 1 2; do
          run 150 "${OLD_DRIVER:?}" "$schedule" ${AB_FLAGS:-} bench ${AB_CASES:+"$AB_CASES"}
          run 150 "$DRIVER" "$schedule" ${AB_FLAGS:-} bench ${AB_CASES:+"$AB_CASES"}
        done
      done ;;
    epilogue)
      from=$(($(wc -l < "$LOG") + 1))  # this step's part of the log, for the table
      run 60 .dev/build_all/kernel_driver --wgmma
      [ "$last" -ne 0 ] && echo "== epilogue: edge cases failed or hung; the rest of the step skipped" | tee -a "$LOG" && continue
      run 200 compute-sanitizer --tool memcheck --error-exitcode 9 .dev/build_all/kernel_driver --wgmma
      for i in 1 2; do
        for d in "$DRIVER" .dev/build_sp/kernel_driver .dev/build_ac/kernel_driver .dev/build_rs/kernel_driver \
          .dev/build_all/kernel_driver; do
          run 60 "$d" --wgmma --rope bench DSpark
        done
      done
      tail -n "+$from" "$LOG" > "$OUT/epilogue.log"
      python3 tools/ab_summary.py "$OUT/epilogue.log" --only DSpark 2>&1 | tee -a "$LOG"
      for d in "$TIMELINE_DRIVER" "${TIMELINE_ALL_DRIVER:-.dev/build_tlall/kernel_driver}"; do
        [ -x "$d" ] && run 60 "$d" --wgmma --rope --timeline bench DSpark
      done ;;
    ncu)
      run 200 ncu --clock-control none --set full -k "regex:${NCU_KERNEL:-wgmma_ws_kernel}" --launch-skip 3 \
        --launch-count 1 -f -o "$OUT/ncu" "${NCU_DRIVER:-.dev/build_li/kernel_driver}" --wgmma --rope bench \
        "${NCU_CASE:-V4-Pro HCA}"
      ncu -i "$OUT/ncu.ncu-rep" --page details --print-units base > "$OUT/ncu_details.txt" 2>&1
      ncu -i "$OUT/ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1 ;;
    probes)
      for mode in --wgmma-lockstep --probe-gather1 --probe-gather2 --probe-math --wgmma-lockstep; do
        run 150 "$DRIVER" "$mode" bench "${PROBE_CASES:-dense 16k}"
      done ;;
    ws-sweep)
      for k in 1024 1536 2048 3072 4096 6144 8192; do
        for schedule in --wgmma-lockstep --wgmma-ws; do
          run 60 "$DRIVER" "$schedule" bench-shape 16 1 128 "$k"
        done
      done ;;
    moe-configs) run 200 "$BUILD/moe_driver" ;;
    prep-tests) run 240 env JAX_DSPARK_TEST_GPU=1 python3 -m pytest -m gpu tests/test_kernels_prep.py -q ;;
    # test_gguf / test_smollm2 import gguf, which the GPU machine lacks; they hold no GPU tests
    gpu-tests) run 580 env JAX_DSPARK_TEST_GPU=1 python3 -m pytest -m gpu tests -q -o faulthandler_timeout=120 \
      --ignore=tests/test_gguf.py --ignore=tests/test_smollm2.py ;;
    bench-prep | bench-attention | bench-moe)
      run 400 python3 -m jax_dspark.cli bench "${step#bench-}" --out "$OUT" --commit "$COMMIT" ;;
    bench-prep-cb | bench-attention-cb)
      what=${step#bench-}
      run 400 python3 -m jax_dspark.cli bench "${what%-cb}" --command-buffers --out "$OUT" --commit "$COMMIT" ;;
    *) echo "unknown step: $step" | tee -a "$LOG"; status=2 ;;
  esac
done
exit "$status"
