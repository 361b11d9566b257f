# smp::nccl: smp::smp plus smp_nccl.h's CUDA runtime and NCCL. Defined only
# where both are found, so a CPU-only machine still configures; a project
# that needs it checks `if(TARGET smp::nccl)` or lists nccl in
# find_package(smp COMPONENTS nccl), which then fails naming what is missing.
# NCCL has no CMake package of its own: look next to the CUDA toolkit, or
# under NCCL_ROOT / NCCL_HOME.
if(NOT TARGET smp::nccl)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(SMP_NCCL_INCLUDE_DIR nccl.h HINTS $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_INCLUDE_DIRS}
              PATH_SUFFIXES include)
    find_library(SMP_NCCL_LIBRARY nccl HINTS $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_DIR}
                 ${CUDAToolkit_LIBRARY_ROOT} PATH_SUFFIXES lib lib64)
  endif()
  if(CUDAToolkit_FOUND AND SMP_NCCL_INCLUDE_DIR AND SMP_NCCL_LIBRARY)
    # SMP_NCCL_SCOPE: GLOBAL in smp's own tree, so a project that adds smp
    # with add_subdirectory sees the target (imported ones are per directory)
    add_library(smp::nccl INTERFACE IMPORTED ${SMP_NCCL_SCOPE})
    if(SMP_NCCL_SCOPE STREQUAL "GLOBAL")
      set_target_properties(CUDA::cudart PROPERTIES IMPORTED_GLOBAL TRUE)
    endif()
    target_include_directories(smp::nccl INTERFACE ${SMP_NCCL_INCLUDE_DIR})
    target_link_libraries(smp::nccl INTERFACE smp::smp CUDA::cudart ${SMP_NCCL_LIBRARY})
    set(smp_nccl_FOUND TRUE)
  else()
    set(smp_nccl_FOUND FALSE)
    if(NOT CUDAToolkit_FOUND)
      set(smp_nccl_NOT_FOUND_MESSAGE "smp::nccl needs the CUDA toolkit, which find_package(CUDAToolkit) did not find (set CUDAToolkit_ROOT)")
    else()
      set(smp_nccl_NOT_FOUND_MESSAGE "smp::nccl needs NCCL (nccl.h and libnccl), not found next to CUDA ${CUDAToolkit_VERSION}: set NCCL_ROOT")
    endif()
  endif()
endif()
