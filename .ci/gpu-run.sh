export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
nvidia-smi -L > $OUT/gpus.txt; python3 -c 'import torch,triton,numpy;print(torch.__version__, triton.__version__, numpy.__version__, torch.cuda.device_count())' | tee -a $OUT/gpus.txt
timeout 150 python3 -m pytest suites/meta/test_device_digest.py -q -p no:cacheprovider > $OUT/digest-tests.log 2>&1; tail -3 $OUT/digest-tests.log
timeout 520 python3 -m harness.gpu_check --out $OUT --only copy_ceiling digests cuda_ipc delta_gpu conformance --conformance-timeout 420 > $OUT/gpu_check.log 2>&1
tail -c 5000 $OUT/gpu_check.log
