# The GPU run (device machine, one call per mode): the product's own commands on the GPU, as a user runs them.
#   bash .ci/gpu-run.sh bench   [sizes in MiB...]   (default: 256 1024 4096 16384)
#   bash .ci/gpu-run.sh certify [certify args...]   (default: every GPU path this host runs, default sizes)
#   bash .ci/gpu-run.sh profile [pushes]            (default: 200; the bare row and 8 x 4 KiB in place)
#   bash .ci/gpu-run.sh reshard [certify args...]   (the reshard backend on the GPU: its GPU tests, then
#                                                    `certify --backend reshard --trainer-ranks 3 --tp 2`)
# bench: the GPU tests (device digests; engines on the device and the zero-copy CUDA IPC path), then
#   `weightsync bench --device cuda` per GPU path (one receiver; a bare-lifecycle row is added; each path's
#   time fitted as fixed + bytes / bandwidth against the verified ceiling).
# certify: `weightsync certify --device cuda`, timed as a newcomer would (conformance, the fault cells that
#   apply, the gated throughput table, the report bundle).
# Everything is packed into $OUT/gpu-run.tgz (the device returns few files), the report.md files beside it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# nothing is installed there: the pytest plugin by name, the control plane's wheels (carried in .whl)
export PYTEST_ADDOPTS="-p harness.pytest_plugin" PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
mode=${1:-bench}; shift || true
run=$OUT/run; mkdir -p "$run"
nvidia-smi -L > "$run/gpus.txt"; nproc >> "$run/gpus.txt"
python3 -c 'import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.device_count())' >> "$run/gpus.txt"
cat "$run/gpus.txt"
if [ "$mode" = profile ]; then
  # where the same-GPU sync's fixed cost goes: the bare row (8 two-byte tensors: packed) and 8 tensors of 4 KiB
  # (whole words: read in place, as the bench's sized rows are), interleaved A/B/A/B
  for arm in bare-a inplace-a bare-b inplace-b; do
    size=(); [ "${arm%-?}" = inplace ] && size=(--tensor-bytes 4096)
    timeout 120 python3 -m harness.profile_push --backend ipc --device cuda --pushes ${1:-200} "${size[@]}" \
      --out "$run/profile-ipc-$arm" > "$run/profile-ipc-$arm.log" 2>&1
    echo "profile ipc $arm exit $?"; python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print({k:d[k] for k in d if k.endswith('ms')})" "$run/profile-ipc-$arm/summary.json"
  done
  timeout 120 python3 -m harness.profile_push --backend delta-ipc --device cuda --pushes ${1:-200} --tensor-bytes 4096 \
    --out "$run/profile-delta-ipc" > "$run/profile-delta-ipc.log" 2>&1
  echo "profile delta-ipc exit $?"; python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print({k:d[k] for k in d if k.endswith('ms')})" "$run/profile-delta-ipc/summary.json"
elif [ "$mode" = bench ]; then
  sizes=${*:-256 1024 4096 16384}
  timeout 150 python3 -m pytest suites/meta/test_device_digest.py suites/meta/test_gpu_engine.py -q -p no:cacheprovider \
    > "$run/gpu-tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "passed|failed|Error" "$run/gpu-tests.log" | tail -8
  # delta: the crossover sweep (changed fractions) runs at the largest size, so it stops at 4 GiB
  for backend in ipc delta-ipc; do
    [ $backend = ipc ] && sz=$sizes || sz=$(for s in $sizes; do [ "$s" -le 4096 ] && echo $s; done)
    timeout 200 python3 -m harness.cli bench --device cuda --backend $backend --sizes-mib $sz --receivers 1 \
      --delta-fractions 0.01 --out "$run/bench-$backend" > "$run/bench-$backend.log" 2>&1
    echo "bench $backend exit $?"; grep -E "ms,|PASS|FAIL|Error" "$run/bench-$backend.log" | tail -8
    sed -n '/Fixed cost and bandwidth/,/^$/p;/fixed + bytes/,/^$/p' "$run"/bench-$backend/bench-*/report.md | tail -6
    cp "$run"/bench-$backend/bench-*/report.md "$OUT/bench-$backend-report.md" 2>/dev/null
  done
else
  if [ "$mode" = reshard ]; then  # every trainer and engine rank on this GPU: the ipc plane over CUDA IPC
    timeout 150 python3 -m pytest suites/performance/test_reshard_backend.py -m gpu -q -s -p no:cacheprovider \
      > "$run/reshard-gpu-tests.log" 2>&1
    echo "reshard gpu tests exit $?"; grep -E "passed|failed|Error|ipc plane" "$run/reshard-gpu-tests.log" | tail -8
    # the cells that recover a world inside a push, alone, each recovery's steps timed (stderr, -s)
    timeout 150 python3 -m pytest suites/faults/test_fault_matrix.py -k "reshard-receiver-kill" -q -s -p no:cacheprovider \
      --weightsync-backend=reshard --weightsync-device=cuda:0 -m "not docker and not slow" > "$run/reshard-recovery.log" 2>&1
    echo "reshard receiver-kill cells exit $?"; grep -E "reshard recovery|passed|failed" "$run/reshard-recovery.log" | tail -8
    set -- --backend reshard --trainer-ranks 3 --tp 2 "$@"
  fi
  start=$(date +%s)
  timeout ${CERTIFY_TIMEOUT_S:-560} python3 -m harness.cli certify --device cuda --out "$run" "$@" > "$run/certify.log" 2>&1
  echo "certify exit $? after $(( $(date +%s) - start )) s"
  grep -vE "^\s*$" "$run/certify.log" | grep -E "passed|failed|could not|PASS|FAIL|fitted|ipc " | tail -24
  cp "$run"/certify-*/report.md "$OUT/certify-report.md" 2>/dev/null
fi
tar czf "$OUT/gpu-run.tgz" -C "$OUT" run && rm -rf "$run"
