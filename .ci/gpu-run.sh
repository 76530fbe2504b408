# The GPU run (device machine, one call): the product's own commands on the GPU, as a user runs them.
#   bash .ci/gpu-run.sh [sizes in MiB...]      (default: 1 64 256 1024 4096)
# 1. the GPU tests (device digests; engines on the device and the zero-copy CUDA IPC path);
# 2. `weightsync bench --device cuda` per GPU path this host runs (one receiver: the throughput table, its
#    breakdown and the delta crossover, against the GPU's own ceilings);
# 3. `weightsync certify --device cuda` (conformance, the fault cells that apply, the gated throughput
#    table, the report bundle). Everything is packed into $OUT/gpu-run.tgz (the device returns few
#    files), with the three report.md files beside it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# nothing is installed there: the pytest plugin by name, the control plane's wheels (carried in .whl)
export PYTEST_ADDOPTS="-p harness.pytest_plugin" PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
sizes=${*:-1 64 256 1024 4096}
run=$OUT/run; mkdir -p "$run"
nvidia-smi -L > "$run/gpus.txt"
python3 -c 'import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.device_count())' >> "$run/gpus.txt"
cat "$run/gpus.txt"
timeout 150 python3 -m pytest suites/meta/test_device_digest.py suites/meta/test_gpu_engine.py -q -p no:cacheprovider \
  > "$run/gpu-tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|Error" "$run/gpu-tests.log" | tail -8
# delta: the crossover sweep (changed fractions) runs at the largest size, so it stops at 1 GiB
for backend in ipc delta-ipc; do
  [ $backend = ipc ] && sz=$sizes || sz=$(for s in $sizes; do [ "$s" -le 1024 ] && echo $s; done)
  timeout 150 python3 -m harness.cli bench --device cuda --backend $backend --sizes-mib $sz --receivers 1 \
    --delta-fractions 0.001 0.1 0.5 --out "$run/bench-$backend" > "$run/bench-$backend.log" 2>&1
  echo "bench $backend exit $?"; grep -E "ratio|PASS|FAIL|Error" "$run/bench-$backend.log" | tail -12
done
timeout 280 python3 -m harness.cli certify --device cuda --backend ipc --sizes-mib 64 256 1024 --out "$run" \
  > "$run/certify.log" 2>&1
echo "certify exit $?"; grep -vE "^\s*$" "$run/certify.log" | grep -E "passed|failed|could not|PASS|FAIL|ratio|ipc " | tail -20
for b in ipc delta-ipc; do cp "$run"/bench-$b/bench-*/report.md "$OUT/bench-$b-report.md" 2>/dev/null; done
cp "$run"/certify-*/report.md "$OUT/certify-report.md" 2>/dev/null
tar czf "$OUT/gpu-run.tgz" -C "$OUT" run && rm -rf "$run"
