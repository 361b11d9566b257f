/* gpt.cu, unchanged, on test/fake_cuda.c's CPU device, with host twins of
   gpt_cuda.h's kernels. test/test_fake_gpt.sh runs it. */
#include "gpt.cu"
#include "fake_gpt_twins.h"
