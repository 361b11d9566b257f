/* strict_headers.c - the four headers, implementation included, as an engine
   that builds with strict warnings and -Werror includes them. `make
   build-strict` (part of `make test`) compiles this file under gcc and clang,
   with and without SMP_TESTING, with -Wconversion -Wsign-conversion
   -Wcast-qual -Wdouble-promotion -Wshadow -Wpedantic on top of the usual
   flags: a warning there fails the suite. Compiled only, never run.
   SMP_STRICT_NCCL is set where the CUDA and NCCL headers are present. */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"
#ifdef SMP_STRICT_NCCL
#include "smp_nccl.h"
#endif

int main(void) { return 0; }
