/* fmnist.cu, unchanged, on test/fake_cuda.c's CPU device, with host twins
   of fmnist_cuda.h's kernels. test/test_fake_fmnist.sh runs it. */
#include "fmnist.cu"
#include "fake_fmnist_twins.h"
