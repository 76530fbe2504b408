# The GPU run (device machine, one call): the digest tests on the GPU, then harness.gpu_check.
# Usage there: bash .ci/gpu-run.sh [gpu_check variants...]   (default: every variant but delta_gpu)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
variants=${*:-copy_ceiling digests nccl_broadcast cuda_ipc conformance}
nvidia-smi -L > $OUT/gpus.txt; python3 -c 'import torch,triton,numpy;print(torch.__version__, triton.__version__, numpy.__version__, torch.cuda.device_count())' | tee -a $OUT/gpus.txt
timeout 150 python3 -m pytest suites/meta/test_device_digest.py -q -p no:cacheprovider > $OUT/digest-tests.log 2>&1; tail -3 $OUT/digest-tests.log
timeout 540 python3 -m harness.gpu_check --out $OUT --only $variants --conformance-timeout 440 > $OUT/gpu_check.log 2>&1
tail -c 4000 $OUT/gpu_check.log
