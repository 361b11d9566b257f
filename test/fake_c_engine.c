/* fake_c_engine.c - smp_nccl.h included from C (mpicc, no nvcc), as an
   engine whose kernels live elsewhere would: device collectives and
   point-to-point work; smp_nccl_add says it needs nvcc. Runs on
   test/fake_cuda.c's CPU device (test/run_fake_cuda.sh). */
#define SMP_IMPLEMENTATION
#include "smp.h"
#include "smp_nccl.h"
#include "test.h"

#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    (void)test_report;
    smp_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.ddp = SMP_ON;
    smp_status st = smp_init(&cfg);
    MPI_CHECK(st == SMP_OK, "fake-gpu C engine: smp_init", "%s", smp_last_error());
    if (st) { MPI_Finalize(); return 1; }
    enum { N = 1000 };
    float h[N], *d = (float *)smp_nccl_alloc(sizeof h);
    for (int i = 0; i < N; i++) h[i] = (float)(i + smp_rank());
    cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
    smp_tensor t = smp_tensor_1d(d, SMP_F32, N);
    t.device = smp_nccl_device();
    st = smp_all_reduce(&t, &t, SMP_SUM, SMP_WORLD);
    cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    int n = smp_size(), bad = -1;
    for (int i = 0; i < N && bad < 0; i++)
        if (h[i] != (float)(n * i + n * (n - 1) / 2)) bad = i;
    MPI_CHECK(st == SMP_OK && bad < 0, "fake-gpu C engine: a device all-reduce from C", "%s (first wrong element %d)",
              st ? smp_last_error() : "", bad);
    st = smp_nccl_add(d, d, SMP_F32, N);
    MPI_CHECK(st == SMP_ERR_STATE && strstr(smp_last_error(), "nvcc"),
              "fake-gpu C engine: smp_nccl_add from C says it needs nvcc", "status %d: %s", (int)st, smp_last_error());
    smp_nccl_free(d);
    smp_finalize();
    MPI_Finalize();
    return test_exit_code();
}
