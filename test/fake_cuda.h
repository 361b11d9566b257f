/* fake_cuda.h - run smp's CUDA programs on a machine without a GPU.

   test/fake_cuda.c implements, on the CPU, the parts of the CUDA runtime,
   NCCL and cuBLAS that smp_nccl.h, test_gpu.cu and the CUDA examples call.
   A program compiled by nvcc as usual and linked with `-cudart none` against
   fake_cuda.o instead of libcudart, libnccl and libcublas runs unchanged:

     - "GPUs": FAKE_CUDA_DEVICES per node (default 1), each with its own
       UUID and PCI address, so ranks sharing one are found as on real GPUs.
     - Device memory is host memory behind addresses the CPU cannot
       dereference (bit 62 set: a non-canonical x86-64 address), so host code
       that touches device memory faults as it would on a GPU. Every copy,
       kernel and NCCL call is bounds-checked against its allocation.
     - Streams are queues run by a "device" thread in order; events, waits
       between streams and the legacy default stream's implicit ordering
       follow CUDA. Kernels and copies on ordinary streams run
       FAKE_CUDA_DELAY_US (default 300) late, and high-priority streams
       (smp's) run at once: a missing wait between the engine's stream and
       smp's shows up as stale data. FAKE_CUDA_SLOW=comm turns that round.
     - NCCL communicators are built from the unique id over MPI; collectives
       and point-to-point move over MPI from the device thread, in the
       stream's order, grouped between ncclGroupStart/End. Reductions add in
       rank order, so every rank gets the same bits. ncclGetVersion reports
       FAKE_NCCL_VERSION (default 22800, 2.28.0); for a version NCCL's issue
       1950 affects (2.27 to 2.29.6), an ncclAvg on one rank leaves the last
       elements of a count of 2^18 or more unwritten, as those versions do.
     - Kernels: nvcc's launch stubs call into fake_cuda.c, which runs the
       kernel's host twin - a plain C++ function with the kernel's
       parameters, registered with fake_cuda_twin below. Pointer arguments
       reach the twin already translated to host addresses.

   It is a test double: it checks smp's host logic, ordering and error paths,
   not NCCL's or the GPU's behaviour, and says nothing about speed. */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#include <stddef.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif
/* runs a registered twin: host_fn is the twin, args the launch's argument slots */
typedef void (*fake_cuda_run_fn)(const void *host_fn, void **args);
void fake_cuda_register_twin(const void *kernel_stub, const void *host_fn, int nargs, const size_t *sizes,
                             fake_cuda_run_fn run);
/* for twins: the launch's threads in all (grid x block) and per block */
void fake_cuda_launch_dims(long long *threads, int *per_block);
/* the next NCCL operation this process queues fails its communicator: the
   operation never finishes, and ncclCommGetAsyncError reports ncclRemoteError
   until the communicator is aborted */
void fake_nccl_fail_next(void);
/* how many calls so far waited for the whole device (cudaDeviceSynchronize,
   cudaFree, cudaFreeHost, cudaMallocHost), and the last one's name */
long fake_cuda_device_syncs(void);
const char *fake_cuda_last_device_sync(void);
/* host-to-device copies waited for: by stream s on the device (cudaStreamWaitEvent of s on an event recorded on
   another stream right after a host-to-device copy there), and on the host (cudaMemcpy to the device, and stream, event
   or device synchronisations that found a host-to-device copy they cover unfinished) */
long fake_cuda_h2d_device_waits(cudaStream_t s);
long fake_cuda_h2d_host_waits(void);
/* the most device memory (not pinned host memory) allocated at once since the last reset; reset_peak starts a new
   one from what is allocated now */
long long fake_cuda_device_bytes(int reset_peak);
/* the host address behind a device pointer (host pointers come back as they are) */
void *fake_cuda_host_ptr(const void *p);
#ifdef __cplusplus
}

#include <type_traits>
#include <utility>

template <typename T> static T fake_cuda_arg(void *slot) {
    T v = *(T *)slot;
    if constexpr (std::is_pointer<T>::value) v = (T)fake_cuda_host_ptr((const void *)v);
    return v;
}
template <typename... A, size_t... I>
static void fake_cuda_call(const void *host_fn, void **args, std::index_sequence<I...>) {
    ((void (*)(A...))host_fn)(fake_cuda_arg<A>(args[I])...);
    (void)args;
}
template <typename... A> static void fake_cuda_run(const void *host_fn, void **args) {
    fake_cuda_call<A...>(host_fn, args, std::index_sequence_for<A...>{});
}
/* fake_cuda_twin(kernel, host_function): both take the same parameters */
template <typename... A> static void fake_cuda_twin(void (*kernel)(A...), void (*host)(A...)) {
    static const size_t sizes[sizeof...(A) + 1] = {sizeof(A)..., 0};
    fake_cuda_register_twin((const void *)kernel, (const void *)host, (int)sizeof...(A), sizes, fake_cuda_run<A...>);
}
#endif
#endif
