# smp - build, test, benchmark, install.  `make test` and `make demo` start
# with `make deps`, so on a fresh Debian machine each is one command.

HEADERS   := smp.h smp_nccl.h smp_pipeline.h smp_checkpoint.h
# the version the pkg-config files carry: smp.h's
SMP_VERSION := $(shell sed -n 's/^#define SMP_VERSION_STRING "\(.*\)"/\1/p' smp.h)
PREFIX    ?= /usr/local
NP        ?= 2
CSTD      := -std=c11
WARN      := -Wall -Wextra -Werror
# the tests' gcc build; -g would add a third to its compile time (make CFLAGS='-O2 -g' for a debugger)
CFLAGS    ?= -O2
INCLUDES  := -I. -Itest
LDLIBS    := -lm
# Tests that run in one process, and tests run under mpirun -n 1 and 2 (and
# 4: MPI4_TESTS).
UNIT_TESTS := test_config test_schedule test_autopart test_ckpt_file
MPI_TESTS  := test_topology test_collectives test_model test_pipeline test_ddp test_checkpoint test_ckpt_nomem test_ckpt_threads test_device test_tied test_composite test_chaos test_mpi_errors test_seeds test_memory test_zero test_port test_tp test_alloc test_ckpt_tp test_tp_chaos test_tp_batch
# The MPI tests whose 4-rank runs reach what 1 and 2 ranks cannot. At 2
# ranks a pipeline stage is first or last and a group is the world or one
# rank; 4 ranks bring 4 stages (middle stages, which both receive and send),
# 2 partitions x 2 replicas (MP_GROUP and DP_GROUP both of 2, apart from the
# world and each other) and 4 replicas. 4 ranks on 2 cores cost more than 2
# (less since test/mpi_yield_shim.c), so a new test goes here only for such
# a reason:
#   test_topology     cluster and spread placement differ only when both
#                     groups have more than one rank
#   test_collectives  every collective on MP_GROUP and DP_GROUP as
#                     sub-communicators, and on a world of 4
#   test_model        auto partitioning into 4, the 4-rank memory budget
#   test_pipeline     4 stages, every schedule (a V of 8)
#   test_ddp          2x2 and 4 replicas' buckets
#   test_checkpoint   resharding to and from 4 partitions and 2x2, partial
#                     saves written by dp rank 0 of each partition
#   test_ckpt_nomem   out of memory on a replica that writes nothing (2x2)
#   test_device       4 stages through the device backend's point to point
#   test_tied         the tied module's copies with partitions between them
#   test_composite    4 partitions, V placements over 4 ranks
#   test_chaos        failures injected on a random rank of a 2x2 job
#   test_mpi_errors   an MPI failure at each call of a 4-stage step (the
#                     tied model's copies with a partition between them),
#                     4 replicas' buckets
#   test_seeds        dropout and a retried out-of-memory pass on 2x2
#   test_tp           2 stages of 2 shards (PP_GROUP, TP_GROUP both of 2)
#   test_zero         4 replicas' pieces (at 2 a sum in rank order is any
#                     order), 2 stages x 2 replicas sharded
#   test_ckpt_tp      checkpoints saved at 2 stages of 2 shards, resumed at
#                     tp 4 and at pp 1 x tp 1, 2
#   test_tp_chaos     failures injected into 2 stages of 2 shards (a TP
#                     peer's failure meets the pipeline's notices)
#   test_tp_batch     prescaled_batch false at pp 2 x tp 2 (1F1B, zero
#                     bubble) and tp 2 x rdp 2 (DDP): joined batches in a
#                     pipeline and across replicas
#   test_port         the buffers promised zeroed and smp_init_copy on 2
#                     stages x 2 replicas (DDP), the global mean of 4
#                     replicas' losses
# (test_ckpt_threads is not: its I/O thread runs on world rank 0 whatever
# the world, and ThreadSanitizer runs it at 1 and 2.) The gcc build runs at
# 4 those of MPI4_TESTS that the ASan build does not (ASAN4_TESTS): the
# same checks, once each at 4 ranks.
MPI4_TESTS := test_topology test_collectives test_model test_pipeline test_ddp test_checkpoint test_ckpt_nomem test_device test_tied test_composite test_chaos test_mpi_errors test_seeds test_tp test_zero test_ckpt_tp test_tp_chaos test_tp_batch test_port
SCRIPT_TESTS := test/run_timeout.sh test/run_exit.sh test/run_large.sh test/test_install.sh test/test_demo.sh test/test_gpt.sh test/run_fuzz.sh test/run_hosts.sh test/test_minimal.sh test/test_docs.sh test/run_mpi_errors.sh test/run_ckpt_order.sh
# Built with the tests, run by a script.
HELPER_TESTS := test_timeout test_exit test_large test_hosts test_ckpt_order
# Under AddressSanitizer + UBSan at 4 ranks in make test: the whole of
# MPI_TESTS there takes 6 minutes on 2 quiet cores (11 under load), so a
# subset whose 4-rank runs reach what 1 and 2 ranks cannot: 2 partitions x 2
# replicas (DP and MP groups both of 2) in test_ddp, test_checkpoint
# (partial saves by dp rank 0 of each partition, resharding) and test_chaos
# (failures injected on a random rank: the error and cleanup paths), 4
# pipeline stages in test_pipeline, and test_model, and test_mpi_errors (an
# MPI failure at each call of a 4-stage step, 4 replicas' buckets: about a
# minute). `make test-asan` runs all of MPI_TESTS at 1, 2 and 4 ranks.
ASAN4_TESTS := test_model test_pipeline test_ddp test_checkpoint test_chaos test_mpi_errors
# The script tests under the sanitizers: those that take build/asan, and the
# example-based ones on build/examples-asan. (run_fuzz.sh is sanitized
# already; run_hosts.sh preloads a shim that ASan's link-order check refuses
# and runs on build/examples/gpt; test_install.sh builds its own program.)
# (run_large.sh is not: its 2 GiB messages cost 290 CPU-seconds under ASan
# against 126 under gcc, and the sanitizers would check nothing more: smp
# moves them with a derived MPI type in uninstrumented MPICH, and
# test_collectives runs host collectives in 300-element pieces under ASan.)
ASAN_SCRIPT_TESTS := test/run_timeout.sh test/run_exit.sh test/test_demo.sh test/test_gpt.sh test/run_mpi_errors.sh
# Under ThreadSanitizer at 1 and 2 ranks: the checkpoint I/O thread, the one
# thread smp runs besides the caller's. UCX's memory hooks intercept the
# madvise a thread makes as it exits and crash TSan's interceptors there, so
# they are off (UCX_MEM_EVENTS=no); MPICH itself reports no race, and no
# suppression is needed.
TSAN_TESTS := test_ckpt_threads
TSAN_ENV := UCX_MEM_EVENTS=no TSAN_OPTIONS=second_deadlock_stack=1 SMP_SANITIZER_LOGS=1
ASAN_ENV := ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
            SMP_SANITIZER_LOGS=1 SMP_EXAMPLES=$(CURDIR)/build/examples-asan
BENCHES    := collectives partition schedule ddp checkpoint fmnist gpt gpt-cuda nccl recompute memory tp overhead

CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc

.PHONY: all deps test test-large test-hosts test-quick test-asan build-gcc build-clang build-asan build-strict bench install clean examples examples-asan demo demo-gpt fuzz cuda test-gpu test-fake-gpu
all: build-gcc

deps:
	@bash tools/deps.sh

# ---------------------------------------------------------------- builds
# One build directory per compiler/sanitizer variant.
define variant
build/$(1)/%: test/%.c $(HEADERS) test/test.h test/net7.h test/net7_train.h test/linear_ref.h test/tp_mlp.h Makefile | build/$(1)
	MPICH_CC=$(2) mpicc $(CSTD) $(WARN) $(3) $(INCLUDES) $$< -o $$@ $(LDLIBS)
build/$(1):
	@mkdir -p $$@
build-$(1): $(addprefix build/$(1)/,$(UNIT_TESTS) $(MPI_TESTS) $(HELPER_TESTS))
endef
$(eval $(call variant,gcc,gcc,$(CFLAGS)))
$(eval $(call variant,clang,clang,$(CFLAGS)))
# (a variable: a comma inside $(call ...) would split the argument)
# -g1: line tables, all a sanitizer's report needs (file:line per frame), at three quarters of -g's compile time
SANFLAGS  := -O1 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
$(eval $(call variant,asan,gcc,$(SANFLAGS)))
TSANFLAGS := -O1 -g1 -fsanitize=thread
$(eval $(call variant,tsan,gcc,$(TSANFLAGS)))
# test_alloc runs the examples' models, whose kernels call OpenBLAS
define blas_test
build/$(1)/test_alloc: test/test_alloc.c $(HEADERS) test/test.h examples/gpt_model.h examples/fmnist_model.h \
                       examples/mlp_engine.h Makefile | build/$(1)
	MPICH_CC=$(2) mpicc $(CSTD) $(WARN) $(3) $(INCLUDES) $$< -o $$@ -lopenblas $(LDLIBS)
endef
$(eval $(call blas_test,gcc,gcc,$(CFLAGS)))
$(eval $(call blas_test,clang,clang,$(CFLAGS)))
$(eval $(call blas_test,asan,gcc,$(SANFLAGS)))
$(eval $(call blas_test,tsan,gcc,$(TSANFLAGS)))
# make test runs no clang binary: it compiles the suite under clang with
# -fsyntax-only (a stamp file), 0.3 s a file against 12 s for a binary.
# clang's warnings all come from its front end (parsing and semantic
# analysis, the uninitialised-use analysis included), so they are those of
# the -O2 build; build-clang builds the binaries, to run.
build/clang/%.warnings: test/%.c $(HEADERS) test/test.h test/net7.h test/net7_train.h test/linear_ref.h test/tp_mlp.h Makefile | build/clang
	MPICH_CC=clang mpicc -c -fsyntax-only $(CSTD) $(WARN) $(CFLAGS) $(INCLUDES) $< && touch $@
check-clang: $(addprefix build/clang/,$(addsuffix .warnings,$(UNIT_TESTS) $(MPI_TESTS) $(HELPER_TESTS)))
# Preloaded by test/run.sh: ranks oversubscribing the cores yield in MPICH's waits.
build/shim/mpi_yield.so: test/mpi_yield_shim.c Makefile
	@mkdir -p build/shim
	gcc -std=c11 $(WARN) -O2 -shared -fPIC $< -o $@ -ldl
# The headers compile as C99 too (the suite itself is C11).
build/c99/headers.o: test/c99_headers.c $(HEADERS) Makefile
	@mkdir -p build/c99
	MPICH_CC=gcc mpicc -std=c99 $(WARN) -pedantic -I. -c $< -o $@
	MPICH_CC=clang mpicc -std=c99 $(WARN) -pedantic -I. -c $< -o $@.clang

# The headers as an engine with strict warnings and -Werror includes them
# (test/strict_headers.c), under gcc and clang, with and without SMP_TESTING,
# and a test and the README's minimal program with the same flags. Compiled,
# not linked or run: a warning fails make test. smp_nccl.h is in where the
# CUDA and NCCL headers are (it needs only their declarations from C).
# Under clang they are compiled with -fsyntax-only, its warnings being its
# front end's (above: check-clang); gcc's need the optimiser (-O2), which
# finds what -Wmaybe-uninitialized and the like report.
STRICT_WARN := $(WARN) -Wconversion -Wsign-conversion -Wcast-qual -Wdouble-promotion -Wshadow -Wpedantic
STRICT_NCCL := $(if $(and $(wildcard $(CUDA_HOME)/include/cuda_runtime_api.h),$(wildcard $(CUDA_HOME)/include/nccl.h)),-DSMP_STRICT_NCCL -I$(CUDA_HOME)/include)
STRICT_OUT_gcc = -o $@
STRICT_OUT_clang = -fsyntax-only && touch $@
STRICT_OBJS :=
define strict
build/strict/headers_$(1).o: test/strict_headers.c $(HEADERS) Makefile | build/strict
	MPICH_CC=$(1) mpicc $(CSTD) $(STRICT_WARN) -O2 -I. $(STRICT_NCCL) -c $$< $$(STRICT_OUT_$(1))
build/strict/headers_testing_$(1).o: test/strict_headers.c $(HEADERS) Makefile | build/strict
	MPICH_CC=$(1) mpicc $(CSTD) $(STRICT_WARN) -O2 -DSMP_TESTING -I. $(STRICT_NCCL) -c $$< $$(STRICT_OUT_$(1))
build/strict/test_chaos_$(1).o: test/test_chaos.c $(HEADERS) test/test.h test/net7.h test/net7_train.h test/linear_ref.h Makefile | build/strict
	MPICH_CC=$(1) mpicc $(CSTD) $(STRICT_WARN) -O2 $(INCLUDES) -c $$< $$(STRICT_OUT_$(1))
build/strict/minimal_$(1).o: examples/minimal.c $(HEADERS) Makefile | build/strict
	MPICH_CC=$(1) mpicc $(CSTD) $(STRICT_WARN) -O2 -I. -c $$< $$(STRICT_OUT_$(1))
STRICT_OBJS += $(addprefix build/strict/,headers_$(1).o headers_testing_$(1).o test_chaos_$(1).o minimal_$(1).o)
endef
$(eval $(call strict,gcc))
$(eval $(call strict,clang))
build/strict:
	@mkdir -p $@
build-strict: $(STRICT_OBJS)
	@$(if $(STRICT_NCCL),true,echo "build-strict: smp_nccl.h not checked: no cuda_runtime_api.h and nccl.h under CUDA_HOME=$(CUDA_HOME)")

# ---------------------------------------------------------------- tests
# Everything: warnings as errors under gcc and clang (the strict set too:
# build-strict), the suite at 1 and 2 ranks and MPI4_TESTS at 4 (the fuzzers
# included), then again under AddressSanitizer + UBSan at 1 and 2 ranks,
# ASAN4_TESTS at 4 and the script tests, and TSAN_TESTS under
# ThreadSanitizer; a sanitizer report anywhere is a FAIL (test/run.sh,
# SMP_SANITIZER_LOGS).
#
# The builds run in parallel (-j$(TEST_JOBS)): first what the gcc sections
# need, then the rest at nice 19 while those sections run, in the CPU time
# their tests leave (a rank waiting, one-process runs, Python), the nvcc
# builds (the longest) first. After the gcc section of 1 and 2 ranks that
# background make and its compilers are stopped (a loaded machine would
# starve them; it is a process group of its own, setsid, so that none
# outlives it to write a file the next make builds) and a make at normal
# priority finishes what it left. The 4-rank runs come after it: with 4
# ranks on 2 cores a rank waiting for a message yields its core, and a
# compiler beside them takes the core for a whole time slice, which made
# them 3 to 5 times slower. The sections run one after the other
# (MPI ranks on 2 cores must not compete), each printing its wall time, and
# a line of all of them ends the output before the count.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
TEST_BUILD_FIRST = build/shim/mpi_yield.so build-gcc $(addprefix build/examples/,$(EXAMPLES))
TEST_BUILD_REST = cuda build-asan examples-asan check-clang build-strict $(addprefix build/tsan/,$(TSAN_TESTS)) build/c99/headers.o
test: deps
	@t0=$$(date +%s); times=""; fails=0; \
	$(MAKE) --no-print-directory -j$(TEST_JOBS) $(TEST_BUILD_FIRST) || exit 1; \
	times="builds for gcc $$(($$(date +%s) - t0)) s"; t0=$$(date +%s); \
	setsid nice -n 19 $(MAKE) --no-print-directory -j$(TEST_JOBS) $(TEST_BUILD_REST) \
	  >build/test-build.log 2>&1 & rest=$$!; \
	trap 'kill -TERM -$$rest 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	section() { \
	  short=$$1; log=$$2; echo "== $$3"; shift 3; s=$$(date +%s); \
	  "$$@" >$$log 2>&1 || fails=$$((fails + 1)); cat $$log; \
	  echo "   ($$short: $$(($$(date +%s) - s)) s)"; times="$$times, $$short $$(($$(date +%s) - s)) s"; \
	}; \
	section "gcc 1-2 ranks and scripts" build/test-gcc.log "gcc build, mpirun -n 1, 2 and the script tests" \
	  test/run.sh build/gcc "$(UNIT_TESTS)" "$(MPI_TESTS)" "$(SCRIPT_TESTS)" "1 2"; \
	kill -TERM -$$rest 2>/dev/null; { wait $$rest; } 2>/dev/null; trap - EXIT; t1=$$(date +%s); \
	echo "== the other builds: what the background left, at full priority (make deletes what it was killed in)"; \
	$(MAKE) --no-print-directory -j$(TEST_JOBS) $(TEST_BUILD_REST) >>build/test-build.log 2>&1 || \
	  { tail -n 40 build/test-build.log; echo "make test: a build failed (build/test-build.log)"; exit 1; }; \
	echo "   (other builds: $$(($$(date +%s) - t0)) s since the gcc section started," \
	  "$$(($$(date +%s) - t1)) s after it)"; \
	times="$$times, other builds $$(($$(date +%s) - t1)) s after the gcc section"; \
	section "gcc 4 ranks" build/test-gcc4.log "gcc build, mpirun -n 4 ($(filter-out $(ASAN4_TESTS),$(MPI4_TESTS)))" \
	  test/run.sh build/gcc "" "$(filter-out $(ASAN4_TESTS),$(MPI4_TESTS))" "" "4"; \
	section "asan 1-2 ranks" build/test-asan.log "AddressSanitizer + UBSan build, mpirun -n 1, 2" \
	  env $(ASAN_ENV) test/run.sh build/asan "$(UNIT_TESTS)" "$(MPI_TESTS)" "" "1 2"; \
	section "asan 4 ranks and scripts" build/test-asan4.log \
	  "AddressSanitizer + UBSan build, mpirun -n 4 ($(ASAN4_TESTS)), and the script tests" \
	  env $(ASAN_ENV) test/run.sh build/asan "" "$(ASAN4_TESTS)" "$(ASAN_SCRIPT_TESTS)" "4"; \
	section "tsan" build/test-tsan.log "ThreadSanitizer build, mpirun -n 1, 2 ($(TSAN_TESTS))" \
	  env $(TSAN_ENV) test/run.sh build/tsan "" "$(TSAN_TESTS)" "" "1 2"; \
	section "cuda" build/test-cuda.log \
	  "CUDA sources (built with nvcc): the GPU suite where a GPU is present, and on the fake CPU device" \
	  test/run.sh build/cuda "" "$$([ -x build/cuda/test_gpu ] && echo test_gpu)" "$(FAKE_CUDA_TESTS)" "1 2"; \
	p=0; f=0; s=0; \
	for l in build/test-gcc.log build/test-gcc4.log build/test-asan.log build/test-asan4.log build/test-tsan.log build/test-cuda.log; do \
	  set -- $$(tail -n1 $$l | tr -d ','); p=$$((p + $$1)); f=$$((f + $$3)); s=$$((s + $${5:-0})); done; \
	echo; echo "wall times: $$times"; \
	echo; if [ $$s -gt 0 ]; then echo "$$p passed, $$f failed, $$s skipped"; else echo "$$p passed, $$f failed"; fi; \
	[ $$fails -eq 0 ]

# The whole suite under AddressSanitizer + UBSan: every MPI test at 1, 2 and
# 4 ranks and the script tests (make test runs ASAN4_TESTS at 4).
test-asan: deps
	@$(MAKE) --no-print-directory build/shim/mpi_yield.so build-asan examples-asan
	@$(ASAN_ENV) test/run.sh build/asan "$(UNIT_TESTS)" "$(MPI_TESTS)" "$(ASAN_SCRIPT_TESTS)" "1 2 4"

# Messages past 2 GiB; make test runs it too when there is the memory.
test-large: build/gcc/test_large
	@test/run.sh build/gcc "" "" "test/run_large.sh" "1"

# The gcc suite only, for a quick loop while developing. The script tests
# run the examples (test_demo.sh, test_gpt.sh, test_minimal.sh), so they are
# rebuilt too: a stale demo binary would test old headers.
test-quick: build/shim/mpi_yield.so build-gcc examples
	@test/run.sh build/gcc "$(UNIT_TESTS)" "$(MPI_TESTS)" "$(SCRIPT_TESTS)" "1 2 4"

# Two simulated hosts (network namespaces joined by a veth pair, hydra
# starting 2 ranks in each): placement, a training step and a checkpoint
# across hosts, and a host cut off. Needs root and `ip netns`; reports
# skipped with the reason where the machine cannot run it.
test-hosts: build/gcc/test_hosts build/examples/gpt
	@test/run.sh build/gcc "" "" "test/run_hosts.sh"

# ---------------------------------------------------------------- examples and the demo
EXAMPLES := fmnist fmnist_infer gpt minimal gpt_overhead
EXLIBS   := -lopenblas -lz -lm
# -O3 -fno-math-errno vectorises the engine's elementwise loops (ReLU, Adam's
# sqrtf); neither reorders floating-point sums, so results do not change.
EXFLAGS  := -O3 -fno-math-errno -g
EXHDRS   := examples/mlp_engine.h examples/fmnist_model.h examples/fmnist_shared.h examples/memory_peaks.h
build/examples/%: examples/%.c $(HEADERS) $(EXHDRS) | build/examples
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) $(EXFLAGS) -Iexamples -I. $< -o $@ $(EXLIBS)
build/examples/gpt: examples/gpt_model.h examples/gpt_shared.h examples/memory_peaks.h
# the overhead benchmark's program (bench/, not an example), built with them: test_gpt.sh runs its --check
build/examples/gpt_overhead: bench/gpt_overhead.c examples/gpt_model.h examples/mlp_engine.h $(HEADERS) | build/examples
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) $(EXFLAGS) -Iexamples -I. $< -o $@ $(EXLIBS)
build/examples:
	@mkdir -p $@
examples: $(addprefix build/examples/,$(EXAMPLES))
# The same examples under AddressSanitizer + UBSan, for the script tests
# (test_demo.sh, test_gpt.sh with SMP_EXAMPLES=build/examples-asan).
build/examples-asan/%: examples/%.c $(HEADERS) $(EXHDRS) | build/examples-asan
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) $(SANFLAGS) -Iexamples -I. $< -o $@ $(EXLIBS)
build/examples-asan/gpt: examples/gpt_model.h examples/gpt_shared.h examples/memory_peaks.h
build/examples-asan/gpt_overhead: bench/gpt_overhead.c examples/gpt_model.h examples/mlp_engine.h $(HEADERS) | build/examples-asan
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) $(SANFLAGS) -Iexamples -I. $< -o $@ $(EXLIBS)
build/examples-asan:
	@mkdir -p $@
# (not minimal: test_minimal.sh runs only the gcc build)
examples-asan: $(addprefix build/examples-asan/,$(filter-out minimal,$(EXAMPLES)))

# CUDA sources: compiled and linked with nvcc (no GPU needed to build them).
NVFLAGS  := -ccbin mpicxx -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
CUDA_BINS := build/cuda/nccl_allreduce build/cuda/test_gpu build/cuda/fmnist build/cuda/gpt build/bench/nccl
build/cuda/%: examples/%.cu $(HEADERS) | build/cuda
	$(NVCC) $(NVFLAGS) -I. -Iexamples $< -o $@ -lnccl
# Fashion-MNIST on GPUs: the CPU demo's loop with cuBLAS and kernels of its own.
CUDA_MLP := examples/fmnist_cuda.h examples/cuda_engine.h examples/mlp_engine.h examples/fmnist_shared.h \
            examples/memory_peaks.h
build/cuda/fmnist: examples/fmnist.cu $(HEADERS) $(CUDA_MLP) Makefile | build/cuda
	$(NVCC) $(NVFLAGS) -I. -Iexamples $< -o $@ -lcublas -lnccl -lz
# The GPT on GPUs: gpt.c's model, data and loop with cuBLAS and kernels of its own.
CUDA_GPT := examples/gpt_cuda.h examples/cuda_engine.h examples/gpt_model.h examples/gpt_shared.h \
            examples/memory_peaks.h examples/mlp_engine.h
build/cuda/gpt: examples/gpt.cu $(HEADERS) $(CUDA_GPT) Makefile | build/cuda
	$(NVCC) $(NVFLAGS) -I. -Iexamples $< -o $@ -lcublas -lnccl
build/bench/nccl: bench/nccl.cu $(HEADERS) $(CUDA_MLP) Makefile | build/bench
	$(NVCC) $(NVFLAGS) -I. -Iexamples $< -o $@ -lcublas -lnccl -lz
build/cuda/test_gpu: test/test_gpu.cu $(HEADERS) test/test.h test/net7.h test/linear_ref.h | build/cuda
	$(NVCC) $(NVFLAGS) -Xcompiler -ffp-contract=off -I. -Itest $< -o $@ -lnccl
build/cuda:
	@mkdir -p $@
# The same CUDA programs on test/fake_cuda.c, a CPU stand-in for the CUDA
# runtime, NCCL and cuBLAS (-cudart none): smp_nccl.h's logic runs without a GPU.
FAKE_BINS := build/fake/test_gpu build/fake/fake_faults build/fake/nccl_allreduce build/fake/test_gpu_asan build/fake/fmnist build/fake/gpt build/fake/bench_nccl build/fake/c_engine
# The script tests of the fake device (make test's CUDA section).
FAKE_CUDA_TESTS := test/run_fake_cuda.sh test/test_fake_fmnist.sh test/test_fake_gpt.sh
FAKE_FLAGS := $(NVFLAGS) -Xcompiler -ffp-contract=off -cudart none -I. -Itest
build/fake/fake_cuda.o: test/fake_cuda.c test/fake_cuda.h Makefile | build/fake
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) -O2 -g -I$(CUDA_HOME)/include -Itest -c $< -o $@
	MPICH_CC=clang mpicc $(CSTD) $(WARN) -O2 -I$(CUDA_HOME)/include -Itest -c $< -o $@.clang
build/fake/test_gpu: test/fake_test_gpu.cu test/test_gpu.cu test/fake_twins.h build/fake/fake_cuda.o $(HEADERS) test/test.h test/net7.h test/linear_ref.h | build/fake
	$(NVCC) $(FAKE_FLAGS) $< build/fake/fake_cuda.o -o $@ -lpthread
build/fake/fake_faults: test/fake_faults.cu test/fake_twins.h build/fake/fake_cuda.o $(HEADERS) test/test.h | build/fake
	$(NVCC) $(FAKE_FLAGS) $< build/fake/fake_cuda.o -o $@ -lpthread
build/fake/nccl_allreduce: test/fake_nccl_allreduce.cu examples/nccl_allreduce.cu test/fake_twins.h build/fake/fake_cuda.o $(HEADERS) | build/fake
	$(NVCC) $(FAKE_FLAGS) -Iexamples $< build/fake/fake_cuda.o -o $@ -lpthread
build/fake/fmnist: test/fake_fmnist.cu examples/fmnist.cu $(CUDA_MLP) test/fake_fmnist_twins.h test/fake_engine_twins.h test/fake_twins.h build/fake/fake_cuda.o $(HEADERS) | build/fake
	$(NVCC) $(FAKE_FLAGS) -Iexamples $< build/fake/fake_cuda.o -o $@ -lpthread -lz
build/fake/gpt: test/fake_gpt.cu examples/gpt.cu $(CUDA_GPT) test/fake_gpt_twins.h test/fake_engine_twins.h test/fake_twins.h build/fake/fake_cuda.o $(HEADERS) | build/fake
	$(NVCC) $(FAKE_FLAGS) -Iexamples $< build/fake/fake_cuda.o -o $@ -lpthread
build/fake/bench_nccl: test/fake_bench_nccl.cu bench/nccl.cu $(CUDA_MLP) test/fake_fmnist_twins.h test/fake_engine_twins.h test/fake_twins.h build/fake/fake_cuda.o $(HEADERS) | build/fake
	$(NVCC) $(FAKE_FLAGS) -Iexamples $< build/fake/fake_cuda.o -o $@ -lpthread -lz
build/fake/c_engine: test/fake_c_engine.c build/fake/fake_cuda.o $(HEADERS) test/test.h | build/fake
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) -O2 -I. -Itest -I$(CUDA_HOME)/include $< build/fake/fake_cuda.o -o $@ -lpthread -lm
	MPICH_CC=clang mpicc $(CSTD) $(WARN) -O2 -I. -Itest -I$(CUDA_HOME)/include $< build/fake/fake_cuda.o -o $@.clang -lpthread -lm
# and the GPU suite again under AddressSanitizer + UBSan (nvcc compiles, mpicxx links the sanitizers)
build/fake/fake_cuda_asan.o: test/fake_cuda.c test/fake_cuda.h Makefile | build/fake
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) $(SANFLAGS) -I$(CUDA_HOME)/include -Itest -c $< -o $@
build/fake/test_gpu_asan: test/fake_test_gpu.cu test/test_gpu.cu test/fake_twins.h build/fake/fake_cuda_asan.o $(HEADERS) test/test.h test/net7.h test/linear_ref.h | build/fake
	$(NVCC) $(NVFLAGS) -g -Xcompiler -ffp-contract=off,-fsanitize=address,-fsanitize=undefined,-fno-omit-frame-pointer,-fno-sanitize-recover=undefined \
	  -cudart none -I. -Itest -c $< -o $@.o
	mpicxx -fsanitize=address,undefined $@.o build/fake/fake_cuda_asan.o -o $@ -lpthread
build/fake:
	@mkdir -p $@
cuda:
	@if [ -x "$(NVCC)" ]; then $(MAKE) --no-print-directory $(CUDA_BINS) $(FAKE_BINS); else echo "SKIP: cuda: nvcc not found at $(NVCC)"; fi
examples: cuda
# The GPU suite: every collective on device memory, NCCL and host-staged;
# prints "skipped: no GPU" where there is none.
test-gpu: cuda
	@test/run.sh build/cuda "" "test_gpu" "" "1 2 4"
# The GPU suite on the fake CPU device, in its variants (test/run_fake_cuda.sh).
test-fake-gpu: cuda build/examples/gpt
	@test/run.sh build/cuda "" "" "$(FAKE_CUDA_TESTS)"

# The main job: Fashion-MNIST on NP processes, 2 partitions (x replicas with NP=4).
demo: deps
	@$(MAKE) --no-print-directory build/examples/fmnist
	mpirun -n $(NP) build/examples/fmnist --partitions 2 $(if $(filter-out 1 2,$(NP)),--ddp) --checkpoint build/fmnist.safetensors $(DEMO_ARGS)

# The GPT example: a character-level transformer on Debian's fortunes, 2
# pipeline stages on NP processes (x replicas with NP=4, or x 2 shards of every
# layer with NP=4 DEMO_ARGS="--tp 2"), about 3 minutes on 2 cores; the checkpoint is
# nanoGPT's file at any --tp.
demo-gpt: deps
	@$(MAKE) --no-print-directory build/examples/gpt
	mpirun -n $(NP) build/examples/gpt --partitions 2 $(if $(filter-out 1 2,$(NP)),--ddp) \
	  --save build/gpt.safetensors $(DEMO_ARGS)

# ---------------------------------------------------------------- benchmarks
build/bench/%: bench/%.c $(HEADERS) | build/bench
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) -O2 $(INCLUDES) $< -o $@ $(LDLIBS)
build/bench:
	@mkdir -p $@
bench: $(addprefix bench-,$(BENCHES))
bench-collectives: build/bench/collectives
	mpirun -n 2 build/bench/collectives
bench-partition: build/bench/partition
	build/bench/partition
bench-ddp: build/bench/ddp
	mpirun -n 2 build/bench/ddp
bench-schedule: build/bench/schedule
	mpirun -n 2 build/bench/schedule
	mpirun -n 4 build/bench/schedule
bench-fmnist: build/examples/fmnist
	bash bench/fmnist.sh
# The GPT example: 2 pipeline partitions (each schedule) against one process,
# the best one process does on 2 cores, DDP; pipelined generation (~4 min);
# build/bench/simulate gives the best schedule's bound from its timeline.
bench-gpt: build/examples/gpt build/bench/simulate
	bash bench/gpt.sh
# gpt.cu through smp against the same kernels in a plain loop, on the fake
# device (BIN=build/cuda/gpt on a GPU).
bench-gpt-cuda: build/fake/gpt
	bash bench/gpt_cuda.sh
bench-memory: build/examples/gpt build/fake/fmnist build/fake/gpt
	bash bench/memory.sh
# Tensor parallelism: the GPT at width 384, --tp 2 against one process on the same 2 cores.
bench-tp: build/examples/gpt
	bash bench/tp.sh
# smp at one process against the GPT's own kernels in a plain loop (issue 28)
bench-overhead: build/examples/gpt_overhead
	mpirun -n 1 build/examples/gpt_overhead
bench-checkpoint: build/bench/checkpoint
	mpirun -n 2 build/bench/checkpoint
# Activation recomputation on a 12-block composite model (OpenBLAS linears).
build/bench/recompute: bench/recompute.c $(HEADERS) Makefile | build/bench
	MPICH_CC=gcc mpicc $(CSTD) $(WARN) -O2 $(INCLUDES) $< -o $@ -lopenblas -lm
bench-recompute: build/bench/recompute
	mpirun -n 2 build/bench/recompute
# smp against raw NCCL on GPUs: 2 ranks where there are 2 GPUs (NCCL takes
# one GPU per rank), else 1 rank (the all-reduce part only); BENCH_NCCL_NP
# overrides. Without nvcc or a GPU it says "skipped" and succeeds.
bench-nccl:
	@if [ ! -x "$(NVCC)" ]; then echo "skipped: bench-nccl: nvcc not found at $(NVCC)"; exit 0; fi; \
	$(MAKE) --no-print-directory build/bench/nccl || exit 1; \
	gpus=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); \
	np=$${BENCH_NCCL_NP:-$$([ "$${gpus:-0}" -ge 2 ] && echo 2 || echo 1)}; \
	echo "mpirun -n $$np build/bench/nccl"; mpirun -n $$np build/bench/nccl

# The libFuzzer harnesses (checkpoint header parser, config JSON reader) for
# longer than make test's 20 s: FUZZ_SECONDS in all (default 600), split
# evenly; FUZZ_TARGETS=config (or ckpt) runs one.
fuzz:
	FUZZ_SECONDS=$${FUZZ_SECONDS:-600} bash test/run_fuzz.sh

# ---------------------------------------------------------------- install
install:
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 $(HEADERS) $(DESTDIR)$(PREFIX)/include/
	@mpi_cflags="$$(mpicc -show -c | cut -d' ' -f2- | tr ' ' '\n' | grep -E '^-I' | tr '\n' ' ')"; \
	mpi_libs="$$(mpicc -show | tr ' ' '\n' | grep -E '^-(L|l|Wl)' | tr '\n' ' ')"; \
	printf 'prefix=%s\nincludedir=$${prefix}/include\n\nName: smp\nDescription: header-only pipeline and data parallel runtime over MPI\nVersion: $(SMP_VERSION)\nCflags: -I$${includedir} %s\nLibs: %s -lm\n' \
	  "$(PREFIX)" "$$mpi_cflags" "$$mpi_libs" > $(DESTDIR)$(PREFIX)/lib/pkgconfig/smp.pc; \
	printf 'prefix=%s\ncuda=%s\n\nName: smp-nccl\nDescription: smp device backend over CUDA and NCCL\nVersion: $(SMP_VERSION)\nRequires: smp\nCflags: -I$${cuda}/include\nLibs: -L$${cuda}/lib64 -lnccl -lcudart\n' \
	  "$(PREFIX)" "$(CUDA_HOME)" > $(DESTDIR)$(PREFIX)/lib/pkgconfig/smp-nccl.pc
	@if command -v cmake >/dev/null 2>&1; then \
	  mkdir -p build && cmake -S . -B build/cmake-install >build/cmake-install.log 2>&1 && \
	  DESTDIR="$(DESTDIR)" cmake --install build/cmake-install --prefix "$(PREFIX)" >>build/cmake-install.log 2>&1 || \
	  { echo "install: cmake failed (build/cmake-install.log):"; tail -n 5 build/cmake-install.log; exit 1; }; \
	  echo "installed smp headers, smp.pc, smp-nccl.pc and lib/cmake/smp (find_package(smp)) under $(DESTDIR)$(PREFIX)"; \
	else echo "installed smp headers and smp.pc, smp-nccl.pc under $(DESTDIR)$(PREFIX) (no cmake here: no lib/cmake/smp)"; fi

clean:
	rm -rf build
