/* smp_nccl.h - the device backend of smp: CUDA tensors over NCCL.

   Including this header (after smp.h, in the file that defines
   SMP_IMPLEMENTATION too) registers a device backend: collectives and
   pipeline transfers of tensors whose `device` is a CUDA ordinal then move
   over NCCL on a stream the runtime owns, while host tensors keep moving
   over MPI. Ranks sharing one GPU (which NCCL refuses) move device memory
   through pinned host buffers over MPI instead.

   USAGE
       #define SMP_IMPLEMENTATION
       #include "smp.h"
       #include "smp_nccl.h"
       #include "smp_pipeline.h"
       ...
       smp_init(&cfg);
       cudaSetDevice(smp_local_rank());   // as the reference scripts do

   BUILD
       nvcc -ccbin mpicxx prog.cu -o prog -lnccl

   STATUS
       This header holds the backend's interface only; the implementation
       arrives with the CUDA/NCCL issue. Until then smp reports device
       tensors as an error ("no device backend is registered").
*/
#ifndef SMP_NCCL_H
#define SMP_NCCL_H
#include "smp.h"
#endif
