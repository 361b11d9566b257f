/* bench/nccl.cu, unchanged, on test/fake_cuda.c's CPU device: its timings
   mean nothing there, but its check that smp's pipeline step and the raw
   NCCL one compute the same loss and gradients runs on every machine
   (test/run_fake_cuda.sh). */
#include "../bench/nccl.cu"
#include "fake_fmnist_twins.h"
