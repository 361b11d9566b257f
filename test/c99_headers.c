/* c99_headers.c - the headers' implementation compiled as C99 (make test
   builds it with -std=c99 -pedantic under gcc and clang; the suite itself
   is C11). Nothing runs: compiling is the check. */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_pipeline.h"
#include "smp_checkpoint.h"

int smp_c99_check(void);
int smp_c99_check(void) { return smp_dtype_size(SMP_F32) == 4 ? 0 : 1; }
