# The reference on a many-core host (the lent GPU machine's 16 cores, CPU paths only): the resource
# checks count threads that pools start per core, so they must hold where torch runs 16 threads.
#   bash .ci/many-core-run.sh conformance|faults [backends]     (logs and JUnit under $OUT)
#   bash .ci/many-core-run.sh all   13 suites at once, as a loaded CI host runs them: each CPU path's conformance
#                                   suite and its fault column (10), the control plane's column, suites/control,
#                                   suites/performance; the verdict of each in $OUT/exits.txt
set -u
export PYTEST_ADDOPTS="-p harness.pytest_plugin" PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
if ls .whl/*.whl >/dev/null 2>&1; then  # the control plane's wheels, where the host has none
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
mkdir -p "$OUT"
nproc > "$OUT/host.txt"
python3 -c 'import torch; print("torch", torch.__version__, "threads", torch.get_num_threads())' >> "$OUT/host.txt"
cat "$OUT/host.txt"
one() {  # one NAME PATHS MARKS [ARGS...]: a suite in the background's share of the host, its exit to exits.txt
  local name=$1 paths=$2 marks=$3; shift 3
  local t0=$SECONDS
  timeout 540 python3 -m pytest $paths -m "$marks" -q -p no:cacheprovider -rf --durations=5 \
    --junitxml="$OUT/junit-$name.xml" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/$name.log")" >> "$OUT/exits.txt"
}
if [ "${1:-}" = all ]; then
  default="not slow and not vllm and not faults and not meta and not gpu and not docker"
  start=$SECONDS
  for b in disk broadcast ipc delta delta-ipc; do
    one "conformance-$b" suites/conformance "$default" --weightsync-backend=$b &
    one "faults-$b" suites/faults/test_fault_matrix.py "faults and not slow and not docker" --weightsync-backend=$b &
  done
  one faults-control suites/faults/test_fault_matrix.py "faults and not slow and not docker" --weightsync-backend=control &
  one control suites/control "$default" &
  one performance suites/performance "$default" &
  wait
  echo "13 suites at once: $((SECONDS - start)) s"; sort "$OUT/exits.txt"
  grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | head -20
  exit 0
fi
case "${1:-conformance}" in
  conformance) marks="not slow and not vllm and not faults and not meta and not gpu"; paths=suites/conformance ;;
  faults) marks="faults and not slow"; paths=suites/faults/test_fault_matrix.py ;;
esac
[ -n "${2:-}" ] && export WEIGHTSYNC_BACKEND=$2
timeout 540 python3 -m pytest $paths -m "$marks" -q -p no:cacheprovider -rf --durations=5 \
  --junitxml="$OUT/junit-${1:-conformance}.xml" > "$OUT/${1:-conformance}.log" 2>&1
echo "exit $?"; tail -25 "$OUT/${1:-conformance}.log"
