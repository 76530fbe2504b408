#!/usr/bin/env bash
# checkpoint-engine 0.4.2 through weightsync on a GPU host, in one call (the lent one-GPU H200 machine: Python 3.12,
# torch 2.11 cu130, no network). Nothing is installed there beyond the wheels carried in .whl/checkpoint-engine
# (checkpoint-engine, pyzmq, loguru and the fastapi/pydantic set `import checkpoint_engine` needs; fetch them here
# with the pip command in adapters/checkpoint_engine/README.md); weightsync and this adapter run from the checkout
# (PYTHONPATH, the pytest plugin named with -p), as .ci/gpu-run.sh does.
#
#   bash adapters/checkpoint_engine/gpu_run.sh [STEP...]     (default: conformance faults hang smoke)
#     smoke        deploy, 10 pushes of 64 MiB, timings             (python -m weightsync_checkpoint_engine.smoke)
#     conformance  pytest suites/conformance -m "not slow" --weightsync-device=cuda:0
#     faults       the fault matrix (suites/faults, marker faults), every named point, except the one cell that
#                  leaves checkpoint-engine's update blocked (its socket would break every later cell: see hang)
#     hang         that cell alone in a fresh process (receiver killed before the transfer), then one more cell in
#                  the same process, which shows what the blocked update leaves behind
#     reference    the harness's own CUDA IPC path (ipc, same GPU) on the tests and cells that fail above
#     tail         what a first call did not reach, most telling first: test_resources, test_supervision, the
#                  rank-killed-idle and trainer-kill (mid-move) cells, then test_model_updates and test_pause_resume
#     rest         the tail's last two steps alone (what the second call did not reach)
#     bench        weightsync bench at 64 MiB, 1 GiB, 4 GiB, one receiver: checkpoint-engine with
#                  WEIGHTSYNC_CE_AUTO_PG=1 (its default: a process group per update) and 0, and ipc
#                  (CE_BENCH_PG names the modes to measure: "1 0" unless set)
#     certify      weightsync certify --backend weightsync_checkpoint_engine:make_backend --device cuda
#                  (stopped at CE_CERTIFY_LIMIT_S, default 540 s; a later call finishes it with
#                  CE_CERTIFY_BUNDLE=<the bundle from this call's tarball, carried>: certify --resume)
# Per step a log and the results JSON in /tmp/ce-gpu-run/run, packed after every step into $OUT/ce-gpu-run.tgz
# (default OUT: reports/ce-gpu-run; the device tool returns few files, and a call cut short keeps what was packed).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/reports/ce-gpu-run}
run=${CE_RUN_DIR:-/tmp/ce-gpu-run}/run  # the work folder; $OUT gets its tarball and the results (few files)
rm -rf "$run" && mkdir -p "$run" "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_MODULE_LOADING=LAZY
if ls .whl/checkpoint-engine/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/checkpoint-engine/*.whl || exit 3
fi
export PYTHONPATH=$PWD:$PWD/adapters/checkpoint_engine:/tmp/site PYTEST_ADDOPTS="-p harness.pytest_plugin"
B=weightsync_checkpoint_engine:make_backend
PYTEST=(python3 -m pytest -p no:randomly -p no:cacheprovider -q -rfEs --weightsync-device=cuda:0)
HANG_CELL="receiver-kill-before-transfer"
stamp() { date -u +%H:%M:%S; }
step() {  # step NAME SECONDS CMD...: run with a limit, log to $run/NAME.log, print the tail and the time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $(stamp) $name: $*" | tee -a "$run/steps.txt"
  timeout -k 10 "$limit" "$@" > "$run/$name.log" 2>&1
  local rc=$?
  echo "== $(stamp) $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$run/steps.txt"
  grep -E "passed|failed|not_supported|error|Error" "$run/$name.log" | tail -4
  pack
}
pack() {  # what is done so far, in the few files the device tool returns (a later timeout keeps it)
  tar czf "$OUT/ce-gpu-run.tgz" -C "$(dirname "$run")" run && cp "$run/steps.txt" "$OUT/steps.txt"
  for f in "$run"/conformance.json "$run"/faults*.json "$run"/tail-*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
}
{
  nvidia-smi -L
  python3 -c 'import sys,torch,triton;print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))'
  python3 -m pip list 2>/dev/null | grep -iE "^(checkpoint|pyzmq|loguru|fastapi|pydantic|hypothesis|pytest|safetensors|transformers) "
  git log -1 --format='weightsync %h %cs' 2>/dev/null
} > "$run/env.txt" 2>&1
cat "$run/env.txt"
steps=${*:-conformance faults hang smoke}
for s in $steps; do case $s in
  smoke) step smoke 60 python3 -m weightsync_checkpoint_engine.smoke --pushes 8 --mib 64 ;;
  conformance) step conformance 300 "${PYTEST[@]}" suites/conformance -m "not slow" \
      --deselect suites/conformance/test_torchrun.py --hypothesis-seed=0 \
      --weightsync-backend=$B --weightsync-results="$run/conformance.json" --junitxml="$run/junit-conformance.xml" ;;
  faults) step faults 160 "${PYTEST[@]}" suites/faults -m "faults and not slow and not docker" \
      -k "not $HANG_CELL and not drawn" \
      --weightsync-backend=$B --weightsync-results="$run/faults.json" --junitxml="$run/junit-faults.xml" ;;
  hang) step hang 70 "${PYTEST[@]}" suites/faults -m "faults and not slow and not docker" \
      -k "$HANG_CELL or trainer-raise-first-read" \
      --weightsync-backend=$B --weightsync-results="$run/faults-hang.json" ;;
  reference) step reference-conformance 70 "${PYTEST[@]}" suites/conformance/test_bitwise.py --hypothesis-seed=0 \
      --weightsync-backend=ipc --weightsync-results="$run/reference-ipc-conformance.json"
    step reference-faults 60 "${PYTEST[@]}" suites/faults -m "faults and not slow and not docker" \
      -k "ipc-$HANG_CELL or ipc-trainer-raise-first-read" --weightsync-backend=ipc \
      --weightsync-results="$run/reference-ipc-faults.json" ;;
  tail) step tail-resources 70 "${PYTEST[@]}" suites/conformance/test_resources.py \
      --weightsync-backend=$B --weightsync-results="$run/tail-resources.json"
    step tail-supervision 50 "${PYTEST[@]}" suites/conformance/test_supervision.py \
      --weightsync-backend=$B --weightsync-results="$run/tail-supervision.json"
    step tail-faults 70 "${PYTEST[@]}" suites/faults -m "faults and not slow and not docker" \
      -k "rank-killed-idle or trainer-kill-mid-move" \
      --weightsync-backend=$B --weightsync-results="$run/tail-faults.json"
    step tail-conformance 150 "${PYTEST[@]}" suites/conformance/test_model_updates.py \
      suites/conformance/test_pause_resume.py --hypothesis-seed=0 \
      --weightsync-backend=$B --weightsync-results="$run/tail-conformance.json" ;;
  rest) step tail-faults 70 "${PYTEST[@]}" suites/faults -m "faults and not slow and not docker" \
      -k "rank-killed-idle or trainer-kill-mid-move" \
      --weightsync-backend=$B --weightsync-results="$run/tail-faults.json"
    step tail-conformance 150 "${PYTEST[@]}" suites/conformance/test_model_updates.py \
      suites/conformance/test_pause_resume.py --hypothesis-seed=0 \
      --weightsync-backend=$B --weightsync-results="$run/tail-conformance.json" ;;
  certify) step certify "${CE_CERTIFY_LIMIT_S:-540}" python3 -m harness.cli certify --device cuda --backend $B \
      --sizes-mib 64 256 --out "$run" ${CE_CERTIFY_BUNDLE:+--resume "$CE_CERTIFY_BUNDLE"} ;;
  bench) for pg in ${CE_BENCH_PG:-1 0}; do  # where a push's fixed half second goes: a process group per update, or one kept
      WEIGHTSYNC_CE_AUTO_PG=$pg step "bench-auto-pg-$pg" 150 python3 -m harness.cli bench --device cuda \
        --backend $B --sizes-mib 64 1024 4096 --receivers 1 --repeats 3 --out "$run/bench-auto-pg-$pg"
    done
    step bench-ipc 120 python3 -m harness.cli bench --device cuda --backend ipc --sizes-mib 64 1024 4096 \
      --receivers 1 --repeats 3 --out "$run/bench-ipc" ;;
  *) echo "unknown step $s"; exit 2 ;;
esac; done
pack
ls -la "$OUT"
