/* smp_checkpoint.h - checkpoints for smp: models and named tensors in safetensors.

   Two layers. MODEL CHECKPOINTS (smp_save / smp_load, first below) save and
   load a partitioned model with its optimizer state, over MPI, partial or
   full, into any partitioning. They are built on the FILE LAYER (further
   below), which writes and reads one safetensors file of named tensors,
   crash-safely and with a checksum per tensor.

   USAGE
     In exactly one C file:
         #define SMP_IMPLEMENTATION
         #include "smp_checkpoint.h"      // includes smp.h
     Everywhere else include "smp_checkpoint.h" for the declarations only.
     Build: mpicc -std=c11 -O2 prog.c -o prog -lm   (POSIX + libc + pthreads, no zlib)

   MODEL CHECKPOINTS (the reference's smp.save / smp.load)
         // the model is partitioned: after smp_model_trace(model, ...) or a step
         smp_optimizer *opt;                       // smp.DistributedOptimizer
         smp_optimizer_new(model, &opt);
         for (i = 0; (p = smp_model_local_param(model, i, false)); i++)   // local ones
             smp_optimizer_state_add(opt, smp_param_name(p), "exp_avg", &exp_avg[i]);
         smp_optimizer_state_add(opt, NULL, "step", &step);         // whole optimizer

         const char *keys[] = {"epoch", "step"}, *vals[] = {"3", "12000"};
         smp_save_desc sd;
         memset(&sd, 0, sizeof sd);                   // zero: partial, as in the reference
         sd.optimizer = opt;
         sd.meta_keys = keys; sd.meta_values = vals; sd.nmeta = 2;
         if (smp_save(model, "/ckpt/model", &sd) != SMP_OK)   // every rank calls it
             fprintf(stderr, "%s\n", smp_last_error());        // same error on every rank

         smp_load_desc ld;
         memset(&ld, 0, sizeof ld);                   // zero: partial
         ld.optimizer = opt;
         if (smp_load(model, "/ckpt/model", &ld) != SMP_OK) ... // model unchanged
     sd.partial = SMP_OFF (and ld.partial = SMP_OFF) makes one full file,
     "/ckpt/model", which Python's safetensors opens as the whole model under
     the PyTorch module's dotted names ("layers.3.mlp.fc1.weight").

     Files. Partial: "<path>.g<N>_<mp_rank>", one per partition, written by
     dp rank 0 of each, and the manifest "<path>.manifest", written by world
     rank 0, which commits them (see Crash safety); N, the generation, counts
     the partial saves to `path`, and the folder must be the same on every
     rank (one machine, or a shared file system). Full: "<path>", written by
     world rank 0's partition saver, which receives the others' tensors in
     chunk_bytes pieces (4 MiB; at most 8 in flight per rank) and never holds
     the whole model. Tensor names:
     parameters and buffers by their full dotted names; optimizer state as
     "optimizer.<param>.<state>" and "optimizer.<state>" (whole optimizer,
     held by every rank, saved from world rank 0's partition). Entries are
     ordered widest dtype first, so each lies at a multiple of its size.
     Metadata: the user's strings (keys must not start with "smp."), a CRC-32C
     per tensor (smp.checksum.<name>), and smp.format, smp.kind
     (full|partial), smp.partitions, smp.mp_rank and smp.generation
     (partial), smp.save_id and smp.partition.<name> (the partition holding
     each tensor) for resharding and checks. The manifest is JSON:
         {"format": "smp-checkpoint-manifest/1", "kind": "partial",
          "generation": 3, "save_id": "...", "partitions": 2,
          "files": [{"mp_rank": 0, "name": "model.g3_0", "bytes": 1234,
                     "header_crc32c": "crc32c:1a2b3c4d"}, ...]}
     naming each file (in the manifest's folder) with its size and the
     CRC-32C of its length prefix and header, which holds every tensor's
     checksum. smp_ckpt_partial_file gives the file of one partition.

     Resharding. A full checkpoint loads into any partitioning and any number
     of dp replicas; partial checkpoints saved with P partitions load into Q:
     the manifest names P files, every rank opens their headers and takes
     its tensors by name. Optimizer state follows its parameter the same way.

     Tensor parallelism and sharded optimizer state (shard_optimizer_state).
     A full checkpoint holds every tensor whole under its tp = 1 name: each
     partition's saver (tp rank 0, rdp rank 0) gathers the split ones (TP
     slices, owned ranges) whole in host memory first, so it holds its
     partition's split tensors for the length of the save. A partial save at
     tp > 1 writes one file per TP slice of a partition, k = mp_rank =
     pp_rank x tp + tp_rank ("<path>.g<N>_<k>"; the manifest's "partitions"
     and the files' smp.partitions / smp.mp_rank then count files), and with
     sharded state one per replica too, k x rdp + rdp_rank. A piece is stored
     under the tensor's name with the metadata
         smp.shard.<name>  {"shape":[16,8],"axis":0,"parts":2,"index":1,
                            "offset":8,"first":0,"count":64}
     (full shape, shard axis, tp degree, slice index and its offset along
     the axis, then elements [first, first + count) of that slice; a
     parameter of smp_param_new_sharded_blocks adds "blocks":B after
     "parts", its slice being slice `index` of each block, joined, and its
     offset the one within a block), and the
     file records smp.pp, smp.pp_rank, smp.tp, smp.tp_rank, smp.rdp_rank.
     Either kind loads at any (pp, tp, dp), sharded or not: each rank copies
     its slice (and owned range) from whichever file tensors hold it. State
     registered with its parameter's local shape follows the parameter's
     slicing; under shard_optimizer_state, state of the owned range's length
     (one dimension) is that range; other state is saved whole. A save whose
     replicas' ranges leave a gap in a parameter, and a checkpoint whose
     pieces do not cover a tensor, are errors naming it on every rank.

     Loading checks everything before it copies anything: that the files are
     the ones the manifest committed (same smp.save_id, generation, partition
     count, size and header checksum), every tensor's name,
     dtype and shape against the model (missing and unexpected tensors are
     errors), and the checksum of every tensor it will load. An error names
     the file and the tensor, reaches every rank, and leaves every parameter,
     buffer and optimizer state as it was. A load without an optimizer
     (ld.optimizer NULL, for inference) skips the files' optimizer state.

     Crash safety: a checkpoint is replaced at one instant, and a crash at
     any other leaves the previous one loadable, bitwise. A full save writes
     "<path>.tmp.<pid>", fsyncs it and renames it over "<path>". A partial
     save writes every file of a new generation, each to a tmp file that is
     fsynced and renamed to "<path>.g<N>_<mp>" (a name no loader follows yet)
     with its folder fsynced; once every rank's file is in place, world rank
     0 writes the manifest naming them to a tmp file, fsyncs it and renames
     it over "<path>.manifest": that rename is the commit. Only then are the
     files the new generation replaced removed (previous generations, files
     of partitions that no longer exist, files of the format below, tmp
     files of killed writers), each after its header shows it is one; a
     crash during the removal leaves the new checkpoint loadable and the
     next save removes the rest. A save that fails (on any rank) before the
     commit removes its new files and returns the error everywhere.

     Out of memory (smp.h's one policy): an allocation that fails anywhere
     in smp_save or smp_load, on any rank, makes the call return
     SMP_ERR_NOMEM there, naming the bytes and what they were for ("out of
     memory: 4096 bytes for the header of checkpoint '...' on rank 1"), and
     SMP_ERR_NOMEM on every other rank with that message after "rank 1: ";
     the previous checkpoint is as it was, no file of the failed save is
     left, and a load changes nothing. What an exchange between ranks fills
     (the plan's exchanges, a full save's ring of chunk buffers) is allocated
     and agreed on before any rank enters it, so no rank fails inside one
     while the others wait. One exception: a partial save that runs out of
     memory after its commit, while removing the files of the generation it
     replaced, returns SMP_OK (the new checkpoint is committed and loads)
     and logs a warning; the next save removes what was left.
     test/test_ckpt_nomem.c fails each allocation of a save and a load in
     turn, on each rank.

     Checkpoints saved before manifests. Partial checkpoints of earlier
     versions, "<path>_0" .. "<path>_<P-1>" without "<path>.manifest", still
     load (their files must share one smp.save_id); the first partial save
     to the same path commits a manifest and then removes them. Where both
     exist, the manifest wins.

     Costs. A partial save writes in parallel and moves no data between
     ranks; its commit adds, on world rank 0, a manifest of about 100 bytes
     per partition (write, fsync, rename) and a folder fsync: two journal
     commits, 1-16 ms per save on a virtual disk (bench/RESULTS.md). A full
     save streams every other partition's bytes to one writer,
     whose I/O thread writes while the next chunks arrive. Loading reads each
     byte twice (a checksum pass, then the copy) through a read-only mapping
     of the files (plain reads where mmap fails), so it costs about two
     memory passes over the data, against one for an unverified read().
     Waits are bounded by smp_timeout(): a full save of a model that takes
     the writer longer than that to write needs a longer timeout.

     State dicts. smp_model_local_state_dict: views of this rank's tensors
     (local_state_dict). smp_model_state_dict: the whole model copied to one
     rank's host memory (state_dict, cpu()); a full smp_save is the way to
     hand a model to a program without smp.

   FILE LAYER: WRITING (the whole file at once)
         float w[6] = {0, 1, 2, 3, 4, 5};
         smp_ckpt_entry e;
         memset(&e, 0, sizeof e);
         e.name = "fc1.weight"; e.dtype = SMP_F32; e.ndim = 2;
         e.shape[0] = 2; e.shape[1] = 3; e.data = w;
         const char *keys[] = {"epoch"}, *vals[] = {"3"};
         if (smp_ckpt_write_file("model.safetensors", &e, 1, keys, vals, 1) != SMP_OK)
             fprintf(stderr, "%s\n", smp_last_error());

   WRITING (streamed: never holds more than one chunk)
         smp_ckpt_writer *w;
         smp_ckpt_writer_open(path, entries, n, keys, vals, nmeta, &w);
         while (more) smp_ckpt_writer_write(w, chunk, chunk_bytes);  // entry order
         smp_ckpt_writer_commit(w);     // or smp_ckpt_writer_abort(w)
     The bytes are the tensors' data back to back in entry order, in any chunk
     sizes. commit() and abort() always free the writer; after a failed write()
     call either of them (commit then returns the earlier error).

   READING
         smp_ckpt_file *f;
         if (smp_ckpt_open("model.safetensors", &f) != SMP_OK) ...  // whole header checked
         const smp_ckpt_info *e = smp_ckpt_find(f, "fc1.weight");   // NULL: not there
         smp_ckpt_read(f, e, w, sizeof w);                         // checksum checked
         const char *epoch = smp_ckpt_meta(f, "epoch");             // NULL: not there
         smp_ckpt_close(f);

   FILE FORMAT (safetensors, opens in Python's `safetensors`): an 8-byte
   little-endian header length N; N bytes of JSON
       {"__metadata__": {"key": "value", ...},
        "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}
   padded with spaces to a multiple of 8; then the raw little-endian data,
   offsets relative to its start. dtype strings: F32 F16 BF16 F64 I32 I64 U8
   BOOL. The writer adds one metadata entry per tensor,
       "smp.checksum.<name>": "crc32c:xxxxxxxx"   (CRC-32C, lowercase hex)
   and the reader checks it whenever a tensor is read in full. Files without
   these entries (written by other tools) read fine, unchecked.

   CRASH SAFETY: the writer writes `<path>.tmp.<pid>` in the same folder,
   fsyncs it, renames it over `path` and fsyncs the folder. A process killed
   at any point leaves `path` as it was (old file) or complete (new file),
   never half-written. A killed writer leaves its tmp file behind; the reader
   never looks at it, and the next writer of the same `path` deletes any
   `<path>.tmp.<pid>` whose process no longer runs on this host.

   CHECKS ON OPEN (each an SMP_ERR_FORMAT naming the file, the tensor and the
   problem): file shorter than 8 bytes, header length beyond the file or over
   100 MB, malformed JSON (strict: no trailing commas, no comments, no
   duplicate keys, valid UTF-8, no \u0000), unknown dtype or key, more than
   SMP_MAX_DIMS dimensions, shape bytes not equal to the offsets' span,
   offsets out of bounds, overlapping, or leaving bytes of the data section
   uncovered, duplicate tensor names, non-string metadata, malformed or
   orphaned smp checksums.

   TEST-ONLY FAULT INJECTION (SMP_CKPT_FAULT, in smp.h's ENVIRONMENT
   VARIABLES with the others; the phases are here), compiled only where
   SMP_TESTING is defined (other builds ignore it): with it set to one of
       header   after the header is in the tmp file, before any data
       data     after the first write() call's bytes are in the tmp file
                (or at commit when there is no data)
       flush    after all data and checksums are written, before fsync
       rename   after the tmp file is fsynced and closed, before the rename
                (in a partial model save: once every other rank's file is
                renamed, so the process dies between the per-rank renames)
       dirsync  after the rename, before the folder is fsynced
   the writer logs "SMP_CKPT_FAULT=<phase>: ..." and calls _exit(77) at that
   point. A partial smp_save adds phases of its own:
       renamed  every rank's file renamed into place, no manifest written
       manifest (world rank 0) the manifest's tmp file complete and fsynced,
                not renamed
       commit   (world rank 0) the manifest renamed into place, the folder
                not yet fsynced
       cleanup  after this rank removed one file that the save replaced
   Set it in the environment of one rank to kill that rank there. Never set
   it outside tests.

   ALIGNMENT: offsets follow entry order and the data section starts at a
   multiple of 8. safetensors' own writer puts the widest dtypes first so
   every tensor sits at a multiple of its element size; order entries the
   same way (8-byte dtypes, then 4, 2, 1) when readers map the file.

   THREADS: use one writer or open file from one thread at a time; call the
   model-level functions from the thread that calls MPI (a full save runs an
   I/O thread of its own, which never calls MPI).
   The host must be little-endian (the data is written as it lies in memory).
*/
#ifndef SMP_CHECKPOINT_H
#define SMP_CHECKPOINT_H

#include "smp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- file layer */

/* One tensor to write: its name (UTF-8, unique, not "__metadata__"), dtype
   and shape; `data` is read only by smp_ckpt_write_file. */
typedef struct smp_ckpt_entry {
    const char *name;
    smp_dtype dtype;
    int ndim;
    int64_t shape[SMP_MAX_DIMS];
    const void *data;
} smp_ckpt_entry;

/* An entry for a host tensor (name is not copied). */
SMPDEF smp_ckpt_entry smp_ckpt_entry_of(const char *name, const smp_tensor *t);

typedef struct smp_ckpt_writer smp_ckpt_writer;

/* Creates the tmp file and writes the header. The entries and metadata are
   copied; metadata keys must not start with "smp.checksum.". */
SMPDEF smp_status smp_ckpt_writer_open(const char *path, const smp_ckpt_entry *entries,
                                       int n, const char *const *meta_keys, const char *const *meta_values,
                                       int nmeta, smp_ckpt_writer **w);
/* Appends data in entry order; any chunk size. More bytes than the entries
   declare is an error. */
SMPDEF smp_status smp_ckpt_writer_write(smp_ckpt_writer *w, const void *bytes, size_t n);
/* Bytes still expected before commit. */
SMPDEF uint64_t smp_ckpt_writer_remaining(const smp_ckpt_writer *w);
/* Patches the checksums, fsyncs, renames over the path, fsyncs the folder;
   frees w. Fewer bytes than declared is an error (and nothing is saved). */
SMPDEF smp_status smp_ckpt_writer_commit(smp_ckpt_writer *w);
/* Deletes the tmp file and frees w; `path` stays as it was. */
SMPDEF void smp_ckpt_writer_abort(smp_ckpt_writer *w);
/* Open, write every entry's data, commit. */
SMPDEF smp_status smp_ckpt_write_file(const char *path, const smp_ckpt_entry *entries, int n,
                                      const char *const *meta_keys, const char *const *meta_values, int nmeta);

/* One tensor of an open file. Strings live as long as the file. */
typedef struct smp_ckpt_info {
    const char *name;
    smp_dtype dtype;
    int ndim;
    int64_t shape[SMP_MAX_DIMS];
    int64_t numel;
    uint64_t offset;   /* from the start of the data section */
    uint64_t nbytes;
    bool has_checksum; /* the file records a CRC-32C for it */
    uint32_t checksum;
} smp_ckpt_info;

typedef struct smp_ckpt_file smp_ckpt_file;

/* Opens and validates the whole header (not the data: see verify_all). */
SMPDEF smp_status smp_ckpt_open(const char *path, smp_ckpt_file **f);
SMPDEF void smp_ckpt_close(smp_ckpt_file *f);
SMPDEF const char *smp_ckpt_path(const smp_ckpt_file *f);
/* Tensors in header order. */
SMPDEF int smp_ckpt_count(const smp_ckpt_file *f);
SMPDEF const smp_ckpt_info *smp_ckpt_info_at(const smp_ckpt_file *f, int i);
/* NULL when absent, with smp_last_error() naming the file and the tensor. */
SMPDEF const smp_ckpt_info *smp_ckpt_find(const smp_ckpt_file *f, const char *name);
/* Metadata in header order (smp's checksum entries included). */
SMPDEF int smp_ckpt_meta_count(const smp_ckpt_file *f);
SMPDEF void smp_ckpt_meta_at(const smp_ckpt_file *f, int i, const char **key, const char **value);
/* NULL when absent (no error recorded: metadata keys are often optional). */
SMPDEF const char *smp_ckpt_meta(const smp_ckpt_file *f, const char *key);
/* Reads the whole tensor into dst (cap >= nbytes) and checks its checksum;
   on a mismatch (SMP_ERR_FORMAT) dst holds the corrupt bytes. */
SMPDEF smp_status smp_ckpt_read(smp_ckpt_file *f, const smp_ckpt_info *e, void *dst, size_t cap);
/* Reads bytes [offset, offset + n) of the tensor's data, unchecked: use
   verify_all first, or smp_ckpt_crc32c over all chunks. */
SMPDEF smp_status smp_ckpt_read_range(smp_ckpt_file *f, const smp_ckpt_info *e, uint64_t offset, void *dst,
                                      size_t n);
/* Checks every recorded checksum, streaming the data in 1 MiB pieces. */
SMPDEF smp_status smp_ckpt_verify_all(smp_ckpt_file *f);

/* CRC-32C (Castagnoli), continuing from `crc` (0 to start):
   smp_ckpt_crc32c(smp_ckpt_crc32c(0, a, n), b, m) == crc of a then b. */
SMPDEF uint32_t smp_ckpt_crc32c(uint32_t crc, const void *data, size_t n);
/* "F32", "BF16", ... (safetensors spelling); NULL for an invalid dtype. */
SMPDEF const char *smp_ckpt_dtype_string(smp_dtype dt);

/* ---------------------------------------------------------------- model checkpoints
   smp_save / smp_load: the parameters, buffers and optimizer state of a
   partitioned model, written and read by every rank together (see the
   usage comment at the top of this file). */

/* Names of optimizer state in files: "optimizer.<param>.<state>", or
   "optimizer.<state>" for state of the optimizer as a whole. */
#define SMP_CKPT_OPTIMIZER_PREFIX "optimizer."
/* Bytes per message when a full save streams a tensor to the writer. */
#define SMP_CKPT_DEFAULT_CHUNK ((size_t)4 << 20)

/* The optimizer state that checkpoints carry (smp.DistributedOptimizer):
   named tensors the engine registers. The registry holds descriptors, not
   data; the engine owns the memory, which must stay valid (same address,
   dtype and shape) while the registry is used. */
typedef struct smp_optimizer smp_optimizer;

SMPDEF smp_status smp_optimizer_new(smp_model *m, smp_optimizer **out);
SMPDEF void smp_optimizer_free(smp_optimizer *o);
/* Registers *t as state `name` ("exp_avg"; no '.') of parameter `param` (its
   full dotted name; the parameter must live on this rank: register after
   partitioning, on every dp replica of the partition), or, with param NULL,
   as state of the optimizer as a whole, which every rank holds a copy of
   (a step count, a learning rate). Host or device tensors, any dtype and
   shape. Not collective. */
SMPDEF smp_status smp_optimizer_state_add(smp_optimizer *o, const char *param, const char *name, const smp_tensor *t);
SMPDEF int smp_optimizer_state_count(const smp_optimizer *o);

typedef struct smp_save_desc {
    smp_switch partial;             /* default ON: one file per mp rank, "<path>.g<N>_<mp_rank>",
                                       committed by the manifest "<path>.manifest";
                                       OFF: one file with the whole model, "<path>" */
    const smp_optimizer *optimizer; /* NULL: no optimizer state */
    const char *const *meta_keys;   /* user metadata (epoch, step, ...), strings; */
    const char *const *meta_values; /* keys must not start with "smp." */
    int nmeta;
    size_t chunk_bytes;             /* full save: bytes per message to the writer; 0: 4 MiB */
} smp_save_desc;

/* Saves the model (desc NULL: a partial save without optimizer state or
   metadata). Collective over the world; the model must be partitioned
   (smp_model_trace or a first step). Only dp rank 0 of each partition
   writes; a full save streams every tensor to world rank 0's writer in
   chunks, never gathering the model in one place. The new checkpoint
   replaces the previous one in a single rename, once every file of the save
   is complete on disk (a partial save's manifest; see Crash safety at the
   top); an error on any rank is an error on every rank, and then the
   previous checkpoint is as it was. */
SMPDEF smp_status smp_save(smp_model *m, const char *path, const smp_save_desc *desc);

/* The file holding partition `mp_rank` of the partial checkpoint at `path`,
   as smp_load reads it: the one its manifest "<path>.manifest" names
   ("<path>.g<N>_<mp_rank>"), or "<path>_<mp_rank>" for a checkpoint saved
   before manifests. Copies the path (NUL included) into out[cap] and sets
   *partitions (when not NULL) to the checkpoint's partition count. For
   tools that read or copy the files; not collective, checks no data. */
SMPDEF smp_status smp_ckpt_partial_file(const char *path, int mp_rank, char *out, size_t cap, int *partitions);

typedef struct smp_load_desc {
    smp_switch partial;       /* default ON: the files "<path>.manifest" names (or "<path>_0" ..
                                 "<path>_<P-1>" of a checkpoint saved before manifests);
                                 OFF: the one file "<path>" */
    smp_optimizer *optimizer; /* NULL: optimizer state in the files is ignored */
    /* Called on every rank after a successful load, once per user metadata
       entry (smp's own "smp.*" entries are not passed). */
    void (*on_meta)(const char *key, const char *value, void *user);
    void *user;
} smp_load_desc;

/* Loads a checkpoint into the model, whatever partitioning either was saved
   or runs with. Collective over the world; the model must be partitioned.
   Everything is checked before anything is copied: the headers; that the
   files form one save; every tensor's name, dtype and shape against the
   model (missing and unexpected tensors are errors); the checksum of every
   tensor this rank loads. On any error, on any rank, every rank returns it
   and no parameter, buffer or optimizer state has changed. */
SMPDEF smp_status smp_load(smp_model *m, const char *path, const smp_load_desc *desc);

/* ---------------------------------------------------------------- state dicts */
typedef struct smp_named_tensor {
    const char *name;
    smp_tensor tensor;
} smp_named_tensor;

typedef struct smp_state_dict {
    int n;
    smp_named_tensor *entries; /* declaration order; optimizer state last */
    bool partial;              /* only this rank's partition (_smp_is_partial) */
    void *storage_;            /* internal */
} smp_state_dict;

/* This rank's parameters, buffers and registered optimizer state, as views
   of the live tensors (no copy; local_state_dict). Not collective. */
SMPDEF smp_status smp_model_local_state_dict(smp_model *m, const smp_optimizer *opt, smp_state_dict *out);
/* The whole model gathered into host memory on world rank `root`
   (state_dict / cpu()): copies that `root` owns; other ranks get n = 0.
   Collective over the world. Needs the whole model's bytes on root; to hand
   a model to a program without smp, prefer a full smp_save, which any
   safetensors reader opens. */
SMPDEF smp_status smp_model_state_dict(smp_model *m, const smp_optimizer *opt, int root, smp_state_dict *out);
SMPDEF void smp_state_dict_free(smp_state_dict *sd);
/* The entry called `name`, or NULL. */
SMPDEF const smp_tensor *smp_state_dict_find(const smp_state_dict *sd, const char *name);

#ifdef __cplusplus
}
#endif
#endif /* SMP_CHECKPOINT_H */

/* ======================================================================== */
#if defined(SMP_IMPLEMENTATION) && !defined(SMP_CHECKPOINT_IMPLEMENTATION_DONE)
#define SMP_CHECKPOINT_IMPLEMENTATION_DONE

/* the POSIX headers files need; the C library's come with smp.h's
   implementation, as do SMP_MALLOC, the allocators and the internal core */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

/* pread, pwrite, kill, O_CLOEXEC and O_DIRECTORY are POSIX.1-2008, hidden by
   glibc in a strict -std=c11 translation unit that defined no feature macro
   before its first #include. Without them: lseek + read/write, /proc for
   "is this process alive", and no close-on-exec. */
#if defined(__GLIBC__)
#if defined(__USE_XOPEN2K8)
#define SMP__CKPT_POSIX2008 1
#endif
#elif defined(__unix__) || defined(__APPLE__)
#define SMP__CKPT_POSIX2008 1
#endif
#ifdef O_CLOEXEC
#define SMP__CKPT_O_CLOEXEC O_CLOEXEC
#else
#define SMP__CKPT_O_CLOEXEC 0
#endif
#ifdef O_DIRECTORY
#define SMP__CKPT_O_DIRECTORY O_DIRECTORY
#else
#define SMP__CKPT_O_DIRECTORY 0
#endif
/* Test hooks, as smp.h's: declared for the test builds (SMP_TESTING) and
   static in every build. smp__ckpt_open_memory validates an in-memory file
   image (length prefix + header + data) exactly as smp_ckpt_open validates
   a file; reads are then served from `bytes`, which must outlive *f;
   `label` names it in messages. smp__ckpt_manifest_check parses a partial
   checkpoint's manifest. smp__ckpt_crc32c_sw is the CRC without the CPU's
   instruction; smp__ckpt_copy_in_host the copy a load uses for host memory. */
#ifdef SMP_TESTING
SMP__CORE smp_status smp__ckpt_open_memory(smp_ckpt_file **f, const char *label, const void *bytes, size_t n);
SMP__CORE smp_status smp__ckpt_manifest_check(const void *bytes, size_t n, const char *label);
SMP__CORE uint32_t smp__ckpt_crc32c_sw(uint32_t crc, const void *data, size_t n);
SMP__CORE void smp__ckpt_copy_in_host(void *dst, const void *src, size_t n);
#endif
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "smp_checkpoint.h writes tensor data as it lies in memory, and safetensors is little-endian"
#endif

#define SMP__CKPT_MAX_HEADER 100000000ull /* the limit the safetensors reference uses */
#define SMP__CKPT_IO_CHUNK ((size_t)1 << 20)
#define SMP__CKPT_CRC_PREFIX "crc32c:"
#define SMP__CKPT_CRC_KEY "smp.checksum."

#ifdef __cplusplus
extern "C" {
#endif

typedef unsigned long long smp__ckpt_ull; /* for printf */

/* ---------------------------------------------------------------- dtypes */

SMPDEF const char *smp_ckpt_dtype_string(smp_dtype dt) {
    if ((int)dt <= (int)SMP_DTYPE_INVALID || (int)dt >= (int)SMP_DTYPE_COUNT) return NULL;
    return smp__dtypes[dt].file_name;
}

/* ---------------------------------------------------------------- messages */
/* Records "<label>: tensor '<tensor>': <message>" (the tensor part when
   tensor is non-NULL) as the last error and returns st. */
static smp_status smp__ckpt_fail(smp_status st, const char *label, const char *tensor, const char *fmt, ...)
    SMP__PRINTF(4, 5);
static smp_status smp__ckpt_fail(smp_status st, const char *label, const char *tensor, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (tensor) return smp_error(st, "%s: tensor '%s': %s", label, tensor, msg);
    return smp_error(st, "%s: %s", label, msg);
}

/* The out-of-memory policy's error (smp.h's smp__nomem: the bytes and what
   they were for, on which rank), `what` continued by " of <label>" when a
   label names the file. */
static smp_status smp__ckpt_nomem(size_t bytes, const char *label, const char *what) {
    char buf[768];
    snprintf(buf, sizeof buf, "%s%s%s", what, label ? " of " : "", label ? label : "");
    return smp__nomem(bytes, buf);
}

/* smp__alloc_or (uninitialised, SMP__ALLOC_OTHER) where a label names the
   file: the out-of-memory message names it too, as smp__ckpt_nomem does. */
static void *smp__ckpt_alloc(smp_status *st, size_t n, const char *label, const char *what) {
    if (*st) return NULL;
    void *p = smp__alloc_or(st, n, SMP__ALLOC_OTHER | SMP__UNINIT, what);
    if (!p) *st = smp__ckpt_nomem(n, label, what);
    return p;
}

/* printf into memory of its own (smp__free it); NULL when there is none. */
static char *smp__ckpt_strf(const char *fmt, ...) SMP__PRINTF(1, 2);
static char *smp__ckpt_strf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *p = n < 0 ? NULL : (char *)smp__alloc((size_t)n + 1, SMP__ALLOC_OTHER);
    if (!p) return NULL;
    va_start(ap, fmt);
    vsnprintf(p, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return p;
}

/* ---------------------------------------------------------------- CRC-32C */
static uint32_t smp__ckpt_crc_table[8][256];
static pthread_once_t smp__ckpt_crc_once = PTHREAD_ONCE_INIT;

/* x86-64 has a CRC-32C instruction (SSE4.2), used when the CPU has it;
   SMP_CKPT_NO_HW_CRC keeps to the table. One chain of crc32 instructions
   waits on each result, so blocks of 3 x LANE bytes run as three
   independent chains, joined through CRC linearity: feeding bytes X to a
   register r gives shift_|X|(r) ^ crc_raw(0, X), where shift_L (L zero bytes)
   is a fixed linear map, applied through four 256-entry tables.
   Three chains outrun memory (~32 GB/s on data in cache), but each lane
   enters a new 4 KiB page every block and the hardware prefetcher stops at
   page boundaries, so a pass over data that is not in cache waited on
   memory at the start of every page: each lane asks for its line of the
   next block while it works on this one (the load's checksum pass over
   128 MiB went from ~13 to ~11 ms per rank here, page faults included, as
   fast as a bare read of the same mapping). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SMP_CKPT_NO_HW_CRC)
#define SMP__CKPT_HW_CRC 1
#define SMP__CKPT_CRC_LANE 4096
static bool smp__ckpt_crc_has_hw;
static uint32_t smp__ckpt_crc_shift[4][256]; /* shift_LANE, by byte of the register */

static uint32_t smp__ckpt_crc_shift_lane(uint32_t r) {
    return smp__ckpt_crc_shift[0][r & 0xff] ^ smp__ckpt_crc_shift[1][(r >> 8) & 0xff] ^
           smp__ckpt_crc_shift[2][(r >> 16) & 0xff] ^ smp__ckpt_crc_shift[3][r >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t smp__ckpt_crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = (uint32_t)~crc;
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 3 * SMP__CKPT_CRC_LANE) {
        uint64_t a = c, b = 0, d = 0, va, vb, vd;
        /* the last block prefetches itself: no address past the buffer */
        const uint8_t *next = n >= 6 * SMP__CKPT_CRC_LANE ? p + 3 * SMP__CKPT_CRC_LANE : p;
        for (size_t i = 0; i < SMP__CKPT_CRC_LANE; i += 8) {
            if (!(i & 63)) {
                __builtin_prefetch(next + i);
                __builtin_prefetch(next + SMP__CKPT_CRC_LANE + i);
                __builtin_prefetch(next + 2 * SMP__CKPT_CRC_LANE + i);
            }
            memcpy(&va, p + i, 8);
            memcpy(&vb, p + SMP__CKPT_CRC_LANE + i, 8);
            memcpy(&vd, p + 2 * SMP__CKPT_CRC_LANE + i, 8);
            a = __builtin_ia32_crc32di(a, va);
            b = __builtin_ia32_crc32di(b, vb);
            d = __builtin_ia32_crc32di(d, vd);
        }
        c = smp__ckpt_crc_shift_lane(smp__ckpt_crc_shift_lane((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
        p += 3 * SMP__CKPT_CRC_LANE;
        n -= 3 * SMP__CKPT_CRC_LANE;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

static void smp__ckpt_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        smp__ckpt_crc_table[0][i] = c;
    }
    for (int i = 0; i < 256; i++)
        for (int k = 1; k < 8; k++)
            smp__ckpt_crc_table[k][i] =
                (smp__ckpt_crc_table[k - 1][i] >> 8) ^ smp__ckpt_crc_table[0][smp__ckpt_crc_table[k - 1][i] & 0xff];
#ifdef SMP__CKPT_HW_CRC
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) { /* shift_LANE of each single-bit register */
        uint32_t c = 1u << bit;
        for (int k = 0; k < SMP__CKPT_CRC_LANE; k++) c = smp__ckpt_crc_table[0][c & 0xff] ^ (c >> 8);
        basis[bit] = c;
    }
    for (int byte = 0; byte < 4; byte++)
        for (int v = 0; v < 256; v++) {
            uint32_t c = 0;
            for (int bit = 0; bit < 8; bit++)
                if (v & (1 << bit)) c ^= basis[8 * byte + bit];
            smp__ckpt_crc_shift[byte][v] = c;
        }
    smp__ckpt_crc_has_hw = __builtin_cpu_supports("sse4.2") != 0;
#endif
}

/* The table version (slicing by 8), used where the CPU has no CRC-32C
   instruction; internal, exposed for tests. */
SMP__CORE uint32_t smp__ckpt_crc32c_sw(uint32_t crc, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    uint32_t (*t)[256] = smp__ckpt_crc_table;
    pthread_once(&smp__ckpt_crc_once, smp__ckpt_crc_init);
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
              t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

SMPDEF uint32_t smp_ckpt_crc32c(uint32_t crc, const void *data, size_t n) {
    pthread_once(&smp__ckpt_crc_once, smp__ckpt_crc_init);
#ifdef SMP__CKPT_HW_CRC
    if (smp__ckpt_crc_has_hw) return smp__ckpt_crc32c_hw(crc, (const uint8_t *)data, n);
#endif
    return smp__ckpt_crc32c_sw(crc, data, n);
}

/* ---------------------------------------------------------------- small helpers */
static bool smp__ckpt_utf8_valid(const char *s) {
    const uint8_t *p = (const uint8_t *)s;
    for (size_t n = strlen(s), i = 0, k; i < n; i += k)
        if (!(k = smp__utf8_len(p + i, n - i))) return false;
    return true;
}

/* Bytes of a tensor; 0 on overflow of int64/uint64 (reported by callers). */
static bool smp__ckpt_tensor_bytes(smp_dtype dt, int ndim, const int64_t *shape, int64_t *numel, uint64_t *bytes) {
    int64_t ne = 1;
    size_t es = smp__dtypes[dt].size;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return false;
        if (shape[i] != 0 && ne > INT64_MAX / shape[i]) return false;
        ne *= shape[i];
    }
    if ((uint64_t)ne > UINT64_MAX / es) return false;
    *numel = ne;
    *bytes = (uint64_t)ne * es;
    return true;
}

static int smp__ckpt_strcmp_p(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The first name that names[0..n) (sorted in place) holds twice, or NULL. */
static const char *smp__ckpt_twice(const char **names, int n) {
    qsort(names, (size_t)n, sizeof *names, smp__ckpt_strcmp_p);
    for (int i = 1; i < n; i++)
        if (!strcmp(names[i - 1], names[i])) return names[i];
    return NULL;
}

static bool smp__ckpt_starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* Folder and file name of a path ("x" -> "." and "x"). dir is malloc'd. */
static char *smp__ckpt_dirname(const char *path, const char **base) {
    const char *slash = strrchr(path, '/');
    *base = slash ? slash + 1 : path;
    if (!slash) return smp__strdup(".");
    return smp__ckpt_strf("%.*s", slash == path ? 1 : (int)(slash - path), path);
}

/* Writes all of buf at offset `off`, or at the file's offset when off < 0. */
static int smp__ckpt_write_all(int fd, const void *buf, size_t n, int64_t off) {
#ifndef SMP__CKPT_POSIX2008
    if (off >= 0 && lseek(fd, (off_t)off, SEEK_SET) < 0) return -1;
    off = -1;
#endif
    const char *p = (const char *)buf;
    while (n) {
#ifdef SMP__CKPT_POSIX2008
        ssize_t k = off >= 0 ? pwrite(fd, p, n, (off_t)off) : write(fd, p, n);
#else
        ssize_t k = write(fd, p, n);
#endif
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        p += k;
        n -= (size_t)k;
        if (off >= 0) off += k;
    }
    return 0;
}

/* Whether process `pid` may still be running on this host. */
static bool smp__ckpt_pid_alive(long pid) {
#ifdef SMP__CKPT_POSIX2008
    return kill((pid_t)pid, 0) == 0 || errno != ESRCH; /* EPERM: alive, not ours */
#else
    char proc[64];
    struct stat sb;
    if (stat("/proc/self", &sb) != 0) return true; /* cannot tell: keep its file */
    snprintf(proc, sizeof proc, "/proc/%ld", pid);
    return stat(proc, &sb) == 0;
#endif
}

/* ---------------------------------------------------------------- writer */
/* Test-only fault injection (SMP_CKPT_FAULT): the file layer's phases,
   which any writer hits, then those of a partial model save (smp_save). */
enum { SMP__CKPT_FAULT_NONE, SMP__CKPT_FAULT_HEADER, SMP__CKPT_FAULT_DATA, SMP__CKPT_FAULT_FLUSH,
       SMP__CKPT_FAULT_RENAME, SMP__CKPT_FAULT_DIRSYNC, SMP__CKPT_FAULT_RENAMED, SMP__CKPT_FAULT_MANIFEST,
       SMP__CKPT_FAULT_COMMIT, SMP__CKPT_FAULT_CLEANUP, SMP__CKPT_FAULT_COUNT };
#ifdef SMP_TESTING
static const char *const smp__ckpt_fault_names[SMP__CKPT_FAULT_COUNT] = {
    "", "header", "data", "flush", "rename", "dirsync", "renamed", "manifest", "commit", "cleanup"};
#endif

struct smp_ckpt_writer {
    char *path, *tmp, *dir; /* dir: for the folder fsync */
    int fd;
    int fault;
    int n, cur;             /* entries; the one being filled */
    uint64_t *sizes;        /* bytes per entry */
    uint32_t *crcs;         /* running CRC-32C per entry */
    size_t *crc_pos;        /* where each entry's 8 hex digits sit in `header` */
    char *names;            /* n NUL-terminated names back to back */
    char **name_of;         /* pointers into names */
    uint64_t done;          /* bytes of entry `cur` written */
    uint64_t total, written;
    char *header;           /* length prefix + JSON + padding */
    size_t header_len;
    uint8_t *buf;           /* output buffer */
    size_t buf_len, buf_cap;
    smp_status failed;      /* first error; later calls repeat it */
    char failed_msg[sizeof smp__errbuf]; /* its message (no allocation on an error path) */
    int sealed;             /* the tmp file is complete and closed, not yet renamed */
    uint32_t header_crc;    /* once sealed: CRC-32C of the length prefix + header as on disk */
};

#ifdef SMP_TESTING
static bool smp__ckpt_fault_from_env(int *fault) {
    const char *s = getenv("SMP_CKPT_FAULT");
    *fault = SMP__CKPT_FAULT_NONE;
    if (!s || !*s) return true;
    for (int i = 1; i < SMP__CKPT_FAULT_COUNT; i++)
        if (!strcmp(s, smp__ckpt_fault_names[i])) {
            *fault = i;
            return true;
        }
    return false;
}

/* Ends the process as a crash would, saying so first (tests check that the
   fault they asked for is the one that fired). */
static void smp__ckpt_die(int phase) {
    smp__log(SMP_LOG_ERROR, "SMP_CKPT_FAULT=%s: test fault injection ends this process (status 77)",
            smp__ckpt_fault_names[phase]);
    _exit(77);
}

static void smp__ckpt_fault(const smp_ckpt_writer *w, int phase) {
    if (w->fault == phase) smp__ckpt_die(phase);
}

/* Test-only (SMP_CKPT_FAULT=rename in a partial save): before this rank
   dies ahead of its rename, let every other saver rename its file, so the
   kill falls between the per-rank renames. */
static void smp__ckpt_fault_pace(const char *path, uint64_t gen, int P, int mine);
#else
/* Without SMP_TESTING nothing reads SMP_CKPT_FAULT and nothing exits. */
static bool smp__ckpt_fault_from_env(int *fault) {
    *fault = SMP__CKPT_FAULT_NONE;
    return true;
}
#define smp__ckpt_die(phase) ((void)(phase))
#define smp__ckpt_fault(w, phase) ((void)(w), (void)(phase))
#define smp__ckpt_fault_pace(path, gen, P, mine) ((void)(path), (void)(gen), (void)(P), (void)(mine))
#endif

static void smp__ckpt_writer_free(smp_ckpt_writer *w) {
    if (!w) return;
    if (w->fd >= 0) {
        close(w->fd);
        if (w->tmp) unlink(w->tmp);
    } else if (w->sealed && w->tmp) {
        unlink(w->tmp);
    }
    void *blocks[] = {w->path, w->tmp, w->dir, w->sizes, w->crcs, w->crc_pos,
                      w->names, w->name_of, w->header, w->buf, w};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) smp__free(blocks[i]);
}

/* Remembers the error just recorded so later calls on w can repeat it. */
static smp_status smp__ckpt_writer_failed(smp_ckpt_writer *w, smp_status st) {
    if (!w->failed) {
        w->failed = st;
        snprintf(w->failed_msg, sizeof w->failed_msg, "%s", smp_last_error());
    }
    return st;
}

static smp_status smp__ckpt_writer_repeat(const smp_ckpt_writer *w) {
    return smp_error(w->failed, "%s", w->failed_msg[0] ? w->failed_msg : "an earlier checkpoint write failed");
}

/* Deletes `<base>.tmp.<pid>` files in dir whose process is gone from this
   host (left by killed writers). Best effort: errors are ignored. */
static void smp__ckpt_remove_stale(const char *dir, const char *base) {
    DIR *d = opendir(dir);
    size_t blen = strlen(base);
    if (!d) return;
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        const char *nm = de->d_name;
        if (strncmp(nm, base, blen) != 0 || strncmp(nm + blen, ".tmp.", 5) != 0) continue;
        const char *digits = nm + blen + 5;
        long long pid = 0;
        int nd = 0;
        while (digits[nd] >= '0' && digits[nd] <= '9' && nd < 10) pid = pid * 10 + (digits[nd++] - '0');
        if (nd == 0 || digits[nd] != 0 || pid <= 0 || pid > 0x7fffffff) continue;
        if ((pid_t)pid == getpid()) continue;
        if (smp__ckpt_pid_alive((long)pid)) continue;
#ifdef SMP__CKPT_POSIX2008
        unlinkat(dirfd(d), nm, 0); /* no path to build: nothing to allocate */
#else
        char *full = smp__ckpt_strf("%s/%s", dir, nm);
        if (!full) continue; /* best effort: the next writer tries again */
        unlink(full);
        smp__free(full);
#endif
    }
    closedir(d);
}

static smp_status smp__ckpt_check_entries(const char *label, const smp_ckpt_entry *entries, int n,
                                          const char *const *mk, const char *const *mv, int nmeta,
                                          uint64_t *total) {
    *total = 0;
    if (n < 0 || nmeta < 0) return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "negative entry or metadata count");
    if (n > 0 && !entries) return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "%d entries but entries is NULL", n);
    if (nmeta > 0 && (!mk || !mv))
        return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "%d metadata entries but keys or values is NULL", nmeta);
    for (int i = 0; i < n; i++) {
        const smp_ckpt_entry *e = &entries[i];
        if (!e->name || !*e->name)
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "entry %d has no name", i);
        if (!smp__ckpt_utf8_valid(e->name))
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "the name is not valid UTF-8");
        if (!strcmp(e->name, "__metadata__"))
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "that name is reserved by safetensors");
        if ((int)e->dtype <= (int)SMP_DTYPE_INVALID || (int)e->dtype >= (int)SMP_DTYPE_COUNT)
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "invalid dtype %d", (int)e->dtype);
        if (e->ndim < 0 || e->ndim > SMP_MAX_DIMS)
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "ndim %d is outside 0..%d", e->ndim, SMP_MAX_DIMS);
        for (int k = 0; k < e->ndim; k++)
            if (e->shape[k] < 0)
                return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "dimension %d is negative (%lld)", k,
                                      (long long)e->shape[k]);
        int64_t numel;
        uint64_t bytes;
        if (!smp__ckpt_tensor_bytes(e->dtype, e->ndim, e->shape, &numel, &bytes) || bytes > UINT64_MAX - *total)
            return smp__ckpt_fail(SMP_ERR_ARG, label, e->name, "its size overflows 64 bits");
        *total += bytes;
    }
    for (int i = 0; i < nmeta; i++) {
        if (!mk[i] || !mv[i])
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "metadata entry %d has a NULL key or value", i);
        if (!smp__ckpt_utf8_valid(mk[i]) || !smp__ckpt_utf8_valid(mv[i]))
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "metadata entry '%s' is not valid UTF-8", mk[i]);
        if (smp__ckpt_starts(mk[i], SMP__CKPT_CRC_KEY))
            return smp__ckpt_fail(SMP_ERR_ARG, label, NULL,
                                  "metadata key '%s' is reserved for smp's checksums (" SMP__CKPT_CRC_KEY "*)", mk[i]);
    }
    /* duplicates: names, then metadata keys */
    int most = n > nmeta ? n : nmeta;
    if (most < 2) return SMP_OK;
    const char **sorted = (const char **)smp__alloc((size_t)most * sizeof *sorted, SMP__ALLOC_OTHER);
    if (!sorted) return smp__ckpt_nomem((size_t)most * sizeof *sorted, label, "checking the names");
    for (int i = 0; i < n; i++) sorted[i] = entries[i].name;
    const char *twice = smp__ckpt_twice(sorted, n);
    smp_status st = twice ? smp__ckpt_fail(SMP_ERR_ARG, label, twice, "two entries have this name") : SMP_OK;
    if (!st) {
        for (int i = 0; i < nmeta; i++) sorted[i] = mk[i];
        if ((twice = smp__ckpt_twice(sorted, nmeta)))
            st = smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "metadata key '%s' appears twice", twice);
    }
    smp__free(sorted);
    return st;
}

/* Builds the length prefix + JSON header with zero checksums, recording where
   each checksum's hex digits go. */
static smp_status smp__ckpt_build_header(smp_ckpt_writer *w, const char *label, const smp_ckpt_entry *entries,
                                         const char *const *mk, const char *const *mv, int nmeta) {
    smp__sbuf b;
    memset(&b, 0, sizeof b);
    const char *sep = ""; /* between the top level's members */
    smp__sbuf_put(&b, "\0\0\0\0\0\0\0\0", 8); /* length, patched below */
    smp__sbuf_puts(&b, "{");
    if (w->n > 0 || nmeta > 0) {
        smp__sbuf_puts(&b, "\"__metadata__\":{");
        for (int i = 0; i < nmeta; i++) {
            if (i) smp__sbuf_puts(&b, ",");
            smp__sbuf_jstr(&b, NULL, mk[i]);
            smp__sbuf_puts(&b, ":");
            smp__sbuf_jstr(&b, NULL, mv[i]);
        }
        for (int i = 0; i < w->n; i++) {
            if (i || nmeta) smp__sbuf_puts(&b, ",");
            smp__sbuf_jstr(&b, SMP__CKPT_CRC_KEY, entries[i].name);
            smp__sbuf_puts(&b, ":\"" SMP__CKPT_CRC_PREFIX);
            w->crc_pos[i] = b.len;
            smp__sbuf_puts(&b, "00000000\"");
        }
        smp__sbuf_puts(&b, "}");
        sep = ",";
    }
    uint64_t off = 0;
    for (int i = 0; i < w->n; i++) {
        const smp_ckpt_entry *e = &entries[i];
        smp__sbuf_puts(&b, sep);
        sep = ",";
        smp__sbuf_jstr(&b, NULL, e->name);
        smp__sbuf_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[", smp__dtypes[e->dtype].file_name);
        for (int k = 0; k < e->ndim; k++) smp__sbuf_printf(&b, "%s%lld", k ? "," : "", (long long)e->shape[k]);
        smp__sbuf_printf(&b, "],\"data_offsets\":[%llu,%llu]}", (smp__ckpt_ull)off, (smp__ckpt_ull)(off + w->sizes[i]));
        off += w->sizes[i];
    }
    smp__sbuf_puts(&b, "}");
    while (!b.oom && b.len % 8) smp__sbuf_puts(&b, " ");
    if (b.oom) {
        smp__free(b.p);
        return smp__ckpt_nomem(b.want, label, "the header");
    }
    uint64_t hlen = b.len - 8;
    if (hlen > SMP__CKPT_MAX_HEADER) {
        smp__free(b.p);
        return smp__ckpt_fail(SMP_ERR_ARG, label, NULL,
                              "the header would be %llu bytes, over the %llu-byte limit of safetensors readers",
                              (smp__ckpt_ull)hlen, (smp__ckpt_ull)SMP__CKPT_MAX_HEADER);
    }
    for (int i = 0; i < 8; i++) b.p[i] = (char)((hlen >> (8 * i)) & 0xff);
    w->header = b.p;
    w->header_len = b.len;
    return SMP_OK;
}

/* Creates the tmp file `tmp` for writing: -1 (errno) when it cannot. */
static int smp__ckpt_create(const char *tmp) {
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | SMP__CKPT_O_CLOEXEC, 0666);
    if (fd < 0 && errno == EEXIST) { /* ours from an earlier, killed process with our pid */
        unlink(tmp);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | SMP__CKPT_O_CLOEXEC, 0666);
    }
    return fd;
}

/* fsyncs the folder `dir` (a file system that cannot is no error): 0, or
   the errno of the failure. */
static int smp__ckpt_sync_dir(const char *dir) {
    int dfd = open(dir, O_RDONLY | SMP__CKPT_O_DIRECTORY | SMP__CKPT_O_CLOEXEC);
    if (dfd < 0) return errno;
    int err = fsync(dfd) == 0 || errno == EINVAL || errno == ENOTSUP || errno == EOPNOTSUPP ? 0 : errno;
    close(dfd);
    return err;
}

SMPDEF smp_status smp_ckpt_writer_open(const char *path, const smp_ckpt_entry *entries, int n, const char *const *mk,
                                       const char *const *mv, int nmeta, smp_ckpt_writer **out) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_open: out is NULL");
    *out = NULL;
    if (!path || !*path) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_open: no path");
    char label[512];
    snprintf(label, sizeof label, "checkpoint '%s'", path);
    if (path[strlen(path) - 1] == '/') return smp__ckpt_fail(SMP_ERR_ARG, label, NULL, "the path names a folder");
    uint64_t total;
    SMP_TRY(smp__ckpt_check_entries(label, entries, n, mk, mv, nmeta, &total));
    int fault;
    if (!smp__ckpt_fault_from_env(&fault))
        return smp__ckpt_fail(SMP_ERR_ARG, label, NULL,
                              "SMP_CKPT_FAULT='%s' is not one of header, data, flush, rename, dirsync, renamed, "
                              "manifest, commit, cleanup (a test-only setting: unset it)",
                              getenv("SMP_CKPT_FAULT"));

    smp_status st = SMP_OK;
    smp_ckpt_writer *w = (smp_ckpt_writer *)smp__ckpt_alloc(&st, sizeof *w, label, "the writer");
    if (!w) return st;
    memset(w, 0, sizeof *w);
    w->fd = -1;
    w->fault = fault;
    w->n = n;
    w->total = total;
    size_t names_len = 0, plen = strlen(path);
    for (int i = 0; i < n; i++) names_len += strlen(entries[i].name) + 1;
    const char *base;
    w->path = (char *)smp__ckpt_alloc(&st, plen + 1, label, "the writer's path");
    w->tmp = (char *)smp__ckpt_alloc(&st, plen + 32, label, "the tmp file's name");
    if (!st && !(w->dir = smp__ckpt_dirname(path, &base)))
        st = smp__ckpt_nomem(plen + 1, label, "the folder's name");
    w->sizes = (uint64_t *)smp__ckpt_alloc(&st, sizeof(uint64_t) * (size_t)n, label, "the tensor sizes");
    w->crcs = (uint32_t *)smp__ckpt_alloc(&st, sizeof(uint32_t) * (size_t)n, label, "the tensor checksums");
    w->crc_pos = (size_t *)smp__ckpt_alloc(&st, sizeof(size_t) * (size_t)n, label, "the checksums' places");
    w->name_of = (char **)smp__ckpt_alloc(&st, sizeof(char *) * (size_t)n, label, "the tensor names");
    w->names = (char *)smp__ckpt_alloc(&st, names_len, label, "the tensor names");
    w->buf_cap = total < SMP__CKPT_IO_CHUNK ? (size_t)total : SMP__CKPT_IO_CHUNK;
    w->buf = (uint8_t *)smp__ckpt_alloc(&st, w->buf_cap, label, "the write buffer");
    if (!st) {
        memcpy(w->path, path, plen + 1);
        snprintf(w->tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
        size_t pos = 0;
        for (int i = 0; i < n; i++) {
            int64_t numel;
            size_t len = strlen(entries[i].name) + 1;
            smp__ckpt_tensor_bytes(entries[i].dtype, entries[i].ndim, entries[i].shape, &numel, &w->sizes[i]);
            w->crcs[i] = 0;
            w->name_of[i] = w->names + pos;
            memcpy(w->names + pos, entries[i].name, len);
            pos += len;
        }
        st = smp__ckpt_build_header(w, label, entries, mk, mv, nmeta);
    }
    if (!st) {
        smp__ckpt_remove_stale(w->dir, base);
        if ((w->fd = smp__ckpt_create(w->tmp)) < 0)
            st = smp__ckpt_fail(SMP_ERR_IO, label, NULL, "cannot create '%s': %s", w->tmp, strerror(errno));
        else if (smp__ckpt_write_all(w->fd, w->header, w->header_len, -1) != 0)
            st = smp__ckpt_fail(SMP_ERR_IO, label, NULL, "writing '%s' failed: %s", w->tmp, strerror(errno));
    }
    if (st) {
        smp__ckpt_writer_free(w);
        return st;
    }
    smp__ckpt_fault(w, SMP__CKPT_FAULT_HEADER);
    *out = w;
    return SMP_OK;
}

/* The error of a failed system call on w's tmp file ("writing", "closing"). */
static smp_status smp__ckpt_writer_io(const smp_ckpt_writer *w, const char *doing) {
    return smp_error(SMP_ERR_IO, "checkpoint '%s': %s '%s' failed: %s", w->path, doing, w->tmp, strerror(errno));
}

static smp_status smp__ckpt_writer_flush(smp_ckpt_writer *w) {
    if (w->buf_len && smp__ckpt_write_all(w->fd, w->buf, w->buf_len, -1) != 0)
        return smp__ckpt_writer_failed(w, smp__ckpt_writer_io(w, "writing"));
    w->buf_len = 0;
    return SMP_OK;
}

static smp_status smp__ckpt_writer_out(smp_ckpt_writer *w, const uint8_t *p, size_t n) {
    if (w->buf_len + n > w->buf_cap) {
        SMP_TRY(smp__ckpt_writer_flush(w));
        if (n >= w->buf_cap) { /* straight from the caller's bytes */
            if (smp__ckpt_write_all(w->fd, p, n, -1) != 0)
                return smp__ckpt_writer_failed(w, smp__ckpt_writer_io(w, "writing"));
            return SMP_OK;
        }
    }
    memcpy(w->buf + w->buf_len, p, n);
    w->buf_len += n;
    return SMP_OK;
}

SMPDEF smp_status smp_ckpt_writer_write(smp_ckpt_writer *w, const void *bytes, size_t n) {
    const uint8_t *p = (const uint8_t *)bytes;
    if (!w) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_write: writer is NULL");
    if (w->failed) return smp__ckpt_writer_repeat(w);
    if (n && !bytes)
        return smp__ckpt_writer_failed(
            w, smp_error(SMP_ERR_ARG, "checkpoint '%s': write of %zu bytes from a NULL pointer", w->path, n));
    while (n) {
        while (w->cur < w->n && w->done == w->sizes[w->cur]) {
            w->cur++;
            w->done = 0;
        }
        if (w->cur == w->n)
            return smp__ckpt_writer_failed(
                w, smp_error(SMP_ERR_ARG,
                             "checkpoint '%s': got %zu bytes more than the entries declare (%llu bytes in all)",
                             w->path, n, (smp__ckpt_ull)w->total));
        uint64_t room = w->sizes[w->cur] - w->done;
        size_t take = (uint64_t)n < room ? n : (size_t)room;
        /* checksum and write in slices, so the kernel copies each slice from
           cache rather than reading the whole piece from memory twice */
        if (take > SMP__CKPT_IO_CHUNK) take = SMP__CKPT_IO_CHUNK;
        w->crcs[w->cur] = smp_ckpt_crc32c(w->crcs[w->cur], p, take);
        SMP_TRY(smp__ckpt_writer_out(w, p, take));
        w->done += take;
        w->written += take;
        p += take;
        n -= take;
    }
    if (w->fault == SMP__CKPT_FAULT_DATA) {
        smp__ckpt_writer_flush(w);
        smp__ckpt_die(SMP__CKPT_FAULT_DATA);
    }
    return SMP_OK;
}

SMPDEF uint64_t smp_ckpt_writer_remaining(const smp_ckpt_writer *w) { return w ? w->total - w->written : 0; }

SMPDEF void smp_ckpt_writer_abort(smp_ckpt_writer *w) { smp__ckpt_writer_free(w); }

/* The first half of commit: the data is complete, the checksums are in the
   header, the tmp file is fsynced and closed, but `path` is untouched. On
   error w is freed (and its tmp file deleted); on success w waits for
   smp__ckpt_writer_publish or smp_ckpt_writer_abort (which deletes the tmp
   file). Model checkpoints seal every file of a save before renaming any. */
static smp_status smp__ckpt_writer_seal(smp_ckpt_writer *w) {
    if (!w) return smp_error(SMP_ERR_ARG, "smp_ckpt_writer_commit: writer is NULL");
    smp_status st = SMP_OK;
    if (w->failed) {
        st = smp__ckpt_writer_repeat(w);
    } else if (w->written != w->total) {
        int cur = w->cur;
        uint64_t done = w->done;
        while (cur < w->n && done == w->sizes[cur]) { /* skip finished and empty entries */
            cur++;
            done = 0;
        }
        st = smp_error(SMP_ERR_ARG,
                       "checkpoint '%s': commit after %llu of %llu bytes: tensor '%s' has %llu of its %llu bytes; "
                       "nothing was saved",
                       w->path, (smp__ckpt_ull)w->written, (smp__ckpt_ull)w->total,
                       cur < w->n ? w->name_of[cur] : "?", (smp__ckpt_ull)done,
                       (smp__ckpt_ull)(cur < w->n ? w->sizes[cur] : 0));
    }
    if (!st) {
        smp__ckpt_fault(w, SMP__CKPT_FAULT_DATA); /* no data was written: die here */
        st = smp__ckpt_writer_flush(w);
    }
    if (!st && w->n > 0) {
        for (int i = 0; i < w->n; i++) {
            char hex[16];
            snprintf(hex, sizeof hex, "%08x", (unsigned)w->crcs[i]);
            memcpy(w->header + w->crc_pos[i], hex, 8);
        }
        size_t lo = w->crc_pos[0], hi = w->crc_pos[w->n - 1] + 8;
        if (smp__ckpt_write_all(w->fd, w->header + lo, hi - lo, (int64_t)lo) != 0)
            st = smp__ckpt_writer_io(w, "writing");
    }
    if (!st) {
        w->header_crc = smp_ckpt_crc32c(0, w->header, w->header_len);
        smp__ckpt_fault(w, SMP__CKPT_FAULT_FLUSH);
        if (fsync(w->fd) != 0) st = smp__ckpt_writer_io(w, "fsync of");
    }
    if (!st) {
        int closed = close(w->fd);
        w->fd = -1;
        w->sealed = 1; /* from here on, freeing w deletes the tmp file */
        if (closed == 0) return SMP_OK;
        st = smp__ckpt_writer_io(w, "closing");
    }
    smp__ckpt_writer_free(w);
    return st;
}

/* The second half: renames the sealed tmp file over `path` and fsyncs the
   folder. Always frees w. */
static smp_status smp__ckpt_writer_publish(smp_ckpt_writer *w) {
    smp_status st = SMP_OK;
    smp__ckpt_fault(w, SMP__CKPT_FAULT_RENAME);
    if (rename(w->tmp, w->path) != 0) {
        st = smp_error(SMP_ERR_IO, "checkpoint '%s': renaming '%s' over it failed: %s", w->path, w->tmp,
                       strerror(errno));
    } else {
        w->sealed = 0; /* the tmp name is gone */
        smp__ckpt_fault(w, SMP__CKPT_FAULT_DIRSYNC);
        int err = smp__ckpt_sync_dir(w->dir);
        if (err)
            st = smp_error(SMP_ERR_IO, "checkpoint '%s' is in place, but flushing its folder '%s' failed: %s", w->path,
                           w->dir, strerror(err));
    }
    smp__ckpt_writer_free(w);
    return st;
}

SMPDEF smp_status smp_ckpt_writer_commit(smp_ckpt_writer *w) {
    smp_status st = smp__ckpt_writer_seal(w);
    return st ? st : smp__ckpt_writer_publish(w);
}

SMPDEF smp_status smp_ckpt_write_file(const char *path, const smp_ckpt_entry *entries, int n,
                                      const char *const *mk, const char *const *mv, int nmeta) {
    smp_ckpt_writer *w;
    SMP_TRY(smp_ckpt_writer_open(path, entries, n, mk, mv, nmeta, &w));
    smp_status st = SMP_OK;
    for (int i = 0; i < n && !st; i++) {
        uint64_t bytes = w->sizes[i];
        if (bytes && !entries[i].data)
            st = smp_error(SMP_ERR_ARG, "checkpoint '%s': tensor '%s': data is NULL", path, entries[i].name);
        else if (bytes)
            st = smp_ckpt_writer_write(w, entries[i].data, (size_t)bytes);
    }
    if (!st) return smp_ckpt_writer_commit(w);
    smp_ckpt_writer_abort(w);
    return st;
}

SMPDEF smp_ckpt_entry smp_ckpt_entry_of(const char *name, const smp_tensor *t) {
    smp_ckpt_entry e;
    memset(&e, 0, sizeof e);
    e.name = name;
    if (!t) return e;
    e.dtype = t->dtype;
    e.ndim = t->ndim;
    for (int i = 0; i < t->ndim && i < SMP_MAX_DIMS; i++) e.shape[i] = t->shape[i];
    e.data = t->data;
    return e;
}

/* Reads "crc32c:" and 8 lowercase hex digits from v, the value of `what`
   (an error of `label` and `tensor` when it is something else). */
static smp_status smp__ckpt_crc_text(const char *v, uint32_t *out, const char *label, const char *tensor,
                                     const char *what) {
    size_t plen = strlen(SMP__CKPT_CRC_PREFIX);
    const char *bad = strlen(v) != plen + 8 || strncmp(v, SMP__CKPT_CRC_PREFIX, plen) != 0 ? "8 hex digits" : NULL;
    uint32_t crc = 0;
    for (int j = 0; j < 8 && !bad; j++) {
        char c = v[plen + (size_t)j];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) bad = "8 lowercase hex digits";
        crc = crc << 4 | (uint32_t)(c <= '9' ? c - '0' : c - 'a' + 10);
    }
    if (bad)
        return smp__ckpt_fail(SMP_ERR_FORMAT, label, tensor, "%s \"%s\" is not \"" SMP__CKPT_CRC_PREFIX "\" and %s",
                              what, v, bad);
    *out = crc;
    return SMP_OK;
}

/* ---------------------------------------------------------------- reader */
typedef struct smp__ckpt_meta {
    const char *key, *value;
} smp__ckpt_meta;

struct smp_ckpt_file {
    char *path;
    char *label;             /* "checkpoint '<path>'", in path's block */
    int fd;                  /* -1 for a memory image */
    const uint8_t *mem;      /* memory image, or NULL */
    uint64_t size, data_start, data_len;
    uint8_t *header;         /* JSON, strings decoded in place */
    size_t header_len;
    int n, cap;
    smp_ckpt_info *info;     /* header order */
    smp_ckpt_info **by_name; /* sorted by name */
    int nmeta, meta_cap;
    smp__ckpt_meta *meta;    /* header order */
    smp__ckpt_meta *meta_sorted;
    const uint8_t *map;      /* the whole file mapped read-only (model loads), or NULL */
    int map_tried;
    uint32_t header_crc;     /* CRC-32C of the length prefix + header as read (manifests record it) */
};

/* The header parser. Strict JSON for exactly the safetensors schema, so it
   never nests deeper than object > object > array and needs no recursion.
   Strings are decoded in place (escapes only shrink) and NUL-terminated. */
typedef struct smp__ckpt_jp {
    uint8_t *s;
    size_t n, i;
    const char *label;
    const char *tensor; /* for messages */
    const char *doc;    /* what is parsed, for messages: NULL for "header" */
} smp__ckpt_jp;

static smp_status smp__ckpt_jerr(smp__ckpt_jp *jp, const char *fmt, ...) SMP__PRINTF(2, 3);
static smp_status smp__ckpt_jerr(smp__ckpt_jp *jp, const char *fmt, ...) {
    const char *doc = jp->doc ? jp->doc : "header";
    char msg[512], found[32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    smp__json_found((const char *)jp->s, jp->n, jp->i, doc, found, sizeof found);
    return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor, "malformed JSON %s at byte %llu: %s, found %s", doc,
                          (smp__ckpt_ull)jp->i, msg, found);
}

static void smp__ckpt_ws(smp__ckpt_jp *jp) { jp->i = smp__json_skip_ws((const char *)jp->s, jp->n, jp->i); }

/* Skips whitespace, then eats c if it is next. */
static bool smp__ckpt_eat(smp__ckpt_jp *jp, char c) {
    smp__ckpt_ws(jp);
    if (jp->i < jp->n && jp->s[jp->i] == (uint8_t)c) {
        jp->i++;
        return true;
    }
    return false;
}

/* Parses a string at jp->i (after whitespace), decoded in place and
   NUL-terminated; *out points into the buffer. */
static smp_status smp__ckpt_jstring(smp__ckpt_jp *jp, const char **out, const char *what) {
    smp__ckpt_ws(jp);
    if (jp->i >= jp->n || jp->s[jp->i] != '"') return smp__ckpt_jerr(jp, "expected %s in double quotes", what);
    char *text = (char *)jp->s + jp->i + 1, why[160];
    smp__jstr d;
    memset(&d, 0, sizeof d);
    d.out = text;
    d.cap = jp->n;
    d.no_nul = true;
    if (!smp__json_string_at((const char *)jp->s, jp->n, &jp->i, &d, why, sizeof why))
        return smp__ckpt_jerr(jp, "%s", why);
    text[d.len] = 0; /* at most where the closing quote was */
    *out = text;
    return SMP_OK;
}

/* A JSON integer >= 0 that fits in 63 bits (no sign, fraction or exponent). */
static smp_status smp__ckpt_juint(smp__ckpt_jp *jp, uint64_t *out, const char *what) {
    smp__ckpt_ws(jp);
    const char *p = (const char *)jp->s + jp->i, *why = NULL;
    if (jp->i < jp->n && *p == '-') return smp__ckpt_jerr(jp, "%s must not be negative", what);
    if (jp->i >= jp->n || *p < '0' || *p > '9') return smp__ckpt_jerr(jp, "expected %s (an integer)", what);
    size_t bad = 0, len = smp__json_scan_number(p, &why, &bad), digits = 0;
    if (!len) {
        jp->i += bad;
        return smp__ckpt_jerr(jp, "%s: %s", what, why);
    }
    while (digits < len && p[digits] >= '0' && p[digits] <= '9') digits++;
    if (digits < len) {
        jp->i += digits;
        return smp__ckpt_jerr(jp, "%s must be an integer", what);
    }
    bool neg;
    uint64_t v = 0;
    if (smp__json_exact_int(p, len, &neg, &v) || v > (uint64_t)INT64_MAX)
        return smp__ckpt_jerr(jp, "%s does not fit in 63 bits", what);
    jp->i += len;
    *out = v;
    return SMP_OK;
}

/* A new element, zeroed, at the end of the array *arr (*n of them, room
   for *cap): NULL, with the out-of-memory error, when there is no memory. */
static void *smp__ckpt_push(void **arr, int *n, int *cap, size_t elem, const char *label, const char *what) {
    size_t want;
    if (!smp__grow(arr, cap, *n + 1, elem, &want)) {
        smp__ckpt_nomem(want, label, what);
        return NULL;
    }
    void *e = (char *)*arr + elem * (size_t)(*n)++;
    memset(e, 0, elem);
    return e;
}

static smp_status smp__ckpt_parse_meta(smp__ckpt_jp *jp, smp_ckpt_file *f) {
    if (!smp__ckpt_eat(jp, '{')) return smp__ckpt_jerr(jp, "__metadata__ must be an object of strings");
    if (smp__ckpt_eat(jp, '}')) return SMP_OK;
    for (;;) {
        const char *k, *v;
        SMP_TRY(smp__ckpt_jstring(jp, &k, "a metadata key"));
        if (!smp__ckpt_eat(jp, ':')) return smp__ckpt_jerr(jp, "expected ':' after metadata key '%s'", k);
        smp__ckpt_ws(jp);
        if (jp->i >= jp->n || jp->s[jp->i] != '"')
            return smp__ckpt_jerr(jp, "the value of metadata key '%s' is not a string (metadata holds strings only)",
                                  k);
        SMP_TRY(smp__ckpt_jstring(jp, &v, "a metadata value"));
        smp__ckpt_meta *m =
            (smp__ckpt_meta *)smp__ckpt_push((void **)&f->meta, &f->nmeta, &f->meta_cap, sizeof *m, jp->label,
                                             "the header's metadata");
        if (!m) return SMP_ERR_NOMEM;
        m->key = k;
        m->value = v;
        if (smp__ckpt_eat(jp, ',')) continue;
        if (smp__ckpt_eat(jp, '}')) return SMP_OK;
        return smp__ckpt_jerr(jp, "expected ',' or '}' after metadata key '%s'", k);
    }
}

static smp_status smp__ckpt_parse_tensor(smp__ckpt_jp *jp, smp_ckpt_info *e) {
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    uint64_t begin = 0, end = 0;
    if (!smp__ckpt_eat(jp, '{')) return smp__ckpt_jerr(jp, "expected '{' holding dtype, shape and data_offsets");
    if (!smp__ckpt_eat(jp, '}')) {
        for (;;) {
            const char *k, *dt;
            SMP_TRY(smp__ckpt_jstring(jp, &k, "a key"));
            if (!smp__ckpt_eat(jp, ':')) return smp__ckpt_jerr(jp, "expected ':' after key '%s'", k);
            if (!strcmp(k, "dtype")) {
                if (have_dtype++) return smp__ckpt_jerr(jp, "dtype appears twice");
                SMP_TRY(smp__ckpt_jstring(jp, &dt, "the dtype"));
                int d = 1;
                for (; d < SMP_DTYPE_COUNT; d++)
                    if (!strcmp(dt, smp__dtypes[d].file_name)) break;
                if (d == SMP_DTYPE_COUNT)
                    return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor,
                                          "dtype \"%s\" is not one smp reads (F32 F16 BF16 F64 I32 I64 U8 BOOL)", dt);
                e->dtype = (smp_dtype)d;
            } else if (!strcmp(k, "shape")) {
                if (have_shape++) return smp__ckpt_jerr(jp, "shape appears twice");
                if (!smp__ckpt_eat(jp, '[')) return smp__ckpt_jerr(jp, "shape must be an array of integers");
                if (!smp__ckpt_eat(jp, ']')) {
                    for (;;) {
                        if (e->ndim == SMP_MAX_DIMS)
                            return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor,
                                                  "shape has more than %d dimensions", SMP_MAX_DIMS);
                        uint64_t v;
                        SMP_TRY(smp__ckpt_juint(jp, &v, "a dimension"));
                        e->shape[e->ndim++] = (int64_t)v;
                        if (smp__ckpt_eat(jp, ',')) continue;
                        if (smp__ckpt_eat(jp, ']')) break;
                        return smp__ckpt_jerr(jp, "expected ',' or ']' in shape");
                    }
                }
            } else if (!strcmp(k, "data_offsets")) {
                if (have_offsets++) return smp__ckpt_jerr(jp, "data_offsets appears twice");
                if (!smp__ckpt_eat(jp, '[')) return smp__ckpt_jerr(jp, "data_offsets must be [begin, end]");
                SMP_TRY(smp__ckpt_juint(jp, &begin, "the begin offset"));
                if (!smp__ckpt_eat(jp, ',')) return smp__ckpt_jerr(jp, "data_offsets must be [begin, end]");
                SMP_TRY(smp__ckpt_juint(jp, &end, "the end offset"));
                if (!smp__ckpt_eat(jp, ']')) return smp__ckpt_jerr(jp, "data_offsets must be [begin, end]");
            } else {
                return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor,
                                      "unknown key \"%s\" (a tensor has dtype, shape and data_offsets)", k);
            }
            if (smp__ckpt_eat(jp, ',')) continue;
            if (smp__ckpt_eat(jp, '}')) break;
            return smp__ckpt_jerr(jp, "expected ',' or '}' after key '%s'", k);
        }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor, "has no \"%s\"",
                              !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    if (end < begin)
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, jp->tensor, "data_offsets [%llu, %llu] run backwards",
                              (smp__ckpt_ull)begin, (smp__ckpt_ull)end);
    e->offset = begin;
    e->nbytes = end - begin;
    return SMP_OK;
}

static int smp__ckpt_cmp_name(const void *a, const void *b) {
    return strcmp((*(smp_ckpt_info *const *)a)->name, (*(smp_ckpt_info *const *)b)->name);
}

static int smp__ckpt_cmp_offset(const void *a, const void *b) {
    const smp_ckpt_info *x = *(smp_ckpt_info *const *)a, *y = *(smp_ckpt_info *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

static int smp__ckpt_cmp_meta(const void *a, const void *b) {
    return strcmp(((const smp__ckpt_meta *)a)->key, ((const smp__ckpt_meta *)b)->key);
}

static smp_ckpt_info *smp__ckpt_lookup(const smp_ckpt_file *f, const char *name) {
    smp_ckpt_info key, *kp = &key, **e;
    key.name = name;
    e = f->n ? (smp_ckpt_info **)bsearch(&kp, f->by_name, (size_t)f->n, sizeof *e, smp__ckpt_cmp_name) : NULL;
    return e ? *e : NULL;
}

/* Everything after the JSON: sizes, bounds, coverage, names, checksums. */
static smp_status smp__ckpt_validate(smp_ckpt_file *f) {
    char shp[160];
    for (int i = 0; i < f->n; i++) {
        smp_ckpt_info *e = &f->info[i];
        uint64_t need;
        if (e->offset + e->nbytes > f->data_len)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                                  "data_offsets [%llu, %llu] run past the end of the data section (%llu bytes)",
                                  (smp__ckpt_ull)e->offset, (smp__ckpt_ull)(e->offset + e->nbytes),
                                  (smp__ckpt_ull)f->data_len);
        if (!smp__ckpt_tensor_bytes(e->dtype, e->ndim, e->shape, &e->numel, &need))
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name, "shape %s overflows 64 bits",
                                  smp__shape_text(e->shape, e->ndim, shp, sizeof shp));
        if (need != e->nbytes)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                                  "shape %s of %s is %llu bytes, but data_offsets [%llu, %llu] span %llu",
                                  smp__shape_text(e->shape, e->ndim, shp, sizeof shp),
                                  smp__dtypes[e->dtype].file_name, (smp__ckpt_ull)need, (smp__ckpt_ull)e->offset,
                                  (smp__ckpt_ull)(e->offset + e->nbytes), (smp__ckpt_ull)e->nbytes);
    }
    /* names */
    smp_status st = SMP_OK;
    f->by_name = (smp_ckpt_info **)smp__ckpt_alloc(&st, sizeof(smp_ckpt_info *) * (size_t)f->n, f->label,
                                                   "the tensors sorted by name");
    smp_ckpt_info **by_off = (smp_ckpt_info **)smp__ckpt_alloc(&st, sizeof(smp_ckpt_info *) * (size_t)f->n, f->label,
                                               "the tensors sorted by offset");
    f->meta_sorted = (smp__ckpt_meta *)smp__ckpt_alloc(&st, sizeof(smp__ckpt_meta) * (size_t)f->nmeta, f->label,
                                                       "the metadata sorted by key");
    if (st) {
        smp__free(by_off);
        return st;
    }
    for (int i = 0; i < f->n; i++) f->by_name[i] = by_off[i] = &f->info[i];
    qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, smp__ckpt_cmp_name);
    for (int i = 1; i < f->n && !st; i++)
        if (!strcmp(f->by_name[i - 1]->name, f->by_name[i]->name))
            st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, f->by_name[i]->name, "the name appears twice in the header");
    /* coverage: sorted by offset, each tensor starts where the last ended */
    uint64_t pos = 0;
    if (!st) {
        qsort(by_off, (size_t)f->n, sizeof *by_off, smp__ckpt_cmp_offset);
        for (int i = 0; i < f->n && !st; i++) {
            smp_ckpt_info *e = by_off[i];
            if (e->offset < pos)
                st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                                    "data_offsets [%llu, %llu] overlap tensor '%s' [%llu, %llu]",
                                    (smp__ckpt_ull)e->offset, (smp__ckpt_ull)(e->offset + e->nbytes),
                                    by_off[i - 1]->name, (smp__ckpt_ull)by_off[i - 1]->offset,
                                    (smp__ckpt_ull)(by_off[i - 1]->offset + by_off[i - 1]->nbytes));
            else if (e->offset > pos)
                st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                                    "bytes [%llu, %llu) of the data section belong to no tensor (next is '%s')",
                                    (smp__ckpt_ull)pos, (smp__ckpt_ull)e->offset, e->name);
            pos = e->offset + e->nbytes;
        }
        if (!st && pos != f->data_len)
            st = smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                                "the data section is %llu bytes but the tensors cover only the first %llu",
                                (smp__ckpt_ull)f->data_len, (smp__ckpt_ull)pos);
    }
    smp__free(by_off);
    if (st) return st;
    /* metadata: unique keys, checksums of existing tensors */
    if (f->nmeta) memcpy(f->meta_sorted, f->meta, sizeof(smp__ckpt_meta) * (size_t)f->nmeta);
    qsort(f->meta_sorted, (size_t)f->nmeta, sizeof *f->meta_sorted, smp__ckpt_cmp_meta);
    for (int i = 1; i < f->nmeta; i++)
        if (!strcmp(f->meta_sorted[i - 1].key, f->meta_sorted[i].key))
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL, "metadata key '%s' appears twice",
                                  f->meta_sorted[i].key);
    for (int i = 0; i < f->nmeta; i++) {
        const char *k = f->meta[i].key, *v = f->meta[i].value;
        if (!smp__ckpt_starts(k, SMP__CKPT_CRC_KEY)) continue;
        const char *name = k + strlen(SMP__CKPT_CRC_KEY);
        smp_ckpt_info *e = smp__ckpt_lookup(f, name);
        if (!e)
            return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, name,
                                  "metadata holds a checksum for it, but the header has no such tensor");
        SMP_TRY(smp__ckpt_crc_text(v, &e->checksum, f->label, name, "checksum"));
        e->has_checksum = true;
    }
    return SMP_OK;
}

static smp_status smp__ckpt_parse(smp_ckpt_file *f) {
    smp__ckpt_jp jp;
    memset(&jp, 0, sizeof jp);
    int have_meta = 0;
    jp.s = f->header;
    jp.n = f->header_len;
    jp.label = f->label;
    if (jp.n == 0 || jp.s[0] != '{') return smp__ckpt_jerr(&jp, "the header must start with '{'");
    jp.i = 1;
    if (!smp__ckpt_eat(&jp, '}')) {
        for (;;) {
            const char *name;
            jp.tensor = NULL;
            SMP_TRY(smp__ckpt_jstring(&jp, &name, "a tensor name"));
            if (!smp__ckpt_eat(&jp, ':')) return smp__ckpt_jerr(&jp, "expected ':' after name '%s'", name);
            if (!strcmp(name, "__metadata__")) {
                if (have_meta++) return smp__ckpt_jerr(&jp, "__metadata__ appears twice");
                SMP_TRY(smp__ckpt_parse_meta(&jp, f));
            } else {
                smp_ckpt_info *e =
                    (smp_ckpt_info *)smp__ckpt_push((void **)&f->info, &f->n, &f->cap, sizeof *e, f->label,
                                                    "the header's tensor list");
                if (!e) return SMP_ERR_NOMEM;
                e->name = name;
                jp.tensor = name;
                SMP_TRY(smp__ckpt_parse_tensor(&jp, e));
                jp.tensor = NULL;
            }
            if (smp__ckpt_eat(&jp, ',')) continue;
            if (smp__ckpt_eat(&jp, '}')) break;
            return smp__ckpt_jerr(&jp, "expected ',' or '}' after '%s'", name);
        }
    }
    smp__ckpt_ws(&jp);
    if (jp.i != jp.n) return smp__ckpt_jerr(&jp, "only spaces may follow the header's closing '}'");
    return smp__ckpt_validate(f);
}

static smp_status smp__ckpt_pread_all(smp_ckpt_file *f, void *dst, size_t n, uint64_t off) {
    char *p = (char *)dst;
    if (f->mem) {
        if (off > f->size || n > f->size - off)
            return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL, "read past the end of the image");
        memcpy(dst, f->mem + off, n);
        return SMP_OK;
    }
#ifndef SMP__CKPT_POSIX2008
    if (lseek(f->fd, (off_t)off, SEEK_SET) < 0)
        return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL, "seek failed: %s", strerror(errno));
#endif
    while (n) {
#ifdef SMP__CKPT_POSIX2008
        ssize_t k = pread(f->fd, p, n, (off_t)off);
#else
        ssize_t k = read(f->fd, p, n);
#endif
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL, "read failed: %s", strerror(errno));
        if (k == 0)
            return smp__ckpt_fail(SMP_ERR_IO, f->label, NULL,
                                  "the file ends at byte %llu, before its data does (was it truncated while open?)",
                                  (smp__ckpt_ull)off);
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return SMP_OK;
}

/* Reads the length prefix and the header of an opened f and validates it. */
static smp_status smp__ckpt_load(smp_ckpt_file *f) {
    if (f->size < 8)
        return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                              "the file is %llu bytes, shorter than the 8-byte header length it must start with",
                              (smp__ckpt_ull)f->size);
    uint8_t pre[8];
    uint64_t hlen = 0;
    SMP_TRY(smp__ckpt_pread_all(f, pre, 8, 0));
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | pre[i];
    if (hlen > f->size - 8)
        return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL,
                              "the header length %llu is larger than the file (%llu bytes after the length)",
                              (smp__ckpt_ull)hlen, (smp__ckpt_ull)(f->size - 8));
    if (hlen > SMP__CKPT_MAX_HEADER)
        return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, NULL, "the header length %llu is over the %llu-byte limit",
                              (smp__ckpt_ull)hlen, (smp__ckpt_ull)SMP__CKPT_MAX_HEADER);
    f->header_len = (size_t)hlen;
    f->data_start = 8 + hlen;
    f->data_len = f->size - f->data_start;
    smp_status st = SMP_OK;
    if (!(f->header = (uint8_t *)smp__ckpt_alloc(&st, f->header_len + 1, f->label, "the header"))) return st;
    SMP_TRY(smp__ckpt_pread_all(f, f->header, f->header_len, 8));
    f->header[f->header_len] = 0;
    f->header_crc =
        smp_ckpt_crc32c(smp_ckpt_crc32c(0, pre, 8), f->header, f->header_len); /* before parsing decodes it */
    return smp__ckpt_parse(f);
}

/* Opens `path`, or with `mem` the image mem[0..n) that `path` names, and
   validates its header. */
static smp_status smp__ckpt_file_open(smp_ckpt_file **out, const char *path, const uint8_t *mem, size_t n) {
    char label[600];
    snprintf(label, sizeof label, "checkpoint '%s'", path);
    smp_status st = SMP_OK;
    smp_ckpt_file *f = (smp_ckpt_file *)smp__ckpt_alloc(&st, sizeof *f, label, "opening it");
    if (!f) return st;
    memset(f, 0, sizeof *f);
    f->fd = -1;
    size_t plen = strlen(path);
    /* one block: the path, then "checkpoint '<path>'" for messages */
    if ((f->path = (char *)smp__ckpt_alloc(&st, 2 * plen + 16, label, "its path and its name in messages"))) {
        memcpy(f->path, path, plen + 1);
        f->label = f->path + plen + 1;
        snprintf(f->label, plen + 15, "checkpoint '%s'", path);
    }
    f->mem = mem;
    f->size = n;
    if (!st && !mem) {
        struct stat sb;
        if ((f->fd = open(path, O_RDONLY | SMP__CKPT_O_CLOEXEC)) < 0)
            st = smp_error(SMP_ERR_IO, "cannot open checkpoint '%s': %s", path, strerror(errno));
        else if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode))
            st = smp_error(SMP_ERR_IO, "checkpoint '%s' is not a regular file", path);
        else
            f->size = (uint64_t)sb.st_size;
    }
    if (!st) st = smp__ckpt_load(f);
    if (st) smp_ckpt_close(f);
    else *out = f;
    return st;
}

SMPDEF smp_status smp_ckpt_open(const char *path, smp_ckpt_file **out) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp_ckpt_open: out is NULL");
    *out = NULL;
    if (!path) return smp_error(SMP_ERR_ARG, "smp_ckpt_open: path is NULL");
    return smp__ckpt_file_open(out, path, NULL, 0);
}

SMP__CORE smp_status smp__ckpt_open_memory(smp_ckpt_file **out, const char *label, const void *bytes, size_t n) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp__ckpt_open_memory: out is NULL");
    *out = NULL;
    if (!bytes && n) return smp_error(SMP_ERR_ARG, "smp__ckpt_open_memory: bytes is NULL");
    return smp__ckpt_file_open(out, label ? label : "<memory>", (const uint8_t *)(bytes ? bytes : ""), n);
}

SMPDEF void smp_ckpt_close(smp_ckpt_file *f) {
    if (!f) return;
    if (f->map && !f->mem) munmap((void *)(uintptr_t)f->map, (size_t)f->size);
    if (f->fd >= 0) close(f->fd);
    smp__free(f->path); /* and the label */
    smp__free(f->header);
    smp__free(f->info);
    smp__free(f->by_name);
    smp__free(f->meta);
    smp__free(f->meta_sorted);
    smp__free(f);
}

SMPDEF const char *smp_ckpt_path(const smp_ckpt_file *f) { return f ? f->path : NULL; }
SMPDEF int smp_ckpt_count(const smp_ckpt_file *f) { return f ? f->n : 0; }

SMPDEF const smp_ckpt_info *smp_ckpt_info_at(const smp_ckpt_file *f, int i) {
    return (f && i >= 0 && i < f->n) ? &f->info[i] : NULL;
}

SMPDEF const smp_ckpt_info *smp_ckpt_find(const smp_ckpt_file *f, const char *name) {
    if (!f || !name) {
        smp_error(SMP_ERR_ARG, "smp_ckpt_find: file or name is NULL");
        return NULL;
    }
    const smp_ckpt_info *e = smp__ckpt_lookup(f, name);
    if (!e) smp__ckpt_fail(SMP_ERR_ARG, f->label, name, "no tensor of that name in the file (%d tensors)", f->n);
    return e;
}

SMPDEF int smp_ckpt_meta_count(const smp_ckpt_file *f) { return f ? f->nmeta : 0; }

SMPDEF void smp_ckpt_meta_at(const smp_ckpt_file *f, int i, const char **key, const char **value) {
    int ok = f && i >= 0 && i < f->nmeta;
    if (key) *key = ok ? f->meta[i].key : NULL;
    if (value) *value = ok ? f->meta[i].value : NULL;
}

SMPDEF const char *smp_ckpt_meta(const smp_ckpt_file *f, const char *key) {
    if (!f || !key || !f->nmeta) return NULL;
    smp__ckpt_meta k = {key, NULL};
    const smp__ckpt_meta *m =
        (const smp__ckpt_meta *)bsearch(&k, f->meta_sorted, (size_t)f->nmeta, sizeof k, smp__ckpt_cmp_meta);
    return m ? m->value : NULL;
}

static smp_status smp__ckpt_check_entry(const smp_ckpt_file *f, const smp_ckpt_info *e, const char *fn) {
    if (!f || !e) return smp_error(SMP_ERR_ARG, "%s: file or entry is NULL", fn);
    uintptr_t p = (uintptr_t)e, lo = (uintptr_t)f->info, hi = (uintptr_t)(f->info + f->n);
    if (p < lo || p >= hi || (p - lo) % sizeof *e)
        return smp__ckpt_fail(SMP_ERR_ARG, f->label, NULL, "%s: the entry does not belong to this file", fn);
    return SMP_OK;
}

SMPDEF smp_status smp_ckpt_read_range(smp_ckpt_file *f, const smp_ckpt_info *e, uint64_t offset, void *dst,
                                      size_t n) {
    SMP_TRY(smp__ckpt_check_entry(f, e, "smp_ckpt_read_range"));
    if (offset > e->nbytes || n > e->nbytes - offset)
        return smp__ckpt_fail(SMP_ERR_ARG, f->label, e->name, "bytes [%llu, %llu) are outside its %llu bytes",
                              (smp__ckpt_ull)offset, (smp__ckpt_ull)offset + (smp__ckpt_ull)n,
                              (smp__ckpt_ull)e->nbytes);
    if (n && !dst) return smp__ckpt_fail(SMP_ERR_ARG, f->label, e->name, "destination is NULL");
    if (!n) return SMP_OK;
    return smp__ckpt_pread_all(f, dst, n, f->data_start + e->offset + offset);
}

static smp_status smp__ckpt_mismatch(const smp_ckpt_file *f, const smp_ckpt_info *e, uint32_t got) {
    return smp__ckpt_fail(SMP_ERR_FORMAT, f->label, e->name,
                          "checksum mismatch: the header records " SMP__CKPT_CRC_PREFIX "%08x but the data gives "
                          SMP__CKPT_CRC_PREFIX "%08x (the data is corrupt)",
                          (unsigned)e->checksum, (unsigned)got);
}

SMPDEF smp_status smp_ckpt_read(smp_ckpt_file *f, const smp_ckpt_info *e, void *dst, size_t cap) {
    SMP_TRY(smp__ckpt_check_entry(f, e, "smp_ckpt_read"));
    if (cap < e->nbytes)
        return smp__ckpt_fail(SMP_ERR_ARG, f->label, e->name, "a buffer of %zu bytes cannot hold its %llu bytes", cap,
                              (smp__ckpt_ull)e->nbytes);
    SMP_TRY(smp_ckpt_read_range(f, e, 0, dst, (size_t)e->nbytes));
    if (!e->has_checksum) return SMP_OK;
    uint32_t got = smp_ckpt_crc32c(0, dst, (size_t)e->nbytes);
    return got == e->checksum ? SMP_OK : smp__ckpt_mismatch(f, e, got);
}

SMPDEF smp_status smp_ckpt_verify_all(smp_ckpt_file *f) {
    if (!f) return smp_error(SMP_ERR_ARG, "smp_ckpt_verify_all: file is NULL");
    size_t cap = f->data_len < SMP__CKPT_IO_CHUNK ? (size_t)f->data_len : SMP__CKPT_IO_CHUNK;
    smp_status st = SMP_OK;
    uint8_t *buf = (uint8_t *)smp__ckpt_alloc(&st, cap, f->label, "verifying its checksums");
    if (!buf) return st;
    for (int i = 0; i < f->n && !st; i++) {
        const smp_ckpt_info *e = &f->info[i];
        uint64_t off = 0;
        uint32_t crc = 0;
        if (!e->has_checksum) continue;
        while (off < e->nbytes && !st) {
            size_t k = e->nbytes - off < cap ? (size_t)(e->nbytes - off) : cap;
            st = smp_ckpt_read_range(f, e, off, buf, k);
            crc = smp_ckpt_crc32c(crc, buf, k);
            off += k;
        }
        if (!st && crc != e->checksum) st = smp__ckpt_mismatch(f, e, crc);
    }
    smp__free(buf);
    return st;
}

/* ======================================================================== model checkpoints

   How a save and a load run (all ranks, in step; each numbered phase ends
   in an agreement, so an error anywhere is an error everywhere):

   PLAN (both): a private duplicate of the world communicator; every rank's
   (mp, dp) coordinates, so each partition's saver (its dp rank 0) is known;
   the list of tensors of the whole model: every parameter and buffer, which
   every rank knows from the module tree, plus the optimizer state that
   every rank registered, gathered and merged by name. File order puts the
   8-byte dtypes first, then 4, 2, 1 (declaration order within a width), so
   every tensor lies at a multiple of its element size.

   PARTIAL SAVE: world rank 0 picks the generation N, one past the
   manifest's and past any "<path>.g<M>_*" in the folder (0); each saver
   writes "<path>.g<N>_<mp>" with its partition's tensors and seals it:
   data, checksums, fsync, but no rename, while world rank 0 takes the
   memory its commit needs (1); only when every saver has
   sealed does each rename its file into place and fsync the folder (2);
   then world rank 0 gathers every file's size and header checksum and
   commits: the manifest's tmp file, fsync, rename over "<path>.manifest",
   folder fsync (3); then each saver removes what the new generation
   replaced for its partition, partition 0's saver also for partitions
   that no longer exist (4). A failure before the commit removes the new
   files (each saver its own).

   FULL SAVE: world rank 0's saver opens the one file and writes the header
   for all tensors, and every rank takes the buffers of the transfer (1);
   then it takes the tensors in file order, its own from
   memory and the others' from their savers, which send them in chunks
   (chunk_bytes, 4 MiB) over MPI, at most SMP__CKPT_RING chunks in flight per
   rank: no rank ever holds more than that of another's data. An I/O thread
   of the writer checksums and writes while its main thread receives the
   next chunks, and the file puts partition 0's own tensors last in each
   dtype width, so the transfers overlap the disk (2); then it commits (3).

   LOAD: open the headers (partial: the files the manifest names, each
   checked against it; without a manifest, the format before them:
   "<path>_0" names the partition count P, then "<path>_1" .. "<path>_<P-1>",
   all with the same save id) (1);
   match every tensor of the files with the model by name, dtype and shape,
   missing and unexpected ones being errors (2); checksum every tensor this
   rank will load, reading the files through a read-only mapping (3); only
   then copy (4), large host tensors with streaming stores. A mapping lets
   the checksum pass and the copy read the page cache directly, so a load
   reads the data about as fast as one plain read() would; where mmap fails
   it falls back to reading into buffers.

   METADATA smp adds to every file (the file layer adds smp.checksum.*):
       smp.format            "smp-checkpoint/1"
       smp.kind              "full" or "partial"
       smp.partitions        the partition count of the model that saved it
       smp.mp_rank           (partial) the partition this file holds
       smp.generation        (partial) N of "<path>.g<N>_<mp>"
       smp.save_id           the same in every file of one save
       smp.partition.<name>  for every tensor of the model (in every file):
                             the partition that held it */

#define SMP__CKPT_FORMAT "smp-checkpoint/1"
#define SMP__CKPT_TAG 7411
#define SMP__CKPT_RING 8
#define SMP__CKPT_MAX_TP 1024

enum { SMP__CKPT_PARAM, SMP__CKPT_BUFFER, SMP__CKPT_OPTIM, SMP__CKPT_GLOBAL };

typedef struct smp__ckpt_state {
    char *full; /* name in files: "optimizer.<param>.<name>" or "optimizer.<name>" */
    int global; /* state of the optimizer as a whole */
    smp_tensor t;
    smp_param *param; /* NULL for global state */
} smp__ckpt_state;

/* The part of a tensor that one rank holds, one file has or one segment
   moves: slice `index` of `parts` equal slices along `axis` of the full
   shape (parts 1: the whole tensor), and elements [first, first + count)
   of that slice, counted row-major within it. A TP shard is a slice, a
   shard_optimizer_state range a run of elements of one. With blocks > 1
   the axis is that many equal blocks and the slice is slice `index` of
   each, joined (smp_param_new_sharded_blocks): the slice of axis + 1 of
   the tensor seen as [..., blocks, shape[axis] / blocks, ...]. */
typedef struct smp__ckpt_piece {
    int axis, parts, index, blocks;
    int64_t first, count;
} smp__ckpt_piece;

/* Elements [lo, hi) of slice pc.index, held by world rank `rank` as its piece pc. */
typedef struct smp__ckpt_seg {
    int rank;
    smp__ckpt_piece pc;
    int64_t lo, hi;
} smp__ckpt_seg;

/* A tensor of a file that a load reads from, and the piece of the item it holds. */
typedef struct smp__ckpt_src {
    int item, file, sharded; /* sharded: it has a smp.shard.<name> entry */
    const smp_ckpt_info *e;
    smp__ckpt_piece pc;
    const uint8_t *bytes; /* its verified data (mapped or staged) */
    uint8_t *staged;      /* owned copy when the file could not be mapped */
} smp__ckpt_src;

struct smp_optimizer {
    smp_model *model;
    smp__ckpt_state *s;
    int n, cap;
};

/* One tensor of the whole model, as the plan sees it: its full shape, as a
   full checkpoint holds it. */
typedef struct smp__ckpt_item {
    const char *name;
    smp_dtype dtype;
    int ndim;
    int64_t shape[SMP_MAX_DIMS];
    uint64_t nbytes;
    int mp;                  /* the partition holding it (whole-optimizer state: 0) */
    int kind;                /* SMP__CKPT_PARAM ... */
    int saver_has;           /* optimizer state: registered on the rank that saves it */
    int elementwise;         /* optimizer state shaped as its parameter, sharded as it is (TP, ZeRO) */
    const smp_tensor *local; /* this rank's tensor when it holds all of it, or NULL */
    const smp_tensor *copy;  /* a shared module's copy on this rank, saved by partition `mp`; loads like local */
    const smp_tensor *mine;  /* what this rank holds of it (its own or a copy), or NULL ... */
    smp__ckpt_piece mine_pc; /* ... and which piece that is */
    int seg0, nseg;          /* pl->segs[seg0 ..]: who holds which part, for saving; in order */
    int split;               /* more than the partition saver's whole tensor: TP shards, ZeRO ranges */
    smp_tensor whole;        /* a full save: a split item gathered on its saver (data owned) */
    int src0, nsrc;          /* a load: pl->srcs[src0 ..], the file tensors holding it */
} smp__ckpt_item;

typedef struct smp__ckpt_plan {
    MPI_Comm comm; /* private duplicate of the world */
    int rank, size, P, mp, dp, tp, tp_rank;
    int *coords;   /* [3 x size]: every rank's pp, tp and rdp rank */
    int *saver;    /* [P]: world rank of tp rank 0 and rdp rank 0 of each partition */
    smp__ckpt_item *items;
    int n;
    int *order;    /* file order */
    int *by_name;  /* indices sorted by name */
    char *gathered; /* every rank's optimizer registrations (names point into it) */
    smp__ckpt_seg *segs;
    int nsegs, segs_cap;
    smp__ckpt_src *srcs;
    int nsrcs, srcs_cap;
    int split, zero; /* some item is split; some is held in ranges by replicas other than rdp rank 0 */
    size_t chunk;
    char save_id[40];
    smp_status failed; /* an agreement failed: every rank holds this error */
} smp__ckpt_plan;

/* An agreement of the plan's ranks (smp__agree_on), made once per failure:
   once one has failed, every rank holds the agreed error and the later ones
   return it without agreeing again (a second agreement would credit the
   error to the lowest rank and prefix its message twice). */
static smp_status smp__ckpt_agree(smp__ckpt_plan *pl, smp_status st, const char *what) {
    if (pl->failed) return pl->failed;
    st = smp__agree_on(pl->comm, st, what);
    pl->failed = st;
    return st;
}

static const char *smp__ckpt_kind_name(int kind) {
    return kind == SMP__CKPT_PARAM ? "parameter" : kind == SMP__CKPT_BUFFER ? "buffer" : "optimizer state";
}

static const char *smp__ckpt_describe(smp_dtype dt, int ndim, const int64_t *shape, char *buf, size_t cap) {
    char shp[160];
    const char *d = smp_ckpt_dtype_string(dt);
    snprintf(buf, cap, "%s %s", d ? d : "?", smp__shape_text(shape, ndim, shp, sizeof shp));
    return buf;
}

/* Host <-> host or device copies; devices go through the registered backend. */
static smp_status smp__ckpt_copy(void *dst, int dst_dev, const void *src, int src_dev, size_t n) {
    if (!n) return SMP_OK;
    if (dst_dev == SMP_HOST && src_dev == SMP_HOST) {
        memcpy(dst, src, n);
        return SMP_OK;
    }
    if (!smp__ctx.has_device || !smp__ctx.device.copy)
        return smp_error(SMP_ERR_DEVICE, "a tensor on CUDA device %d needs a device backend (include smp_nccl.h)",
                         SMP_CUDA_ORDINAL(dst_dev != SMP_HOST ? dst_dev : src_dev));
    return smp__ctx.device.copy(dst, dst_dev, src, src_dev, n);
}

/* The load's copy into the model. A plain copy reads every destination line
   before it overwrites it (read for ownership), so a large copy moves three
   bytes over the memory bus for each byte loaded; non-temporal stores write
   whole lines without reading them first: with two ranks copying 128 MiB
   each at once, 13-14 ms per rank instead of 18-19 here. They also leave
   the tensor out of the cache, which costs nothing for a tensor larger than
   the cache and would for a small one, hence the threshold. SSE2 is part
   of x86-64, so no dispatch: 32- and 64-byte stores measured within the
   noise of 16-byte ones (the bus, not the core, sets the pace). */
#if defined(__x86_64__) && defined(__SSE2__) && !defined(SMP_CKPT_NO_STREAM)
#define SMP__CKPT_STREAM 1
#define SMP__CKPT_STREAM_MIN ((size_t)1 << 20)
static void smp__ckpt_stream_copy(void *dst, const void *src, size_t n) {
    uint8_t *d = (uint8_t *)dst;
    const uint8_t *s = (const uint8_t *)src;
    size_t head = (size_t)(-(uintptr_t)d & 63);
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, a);
        _mm_stream_si128((__m128i *)(void *)(d + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + 48), e);
    }
    /* streaming stores are weakly ordered: without the fence another thread
       could see the agreement that follows before it sees the parameters */
    _mm_sfence();
    memcpy(d, s, n);
}
#endif

/* The host-to-host copy of a load, whatever the size; internal, exposed for
   tests. */
SMP__CORE void smp__ckpt_copy_in_host(void *dst, const void *src, size_t n) {
#ifdef SMP__CKPT_STREAM
    if (n >= SMP__CKPT_STREAM_MIN) {
        smp__ckpt_stream_copy(dst, src, n);
        return;
    }
#endif
    if (n) memcpy(dst, src, n);
}

static smp_status smp__ckpt_copy_in(void *dst, int dst_dev, const void *src, size_t n) {
    if (dst_dev == SMP_HOST) {
        smp__ckpt_copy_in_host(dst, src, n);
        return SMP_OK;
    }
    return smp__ckpt_copy(dst, dst_dev, src, SMP_HOST, n);
}

/* ---------------------------------------------------------------- pieces */
static int64_t smp__ckpt_numel(const smp__ckpt_item *it) {
    int64_t n = 1;
    for (int d = 0; d < it->ndim; d++) n *= it->shape[d];
    return n;
}

static smp__ckpt_piece smp__ckpt_whole(const smp__ckpt_item *it) {
    smp__ckpt_piece pc = {0, 1, 0, 1, 0, smp__ckpt_numel(it)};
    return pc;
}

static bool smp__ckpt_is_whole(const smp__ckpt_item *it, const smp__ckpt_piece *pc) {
    return pc->parts == 1 && pc->first == 0 && pc->count == smp__ckpt_numel(it);
}

/* Where element j of slice pc->index lies in the full tensor, and in *len
   how many elements from j on (up to hi) follow it there contiguously. */
static int64_t smp__ckpt_run(const smp__ckpt_item *it, const smp__ckpt_piece *pc, int64_t j, int64_t hi, int64_t *len) {
    if (pc->parts == 1) {
        *len = hi - j;
        return j;
    }
    int64_t inner = 1;
    for (int d = pc->axis + 1; d < it->ndim; d++) inner *= it->shape[d];
    int64_t run = it->shape[pc->axis] / pc->blocks / pc->parts * inner, o = j / run, r = j % run;
    *len = run - r < hi - j ? run - r : hi - j;
    return (o * pc->parts + pc->index) * run + r;
}

/* Copies the elements that pieces d and s of an item share, from src (s's
   elements back to back, host memory) to dst (d's, on device dst_dev);
   adds their count to *moved. Both pieces run through the full tensor in
   increasing order, so one pass over the runs of each finds them all. */
static smp_status smp__ckpt_overlap(const smp__ckpt_item *it, const smp__ckpt_piece *d, uint8_t *dst, int dst_dev,
                                    const smp__ckpt_piece *s, const uint8_t *src, int64_t *moved) {
    size_t es = smp__dtypes[it->dtype].size;
    int64_t jd = d->first, de = d->first + d->count, js = s->first, se = s->first + s->count, ld, ls;
    smp_status st = SMP_OK;
    if (jd >= de || js >= se) return SMP_OK;
    int64_t fd = smp__ckpt_run(it, d, jd, de, &ld), fs = smp__ckpt_run(it, s, js, se, &ls);
    for (;;) {
        int64_t a = fd > fs ? fd : fs, b = fd + ld < fs + ls ? fd + ld : fs + ls;
        if (a < b && dst) {
            smp_status s2 = smp__ckpt_copy_in(dst + (size_t)(jd - d->first + a - fd) * es, dst_dev,
                                              src + (size_t)(js - s->first + a - fs) * es, (size_t)(b - a) * es);
            if (!st) st = s2;
        }
        if (a < b && moved) *moved += b - a;
        if (fd + ld <= fs + ls) {
            if ((jd += ld) >= de) break;
            fd = smp__ckpt_run(it, d, jd, de, &ld);
        } else {
            if ((js += ls) >= se) break;
            fs = smp__ckpt_run(it, s, js, se, &ls);
        }
    }
    return st;
}

/* The metadata "smp.shard.<name>" of a piece in a partial checkpoint's file:
   {"shape":[16,8],"axis":0,"parts":2,"index":1,"offset":8,"first":0,"count":64}
   (offset: where the slice starts along the axis); a blocked slice has
   "blocks":3 after "parts", and its offset is within each block. */
static void smp__ckpt_piece_text(int ndim, const int64_t *shape, const smp__ckpt_piece *pc, char *buf, size_t cap) {
    size_t at = (size_t)snprintf(buf, cap, "{\"shape\":[");
    for (int d = 0; d < ndim && at < cap; d++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%lld", d ? "," : "", (long long)shape[d]);
    if (at < cap) at += (size_t)snprintf(buf + at, cap - at, "],\"axis\":%d,\"parts\":%d,", pc->axis, pc->parts);
    if (at < cap && pc->blocks > 1) at += (size_t)snprintf(buf + at, cap - at, "\"blocks\":%d,", pc->blocks);
    if (at < cap)
        snprintf(buf + at, cap - at, "\"index\":%d,\"offset\":%lld,\"first\":%lld,\"count\":%lld}", pc->index,
                 (long long)(ndim ? shape[pc->axis] / pc->blocks / pc->parts * pc->index : 0), (long long)pc->first,
                 (long long)pc->count);
}

/* Parses that text (only exactly as smp__ckpt_piece_text writes it) into a
   consistent piece of a tensor of *ndim dimensions. */
static bool smp__ckpt_piece_parse(const char *v, int *ndim, int64_t *shape, smp__ckpt_piece *pc) {
    int64_t x[SMP_MAX_DIMS + 6], numel = 1;
    int n = 0;
    for (const char *c = v; *c;) {
        if (*c < '0' || *c > '9') {
            c++;
            continue;
        }
        if (n == SMP_MAX_DIMS + 6) return false;
        char *end;
        x[n++] = (int64_t)strtoll(c, &end, 10);
        c = end;
    }
    int blocked = strstr(v, "\"blocks\":") != NULL, fields = 6 + blocked; /* blocks: between parts and index */
    if (n < fields) return false;
    *ndim = n - fields;
    for (int d = 0; d < *ndim; d++) numel *= (shape[d] = x[d]);
    pc->axis = (int)x[*ndim];
    pc->parts = (int)x[*ndim + 1];
    pc->blocks = blocked ? (int)x[*ndim + 2] : 1;
    pc->index = (int)x[n - 4];
    pc->first = x[n - 2];
    pc->count = x[n - 1];
    if (pc->parts < 1 || pc->index >= pc->parts || pc->axis >= (*ndim ? *ndim : 1) || x[*ndim + 1] > INT32_MAX ||
        pc->blocks < 1 || (blocked && x[*ndim + 2] > INT32_MAX) ||
        (pc->parts > 1 && (!*ndim || shape[pc->axis] % ((int64_t)pc->parts * pc->blocks))) ||
        pc->first + pc->count > numel / pc->parts)
        return false;
    char again[400];
    smp__ckpt_piece_text(*ndim, shape, pc, again, sizeof again);
    return !strcmp(again, v);
}

/* ---------------------------------------------------------------- optimizer registry */
SMPDEF smp_status smp_optimizer_new(smp_model *m, smp_optimizer **out) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp_optimizer_new: out is NULL");
    *out = NULL;
    if (!m) return smp_error(SMP_ERR_ARG, "smp_optimizer_new: model is NULL");
    smp_status st = SMP_OK;
    smp_optimizer *o = (smp_optimizer *)smp__alloc_or(&st, sizeof *o, SMP__ALLOC_OTHER, "smp_optimizer_new's registry");
    if (!o) return st;
    o->model = m;
    *out = o;
    return SMP_OK;
}

SMPDEF void smp_optimizer_free(smp_optimizer *o) {
    if (!o) return;
    for (int i = 0; i < o->n; i++) {
        smp__count_kind(SMP_MEMORY_OPTIMIZER, -(int64_t)smp_tensor_nbytes(&o->s[i].t)); /* the memory account */
        smp__free(o->s[i].full);
    }
    smp__free(o->s);
    smp__free(o);
}

SMPDEF int smp_optimizer_state_count(const smp_optimizer *o) { return o ? o->n : 0; }

SMPDEF smp_status smp_optimizer_state_add(smp_optimizer *o, const char *param, const char *name, const smp_tensor *t) {
    const char *fn = "smp_optimizer_state_add";
    if (!o || !name || !t) return smp_error(SMP_ERR_ARG, "%s: optimizer, name and tensor must not be NULL", fn);
    if (!*name || strchr(name, '.'))
        return smp_error(SMP_ERR_ARG, "%s: state name \"%s\" must be non-empty and hold no '.'", fn, name);
    int64_t numel;
    uint64_t bytes;
    if ((int)t->dtype <= (int)SMP_DTYPE_INVALID || (int)t->dtype >= (int)SMP_DTYPE_COUNT || t->ndim < 0 ||
        t->ndim > SMP_MAX_DIMS || !smp__ckpt_tensor_bytes(t->dtype, t->ndim, t->shape, &numel, &bytes))
        return smp_error(SMP_ERR_ARG, "%s: state '%s' of '%s': invalid dtype, ndim or shape", fn, name,
                         param ? param : "(optimizer)");
    if (bytes && !t->data)
        return smp_error(SMP_ERR_ARG, "%s: state '%s' of '%s' has no data", fn, name, param ? param : "(optimizer)");
    char what[320];
    snprintf(what, sizeof what, "state '%s' of '%s'", name, param ? param : "(optimizer)");
    SMP_TRY(smp__check_device(t, fn, what));
    if (param) {
        smp_param *p = smp_model_find_param(o->model, param);
        if (!p) return smp_error(SMP_ERR_ARG, "%s: the model has no parameter '%s'", fn, param);
        int part = smp_module_partition(smp_param_module(p));
        if (!smp_model_is_partitioned(o->model) || part < 0)
            return smp_error(SMP_ERR_STATE,
                             "%s: the model is not partitioned yet; register optimizer state of '%s' after "
                             "smp_model_trace or the first step",
                             fn, param);
        if (!smp_module_is_local(smp_param_module(p)))
            return smp_error(SMP_ERR_ARG,
                             "%s: parameter '%s' lives on partition %d, not on this rank (pp rank %d); register its "
                             "state on the ranks of partition %d",
                             fn, param, part, smp_pp_rank(), part);
        int64_t first = 0, owned = 0;
        smp_status rs = smp_param_owned_range(o->model, p, &first, &owned);
        if (rs) return rs;
        if (smp_current_config()->shard_optimizer_state == SMP_ON && numel != owned && numel > 1)
            return smp_error(
                SMP_ERR_ARG,
                "%s: state '%s' of '%s' has %lld elements, but with shard_optimizer_state this replica "
                "owns %lld of the parameter's %lld (elements %lld..%lld): register state for the owned range only "
                "(smp_param_owned_range)",
                fn, name, param, (long long)numel, (long long)owned, (long long)smp_tensor_numel(smp_param_value(p)),
                (long long)first, (long long)(first + owned - 1));
    }
    smp_status st = SMP_OK;
    size_t len = strlen(SMP_CKPT_OPTIMIZER_PREFIX) + (param ? strlen(param) + 1 : 0) + strlen(name) + 1;
    char *full = (char *)smp__alloc_or(&st, len, SMP__ALLOC_OTHER | SMP__UNINIT,
                                       "the name of the optimizer state smp_optimizer_state_add registers");
    if (st) return st;
    snprintf(full, len, "%s%s%s%s", SMP_CKPT_OPTIMIZER_PREFIX, param ? param : "", param ? "." : "", name);
    for (int i = 0; i < o->n; i++)
        if (!strcmp(o->s[i].full, full)) {
            st = smp_error(SMP_ERR_ARG, "%s: '%s' is already registered", fn, full);
            smp__free(full);
            return st;
        }
    if (!smp__grow_or(&st, (void **)&o->s, &o->cap, o->n + 1, sizeof *o->s,
                      "the optimizer registry smp_optimizer_state_add extends")) {
        smp__free(full);
        return st;
    }
    o->s[o->n].full = full;
    o->s[o->n].global = param == NULL;
    o->s[o->n].t = *t;
    o->s[o->n].param = param ? smp_model_find_param(o->model, param) : NULL;
    o->n++;
    smp__count_kind(SMP_MEMORY_OPTIMIZER, (int64_t)bytes); /* the memory account: the engine's state, registered */
    return SMP_OK;
}

/* ---------------------------------------------------------------- the plan */
static void smp__ckpt_plan_free(smp__ckpt_plan *pl) {
    if (pl->items)
        for (int i = 0; i < pl->n; i++) smp__free(pl->items[i].whole.data);
    for (int i = 0; i < pl->nsrcs; i++) smp__free(pl->srcs[i].staged);
    if (pl->comm != MPI_COMM_NULL) SMP__MPI_WARN(MPI_Comm_free(&pl->comm), "releasing a checkpoint's communicator");
    smp__free(pl->saver);
    smp__free(pl->coords);
    smp__free(pl->segs);
    smp__free(pl->srcs);
    smp__free(pl->items);
    smp__free(pl->order);
    smp__free(pl->by_name);
    smp__free(pl->gathered);
    memset(pl, 0, sizeof *pl);
    pl->comm = MPI_COMM_NULL;
}

static const smp__ckpt_plan *smp__ckpt_sort_plan; /* qsort has no context argument */

static int smp__ckpt_cmp_item_name(const void *a, const void *b) {
    return strcmp(smp__ckpt_sort_plan->items[*(const int *)a].name, smp__ckpt_sort_plan->items[*(const int *)b].name);
}

/* File order: widest dtype first (alignment); within a width, partition
   0's tensors last, so a full save's writer (partition 0's saver) receives
   the others' data while its disk is busy, and writes its own at the end;
   then declaration order. */
static int smp__ckpt_cmp_order(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b, lx, ly;
    size_t sx = smp__dtypes[smp__ckpt_sort_plan->items[x].dtype].size,
           sy = smp__dtypes[smp__ckpt_sort_plan->items[y].dtype].size;
    if (sx != sy) return sx > sy ? -1 : 1;
    lx = smp__ckpt_sort_plan->items[x].mp == 0;
    ly = smp__ckpt_sort_plan->items[y].mp == 0;
    if (lx != ly) return lx - ly;
    return x < y ? -1 : x > y;
}

static int smp__ckpt_find(const smp__ckpt_plan *pl, const char *name) {
    for (int lo = 0, hi = pl->n - 1; lo <= hi;) {
        int mid = lo + (hi - lo) / 2, c = strcmp(pl->items[pl->by_name[mid]].name, name);
        if (!c) return pl->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* The world rank that sends an item's data when saving or gathering. */
static int smp__ckpt_source(const smp__ckpt_plan *pl, const smp__ckpt_item *it) { return pl->saver[it->mp]; }

/* One registration record as it travels: global (1 byte), name + NUL, then
   the wire struct (the same binary on every rank). Elementwise state (shaped
   as its parameter's local slice, or as the range this replica owns under
   shard_optimizer_state) travels with its parameter's full shape and the
   piece it holds; other state with its own shape, whole. */
typedef struct smp__ckpt_wire {
    int32_t dtype, ndim, elementwise, unused;
    int64_t shape[SMP_MAX_DIMS];
    smp__ckpt_piece pc;
} smp__ckpt_wire;

typedef struct smp__ckpt_rec {
    const char *name;
    int rank, global, index; /* index: in the registry of `rank` */
    smp__ckpt_wire w;
} smp__ckpt_rec;

static void smp__ckpt_wire_of(const smp_optimizer *o, const smp__ckpt_state *s, smp__ckpt_wire *w) {
    int64_t n = smp_tensor_numel(&s->t), nloc, first = 0, owned;
    memset(w, 0, sizeof *w);
    w->dtype = (int32_t)s->t.dtype;
    w->ndim = s->t.ndim;
    memcpy(w->shape, s->t.shape, sizeof(int64_t) * (size_t)s->t.ndim);
    w->pc.parts = w->pc.blocks = 1;
    w->pc.count = n;
    if (!s->param || !smp_module_is_local(smp_param_module(s->param))) return;
    nloc = owned = smp_tensor_numel(smp_param_value(s->param));
    if (smp_param_owned_range(o->model, s->param, &first, &owned)) return;
    if (owned == nloc) first = 0;
    else if (n != owned) return; /* not the owned range: whole */
    if (owned == nloc && n != nloc) return;
    w->elementwise = 1;
    w->ndim = smp_param_full_shape(s->param, w->shape);
    w->pc.axis = smp_param_shard_axis(s->param);
    w->pc.parts = w->pc.axis >= 0 ? smp_tp_size() : 1;
    w->pc.index = w->pc.axis >= 0 ? smp_tp_rank() : 0;
    w->pc.blocks = w->pc.axis >= 0 ? smp_param_shard_blocks(s->param) : 1;
    if (w->pc.axis < 0) w->pc.axis = 0;
    w->pc.first = first;
    w->pc.count = owned;
}

static int smp__ckpt_cmp_rec(const void *a, const void *b) {
    const smp__ckpt_rec *x = (const smp__ckpt_rec *)a, *y = (const smp__ckpt_rec *)b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->rank < y->rank ? -1 : x->rank > y->rank);
}


/* Sets a plan item: a tensor `name` of partition mp, in no file yet. */
static void smp__ckpt_item_init(smp__ckpt_item *it, const char *name, smp_dtype dt, int ndim, const int64_t *shape,
                                int kind, int mp) {
    int64_t numel;
    memset(it, 0, sizeof *it);
    it->name = name;
    it->dtype = dt;
    it->ndim = ndim;
    memcpy(it->shape, shape, sizeof it->shape);
    smp__ckpt_tensor_bytes(dt, ndim, shape, &numel, &it->nbytes);
    it->kind = kind;
    it->mp = mp;
}

/* Serialises this rank's registrations into *out (malloc'd). */
static smp_status smp__ckpt_pack(const smp_optimizer *o, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    if (!o || !o->n) return SMP_OK;
    size_t n = 0, at = 0;
    for (int i = 0; i < o->n; i++) n += 1 + strlen(o->s[i].full) + 1 + sizeof(smp__ckpt_wire);
    smp_status st = SMP_OK;
    char *b =
        (char *)smp__alloc_or(&st, n, SMP__ALLOC_OTHER | SMP__UNINIT,
                              "this rank's optimizer state names, packed for the other ranks (a checkpoint's plan)");
    if (!b) return st;
    for (int i = 0; i < o->n; i++) {
        const smp__ckpt_state *s = &o->s[i];
        size_t k = strlen(s->full) + 1;
        smp__ckpt_wire w;
        b[at++] = (char)s->global;
        memcpy(b + at, s->full, k);
        at += k;
        smp__ckpt_wire_of(o, s, &w);
        memcpy(b + at, &w, sizeof w);
        at += sizeof w;
    }
    *out = b;
    *len = at;
    return SMP_OK;
}

/* Appends a segment to the plan. */
static smp_status smp__ckpt_add_seg(smp__ckpt_plan *pl, int rank, const smp__ckpt_piece *pc, int64_t lo, int64_t hi) {
    smp_status st = SMP_OK;
    if (!smp__grow_or(&st, (void **)&pl->segs, &pl->segs_cap, pl->nsegs + 1, sizeof *pl->segs,
                      "the parts of the model's tensors each rank holds (a checkpoint's plan)"))
        return st;
    smp__ckpt_seg sg = {rank, *pc, lo, hi};
    pl->segs[pl->nsegs++] = sg;
    return SMP_OK;
}

/* The world rank at (pp, tp, rdp), or -1. */
static int smp__ckpt_rank_at(const smp__ckpt_plan *pl, int pp, int tp, int rdp) {
    for (int r = 0; r < pl->size; r++)
        if (pl->coords[3 * r] == pp && pl->coords[3 * r + 1] == tp && pl->coords[3 * r + 2] == rdp) return r;
    return -1;
}

/* Covers item `it` with segments of the pieces that ranks rank[0..nc) hold
   (pcs[]), preferring the partition's saver, then rdp rank 0, then the
   lowest rank: the same on every rank. A gap is an error naming it. */
static smp_status smp__ckpt_cover(smp__ckpt_plan *pl, smp__ckpt_item *it, const int *rank, const smp__ckpt_piece *pcs,
                                  int nc) {
    int parts = nc ? pcs[0].parts : 1, saver = pl->saver[it->mp];
    int64_t n = smp__ckpt_numel(it) / parts;
    it->seg0 = pl->nsegs;
    for (int t = 0; t < parts; t++)
        for (int64_t at = 0; at < n;) {
            int best = -1;
            for (int c = 0; c < nc; c++) {
                const smp__ckpt_piece *pc = &pcs[c];
                if (pc->index != t || pc->first > at || pc->first + pc->count <= at) continue;
                long key = rank[c] == saver ? -1 : (long)pl->coords[3 * rank[c] + 2] * pl->size + rank[c];
                long bk = best < 0              ? 0
                          : rank[best] == saver ? -1
                                                : (long)pl->coords[3 * rank[best] + 2] * pl->size + rank[best];
                if (best < 0 || key < bk) best = c;
            }
            if (best < 0)
                return smp_error(SMP_ERR_ARG,
                                 "%s '%s': no rank holds element %lld of %s (%lld elements): the ranks' "
                                 "shard_optimizer_state ranges do not cover the parameter; register its state for "
                                 "the range smp_param_owned_range gives, on every replica",
                                 smp__ckpt_kind_name(it->kind), it->name, (long long)at,
                                 parts > 1 ? "its TP slice" : "it", (long long)n);
            int64_t hi = pcs[best].first + pcs[best].count < n ? pcs[best].first + pcs[best].count : n;
            SMP_TRY(smp__ckpt_add_seg(pl, rank[best], &pcs[best], at, hi));
            at = hi;
        }
    it->nseg = pl->nsegs - it->seg0;
    const smp__ckpt_seg *s0 = &pl->segs[it->seg0];
    it->split = !(it->nseg == 1 && s0->rank == saver && s0->pc.parts == 1 && s0->lo == 0 && s0->hi == n);
    for (int k = 0; k < it->nseg; k++)
        if (pl->coords[3 * pl->segs[it->seg0 + k].rank + 2] > 0) pl->zero = 1;
    pl->split |= it->split;
    return SMP_OK;
}

/* An item held whole by its partition's saver. */
static smp_status smp__ckpt_cover_whole(smp__ckpt_plan *pl, smp__ckpt_item *it) {
    smp__ckpt_piece pc = smp__ckpt_whole(it);
    int r = pl->saver[it->mp];
    return smp__ckpt_cover(pl, it, &r, &pc, 1);
}

/* Merges every rank's optimizer registrations into plan items, from
   `first` on. Every rank sees the same gathered bytes, so every rank
   reaches the same verdict. */
static smp_status smp__ckpt_merge_optimizer(smp__ckpt_plan *pl, const int *counts, const int *displs,
                                          const smp_optimizer *opt, int *nitems) {
    smp__ckpt_rec *recs = NULL;
    int nrec = 0, cap = 0, *ranks = NULL;
    smp__ckpt_piece *pcs = NULL;
    smp_status st = SMP_OK;
    for (int r = 0; r < pl->size; r++) {
        const char *p = pl->gathered + displs[r], *end = p + counts[r];
        for (int index = 0; p < end; index++) {
            smp__ckpt_rec rec;
            memset(&rec, 0, sizeof rec);
            rec.global = *p++;
            rec.name = p;
            p += strlen(p) + 1;
            memcpy(&rec.w, p, sizeof rec.w);
            p += sizeof rec.w;
            rec.rank = r;
            rec.index = index;
            if (!smp__grow_or(&st, (void **)&recs, &cap, nrec + 1, sizeof *recs,
                              "merging every rank's optimizer state names (a checkpoint's plan)")) {
                smp__free(recs);
                return st;
            }
            recs[nrec++] = rec;
        }
    }
    if (nrec) qsort(recs, (size_t)nrec, sizeof *recs, smp__ckpt_cmp_rec);
    ranks = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(nrec + 1), SMP__ALLOC_OTHER,
                                 "the ranks holding each optimizer state (a checkpoint's plan)");
    pcs = (smp__ckpt_piece *)smp__alloc_or(&st, sizeof *pcs * (size_t)(nrec + 1), SMP__ALLOC_OTHER,
                                           "the parts of each optimizer state (a checkpoint's plan)");
    for (int i = 0, j; i < nrec && !st; i = j) {
        const smp__ckpt_rec *a = &recs[i];
        for (j = i; j < nrec && !strcmp(recs[j].name, a->name); j++) {
            const smp__ckpt_rec *b = &recs[j];
            if (b->global != a->global || b->w.dtype != a->w.dtype || b->w.elementwise != a->w.elementwise ||
                !smp__same_shape(a->w.ndim, a->w.shape, b->w.ndim, b->w.shape) ||
                (a->w.elementwise && (a->w.pc.parts != b->w.pc.parts || a->w.pc.axis != b->w.pc.axis ||
                                      a->w.pc.blocks != b->w.pc.blocks))) {
                char d1[200], d2[200];
                st = smp_error(
                    SMP_ERR_ARG,
                    "optimizer state '%s' is registered as %s%s on world rank %d but as %s%s on world rank %d", a->name,
                    smp__ckpt_describe((smp_dtype)a->w.dtype, a->w.ndim, a->w.shape, d1, sizeof d1),
                    a->global ? " (whole optimizer)" : a->w.elementwise ? " (shaped as its parameter)" : "", a->rank,
                    smp__ckpt_describe((smp_dtype)b->w.dtype, b->w.ndim, b->w.shape, d2, sizeof d2),
                    b->global ? " (whole optimizer)" : b->w.elementwise ? " (shaped as its parameter)" : "", b->rank);
                break;
            }
        }
        if (st) break;
        smp__ckpt_item *it = &pl->items[*nitems];
        smp__ckpt_item_init(it, a->name, (smp_dtype)a->w.dtype, a->w.ndim, a->w.shape,
                            a->global ? SMP__CKPT_GLOBAL : SMP__CKPT_OPTIM,
                            a->global ? 0 : pl->coords[3 * a->rank]);
        it->elementwise = a->w.elementwise;
        for (int r = i; r < j; r++) {
            if (recs[r].rank == pl->saver[it->mp]) it->saver_has = 1;
            if (recs[r].rank == pl->rank && opt) {
                it->mine = &opt->s[recs[r].index].t;
                it->mine_pc = recs[r].w.pc;
                if (smp__ckpt_is_whole(it, &it->mine_pc)) it->local = it->mine;
            }
            ranks[r - i] = recs[r].rank;
            pcs[r - i] = recs[r].w.pc;
        }
        if (it->elementwise) st = smp__ckpt_cover(pl, it, ranks, pcs, j - i);
        else if (it->saver_has) st = smp__ckpt_cover_whole(pl, it);
        (*nitems)++;
    }
    smp__free(ranks);
    smp__free(pcs);
    smp__free(recs);
    return st;
}

/* Builds the plan. Collective over the world; every rank makes the same MPI
   calls whatever fails locally. The buffers its exchanges fill are agreed
   on (allocated on every rank) before any rank enters an exchange; the
   caller agrees on the rest (smp__ckpt_agree, which returns an agreed failure
   of the plan without agreeing again). */
static smp_status smp__ckpt_plan_init(smp__ckpt_plan *pl, smp_model *m, const smp_optimizer *opt, size_t chunk) {
    MPI_Request req;
    int *counts = NULL, *displs = NULL, mine[3], np, i, nitems = 0, total;
    char *packed = NULL;
    size_t packed_len = 0;
    smp_status st = SMP_OK;
    struct {
        char id[40];
        uint64_t chunk;
    } head;

    memset(pl, 0, sizeof *pl);
    pl->comm = MPI_COMM_NULL;
    /* The collectives of a save or load: a rank whose call fails leaves the
       others inside it, with no agreement possible, so those failures abort
       (MPI ERRORS in smp.h); what fails before an agreement returns there. */
    SMP__MPI_FATAL(MPI_Comm_idup(smp_group_comm(SMP_WORLD), &pl->comm, &req),
                   "copying the world communicator for a checkpoint");
    smp_wait_requests(1, &req, "checkpoint communicator", SMP_WORLD, -1);
    st = SMP__MPI_CHECK(MPI_Comm_rank(pl->comm, &pl->rank), "asking this rank in a checkpoint's communicator");
    if (!st) st = SMP__MPI_CHECK(MPI_Comm_size(pl->comm, &pl->size), "asking the size of a checkpoint's communicator");
    if (st) pl->size = 0; /* nothing to plan for: the agreement below fails the call everywhere */
    pl->P = smp_pp_size();
    pl->mp = smp_pp_rank();
    pl->dp = smp_rdp_rank();
    pl->tp = smp_tp_size();
    pl->tp_rank = smp_tp_rank();

    /* what the exchanges below fill, and this rank's part of them */
    pl->coords = (int *)smp__alloc_or(&st, sizeof(int) * 3 * (size_t)pl->size, SMP__ALLOC_OTHER | SMP__UNINIT,
                                      "every rank's partition, shard and replica (a checkpoint's plan)");
    counts = (int *)smp__alloc_or(&st, sizeof(int) * 2 * (size_t)pl->size, SMP__ALLOC_OTHER | SMP__UNINIT,
                                  "the lengths of every rank's optimizer state names (a checkpoint's plan)");
    pl->saver = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)pl->P, SMP__ALLOC_OTHER | SMP__UNINIT,
                                     "the saver of each partition (a checkpoint's plan)");
    if (!st) st = smp__ckpt_pack(opt, &packed, &packed_len);
    if (!st && packed_len > (size_t)INT32_MAX)
        st = smp_error(SMP_ERR_ARG, "too many optimizer state names to exchange");
    if ((st = smp__ckpt_agree(pl, st, "planning the checkpoint")) != SMP_OK) goto out;

    /* who saves each partition */
    displs = counts + pl->size;
    mine[0] = pl->mp;
    mine[1] = pl->tp_rank;
    mine[2] = pl->dp;
    SMP__MPI_FATAL(MPI_Iallgather(mine, 3, MPI_INT, pl->coords, 3, MPI_INT, pl->comm, &req),
                   "gathering every rank's partition, shard and replica (a checkpoint's plan)");
    smp_wait_requests(1, &req, "checkpoint topology", SMP_WORLD, -1);
    for (i = 0; i < pl->P; i++) pl->saver[i] = -1;
    for (i = 0; i < pl->size; i++)
        if (pl->coords[3 * i + 1] == 0 && pl->coords[3 * i + 2] == 0 && pl->coords[3 * i] >= 0 &&
            pl->coords[3 * i] < pl->P)
            pl->saver[pl->coords[3 * i]] = i;
    for (i = 0; i < pl->P; i++)
        SMP_ASSERT(pl->saver[i] >= 0);

    /* one save id and chunk size for all: rank 0's */
    memset(&head, 0, sizeof head);
    if (pl->rank == 0) {
        static unsigned counter;
        double now = MPI_Wtime(); /* (C99 has no timespec_get) */
        snprintf(head.id, sizeof head.id, "%08llx%08llx-%x-%x", (smp__ckpt_ull)time(NULL) & 0xffffffffull,
                 (smp__ckpt_ull)((now - floor(now)) * 1e9), (unsigned)getpid(), ++counter);
        head.chunk = chunk ? chunk : SMP_CKPT_DEFAULT_CHUNK;
        if (head.chunk > ((size_t)1 << 30)) head.chunk = (size_t)1 << 30;
    }
    SMP__MPI_FATAL(MPI_Ibcast(&head, (int)sizeof head, MPI_BYTE, 0, pl->comm, &req),
                   "sharing the save id from world rank 0 (a checkpoint's plan)");
    smp_wait_requests(1, &req, "checkpoint save id", SMP_WORLD, 0);
    memcpy(pl->save_id, head.id, sizeof pl->save_id);
    pl->save_id[sizeof pl->save_id - 1] = 0;
    pl->chunk = (size_t)head.chunk;

    /* optimizer registrations, from every rank */
    {
        int len = (int)packed_len;
        SMP__MPI_FATAL(MPI_Iallgather(&len, 1, MPI_INT, counts, 1, MPI_INT, pl->comm, &req),
                       "gathering the lengths of optimizer state names (a checkpoint's plan)");
        smp_wait_requests(1, &req, "optimizer state names", SMP_WORLD, -1);
    }
    total = 0;
    for (i = 0; i < pl->size; i++) {
        displs[i] = total;
        total += counts[i];
    }
    pl->gathered = (char *)smp__alloc_or(&st, (size_t)total + 1, SMP__ALLOC_OTHER | SMP__UNINIT,
                                         "every rank's optimizer state names (a checkpoint's plan)");
    if ((st = smp__ckpt_agree(pl, st, "planning the checkpoint")) != SMP_OK) goto out;
    SMP__MPI_FATAL(
        MPI_Iallgatherv(packed, (int)packed_len, MPI_BYTE, pl->gathered, counts, displs, MPI_BYTE, pl->comm, &req),
        "gathering optimizer state names (a checkpoint's plan)");
    smp_wait_requests(1, &req, "optimizer state names", SMP_WORLD, -1);
    smp__free(packed);
    packed = NULL;

    /* items: parameters and buffers, then optimizer state */
    np = smp_model_num_global_params(m, true);
    {
        int nrec = 0;
        const char *p = pl->gathered, *end = pl->gathered + total;
        while (p < end) { /* count records: an upper bound of distinct names */
            p += 1;
            p += strlen(p) + 1 + sizeof(smp__ckpt_wire);
            nrec++;
        }
        pl->items = (smp__ckpt_item *)smp__alloc_or(&st, sizeof(smp__ckpt_item) * (size_t)(np + nrec + 1),
                                                    SMP__ALLOC_OTHER | SMP__UNINIT,
                                                    "the list of the model's tensors (a checkpoint's plan)");
    }
    if (st) goto out;
    for (i = 0; i < np && !st; i++) {
        smp_param *p = smp_model_global_param(m, i, true);
        if (!p) smp__fatal("a checkpoint's plan: the model has no global parameter %d of %d", i, np);
        const smp_tensor *v = smp_param_value(p);
        int64_t full[SMP_MAX_DIMS];
        int nd = smp_param_full_shape(p, full);
        smp__ckpt_item *it = &pl->items[nitems++];
        smp__ckpt_item_init(it, smp_param_name(p), v->dtype, nd, full,
                            smp_param_is_buffer(p) ? SMP__CKPT_BUFFER : SMP__CKPT_PARAM,
                            smp_module_partition(smp_param_module(p)));
        if (it->mp < 0 || it->mp >= pl->P) {
            st = smp_error(SMP_ERR_STATE, "%s '%s' has no partition; is the model partitioned?",
                           smp__ckpt_kind_name(it->kind), it->name);
            break;
        }
        /* a sharded parameter: slice tp_rank of tp along its axis, saved by rdp rank 0 of each slice */
        smp__ckpt_piece pc = smp__ckpt_whole(it);
        if (smp_param_shard_axis(p) >= 0 && pl->tp > 1) {
            pc.axis = smp_param_shard_axis(p);
            pc.blocks = smp_param_shard_blocks(p);
            pc.parts = pl->tp;
            pc.count /= pl->tp;
        }
        if (smp_module_is_local(smp_param_module(p))) {
            it->mine = v;
            it->mine_pc = pc;
            it->mine_pc.index = pl->tp_rank;
            if (pc.parts == 1) *(it->mp == pl->mp ? &it->local : &it->copy) = v;
        }
        if (pc.parts == 1) {
            st = smp__ckpt_cover_whole(pl, it);
        } else {
            int ranks[SMP__CKPT_MAX_TP];
            smp__ckpt_piece pcs[SMP__CKPT_MAX_TP];
            for (int t = 0; t < pc.parts && t < SMP__CKPT_MAX_TP; t++) {
                ranks[t] = smp__ckpt_rank_at(pl, it->mp, t, 0);
                pcs[t] = pc;
                pcs[t].index = t;
            }
            st = pc.parts > SMP__CKPT_MAX_TP ? smp_error(SMP_ERR_ARG,
                                                         "checkpoints take tensor_parallel_degree up to %d, "
                                                         "not %d",
                                                         SMP__CKPT_MAX_TP, pc.parts)
                                             : smp__ckpt_cover(pl, it, ranks, pcs, pc.parts);
        }
    }
    if (!st) st = smp__ckpt_merge_optimizer(pl, counts, displs, opt, &nitems);
    pl->n = nitems;
    if (st) goto out;

    /* names are unique; file order */
    pl->by_name = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(pl->n + 1), SMP__ALLOC_OTHER | SMP__UNINIT,
                                       "the model's tensors sorted by name (a checkpoint's plan)");
    pl->order = (int *)smp__alloc_or(&st, sizeof(int) * (size_t)(pl->n + 1), SMP__ALLOC_OTHER | SMP__UNINIT,
                                     "the model's tensors in file order (a checkpoint's plan)");
    if (st) goto out;
    for (i = 0; i < pl->n; i++) pl->by_name[i] = pl->order[i] = i;
    smp__ckpt_sort_plan = pl;
    qsort(pl->by_name, (size_t)pl->n, sizeof(int), smp__ckpt_cmp_item_name);
    qsort(pl->order, (size_t)pl->n, sizeof(int), smp__ckpt_cmp_order);
    smp__ckpt_sort_plan = NULL;
    for (i = 1; i < pl->n && !st; i++) {
        const smp__ckpt_item *a = &pl->items[pl->by_name[i - 1]], *b = &pl->items[pl->by_name[i]];
        if (!strcmp(a->name, b->name))
            st = smp_error(SMP_ERR_ARG, "two tensors of the checkpoint would be called '%s' (a %s and a %s)", a->name,
                           smp__ckpt_kind_name(a->kind), smp__ckpt_kind_name(b->kind));
    }
out:
    smp__free(counts);
    smp__free(packed);
    return st;
}

/* ---------------------------------------------------------------- streaming to one rank */
typedef smp_status (*smp__ckpt_sink_fn)(void *ctx, int item, uint64_t off, const void *bytes, size_t n);

/* The receiver's I/O thread. The main thread receives (MPI stays on it)
   and queues pieces; this thread hands them to the sink in order, so a sink
   that blocks on the disk does not stop the transfer. Ring slots holding a
   received chunk are "busy" until written. */
#define SMP__CKPT_QUEUE 64

typedef struct smp__ckpt_job {
    int item;
    uint64_t off;
    const void *p;
    size_t n;
    int slot; /* ring slot to release once written; -1: none */
} smp__ckpt_job;

typedef struct smp__ckpt_io {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* broadcast on every change: work queued, work done, quit */
    smp__ckpt_job q[SMP__CKPT_QUEUE];
    int head, count, quit;
    int busy[SMP__CKPT_RING];
    smp__ckpt_sink_fn sink;
    void *ctx;
    smp_status st; /* the sink's first error */
    char msg[sizeof smp__errbuf]; /* its message: the last error is per thread */
} smp__ckpt_io;

static void *smp__ckpt_io_main(void *arg) {
    smp__ckpt_io *io = (smp__ckpt_io *)arg;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->count && !io->quit) pthread_cond_wait(&io->cv, &io->mu);
        if (!io->count) break;
        smp__ckpt_job j = io->q[io->head];
        pthread_mutex_unlock(&io->mu);
        smp_status st = SMP_OK;
        if (!io->st) st = io->sink(io->ctx, j.item, j.off, j.p, j.n); /* after an error: drain */
        pthread_mutex_lock(&io->mu);
        if (!io->st && st) {
            io->st = st;
            memcpy(io->msg, smp__errbuf, sizeof io->msg);
        }
        io->head = (io->head + 1) % SMP__CKPT_QUEUE;
        io->count--;
        if (j.slot >= 0) io->busy[j.slot] = 0;
        pthread_cond_broadcast(&io->cv);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

static void smp__ckpt_io_push(smp__ckpt_io *io, smp__ckpt_job j) {
    pthread_mutex_lock(&io->mu);
    while (io->count == SMP__CKPT_QUEUE) pthread_cond_wait(&io->cv, &io->mu);
    io->q[(io->head + io->count) % SMP__CKPT_QUEUE] = j;
    io->count++;
    if (j.slot >= 0) io->busy[j.slot] = 1;
    pthread_cond_broadcast(&io->cv);
    pthread_mutex_unlock(&io->mu);
}

/* Whether ring slot s may take a new receive; with `block`, waits for it. */
static bool smp__ckpt_io_free(smp__ckpt_io *io, int s, bool block) {
    if (!io) return true;
    pthread_mutex_lock(&io->mu);
    while (block && io->busy[s]) pthread_cond_wait(&io->cv, &io->mu);
    bool ok = !io->busy[s];
    pthread_mutex_unlock(&io->mu);
    return ok;
}

/* Receives, on `receiver`, the data of every item in file order (its own
   from memory, the others' from their savers, chunk by chunk), handing each
   piece to sink in order. Collective over the plan's communicator. At most
   SMP__CKPT_RING chunks are in flight to or buffered on any rank. After a
   sink error the receiver keeps draining, so no sender is left waiting.
   With `threaded`, the sink runs on an I/O thread of the receiver. */
typedef struct smp__ckpt_rx {
    smp__ckpt_plan *pl;
    int receiver, qp; /* posting cursor: position in file order ... */
    uint64_t offp;    /* ... and offset in that item */
    long posted, done;
    uint8_t *buf[SMP__CKPT_RING]; /* allocated before the transfer (smp__ckpt_stream_prepare) */
    MPI_Request req[SMP__CKPT_RING];
    size_t cap;
    uint8_t *stage; /* the receiver's own device tensors go through it */
    smp__ckpt_io *io;
} smp__ckpt_rx;

/* Posts the receive of the next remote chunk if its slot is free (or, with
   `block`, once it is); returns whether it posted one. */
static bool smp__ckpt_post(smp__ckpt_rx *rx, bool block) {
    smp__ckpt_plan *pl = rx->pl;
    if (rx->posted - rx->done >= SMP__CKPT_RING) return false;
    while (rx->qp < pl->n && (smp__ckpt_source(pl, &pl->items[pl->order[rx->qp]]) == rx->receiver ||
                              rx->offp >= pl->items[pl->order[rx->qp]].nbytes)) {
        rx->qp++;
        rx->offp = 0;
    }
    if (rx->qp >= pl->n) return false;
    int s = (int)(rx->posted % SMP__CKPT_RING);
    if (!smp__ckpt_io_free(rx->io, s, block)) return false;
    const smp__ckpt_item *ip = &pl->items[pl->order[rx->qp]];
    size_t lp = ip->nbytes - rx->offp < pl->chunk ? (size_t)(ip->nbytes - rx->offp) : pl->chunk;
    SMP_ASSERT(rx->buf[s] != NULL);
    SMP__MPI_FATAL(
        MPI_Irecv(rx->buf[s], (int)lp, MPI_BYTE, smp__ckpt_source(pl, ip), SMP__CKPT_TAG, pl->comm, &rx->req[s]),
        "receiving checkpoint data of '%s' from world rank %d", ip->name, smp__ckpt_source(pl, ip));
    rx->posted++;
    rx->offp += lp;
    return true;
}

static smp_status smp__ckpt_receive(smp__ckpt_rx *rx, smp__ckpt_sink_fn sink, void *ctx) {
    smp__ckpt_plan *pl = rx->pl;
    smp_status st = SMP_OK;
    for (int q = 0; q < pl->n; q++) {
        int idx = pl->order[q];
        const smp__ckpt_item *it = &pl->items[idx];
        int src = smp__ckpt_source(pl, it);
        uint64_t off = 0;
        while (off < it->nbytes) {
            size_t len;
            smp__ckpt_job j;
            while (smp__ckpt_post(rx, false)) {
            } /* receives posted ahead progress while we poll below */
            if (src == rx->receiver) { /* this rank's own tensor */
                const smp_tensor *t = it->local;
                SMP_ASSERT(t != NULL);
                if (t->device == SMP_HOST) {
                    len = (size_t)(it->nbytes - off);
                    j.item = idx;
                    j.off = off;
                    j.p = (const uint8_t *)t->data + off;
                    j.n = len;
                    j.slot = -1;
                    if (rx->io) smp__ckpt_io_push(rx->io, j);
                    else if (!st) st = sink(ctx, idx, off, j.p, len);
                } else { /* staged through a buffer of its own (never threaded) */
                    len = it->nbytes - off < pl->chunk ? (size_t)(it->nbytes - off) : pl->chunk;
                    SMP_ASSERT(rx->stage != NULL);
                    smp_status st2 =
                        smp__ckpt_copy(rx->stage, SMP_HOST, (const uint8_t *)t->data + off, t->device, len);
                    if (!st) st = st2;
                    if (!st) st = sink(ctx, idx, off, rx->stage, len);
                }
            } else {
                int slot = (int)(rx->done % SMP__CKPT_RING), ready = 0;
                unsigned polls = 0;
                double start = MPI_Wtime(), deadline = start + smp_timeout();
                len = it->nbytes - off < pl->chunk ? (size_t)(it->nbytes - off) : pl->chunk;
                if (rx->posted <= rx->done && !smp__ckpt_post(rx, true)) /* the cursor is at this very chunk */
                    smp__fatal("internal error: checkpoint chunk %ld of '%s' cannot be received", rx->done, it->name);
                /* The receiver drives large transfers within a node (it copies
                   from the sender), so it polls without sleeping, yielding the
                   core between polls; sleeping a millisecond per poll, as
                   smp_wait_requests does after a while, slowed a 4 MiB chunk
                   several times over. Meanwhile it posts receives into slots
                   the I/O thread has freed. Past smp_timeout() the job aborts. */
                while (!ready) {
                    MPI_Status status;
                    SMP__MPI_FATAL(MPI_Test(&rx->req[slot], &ready, &status),
                                   "receiving checkpoint data of '%s' from world rank %d", it->name, src);
                    if (!ready && ++polls % 16 == 0) {
                        while (smp__ckpt_post(rx, false)) {
                        }
                        if (MPI_Wtime() > deadline) {
                            char what[256];
                            snprintf(what, sizeof what, "checkpoint data of '%s' from world rank %d", it->name, src);
                            smp__timeout_abort(what, SMP_WORLD, src, MPI_Wtime() - start);
                        }
                        sched_yield();
                    }
                }
                j.item = idx;
                j.off = off;
                j.p = rx->buf[slot];
                j.n = len;
                j.slot = slot;
                if (rx->io) smp__ckpt_io_push(rx->io, j);
                else if (!st) st = sink(ctx, idx, off, j.p, len);
                rx->done++;
            }
            off += len;
        }
    }
    SMP_ASSERT(rx->posted == rx->done);
    return st;
}

/* Allocates what this rank needs to take part in smp__ckpt_stream to
   `receiver`: the receiver's ring of SMP__CKPT_RING chunk buffers (fewer when
   fewer chunks come) and a staging buffer for its own device tensors; a
   sender's ring when it sends device tensors (staged through host memory).
   Called, and agreed on, before the transfer starts, so no rank runs out of
   memory inside it while the others wait. */
static smp_status smp__ckpt_stream_prepare(smp__ckpt_plan *pl, int receiver, smp__ckpt_rx *rx) {
    memset(rx, 0, sizeof *rx);
    rx->pl = pl;
    rx->receiver = receiver;
    uint64_t biggest = 0;
    for (int i = 0; i < pl->n; i++)
        if (pl->items[i].nbytes > biggest) biggest = pl->items[i].nbytes;
    rx->cap = biggest < pl->chunk ? (size_t)biggest : pl->chunk;
    if (!rx->cap) rx->cap = 1;
    long chunks = 0;
    int device = 0, own_device = 0;
    for (int i = 0; i < pl->n; i++) {
        const smp__ckpt_item *it = &pl->items[i];
        int src = smp__ckpt_source(pl, it);
        long n = (long)((it->nbytes + pl->chunk - 1) / pl->chunk);
        if (pl->rank == receiver && src != receiver) chunks += n;
        if (pl->rank != receiver && src == pl->rank) {
            chunks += n;
            if (it->local && it->local->device != SMP_HOST) device = 1;
        }
        if (pl->rank == receiver && src == receiver && it->local && it->local->device != SMP_HOST) own_device = 1;
    }
    if (pl->rank != receiver && !device) chunks = 0; /* a host sender sends from the tensors themselves */
    smp_status st = SMP_OK;
    for (int i = 0; i < SMP__CKPT_RING && i < chunks; i++)
        rx->buf[i] = (uint8_t *)smp__alloc_or(&st, rx->cap, SMP__ALLOC_OTHER | SMP__UNINIT,
                                              "a checkpoint transfer buffer (one of 8)");
    if (own_device)
        rx->stage = (uint8_t *)smp__alloc_or(&st, rx->cap, SMP__ALLOC_OTHER | SMP__UNINIT,
                                             "staging a device tensor to save it");
    return st;
}

static void smp__ckpt_stream_free(smp__ckpt_rx *rx) {
    for (int i = 0; i < SMP__CKPT_RING; i++) smp__free(rx->buf[i]);
    smp__free(rx->stage);
    memset(rx->buf, 0, sizeof rx->buf);
    rx->stage = NULL;
}

/* Streams every item to `receiver` (see smp__ckpt_receive), with the buffers
   smp__ckpt_stream_prepare allocated on every rank. */
static smp_status smp__ckpt_stream(smp__ckpt_rx *rx, smp__ckpt_sink_fn sink, void *ctx, int threaded) {
    smp__ckpt_plan *pl = rx->pl;
    int receiver = rx->receiver;
    smp_status st = SMP_OK;
    const int K = SMP__CKPT_RING;
    char what[128];
    snprintf(what, sizeof what, "world rank %d to take checkpoint data", receiver);

    if (pl->rank == receiver) {
        smp__ckpt_io io;
        pthread_t th;
        for (int i = 0; i < pl->n && threaded; i++) /* device tensors are staged on the main thread */
            if (smp__ckpt_source(pl, &pl->items[i]) == receiver && pl->items[i].local &&
                pl->items[i].local->device != SMP_HOST)
                threaded = 0;
        if (threaded) {
            memset(&io, 0, sizeof io);
            io.sink = sink;
            io.ctx = ctx;
            pthread_mutex_init(&io.mu, NULL);
            pthread_cond_init(&io.cv, NULL);
            if (pthread_create(&th, NULL, smp__ckpt_io_main, &io) == 0) {
                rx->io = &io;
            } else {
                pthread_cond_destroy(&io.cv);
                pthread_mutex_destroy(&io.mu);
            }
        }
        st = smp__ckpt_receive(rx, sink, ctx);
        if (rx->io) {
            pthread_mutex_lock(&io.mu);
            io.quit = 1;
            pthread_cond_broadcast(&io.cv);
            pthread_mutex_unlock(&io.mu);
            pthread_join(th, NULL);
            if (!st && io.st) st = smp_error(io.st, "%s", io.msg);
            pthread_cond_destroy(&io.cv);
            pthread_mutex_destroy(&io.mu);
        }
    } else {
        long sent = 0;
        for (int q = 0; q < pl->n; q++) {
            const smp__ckpt_item *it = &pl->items[pl->order[q]];
            uint64_t off = 0;
            if (smp__ckpt_source(pl, it) != pl->rank) continue;
            SMP_ASSERT(it->local != NULL);
            while (off < it->nbytes) {
                int slot = (int)(sent % K);
                size_t len = it->nbytes - off < pl->chunk ? (size_t)(it->nbytes - off) : pl->chunk;
                const void *p;
                if (sent >= K) /* senders may sleep between polls: the receiver drives the copy */
                    smp_wait_requests(1, &rx->req[slot], what, SMP_WORLD, receiver);
                if (it->local->device == SMP_HOST) {
                    p = (const uint8_t *)it->local->data + off;
                } else { /* send what the copy gave; a failure fails the save later */
                    SMP_ASSERT(rx->buf[slot] != NULL);
                    smp_status st2 = smp__ckpt_copy(rx->buf[slot], SMP_HOST, (const uint8_t *)it->local->data + off,
                                       it->local->device, len);
                    if (!st) st = st2;
                    p = rx->buf[slot];
                }
                SMP__MPI_FATAL(MPI_Isend(p, (int)len, MPI_BYTE, receiver, SMP__CKPT_TAG, pl->comm, &rx->req[slot]),
                               "sending checkpoint data of '%s' to world rank %d", it->name, receiver);
                sent++;
                off += len;
            }
        }
        for (long k = sent > K ? sent - K : 0; k < sent; k++)
            smp_wait_requests(1, &rx->req[k % K], what, SMP_WORLD, receiver);
    }
    rx->io = NULL;
    return st;
}

/* ---------------------------------------------------------------- gathering split tensors
   A full save (and smp_model_state_dict) streams each tensor whole from its
   partition's saver. A split tensor (TP slices, shard_optimizer_state
   ranges) is first gathered whole there: each other rank holding a segment
   sends it, in plan order and in chunks, and the saver places the chunks.
   The saver then holds its partition's split tensors whole until the end
   of the save, on the host. Collective over the world. */
static smp_status smp__ckpt_assemble(smp__ckpt_plan *pl) {
    smp_status st = SMP_OK;
    int stage = 0;
    uint8_t *buf = NULL;
    for (int i = 0; i < pl->n; i++) {
        smp__ckpt_item *it = &pl->items[i];
        if (!it->split) continue;
        int home = pl->saver[it->mp];
        for (int k = 0; k < it->nseg; k++) {
            int r = pl->segs[it->seg0 + k].rank;
            if ((home == pl->rank && r != home) || (r == pl->rank && it->mine->device != SMP_HOST)) stage = 1;
        }
        if (home != pl->rank || st) continue;
        it->whole = smp_tensor_make(NULL, it->dtype, it->ndim, it->shape);
        it->whole.data = smp__alloc_or(&st, it->nbytes ? (size_t)it->nbytes : 1, SMP__ALLOC_OTHER | SMP__UNINIT,
                                       "a sharded tensor, gathered whole to save it");
        it->local = &it->whole;
    }
    if (stage)
        buf = (uint8_t *)smp__alloc_or(&st, pl->chunk, SMP__ALLOC_OTHER | SMP__UNINIT,
                                       "a chunk of a sharded tensor (gathering it)");
    if ((st = smp__ckpt_agree(pl, st, "gathering the sharded tensors whole")) != SMP_OK) {
        smp__free(buf);
        return st;
    }
    for (int q = 0; q < pl->n; q++) {
        const smp__ckpt_item *it = &pl->items[pl->order[q]];
        if (!it->split) continue;
        int home = pl->saver[it->mp];
        size_t es = smp__dtypes[it->dtype].size;
        int64_t per = pl->chunk / es ? (int64_t)(pl->chunk / es) : 1;
        smp__ckpt_piece all = smp__ckpt_whole(it);
        for (int k = 0; k < it->nseg; k++) {
            const smp__ckpt_seg *sg = &pl->segs[it->seg0 + k];
            if (sg->rank != pl->rank && home != pl->rank) continue;
            for (int64_t a = sg->lo; a < sg->hi; a += per) {
                int64_t b = sg->hi - a < per ? sg->hi : a + per;
                smp__ckpt_piece pc = {sg->pc.axis, sg->pc.parts, sg->pc.index, sg->pc.blocks, a, b - a};
                size_t n = (size_t)(b - a) * es;
                const uint8_t *src = buf;
                MPI_Request req;
                if (sg->rank == pl->rank) {
                    src = (const uint8_t *)it->mine->data + (size_t)(a - it->mine_pc.first) * es;
                    if (it->mine->device != SMP_HOST) {
                        smp_status s2 = smp__ckpt_copy(buf, SMP_HOST, src, it->mine->device, n);
                        if (!st) st = s2; /* sent all the same: the agreement below fails the save */
                        src = buf;
                    }
                    if (home != pl->rank) {
                        SMP__MPI_FATAL(MPI_Isend(src, (int)n, MPI_BYTE, home, SMP__CKPT_TAG + 1, pl->comm, &req),
                                       "sending a slice of '%s' to world rank %d", it->name, home);
                        smp_wait_requests(1, &req, "a sharded tensor's saver to take a slice", SMP_WORLD, home);
                        continue;
                    }
                } else {
                    SMP__MPI_FATAL(MPI_Irecv(buf, (int)n, MPI_BYTE, sg->rank, SMP__CKPT_TAG + 1, pl->comm, &req),
                                   "receiving a slice of '%s' from world rank %d", it->name, sg->rank);
                    smp_wait_requests(1, &req, "a slice of a sharded tensor", SMP_WORLD, sg->rank);
                }
                smp__ckpt_overlap(it, &all, (uint8_t *)it->whole.data, SMP_HOST, &pc, src, NULL);
            }
        }
    }
    smp__free(buf);
    return smp__ckpt_agree(pl, st, "gathering the sharded tensors whole");
}

/* ---------------------------------------------------------------- saving */
typedef struct smp__ckpt_meta_list {
    char **keys, **vals;
    int n, cap;
    int oom;
    size_t want; /* after oom: the bytes it could not have */
} smp__ckpt_meta_list;

static void smp__ckpt_meta_add(smp__ckpt_meta_list *md, const char *k1, const char *k2, const char *v) {
    if (md->oom) return;
    int cap2 = md->cap;
    if (!smp__grow((void **)&md->keys, &md->cap, md->n + 1, sizeof(char *), &md->want) ||
        !smp__grow((void **)&md->vals, &cap2, md->n + 1, sizeof(char *), &md->want)) {
        md->oom = 1;
        return;
    }
    char *k = smp__ckpt_strf("%s%s", k1, k2 ? k2 : ""), *val = k ? smp__strdup(v) : NULL;
    if (!k || !val) {
        md->want = !k ? strlen(k1) + (k2 ? strlen(k2) : 0) + 1 : strlen(v) + 1;
        smp__free(k);
        md->oom = 1;
        return;
    }
    md->keys[md->n] = k;
    md->vals[md->n] = val;
    md->n++;
}

static void smp__ckpt_meta_free(smp__ckpt_meta_list *md) {
    for (int i = 0; i < md->n; i++) {
        smp__free(md->keys[i]);
        smp__free(md->vals[i]);
    }
    smp__free(md->keys);
    smp__free(md->vals);
    memset(md, 0, sizeof *md);
}

static smp_status smp__ckpt_build_meta(const smp__ckpt_plan *pl, const smp_save_desc *d, int partial, uint64_t gen,
                                     int files, int file, smp__ckpt_meta_list *md) {
    char num[48];
    int i;
    memset(md, 0, sizeof *md);
    for (i = 0; i < d->nmeta; i++) smp__ckpt_meta_add(md, d->meta_keys[i], NULL, d->meta_values[i]);
    smp__ckpt_meta_add(md, "smp.format", NULL, SMP__CKPT_FORMAT);
    smp__ckpt_meta_add(md, "smp.kind", NULL, partial ? "partial" : "full");
    snprintf(num, sizeof num, "%d", partial ? files : pl->P);
    smp__ckpt_meta_add(md, "smp.partitions", NULL, num);
    if (partial) {
        snprintf(num, sizeof num, "%d", file);
        smp__ckpt_meta_add(md, "smp.mp_rank", NULL, num);
    }
    if (partial && files != pl->P) { /* a file per TP slice (and replica): where this one sat */
        const char *k[] = {"smp.pp", "smp.pp_rank", "smp.tp", "smp.tp_rank", "smp.rdp_rank"};
        int v[] = {pl->P, pl->mp, pl->tp, pl->tp_rank, pl->dp};
        for (int j = 0; j < 5; j++) {
            snprintf(num, sizeof num, "%d", v[j]);
            smp__ckpt_meta_add(md, k[j], NULL, num);
        }
    }
    smp__ckpt_meta_add(md, "smp.save_id", NULL, pl->save_id);
    if (partial) {
        snprintf(num, sizeof num, "%llu", (smp__ckpt_ull)gen);
        smp__ckpt_meta_add(md, "smp.generation", NULL, num);
    }
    for (i = 0; i < pl->n; i++) {
        snprintf(num, sizeof num, "%d", pl->items[i].mp);
        smp__ckpt_meta_add(md, "smp.partition.", pl->items[i].name, num);
    }
    if (md->oom) {
        size_t want = md->want;
        smp__ckpt_meta_free(md);
        return smp__nomem(want, "the metadata of the checkpoint's files");
    }
    return SMP_OK;
}

/* The entries of the items of partition only_mp (-1: all), in file order;
   NULL and the out-of-memory error in *st when there is no memory. */
static smp_ckpt_entry *smp__ckpt_entries(const smp__ckpt_plan *pl, int only_mp, int *count, smp_status *st) {
    smp_ckpt_entry *e = (smp_ckpt_entry *)smp__alloc_or(st, sizeof(smp_ckpt_entry) * (size_t)(pl->n + 1),
                                                        SMP__ALLOC_OTHER, "the list of tensors of a checkpoint file");
    int n = 0;
    *count = 0;
    if (!e) return NULL;
    for (int q = 0; q < pl->n; q++) {
        const smp__ckpt_item *it = &pl->items[pl->order[q]];
        if (only_mp >= 0 && it->mp != only_mp) continue;
        e[n].name = it->name;
        e[n].dtype = it->dtype;
        e[n].ndim = it->ndim;
        memcpy(e[n].shape, it->shape, sizeof e[n].shape);
        e[n].data = it->local ? it->local->data : NULL;
        n++;
    }
    *count = n;
    return e;
}

/* The entries of a partial save's file at tensor parallelism or with split
   state: the segments this rank holds, in file order. A whole tensor keeps
   its shape; a piece of one gets a "smp.shard.<name>" entry in md saying
   which (smp__ckpt_piece_text), and the slice's shape when it is a whole
   slice, else one dimension. */
static smp_ckpt_entry *smp__ckpt_seg_entries(const smp__ckpt_plan *pl, smp__ckpt_meta_list *md, int *count,
                                             smp_status *st) {
    smp_ckpt_entry *e = (smp_ckpt_entry *)smp__alloc_or(st, sizeof(smp_ckpt_entry) * (size_t)(pl->nsegs + 1),
                                                        SMP__ALLOC_OTHER, "the list of tensors of a checkpoint file");
    int n = 0;
    *count = 0;
    if (!e) return NULL;
    for (int q = 0; q < pl->n; q++) {
        const smp__ckpt_item *it = &pl->items[pl->order[q]];
        for (int k = 0; k < it->nseg; k++) {
            const smp__ckpt_seg *sg = &pl->segs[it->seg0 + k];
            smp__ckpt_piece pc = {sg->pc.axis, sg->pc.parts, sg->pc.index, sg->pc.blocks, sg->lo, sg->hi - sg->lo};
            if (sg->rank != pl->rank) continue;
            memset(&e[n], 0, sizeof e[n]);
            e[n].name = it->name;
            e[n].dtype = it->dtype;
            e[n].ndim = it->ndim;
            memcpy(e[n].shape, it->shape, sizeof e[n].shape);
            if (!smp__ckpt_is_whole(it, &pc)) {
                char text[400];
                if (pc.first || pc.count != smp__ckpt_numel(it) / pc.parts) {
                    e[n].ndim = 1;
                    e[n].shape[0] = pc.count;
                } else {
                    e[n].shape[pc.axis] /= pc.parts;
                }
                smp__ckpt_piece_text(it->ndim, it->shape, &pc, text, sizeof text);
                smp__ckpt_meta_add(md, "smp.shard.", it->name, text);
            }
            n++;
        }
    }
    if (md->oom) {
        *st = smp__nomem(md->want, "the metadata of the checkpoint's files");
        smp__free(e);
        return NULL;
    }
    *count = n;
    return e;
}

static smp_status smp__ckpt_file_sink(void *ctx, int item, uint64_t off, const void *bytes, size_t n) {
    (void)item;
    (void)off;
    return smp_ckpt_writer_write((smp_ckpt_writer *)ctx, bytes, n);
}

/* Writes nbytes of a local tensor's data (staged through host memory when
   it lives on a device). */
static smp_status smp__ckpt_write_local(smp_ckpt_writer *w, const void *data, int device, uint64_t nbytes,
                                        size_t chunk) {
    if (!nbytes) return SMP_OK;
    if (device == SMP_HOST) return smp_ckpt_writer_write(w, data, (size_t)nbytes);
    smp_status st = SMP_OK;
    uint8_t *stage =
        (uint8_t *)smp__alloc_or(&st, chunk, SMP__ALLOC_OTHER | SMP__UNINIT, "staging a device tensor to save it");
    if (!stage) return st;
    for (uint64_t off = 0; off < nbytes && !st;) {
        size_t len = nbytes - off < chunk ? (size_t)(nbytes - off) : chunk;
        st = smp__ckpt_copy(stage, SMP_HOST, (const uint8_t *)data + off, device, len);
        if (!st) st = smp_ckpt_writer_write(w, stage, len);
        off += len;
    }
    smp__free(stage);
    return st;
}

/* ---------------------------------------------------------------- partial checkpoints: generations and manifests
   A partial save writes its files under a new generation number N,
   "<path>.g<N>_<mp>", and commits them all at once by renaming a small JSON
   manifest, "<path>.manifest", over the previous one (see PARTIAL SAVE
   above). These helpers name, scan, write and read those files. */
#define SMP__CKPT_MANIFEST_FORMAT "smp-checkpoint-manifest/1"
#define SMP__CKPT_MANIFEST_MAX ((size_t)64 << 20)

static bool smp__ckpt_exists(const char *path) {
    struct stat sb;
    return path && stat(path, &sb) == 0;
}

/* Decimal digits at s without a leading zero ("0" itself is fine), at most
   18 of them: their count (0: none, or not a plain number) and value. */
static int smp__ckpt_digits(const char *s, uint64_t *v) {
    int n = 0;
    *v = 0;
    while (s[n] >= '0' && s[n] <= '9') {
        if (n == 18) return 0;
        *v = *v * 10 + (uint64_t)(s[n] - '0');
        n++;
    }
    if (n > 1 && s[0] == '0') return 0;
    return n;
}

/* What a name in the checkpoint's folder is, for the checkpoint "<base>":
   a generation's file "<base>.g<gen>_<k>", a file of the format before
   manifests "<base>_<k>", either possibly a killed writer's
   "<name>.tmp.<pid>" (*tmp_pid > 0), or something else. */
enum { SMP__CKPT_NAME_OTHER, SMP__CKPT_NAME_GEN, SMP__CKPT_NAME_LEGACY };

static int smp__ckpt_classify(const char *name, const char *base, uint64_t *gen, int *k, long *tmp_pid) {
    size_t bl = strlen(base);
    *gen = 0;
    *k = -1;
    *tmp_pid = 0;
    if (strncmp(name, base, bl) != 0) return SMP__CKPT_NAME_OTHER;
    const char *p = name + bl;
    int kind, n;
    if (p[0] == '.' && p[1] == 'g') {
        if (!(n = smp__ckpt_digits(p + 2, gen)) || p[2 + n] != '_') return SMP__CKPT_NAME_OTHER;
        p += 2 + n + 1;
        kind = SMP__CKPT_NAME_GEN;
    } else if (p[0] == '_') {
        p++;
        kind = SMP__CKPT_NAME_LEGACY;
    } else {
        return SMP__CKPT_NAME_OTHER;
    }
    uint64_t v;
    if (!(n = smp__ckpt_digits(p, &v)) || v > (1u << 20)) return SMP__CKPT_NAME_OTHER;
    *k = (int)v;
    p += n;
    if (!*p) return kind;
    if (strncmp(p, ".tmp.", 5) != 0 || !(n = smp__ckpt_digits(p + 5, &v)) || p[5 + n] || v == 0 || v > 0x7fffffff)
        return SMP__CKPT_NAME_OTHER;
    *tmp_pid = (long)v;
    return kind;
}

static void smp__ckpt_free_list(char **names) {
    if (!names) return;
    for (int i = 0; names[i]; i++) smp__free(names[i]);
    smp__free(names);
}

/* The names in a folder, into *out (NULL-terminated, malloc'd; NULL when
   the folder cannot be read, or is empty). SMP_ERR_NOMEM when the list
   cannot be had, with *out NULL. */
static smp_status smp__ckpt_list_dir(const char *dir, char ***out) {
    DIR *d = opendir(dir);
    char **names = NULL;
    int n = 0, cap = 0;
    size_t want = 0;
    *out = NULL;
    if (!d) return SMP_OK;
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (!smp__grow((void **)&names, &cap, n + 2, sizeof *names, &want)) break;
        if (!(names[n] = smp__strdup(de->d_name))) {
            want = strlen(de->d_name) + 1;
            break;
        }
        names[++n] = NULL;
    }
    closedir(d);
    if (want) {
        smp__ckpt_free_list(names); /* NULL-terminated at every step */
        return smp__ckpt_nomem(want, NULL, "listing the checkpoint's folder");
    }
    *out = names;
    return SMP_OK;
}

/* ---- the manifest */
typedef struct smp__ckpt_mfile {
    const char *name;    /* in the manifest's folder */
    uint64_t bytes;      /* the file's size */
    uint32_t header_crc; /* CRC-32C of its length prefix and header */
} smp__ckpt_mfile;

typedef struct smp__ckpt_manifest {
    uint64_t generation;
    int partitions;
    const char *save_id;
    smp__ckpt_mfile *files; /* [partitions], by mp rank */
    int nfiles, cap;
    uint8_t *text;        /* the manifest's bytes, strings decoded in place */
} smp__ckpt_manifest;

static void smp__ckpt_manifest_free(smp__ckpt_manifest *m) {
    smp__free(m->files);
    smp__free(m->text);
    memset(m, 0, sizeof *m);
}

static smp_status smp__ckpt_manifest_file(smp__ckpt_jp *jp, smp__ckpt_manifest *m) {
    int have[4] = {0, 0, 0, 0}, idx = m->nfiles;
    uint64_t mp = 0;
    smp__ckpt_mfile *f = (smp__ckpt_mfile *)smp__ckpt_push((void **)&m->files, &m->nfiles, &m->cap, sizeof *f,
                                                           jp->label, "the list of files");
    if (!f) return SMP_ERR_NOMEM;
    if (!smp__ckpt_eat(jp, '{')) return smp__ckpt_jerr(jp, "each entry of \"files\" must be an object");
    for (;;) {
        const char *k, *v;
        SMP_TRY(smp__ckpt_jstring(jp, &k, "a key"));
        if (!smp__ckpt_eat(jp, ':')) return smp__ckpt_jerr(jp, "expected ':' after key '%s'", k);
        int which = !strcmp(k, "mp_rank") ? 0 : !strcmp(k, "name") ? 1 : !strcmp(k, "bytes") ? 2
              : !strcmp(k, "header_crc32c") ? 3 : -1;
        if (which < 0)
            return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, NULL,
                                  "file %d: unknown key \"%s\" (a file has mp_rank, name, bytes, header_crc32c)", idx,
                                  k);
        if (have[which]++) return smp__ckpt_jerr(jp, "key '%s' appears twice in file %d", k, idx);
        if (which == 0) SMP_TRY(smp__ckpt_juint(jp, &mp, "mp_rank"));
        else if (which == 1) SMP_TRY(smp__ckpt_jstring(jp, &f->name, "the file name"));
        else if (which == 2) SMP_TRY(smp__ckpt_juint(jp, &f->bytes, "bytes"));
        else {
            SMP_TRY(smp__ckpt_jstring(jp, &v, "header_crc32c"));
            SMP_TRY(smp__ckpt_crc_text(v, &f->header_crc, jp->label, NULL, "header_crc32c"));
        }
        if (smp__ckpt_eat(jp, ',')) continue;
        if (smp__ckpt_eat(jp, '}')) break;
        return smp__ckpt_jerr(jp, "expected ',' or '}' after key '%s'", k);
    }
    if (!have[0] || !have[1] || !have[2] || !have[3])
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, NULL, "file %d has no \"%s\"", idx,
                              !have[0] ? "mp_rank" : !have[1] ? "name" : !have[2] ? "bytes" : "header_crc32c");
    if (mp != (uint64_t)idx)
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, NULL,
                              "file %d of \"files\" has mp_rank %llu (files are listed by mp_rank)", idx,
                              (smp__ckpt_ull)mp);
    if (!f->name[0] || strchr(f->name, '/') || !strcmp(f->name, ".") || !strcmp(f->name, ".."))
        return smp__ckpt_fail(SMP_ERR_FORMAT, jp->label, NULL,
                              "file %d: \"%s\" is not the name of a file in the manifest's folder", idx, f->name);
    return SMP_OK;
}

/* Parses a manifest held in text[0..n) (malloc'd, n + 1 bytes, decoded in
   place): m owns text on success; on error text is freed. */
static smp_status smp__ckpt_manifest_parse(uint8_t *text, size_t n, const char *label, smp__ckpt_manifest *m) {
    smp__ckpt_jp jp;
    memset(&jp, 0, sizeof jp);
    int have[6] = {0, 0, 0, 0, 0, 0};
    uint64_t parts = 0;
    smp_status st = SMP_OK;
    memset(m, 0, sizeof *m);
    m->text = text;
    jp.s = text;
    jp.n = n;
    jp.label = label;
    jp.doc = "manifest";
    if (!smp__ckpt_eat(&jp, '{')) st = smp__ckpt_jerr(&jp, "a manifest is a JSON object");
    while (!st) {
        const char *k, *v;
        if ((st = smp__ckpt_jstring(&jp, &k, "a key")) != SMP_OK) break;
        if (!smp__ckpt_eat(&jp, ':')) {
            st = smp__ckpt_jerr(&jp, "expected ':' after key '%s'", k);
            break;
        }
        int which = !strcmp(k, "format") ? 0 : !strcmp(k, "kind") ? 1 : !strcmp(k, "generation") ? 2
              : !strcmp(k, "save_id") ? 3 : !strcmp(k, "partitions") ? 4 : !strcmp(k, "files") ? 5 : -1;
        if (which < 0) {
            st = smp__ckpt_fail(
                SMP_ERR_FORMAT, label, NULL,
                "unknown key \"%s\" (a manifest has format, kind, generation, save_id, partitions, files)", k);
            break;
        }
        if (have[which]++) {
            st = smp__ckpt_jerr(&jp, "key '%s' appears twice", k);
            break;
        }
        switch (which) {
        case 0:
            if (!(st = smp__ckpt_jstring(&jp, &v, "the format")) && strcmp(v, SMP__CKPT_MANIFEST_FORMAT))
                st = smp__ckpt_fail(
                    SMP_ERR_FORMAT, label, NULL,
                    "format \"%s\" is not \"" SMP__CKPT_MANIFEST_FORMAT "\" (written by another version of smp?)", v);
            break;
        case 1:
            if (!(st = smp__ckpt_jstring(&jp, &v, "the kind")) && strcmp(v, "partial"))
                st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "kind \"%s\" is not \"partial\"", v);
            break;
        case 2:
            if (!(st = smp__ckpt_juint(&jp, &m->generation, "generation")) && m->generation == 0)
                st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "generation 0 (generations count from 1)");
            break;
        case 3:
            if (!(st = smp__ckpt_jstring(&jp, &m->save_id, "the save id")) &&
                (!m->save_id[0] || strlen(m->save_id) >= 40))
                st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "save_id \"%s\" is empty or longer than 39 bytes",
                                    m->save_id);
            break;
        case 4:
            if (!(st = smp__ckpt_juint(&jp, &parts, "partitions")) && (parts < 1 || parts > (1u << 20)))
                st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "partitions %llu is outside 1..%d",
                                    (smp__ckpt_ull)parts, 1 << 20);
            break;
        default:
            if (!smp__ckpt_eat(&jp, '[')) {
                st = smp__ckpt_jerr(&jp, "\"files\" must be an array");
                break;
            }
            if (smp__ckpt_eat(&jp, ']')) break;
            for (;;) {
                if (m->nfiles >= (1 << 20)) {
                    st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "more than %d files", 1 << 20);
                    break;
                }
                if ((st = smp__ckpt_manifest_file(&jp, m)) != SMP_OK) break;
                if (smp__ckpt_eat(&jp, ',')) continue;
                if (smp__ckpt_eat(&jp, ']')) break;
                st = smp__ckpt_jerr(&jp, "expected ',' or ']' in \"files\"");
                break;
            }
        }
        if (st) break;
        if (smp__ckpt_eat(&jp, ',')) continue;
        if (smp__ckpt_eat(&jp, '}')) break;
        st = smp__ckpt_jerr(&jp, "expected ',' or '}' after key '%s'", k);
    }
    if (!st) {
        smp__ckpt_ws(&jp);
        if (jp.i != jp.n) st = smp__ckpt_jerr(&jp, "only spaces may follow the manifest's closing '}'");
        for (int i = 0; i < 6 && !st; i++)
            if (!have[i]) {
                static const char *const keys[6] = {"format", "kind", "generation", "save_id", "partitions", "files"};
                st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "the manifest has no \"%s\"", keys[i]);
            }
        if (!st && (uint64_t)m->nfiles != parts)
            st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "\"files\" lists %d files for %llu partitions", m->nfiles,
                                (smp__ckpt_ull)parts);
        m->partitions = (int)parts;
    }
    if (st) smp__ckpt_manifest_free(m);
    return st;
}

/* Internal, for fuzzing: validates a manifest image exactly as loading
   does (`label` names it in messages). */
SMP__CORE smp_status smp__ckpt_manifest_check(const void *bytes, size_t n, const char *label) {
    if (!bytes && n) return smp_error(SMP_ERR_ARG, "smp__ckpt_manifest_check: bytes is NULL");
    smp_status st = SMP_OK;
    uint8_t *text =
        (uint8_t *)smp__alloc_or(&st, n + 1, SMP__ALLOC_OTHER | SMP__UNINIT, "a copy of the manifest to check");
    if (!text) return st;
    if (n) memcpy(text, bytes, n);
    text[n] = 0;
    smp__ckpt_manifest m;
    st = smp__ckpt_manifest_parse(text, n, label ? label : "manifest", &m);
    if (!st) smp__ckpt_manifest_free(&m);
    return st;
}

/* Reads and parses the manifest at mpath. */
static smp_status smp__ckpt_manifest_read(const char *mpath, smp__ckpt_manifest *m) {
    char label[600];
    memset(m, 0, sizeof *m);
    snprintf(label, sizeof label, "checkpoint manifest '%s'", mpath);
    int fd = open(mpath, O_RDONLY | SMP__CKPT_O_CLOEXEC);
    if (fd < 0) return smp_error(SMP_ERR_IO, "cannot open %s: %s", label, strerror(errno));
    struct stat sb;
    uint8_t *text = NULL;
    size_t got = 0;
    smp_status st = SMP_OK;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        st = smp_error(SMP_ERR_IO, "%s is not a regular file", label);
    else if ((uint64_t)sb.st_size > SMP__CKPT_MANIFEST_MAX)
        st = smp__ckpt_fail(SMP_ERR_FORMAT, label, NULL, "%llu bytes is over the %llu-byte limit of a manifest",
                            (smp__ckpt_ull)sb.st_size, (smp__ckpt_ull)SMP__CKPT_MANIFEST_MAX);
    else
        text = (uint8_t *)smp__ckpt_alloc(&st, (size_t)sb.st_size + 1, label, "the text");
    while (!st && got < (size_t)sb.st_size) {
        ssize_t k = read(fd, text + got, (size_t)sb.st_size - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            st = smp__ckpt_fail(SMP_ERR_IO, label, NULL, "read failed: %s", k < 0 ? strerror(errno) : "short file");
        else got += (size_t)k;
    }
    close(fd);
    if (st) {
        smp__free(text);
        return st;
    }
    text[got] = 0;
    return smp__ckpt_manifest_parse(text, got, label, m);
}

/* Writes "<path>.manifest" naming generation `gen`'s P files (their sizes
   and header checksums): tmp file, fsync, rename over the old manifest,
   folder fsync. *committed says whether the rename happened: from then on
   the new checkpoint is the one smp_load sees. */
static smp_status smp__ckpt_manifest_write(const char *path, uint64_t gen, const char *save_id, int P,
                                         const uint64_t *bytes, const uint32_t *crcs, int fault, int *committed) {
    *committed = 0;
    char *mpath = smp__ckpt_strf("%s.manifest", path), *dir = NULL, *tmp = NULL;
    const char *base = "";
    smp_status st = SMP_OK;
    if (!mpath) st = smp__nomem(strlen(path) + 16, "the name of the checkpoint's manifest");
    else if (!(dir = smp__ckpt_dirname(path, &base)))
        st = smp__nomem(strlen(path) + 1, "the name of the checkpoint's folder");
    else if (!(tmp = smp__ckpt_strf("%s.tmp.%ld", mpath, (long)getpid())))
        st = smp__nomem(strlen(mpath) + 32, "the name of the manifest's tmp file");
    smp__sbuf b;
    memset(&b, 0, sizeof b);
    if (!st) {
        smp__sbuf_printf(&b, "{\n  \"format\": \"" SMP__CKPT_MANIFEST_FORMAT "\",\n  \"kind\": \"partial\",\n"
                             "  \"generation\": %llu,\n  \"save_id\": ", (smp__ckpt_ull)gen);
        smp__sbuf_jstr(&b, NULL, save_id);
        smp__sbuf_printf(&b, ",\n  \"partitions\": %d,\n  \"files\": [\n", P);
        for (int k = 0; k < P; k++) {
            smp__sbuf_printf(&b, "    {\"mp_rank\": %d, \"name\": \"", k);
            smp__sbuf_escaped(&b, base);
            smp__sbuf_printf(&b,
                             ".g%llu_%d\", \"bytes\": %llu, \"header_crc32c\": \"" SMP__CKPT_CRC_PREFIX "%08x\"}%s\n",
                             (smp__ckpt_ull)gen, k, (smp__ckpt_ull)bytes[k], (unsigned)crcs[k], k + 1 < P ? "," : "");
        }
        smp__sbuf_puts(&b, "  ]\n}\n");
        if (b.oom) st = smp__ckpt_nomem(b.want, NULL, "the text of the checkpoint's manifest");
    }
    if (!st) {
        smp__ckpt_remove_stale(dir, strrchr(mpath, '/') ? strrchr(mpath, '/') + 1 : mpath);
        int fd = smp__ckpt_create(tmp);
        if (fd < 0) {
            st = smp_error(SMP_ERR_IO, "checkpoint '%s': cannot create its manifest '%s': %s", path, tmp,
                           strerror(errno));
        } else if (smp__ckpt_write_all(fd, b.p, b.len, -1) != 0 || fsync(fd) != 0) {
            st = smp_error(SMP_ERR_IO, "checkpoint '%s': writing its manifest '%s' failed: %s", path, tmp,
                           strerror(errno));
            close(fd);
        } else if (close(fd) != 0) {
            st = smp_error(SMP_ERR_IO, "checkpoint '%s': closing its manifest '%s' failed: %s", path, tmp,
                           strerror(errno));
        }
        if (st && fd >= 0) unlink(tmp);
    }
    if (!st) {
        if (fault == SMP__CKPT_FAULT_MANIFEST) smp__ckpt_die(fault);
        if (rename(tmp, mpath) != 0) {
            st = smp_error(SMP_ERR_IO, "checkpoint '%s': renaming '%s' over its manifest '%s' failed: %s", path, tmp,
                           mpath, strerror(errno));
            unlink(tmp);
        }
    }
    if (!st) {
        *committed = 1;
        if (fault == SMP__CKPT_FAULT_COMMIT) smp__ckpt_die(fault);
        int err = smp__ckpt_sync_dir(dir);
        if (err)
            st = smp_error(
                SMP_ERR_IO,
                "checkpoint '%s': its manifest '%s' is in place, but flushing the folder '%s' failed: %s (the "
                "previous generation's files were kept)",
                path, mpath, dir, strerror(err));
    }
    smp__free(b.p);
    smp__free(mpath);
    smp__free(tmp);
    smp__free(dir);
    return st;
}

/* Whether f's metadata says it is a file of an smp partial checkpoint. */
static bool smp__ckpt_is_partial(const smp_ckpt_file *f) {
    const char *fmt = smp_ckpt_meta(f, "smp.format"), *kind = smp_ckpt_meta(f, "smp.kind");
    return fmt && !strcmp(fmt, SMP__CKPT_FORMAT) && kind && !strcmp(kind, "partial");
}

/* Whether the file at `full` is a partial checkpoint file of mp rank k,
   and, for a generation's file, of generation `gen` (smp.generation): what
   the cleanup checks before it deletes anything. -1: no memory to tell. */
static int smp__ckpt_is_ours(const char *full, int kind, uint64_t gen, int k) {
    smp_ckpt_file *f;
    smp_status st = smp_ckpt_open(full, &f);
    if (st) return st == SMP_ERR_NOMEM ? -1 : 0;
    const char *mp = smp_ckpt_meta(f, "smp.mp_rank"), *g = smp_ckpt_meta(f, "smp.generation");
    uint64_t v;
    int ok = smp__ckpt_is_partial(f) && mp && smp__ckpt_digits(mp, &v) == (int)strlen(mp) && v == (uint64_t)k;
    if (ok && kind == SMP__CKPT_NAME_GEN) ok = g && smp__ckpt_digits(g, &v) == (int)strlen(g) && v == gen;
    smp_ckpt_close(f);
    return ok;
}

/* The generation a new save of `path` takes, into *out: one past the
   manifest's and past any generation's file (or a killed writer's tmp file)
   in the folder, so an interrupted save's leftovers are never reused. Out
   of memory is an error: a generation picked without seeing the manifest
   or the folder could be the committed one, whose files the save would
   then overwrite. */
static smp_status smp__ckpt_next_generation(const char *path, uint64_t *out) {
    *out = 0;
    char *mpath = smp__ckpt_strf("%s.manifest", path), *dir = NULL, **names = NULL;
    smp_status st = mpath ? SMP_OK : smp__nomem(strlen(path) + 16, "the name of the checkpoint's manifest");
    uint64_t g = 0;
    if (mpath) {
        smp__ckpt_manifest m;
        st = smp__ckpt_manifest_read(mpath, &m);
        if (!st) {
            g = m.generation;
            smp__ckpt_manifest_free(&m);
        } else if (st != SMP_ERR_NOMEM) {
            st = SMP_OK; /* none, or unreadable: the folder's names decide */
        }
        smp__free(mpath);
    }
    const char *base;
    if (!st && !(dir = smp__ckpt_dirname(path, &base)))
        st = smp__nomem(strlen(path) + 1, "the name of the checkpoint's folder");
    if (!st) st = smp__ckpt_list_dir(dir, &names);
    uint64_t gen;
    long pid;
    int k;
    for (int i = 0; names && names[i]; i++)
        if (smp__ckpt_classify(names[i], base, &gen, &k, &pid) == SMP__CKPT_NAME_GEN && gen > g) g = gen;
    smp__ckpt_free_list(names);
    smp__free(dir);
    *out = g + 1;
    return st;
}

/* Removes, once generation `gen` of `path` is committed, what it replaced:
   the files of other generations and of the format before manifests
   ("<base>_<k>") for partition `mine` (and, with `strays`, for partitions
   >= P, which an earlier save with more partitions left), each only after
   its header shows it is such a file (smp__ckpt_is_ours), and the tmp files of
   writers killed while saving them (their process gone from this host).
   Best effort: what cannot be removed stays, and the next save tries again.
   It runs after the commit, so running out of memory here does not fail the
   save (the new checkpoint is in place): it keeps the files it could not
   look at and says so in a warning. */
static void smp__ckpt_cleanup(const char *path, uint64_t gen, int mine, int P, int strays, int fault) {
    const char *base;
    char *dir = smp__ckpt_dirname(path, &base), **names = NULL;
    int removed = 0, short_of_memory = !dir;
    if (dir && smp__ckpt_list_dir(dir, &names) != SMP_OK) short_of_memory = 1;
    for (int i = 0; names && names[i]; i++) {
        uint64_t g;
        long pid;
        int k, kind = smp__ckpt_classify(names[i], base, &g, &k, &pid), ours = 0;
        if (kind == SMP__CKPT_NAME_OTHER || (kind == SMP__CKPT_NAME_GEN && g == gen)) continue;
        if (k != mine && !(strays && k >= P)) continue;
        char *full = smp__ckpt_strf("%s/%s", dir, names[i]);
        if (!full) {
            short_of_memory = 1;
            continue;
        }
        if (pid) {
            ours = pid != (long)getpid() && !smp__ckpt_pid_alive(pid);
        } else {
            ours = smp__ckpt_is_ours(full, kind, g, k);
            if (ours < 0) short_of_memory = 1;
        }
        if (ours > 0) {
            if (unlink(full) == 0 && !pid) removed++;
            if (removed == 1 && fault == SMP__CKPT_FAULT_CLEANUP) smp__ckpt_die(fault);
        }
        smp__free(full);
    }
    smp__ckpt_free_list(names);
    smp__free(dir);
    if (short_of_memory)
        smp__log(SMP_LOG_WARN,
                "checkpoint '%s': generation %llu is saved and committed, but out of memory removing the files it "
                "replaced (%s); the next save of it removes them",
                path, (smp__ckpt_ull)gen, smp_last_error());
    if (fault == SMP__CKPT_FAULT_CLEANUP) smp__ckpt_die(fault); /* nothing to remove: die at the end of it */
}

#ifdef SMP_TESTING
#define SMP__CKPT_FAULT_PACE_NS 1000000L /* test-only pacing: 1 ms polls, 10 s at most */

static void smp__ckpt_fault_pace(const char *path, uint64_t gen, int P, int mine) {
    for (int tries = 0; tries < 10000; tries++) {
        int all = 1;
        for (int k = 0; k < P && all; k++) {
            if (k == mine) continue;
            char *p = smp__ckpt_strf("%s.g%llu_%d", path, (smp__ckpt_ull)gen, k);
            all = p && smp__ckpt_exists(p);
            smp__free(p);
        }
        if (all) return;
        smp__sleep_ns(SMP__CKPT_FAULT_PACE_NS);
    }
}
#endif

/* The arguments of smp_save (with its desc d) or smp_load (d NULL), as `fn`
   checks them on each rank. */
static smp_status smp__ckpt_check_args(const char *fn, smp_model *m, const char *path, const smp_optimizer *opt,
                                       const smp_save_desc *d) {
    if (!m) return smp_error(SMP_ERR_ARG, "%s: model is NULL", fn);
    if (!path || !*path) return smp_error(SMP_ERR_ARG, "%s: no path", fn);
    if (!smp_model_is_partitioned(m))
        return smp_error(SMP_ERR_STATE,
                         "%s: the model is not partitioned yet (parameters exist only after smp_model_trace or the "
                         "first step)",
                         fn);
    if (opt && opt->model != m)
        return smp_error(SMP_ERR_ARG, "%s: the optimizer registry belongs to another model", fn);
    if (!d) return SMP_OK;
    if (d->nmeta < 0 || (d->nmeta > 0 && (!d->meta_keys || !d->meta_values)))
        return smp_error(SMP_ERR_ARG, "smp_save: %d metadata entries but keys or values is NULL", d->nmeta);
    for (int i = 0; i < d->nmeta; i++) {
        if (!d->meta_keys[i] || !d->meta_values[i])
            return smp_error(SMP_ERR_ARG, "smp_save: metadata entry %d has a NULL key or value", i);
        if (!strncmp(d->meta_keys[i], "smp.", 4))
            return smp_error(SMP_ERR_ARG, "smp_save: metadata key '%s': keys starting with \"smp.\" are smp's own",
                             d->meta_keys[i]);
    }
    return SMP_OK;
}

/* smp_save's and smp_load's (fn's) start: their arguments, checked on every
   rank and agreed on. */
static smp_status smp__ckpt_begin(const char *fn, smp_model *m, const char *path, const smp_optimizer *opt,
                                  const smp_save_desc *save) {
    if (!smp_is_initialized()) return smp_error(SMP_ERR_STATE, "%s called before smp_init", fn);
    char what[32];
    snprintf(what, sizeof what, "%s arguments", fn);
    return smp__agree_on(smp_group_comm(SMP_WORLD), smp__ckpt_check_args(fn, m, path, opt, save), what);
}

SMPDEF smp_status smp_save(smp_model *m, const char *path, const smp_save_desc *desc) {
    smp_save_desc d = {SMP_DEFAULT, NULL, NULL, NULL, 0, 0};
    if (desc) d = *desc;
    SMP_TRY(smp__ckpt_begin("smp_save", m, path, d.optimizer, &d));
    SMP_TRY(smp_model_gather_params(m)); /* shard_optimizer_state: the replicas' updates, before dp rank 0 writes */
    int partial = d.partial != SMP_OFF, ne = 0, i;
    smp__ckpt_plan pl;
    smp__ckpt_meta_list md;
    memset(&md, 0, sizeof md);
    smp__ckpt_rx rx;
    smp_ckpt_writer *w = NULL;
    smp_ckpt_entry *entries = NULL;
    char *file = NULL;
    uint64_t gen = 0;
    memset(&rx, 0, sizeof rx);
    smp_status st = smp__ckpt_plan_init(&pl, m, d.optimizer, d.chunk_bytes);
    if (partial) { /* 0. the generation: world rank 0 looks at the folder */
        MPI_Request req;
        if (pl.rank == 0 && !st) st = smp__ckpt_next_generation(path, &gen);
        SMP__MPI_FATAL(MPI_Ibcast(&gen, 1, MPI_UINT64_T, 0, pl.comm, &req),
                       "sharing the checkpoint generation from world rank 0");
        smp_wait_requests(1, &req, "checkpoint generation", SMP_WORLD, 0);
    }
    for (i = 0; i < pl.n && !st; i++) {
        const smp__ckpt_item *it = &pl.items[i];
        if ((it->kind == SMP__CKPT_OPTIM || it->kind == SMP__CKPT_GLOBAL) && !it->saver_has && !it->elementwise)
            st = smp_error(SMP_ERR_ARG,
                           "optimizer state '%s' is registered on some ranks but not on world rank %d (dp rank 0 of "
                           "partition %d), which saves it",
                           it->name, pl.saver[it->mp], it->mp);
    }
    /* Files: one per partition at tp 1 (file k = its pp rank); else one per
       TP slice of a partition, k = mp_rank = pp_rank x tp + tp_rank, and with
       state in ranges that replicas other than rdp rank 0 hold
       (shard_optimizer_state), one per rank of those: k x rdp + rdp_rank. */
    int sliced = pl.split || pl.tp > 1, R = sliced && pl.zero ? pl.size / (pl.P * pl.tp) : 1;
    int F = sliced ? pl.P * pl.tp * R : pl.P,
        k = sliced ? (pl.mp * pl.tp + pl.tp_rank) * R + (R > 1 ? pl.dp : 0) : pl.mp;
    int writes = R > 1 || pl.dp == 0;
    if (!st) st = smp__ckpt_build_meta(&pl, &d, partial, gen, F, k, &md);
    st = smp__ckpt_agree(&pl, st, "planning the save");
    if (st) goto done;

    if (partial) {
        uint64_t fbytes = 0, mine[3];
        uint64_t *all = NULL;
        uint32_t fcrc = 0;
        int fault = SMP__CKPT_FAULT_NONE, committed = 0;
        MPI_Request req;
        smp__ckpt_fault_from_env(&fault); /* an unknown value: the writer says so */
        /* 1. each partition's saver writes and seals "<path>.g<gen>_<mp>";
           world rank 0 also takes the memory its commit needs (3) now,
           while a failure still fails the save everywhere */
        if (pl.rank == 0)
            all = (uint64_t *)smp__alloc_or(&st, sizeof(uint64_t) * 3 * ((size_t)pl.size + (size_t)F),
                                            SMP__ALLOC_OTHER | SMP__UNINIT,
                                            "every file's size and header checksum (the checkpoint's manifest)");
        if (writes && !st) {
            if (!(file = smp__ckpt_strf("%s.g%llu_%d", path, (smp__ckpt_ull)gen, k)))
                st = smp__nomem(strlen(path) + 48, "the name of this partition's checkpoint file");
            if (!st)
                entries = sliced ? smp__ckpt_seg_entries(&pl, &md, &ne, &st) : smp__ckpt_entries(&pl, pl.mp, &ne, &st);
            if (!st)
                st = smp_ckpt_writer_open(file, entries, ne, (const char *const *)md.keys,
                                          (const char *const *)md.vals, md.n, &w);
            for (i = 0; i < pl.n && !st; i++) {
                const smp__ckpt_item *it = &pl.items[pl.order[i]];
                size_t es = smp__dtypes[it->dtype].size;
                if (!sliced && it->mp == pl.mp)
                    st = smp__ckpt_write_local(w, it->local->data, it->local->device, it->nbytes, pl.chunk);
                for (int s = 0; sliced && s < it->nseg && !st; s++) {
                    const smp__ckpt_seg *sg = &pl.segs[it->seg0 + s];
                    if (sg->rank == pl.rank)
                        st = smp__ckpt_write_local(
                            w, (const uint8_t *)it->mine->data + (size_t)(sg->lo - it->mine_pc.first) * es,
                            it->mine->device, (uint64_t)(sg->hi - sg->lo) * es, pl.chunk);
                }
            }
            if (w && st) {
                smp_ckpt_writer_abort(w);
                w = NULL;
            }
            if (!st) {
                st = smp__ckpt_writer_seal(w); /* frees w on error */
                if (st) w = NULL;
                else {
                    fbytes = w->header_len + w->total;
                    fcrc = w->header_crc;
                }
            }
        }
        st = smp__ckpt_agree(&pl, st, "writing the partial checkpoint files");
        if (st) {
            if (w) smp_ckpt_writer_abort(w); /* deletes the sealed tmp file */
            w = NULL;
            smp__free(all);
            smp__agree_on(pl.comm, SMP_OK, "removing the failed save's files"); /* every rank returns after */
            goto done;
        }
        /* 2. every file is complete on disk: each goes to its name, which no
           loader follows until the manifest names it */
        if (w) {
            if (fault == SMP__CKPT_FAULT_RENAME) smp__ckpt_fault_pace(path, gen, F, k);
            st = smp__ckpt_writer_publish(w);
        }
        w = NULL;
        st = smp__ckpt_agree(&pl, st, "renaming the partial checkpoint files into place");
        if (!st && fault == SMP__CKPT_FAULT_RENAMED) smp__ckpt_die(fault);
        /* 3. world rank 0 commits them: one rename of the manifest, which
           records every file's size and header checksum */
        if (!st) {
            mine[0] = writes ? (uint64_t)k : UINT64_MAX;
            mine[1] = fbytes;
            mine[2] = fcrc;
            SMP__MPI_FATAL(MPI_Igather(mine, 3, MPI_UINT64_T, all, 3, MPI_UINT64_T, 0, pl.comm, &req),
                           "gathering checkpoint file sizes to world rank 0");
            smp_wait_requests(1, &req, "checkpoint file sizes", SMP_WORLD, 0);
            if (pl.rank == 0) {
                uint64_t *bytes = all + 3 * (size_t)pl.size;
                uint32_t *crcs = (uint32_t *)(void *)(bytes + F);
                for (i = 0; i < pl.size; i++)
                    if (all[3 * i] < (uint64_t)F) {
                        bytes[all[3 * i]] = all[3 * i + 1];
                        crcs[all[3 * i]] = (uint32_t)all[3 * i + 2];
                    }
                st = smp__ckpt_manifest_write(path, gen, pl.save_id, F, bytes, crcs, fault, &committed);
            }
            st = smp__ckpt_agree(&pl, st, "committing the partial checkpoint (renaming its manifest into place)");
            SMP__MPI_FATAL(MPI_Ibcast(&committed, 1, MPI_INT, 0, pl.comm, &req),
                           "sharing whether world rank 0 committed the checkpoint");
            smp_wait_requests(1, &req, "checkpoint commit", SMP_WORLD, 0);
        }
        smp__free(all);
        if (st) { /* not committed: the new generation goes, the previous one stays as it was */
            if (!committed && file && writes) unlink(file);
            smp__agree_on(pl.comm, SMP_OK, "removing the failed save's files"); /* every rank returns after */
            goto done;
        }
        /* 4. what the new generation replaced goes: each saver removes its
           partition's old files, partition 0's also those of partitions
           that no longer exist (best effort: the save stands) */
        if (writes) smp__ckpt_cleanup(path, gen, k, F, k == 0, fault);
        st = smp__agree_on(pl.comm, SMP_OK, "removing the previous generation of the checkpoint");
    } else {
        int writer = pl.saver[0];
        /* 1. the writer opens the file; every rank takes the buffers of the
           transfer (2), so none runs out of memory inside it */
        st = smp__ckpt_assemble(&pl);
        if (!st) st = smp__ckpt_stream_prepare(&pl, writer, &rx);
        if (pl.rank == writer && !st) {
            entries = smp__ckpt_entries(&pl, -1, &ne, &st);
            if (!st)
                st = smp_ckpt_writer_open(path, entries, ne, (const char *const *)md.keys,
                                          (const char *const *)md.vals, md.n, &w);
        }
        st = smp__ckpt_agree(&pl, st, "opening the checkpoint file");
        if (st) goto done; /* w is NULL wherever opening failed */
        st = smp__ckpt_stream(&rx, smp__ckpt_file_sink, w, 1);
        st = smp__ckpt_agree(&pl, st, "writing the checkpoint");
        if (w) {
            if (st) smp_ckpt_writer_abort(w);
            else st = smp_ckpt_writer_commit(w);
            w = NULL;
        }
        st = smp__ckpt_agree(&pl, st, "committing the checkpoint file");
    }

done:
    if (w) smp_ckpt_writer_abort(w);
    smp__ckpt_stream_free(&rx);
    smp__free(entries);
    smp__free(file);
    smp__ckpt_meta_free(&md);
    smp__ckpt_plan_free(&pl);
    return st;
}

/* ---------------------------------------------------------------- loading */
static const uint8_t *smp__ckpt_map(smp_ckpt_file *f) {
    if (f->mem) return f->mem;
    if (!f->map_tried) {
        f->map_tried = 1;
        if (f->size > 0 && f->size <= (uint64_t)SIZE_MAX) {
            void *p = mmap(NULL, (size_t)f->size, PROT_READ, MAP_SHARED, f->fd, 0);
            if (p != MAP_FAILED) f->map = (const uint8_t *)p;
        }
    }
    return f->map;
}

/* Parses a metadata integer in [lo, hi]; -1 (with an error) otherwise. */
static int smp__ckpt_meta_int(const smp_ckpt_file *f, const char *key, int lo, int hi) {
    const char *v = smp_ckpt_meta(f, key);
    long x = 0;
    int nd = 0;
    if (!v) {
        smp_error(SMP_ERR_FORMAT, "checkpoint '%s': metadata '%s' is missing", smp_ckpt_path(f), key);
        return -1;
    }
    while (v[nd] >= '0' && v[nd] <= '9' && nd < 10) x = x * 10 + (v[nd++] - '0');
    if (!nd || v[nd] || x < lo || x > hi) {
        smp_error(SMP_ERR_FORMAT, "checkpoint '%s': metadata '%s' is \"%s\", not an integer in %d..%d",
                  smp_ckpt_path(f), key, v, lo, hi);
        return -1;
    }
    return (int)x;
}

/* Hands the P files of a checkpoint to *out, or, after an error, closes them. */
static smp_status smp__ckpt_set_done(smp_status st, smp_ckpt_file **files, int P, smp_ckpt_file ***out, int *nout) {
    if (st) {
        for (int k = 0; files && k < P; k++) smp_ckpt_close(files[k]);
        smp__free(files);
        return st;
    }
    *out = files;
    *nout = P;
    return SMP_OK;
}

/* Opens the files that the manifest of a partial checkpoint commits and
   checks each against it: the same save and generation, its mp rank, its
   size and the checksum of its header. */
static smp_status smp__ckpt_open_manifest_set(const char *mpath, smp_ckpt_file ***out, int *nout) {
    static const char *const fix = "restore it from a copy of the checkpoint, or save the checkpoint again";
    smp__ckpt_manifest m;
    smp_status st = smp__ckpt_manifest_read(mpath, &m);
    if (st == SMP_ERR_NOMEM) return st; /* its message says what for */
    if (st)
        return smp_error(st,
                         "%s; smp_save writes a partial checkpoint's manifest whole and renames it into place in one "
                         "step, so it was damaged or edited after the save: %s",
                         smp_last_error(), fix);
    int P = m.partitions;
    const char *mbase;
    char *dir = smp__ckpt_dirname(mpath, &mbase), want[32];
    if (!dir) st = smp__nomem(strlen(mpath) + 1, "the name of the checkpoint's folder");
    smp_ckpt_file **files = (smp_ckpt_file **)smp__alloc_or(&st, sizeof *files * (size_t)P, SMP__ALLOC_OTHER,
                                                            "the list of a checkpoint's files");
    snprintf(want, sizeof want, "%llu", (smp__ckpt_ull)m.generation);
    for (int k = 0; k < P && !st; k++) {
        const smp__ckpt_mfile *mf = &m.files[k];
        char *full = smp__ckpt_strf("%s/%s", dir, mf->name);
        if (!full) {
            st = smp__nomem(strlen(dir) + strlen(mf->name) + 2, "the name of a checkpoint file");
            break;
        }
        st = smp_ckpt_open(full, &files[k]);
        const smp_ckpt_file *f = files[k];
        if (st == SMP_ERR_NOMEM) {
            /* its message says what for; the file is fine */
        } else if (st) {
            st = smp_error(st,
                           "%s: it is file %d of the %d that the manifest '%s' commits; a checkpoint's files must stay "
                           "next to its manifest: restore the file, or save the checkpoint again",
                           smp_last_error(), k, P, mpath);
        } else {
            const char *id = smp_ckpt_meta(f, "smp.save_id"), *gen = smp_ckpt_meta(f, "smp.generation");
            if (!smp__ckpt_is_partial(f))
                st =
                    smp_error(SMP_ERR_FORMAT,
                              "checkpoint '%s' is not a file of an smp partial checkpoint, but the manifest '%s' names "
                              "it: %s",
                              full, mpath, fix);
            else if (!id || strcmp(id, m.save_id) || !gen || strcmp(gen, want))
                st = smp_error(SMP_ERR_FORMAT,
                               "checkpoint '%s' comes from another save than the manifest '%s' commits (smp.save_id %s "
                               "and smp.generation %s, not %s and %s): files of two checkpoints are mixed; %s",
                               full, mpath, id ? id : "missing", gen ? gen : "missing", m.save_id, want, fix);
            else if (smp__ckpt_meta_int(f, "smp.partitions", P, P) < 0 ||
                     smp__ckpt_meta_int(f, "smp.mp_rank", k, k) < 0)
                st = smp_error(SMP_ERR_FORMAT, "%s, but the manifest '%s' lists it as file %d of %d: %s",
                               smp_last_error(), mpath, k, P, fix);
            else if (f->size != mf->bytes)
                st = smp_error(SMP_ERR_FORMAT,
                               "checkpoint '%s' is %llu bytes, but its manifest '%s' records %llu: the file was "
                               "changed after the save committed it; %s",
                               full, (smp__ckpt_ull)f->size, mpath, (smp__ckpt_ull)mf->bytes, fix);
            else if (f->header_crc != mf->header_crc)
                st = smp_error(SMP_ERR_FORMAT,
                               "checkpoint '%s': its header's checksum is " SMP__CKPT_CRC_PREFIX "%08x, but its "
                               "manifest '%s' records " SMP__CKPT_CRC_PREFIX "%08x: the file was changed after the "
                               "save committed it; %s",
                               full, (unsigned)f->header_crc, mpath, (unsigned)mf->header_crc, fix);
        }
        smp__free(full);
    }
    smp__free(dir);
    smp__ckpt_manifest_free(&m);
    return smp__ckpt_set_done(st, files, P, out, nout);
}

/* Opens "<path>_0", file 0 of a partial checkpoint saved before manifests,
   and checks that it is one; *P: its partition count. */
static smp_status smp__ckpt_open_legacy0(const char *path, smp_ckpt_file **f0, int *P) {
    *f0 = NULL;
    char *p = smp__ckpt_strf("%s_0", path);
    if (!p) return smp__nomem(strlen(path) + 16, "the name of a checkpoint file");
    bool full = smp__ckpt_exists(path);
    smp_status st = smp__ckpt_exists(p) ? smp_ckpt_open(p, f0)
                  : smp_error(SMP_ERR_IO,
                              "no partial checkpoint at '%s': neither its manifest '%s.manifest' nor '%s' (file 0 of a "
                              "checkpoint saved before manifests) exists%s%s%s",
                              path, path, p, full ? " (but '" : "", full ? path : "",
                              full ? "' exists: a full checkpoint? load it with partial = SMP_OFF)" : "");
    smp__free(p);
    if (st) return st;
    const char *fmt = smp_ckpt_meta(*f0, "smp.format"), *kind = smp_ckpt_meta(*f0, "smp.kind");
    if (!fmt || strcmp(fmt, SMP__CKPT_FORMAT) || !kind || !smp_ckpt_meta(*f0, "smp.save_id"))
        st = smp_error(SMP_ERR_FORMAT,
                       "checkpoint '%s' is not a file of an smp partial checkpoint (its metadata lacks smp.format "
                       "\"" SMP__CKPT_FORMAT "\", smp.kind or smp.save_id)",
                       smp_ckpt_path(*f0));
    else if (strcmp(kind, "partial"))
        st = smp_error(SMP_ERR_FORMAT, "checkpoint '%s' is a %s checkpoint, not file 0 of a partial one%s",
                       smp_ckpt_path(*f0), kind, !strcmp(kind, "full") ? "; load it with partial = SMP_OFF" : "");
    else if ((*P = smp__ckpt_meta_int(*f0, "smp.partitions", 1, 1 << 20)) < 0 ||
             smp__ckpt_meta_int(*f0, "smp.mp_rank", 0, 0) < 0)
        st = SMP_ERR_FORMAT;
    if (st) {
        smp_ckpt_close(*f0);
        *f0 = NULL;
    }
    return st;
}

SMPDEF smp_status smp_ckpt_partial_file(const char *path, int mp_rank, char *out, size_t cap, int *partitions) {
    if (partitions) *partitions = 0;
    if (!path || !*path || !out || !cap)
        return smp_error(SMP_ERR_ARG, "smp_ckpt_partial_file: path and out must be given");
    out[0] = 0;
    char *mpath = smp__ckpt_strf("%s.manifest", path), *file = NULL;
    if (!mpath) return smp__nomem(strlen(path) + 16, "the name of the checkpoint's manifest");
    smp_status st = SMP_OK;
    int P = 0;
    if (smp__ckpt_exists(mpath)) {
        smp__ckpt_manifest m;
        if ((st = smp__ckpt_manifest_read(mpath, &m)) == SMP_OK) {
            P = m.partitions;
            if (mp_rank >= 0 && mp_rank < P) {
                const char *mbase;
                char *dir = smp__ckpt_dirname(mpath, &mbase);
                file = dir ? smp__ckpt_strf("%s/%s", dir, m.files[mp_rank].name) : NULL;
                smp__free(dir);
                if (!file)
                    st = smp__nomem(strlen(mpath) + strlen(m.files[mp_rank].name) + 2, "the name of a checkpoint file");
            }
            smp__ckpt_manifest_free(&m);
        }
    } else {
        smp_ckpt_file *f0;
        if ((st = smp__ckpt_open_legacy0(path, &f0, &P)) == SMP_OK) smp_ckpt_close(f0);
        if (!st && mp_rank >= 0 && mp_rank < P && !(file = smp__ckpt_strf("%s_%d", path, mp_rank)))
            st = smp__nomem(strlen(path) + 16, "the name of a checkpoint file");
    }
    if (!st && (mp_rank < 0 || mp_rank >= P))
        st = smp_error(SMP_ERR_ARG, "smp_ckpt_partial_file: checkpoint '%s' has %d partitions, so no mp rank %d", path,
                       P, mp_rank);
    if (!st && strlen(file) >= cap)
        st = smp_error(SMP_ERR_ARG, "smp_ckpt_partial_file: '%s' does not fit in %zu bytes", file, cap);
    if (!st) {
        memcpy(out, file, strlen(file) + 1);
        if (partitions) *partitions = P;
    }
    smp__free(file);
    smp__free(mpath);
    return st;
}

/* Opens the file(s) of a checkpoint and checks that they form one save. */
static smp_status smp__ckpt_open_set(const char *path, int partial, smp_ckpt_file ***out, int *nout) {
    *out = NULL;
    *nout = 0;
    smp_ckpt_file **files = NULL, *f0;
    smp_status st;
    if (!partial) {
        if ((st = smp_ckpt_open(path, &f0)) != SMP_OK) {
            char *mp = smp__ckpt_strf("%s.manifest", path), *p0 = smp__ckpt_strf("%s_0", path);
            const char *other = smp__ckpt_exists(mp) ? mp : smp__ckpt_exists(p0) ? p0 : NULL;
            if (other && !smp__ckpt_exists(path))
                st = smp_error(st, "%s (but '%s' exists: a partial checkpoint? load it with partial = SMP_ON)",
                               smp_last_error(), other);
            smp__free(p0);
            smp__free(mp);
            return st;
        }
        const char *kind = smp_ckpt_meta(f0, "smp.kind");
        if (kind && strcmp(kind, "full")) {
            const char *mpr = smp_ckpt_meta(f0, "smp.mp_rank"), *gen = smp_ckpt_meta(f0, "smp.generation");
            st =
                smp_error(SMP_ERR_FORMAT,
                          "checkpoint '%s' is file %s of a %s checkpoint; load that with partial = SMP_ON and the path "
                          "without the \"%s%s_%s\"",
                          path, mpr ? mpr : "?", kind, gen ? ".g" : "", gen ? gen : "", mpr ? mpr : "<mp_rank>");
        }
        if (!st)
            files = (smp_ckpt_file **)smp__alloc_or(&st, sizeof *files, SMP__ALLOC_OTHER | SMP__UNINIT,
                                                    "the list of a checkpoint's files");
        if (files) files[0] = f0;
        else smp_ckpt_close(f0);
        return smp__ckpt_set_done(st, files, 1, out, nout);
    }
    /* a manifest commits the files of a partial checkpoint; without one,
       "<path>_0" .. are a checkpoint saved before manifests */
    char *p = smp__ckpt_strf("%s.manifest", path);
    if (!p) return smp__nomem(strlen(path) + 16, "the name of the checkpoint's manifest");
    if (smp__ckpt_exists(p)) {
        st = smp__ckpt_open_manifest_set(p, out, nout);
        smp__free(p);
        return st;
    }
    smp__free(p);
    int P;
    SMP_TRY(smp__ckpt_open_legacy0(path, &f0, &P));
    st = SMP_OK;
    files = (smp_ckpt_file **)smp__alloc_or(&st, sizeof *files * (size_t)P, SMP__ALLOC_OTHER,
                                            "the list of a checkpoint's files");
    if (!files) {
        smp_ckpt_close(f0);
        return st;
    }
    files[0] = f0;
    const char *id0 = smp_ckpt_meta(f0, "smp.save_id");
    for (int k = 1; k < P && !st; k++) {
        if (!(p = smp__ckpt_strf("%s_%d", path, k))) {
            st = smp__nomem(strlen(path) + 16, "the name of a checkpoint file");
            break;
        }
        st = smp_ckpt_open(p, &files[k]);
        if (st) {
            st = smp_error(st, "%s (file %d of the %d that '%s' announces)", smp_last_error(), k, P, smp_ckpt_path(f0));
        } else {
            const char *idk = smp_ckpt_meta(files[k], "smp.save_id");
            if (!smp__ckpt_is_partial(files[k]))
                st = smp_error(SMP_ERR_FORMAT, "checkpoint '%s' is not a file of an smp partial checkpoint", p);
            else if (!idk || strcmp(idk, id0))
                st = smp_error(SMP_ERR_FORMAT,
                               "checkpoint '%s' comes from another save than '%s' (smp.save_id %s, not %s): a save was "
                               "interrupted between files, or files of two checkpoints are mixed",
                               p, smp_ckpt_path(f0), idk ? idk : "missing", id0);
            else if (smp__ckpt_meta_int(files[k], "smp.partitions", P, P) < 0 ||
                     smp__ckpt_meta_int(files[k], "smp.mp_rank", k, k) < 0)
                st = SMP_ERR_FORMAT;
        }
        smp__free(p);
    }
    return smp__ckpt_set_done(st, files, P, out, nout);
}

static int smp__ckpt_cmp_src(const void *a, const void *b) {
    const smp__ckpt_src *x = (const smp__ckpt_src *)a, *y = (const smp__ckpt_src *)b;
    if (x->item != y->item) return x->item < y->item ? -1 : 1;
    if (x->file != y->file) return x->file < y->file ? -1 : 1;
    return x->e->offset < y->e->offset ? -1 : x->e->offset > y->e->offset;
}

static int smp__ckpt_cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* How many of an item's elements its file pieces cover, counted once. */
static smp_status smp__ckpt_covered(const smp__ckpt_plan *pl, const smp__ckpt_item *it, int64_t *covered) {
    const smp__ckpt_src *src = &pl->srcs[it->src0];
    int64_t n = 0, len, at = 0, *runs;
    smp_status st = SMP_OK;
    *covered = 0;
    for (int k = 0; k < it->nsrc; k++)
        if (smp__ckpt_is_whole(it, &src[k].pc)) {
            *covered = smp__ckpt_numel(it);
            return SMP_OK;
        }
    for (int k = 0; k < it->nsrc; k++)
        for (int64_t j = src[k].pc.first, e = j + src[k].pc.count; j < e; j += len, n++)
            smp__ckpt_run(it, &src[k].pc, j, e, &len);
    if (!(runs = (int64_t *)smp__alloc_or(&st, sizeof(int64_t) * 2 * (size_t)(n + 1), SMP__ALLOC_OTHER,
                                          "the pieces of a sharded tensor in a checkpoint's files")))
        return st;
    n = 0;
    for (int k = 0; k < it->nsrc; k++)
        for (int64_t j = src[k].pc.first, e = j + src[k].pc.count; j < e; j += len, n++) {
            runs[2 * n] = smp__ckpt_run(it, &src[k].pc, j, e, &len);
            runs[2 * n + 1] = len;
        }
    qsort(runs, (size_t)n, 2 * sizeof(int64_t), smp__ckpt_cmp_i64);
    for (int64_t r = 0; r < n; r++) {
        int64_t lo = runs[2 * r] > at ? runs[2 * r] : at, hi = runs[2 * r] + runs[2 * r + 1];
        if (hi > lo) *covered += hi - lo;
        if (hi > at) at = hi;
    }
    smp__free(runs);
    return SMP_OK;
}

/* Matches the files' tensors with the model: same on every rank. A file
   tensor holds an item whole, or (partial checkpoints) the piece that its
   "smp.shard.<name>" entry names; an item may come in pieces from several
   files, which together must cover it. */
static smp_status smp__ckpt_match(smp__ckpt_plan *pl, smp_ckpt_file **files, int nf, int partial, int with_opt) {
    char d1[200], d2[200];
    size_t plen = strlen(SMP_CKPT_OPTIMIZER_PREFIX);
    smp_status st = SMP_OK;
    for (int i = 0; i < pl->n; i++) pl->items[i].src0 = -1; /* while matching: the file holding it whole */
    for (int k = 0; k < nf; k++) {
        smp_ckpt_file *f = files[k];
        int fpp = k; /* the partition whose tensors the file holds */
        if (partial && smp_ckpt_meta(f, "smp.pp_rank") && (fpp = smp__ckpt_meta_int(f, "smp.pp_rank", 0, 1 << 20)) < 0)
            return SMP_ERR_FORMAT;
        for (int i = 0; i < smp_ckpt_count(f); i++) {
            const smp_ckpt_info *e = smp_ckpt_info_at(f, i);
            int idx = smp__ckpt_find(pl, e->name), is_opt = !strncmp(e->name, SMP_CKPT_OPTIMIZER_PREFIX, plen);
            if (idx < 0) {
                if (is_opt && !with_opt) continue; /* loading without an optimizer */
                return smp_error(SMP_ERR_FORMAT, "checkpoint '%s': tensor '%s' is unexpected: %s", smp_ckpt_path(f),
                                 e->name,
                                 is_opt ? "no rank registered optimizer state of that name"
                                        : "the model has no parameter or buffer of that name");
            }
            smp__ckpt_item *it = &pl->items[idx];
            smp__ckpt_src src;
            memset(&src, 0, sizeof src);
            src.item = idx;
            src.file = k;
            src.e = e;
            src.pc = smp__ckpt_whole(it);
            char *key = partial ? smp__ckpt_strf("smp.shard.%s", e->name) : NULL;
            if (partial && !key)
                return smp__nomem(strlen(e->name) + 16, "a metadata key to look up (smp.shard.<tensor>)");
            const char *sv = key ? smp_ckpt_meta(f, key) : NULL;
            smp__free(key);
            if (sv) {
                int nd;
                int64_t shp[SMP_MAX_DIMS];
                if (!smp__ckpt_piece_parse(sv, &nd, shp, &src.pc))
                    return smp_error(SMP_ERR_FORMAT,
                                     "checkpoint '%s': tensor '%s': its metadata smp.shard.%s, \"%s\", is not a piece "
                                     "of a tensor as smp_save writes it",
                                     smp_ckpt_path(f), e->name, e->name, sv);
                if (e->dtype != it->dtype || !smp__same_shape(nd, shp, it->ndim, it->shape))
                    return smp_error(SMP_ERR_FORMAT,
                                     "checkpoint '%s': tensor '%s' is a piece of %s in the file but %s in the model",
                                     smp_ckpt_path(f), e->name,
                                     smp__ckpt_describe(e->dtype, nd, shp, d1, sizeof d1),
                                     smp__ckpt_describe(it->dtype, it->ndim, it->shape, d2, sizeof d2));
                if (e->numel != src.pc.count)
                    return smp_error(SMP_ERR_FORMAT,
                                     "checkpoint '%s': tensor '%s' holds %lld elements, but its metadata smp.shard.%s "
                                     "says %lld",
                                     smp_ckpt_path(f), e->name, (long long)e->numel, e->name,
                                     (long long)src.pc.count);
                src.sharded = 1;
            } else {
                if (it->src0 >= 0)
                    return smp_error(SMP_ERR_FORMAT, "checkpoint '%s': tensor '%s' is also in '%s'",
                                     smp_ckpt_path(f), e->name, smp_ckpt_path(files[it->src0]));
                if (e->dtype != it->dtype || !smp__same_shape(e->ndim, e->shape, it->ndim, it->shape))
                    return smp_error(SMP_ERR_FORMAT,
                                     "checkpoint '%s': tensor '%s' is %s in the file but %s in the model",
                                     smp_ckpt_path(f), e->name,
                                     smp__ckpt_describe(e->dtype, e->ndim, e->shape, d1, sizeof d1),
                                     smp__ckpt_describe(it->dtype, it->ndim, it->shape, d2, sizeof d2));
                it->src0 = k;
            }
            if (partial) { /* the partition map must agree with where the tensor is */
                char key2[64 + 8];
                size_t kl = strlen("smp.partition.") + strlen(e->name) + 1;
                const char *what = "a metadata key to look up (smp.partition.<tensor>)";
                char *kb = kl <= sizeof key2 ? key2
                                             : (char *)smp__alloc_or(&st, kl, SMP__ALLOC_OTHER | SMP__UNINIT, what);
                if (!kb) return st;
                snprintf(kb, kl, "smp.partition.%s", e->name);
                const char *v = smp_ckpt_meta(f, kb);
                if (kb != key2) smp__free(kb);
                if (v && atoi(v) != fpp)
                    return smp_error(SMP_ERR_FORMAT,
                                     "checkpoint '%s': tensor '%s' is in file %d but the partition map says %s",
                                     smp_ckpt_path(f), e->name, k, v);
            }
            if (!smp__grow_or(&st, (void **)&pl->srcs, &pl->srcs_cap, pl->nsrcs + 1, sizeof *pl->srcs,
                              "the list of tensors a load reads"))
                return st;
            pl->srcs[pl->nsrcs++] = src;
        }
    }
    if (pl->nsrcs) qsort(pl->srcs, (size_t)pl->nsrcs, sizeof *pl->srcs, smp__ckpt_cmp_src);
    for (int i = 0; i < pl->n; i++) pl->items[i].src0 = pl->items[i].nsrc = 0;
    for (int s = pl->nsrcs - 1; s >= 0; s--) {
        pl->items[pl->srcs[s].item].src0 = s;
        pl->items[pl->srcs[s].item].nsrc++;
    }
    for (int i = 0; i < pl->n; i++) {
        const smp__ckpt_item *it = &pl->items[i];
        int64_t covered = 0;
        if (!it->nsrc)
            return smp_error(SMP_ERR_FORMAT, "checkpoint '%s'%s: tensor '%s' is missing (the model has this %s)",
                             smp_ckpt_path(files[0]), nf > 1 ? " and the other files of its save" : "", it->name,
                             smp__ckpt_kind_name(it->kind));
        SMP_TRY(smp__ckpt_covered(pl, it, &covered));
        if (covered != smp__ckpt_numel(it))
            return smp_error(SMP_ERR_FORMAT,
                             "checkpoint '%s'%s: the pieces of tensor '%s' cover %lld of its %lld elements: the "
                             "sharded state (TP slices or shard_optimizer_state ranges) does not cover the %s; load "
                             "a checkpoint saved whole, or save this one again",
                             smp_ckpt_path(files[0]), nf > 1 ? " and the other files of its save" : "", it->name,
                             (long long)covered, (long long)smp__ckpt_numel(it), smp__ckpt_kind_name(it->kind));
    }
    return SMP_OK;
}

/* Checks the checksum of every file tensor this rank loads from: those
   that share elements with what it holds. */
static smp_status smp__ckpt_verify_local(smp__ckpt_plan *pl, smp_ckpt_file **files) {
    for (int q = 0; q < pl->n; q++) {
        smp__ckpt_item *it = &pl->items[pl->order[q]];
        if (!it->mine) continue;
        for (int k = 0; k < it->nsrc; k++) {
            smp__ckpt_src *src = &pl->srcs[it->src0 + k];
            int64_t shared = 0;
            if (src->bytes || !src->e->nbytes) continue;
            smp__ckpt_overlap(it, &it->mine_pc, NULL, SMP_HOST, &src->pc, NULL, &shared);
            if (!shared) continue;
            smp_ckpt_file *f = files[src->file];
            const uint8_t *base = smp__ckpt_map(f);
            if (base) {
                src->bytes = base + f->data_start + src->e->offset;
                if (src->e->has_checksum) {
                    uint32_t got = smp_ckpt_crc32c(0, src->bytes, (size_t)src->e->nbytes);
                    if (got != src->e->checksum) return smp__ckpt_mismatch(f, src->e, got);
                }
            } else {
                src->staged = (uint8_t *)smp__alloc((size_t)src->e->nbytes, SMP__ALLOC_OTHER);
                if (!src->staged) {
                    char what[600];
                    snprintf(what, sizeof what, "reading tensor '%s' of %s", it->name, f->label);
                    return smp__nomem((size_t)src->e->nbytes, what);
                }
                SMP_TRY(smp_ckpt_read(f, src->e, src->staged, (size_t)src->e->nbytes));
                src->bytes = src->staged;
            }
        }
    }
    return SMP_OK;
}

SMPDEF smp_status smp_load(smp_model *m, const char *path, const smp_load_desc *desc) {
    smp_load_desc d = {SMP_DEFAULT, NULL, NULL, NULL};
    if (desc) d = *desc;
    SMP_TRY(smp__ckpt_begin("smp_load", m, path, d.optimizer, NULL));
    int nf = 0, partial = d.partial != SMP_OFF;
    smp__ckpt_plan pl;
    smp_ckpt_file **files = NULL;
    smp_status st = smp__ckpt_agree(&pl, smp__ckpt_plan_init(&pl, m, d.optimizer, 0), "planning the load");
    /* 1. headers; 2. names, dtypes, shapes; 3. checksums; 4. copies */
    if (!st) st = smp__ckpt_agree(&pl, smp__ckpt_open_set(path, partial, &files, &nf), "opening the checkpoint");
    if (!st) st = smp__ckpt_agree(&pl, smp__ckpt_match(&pl, files, nf, partial, d.optimizer != NULL),
                                "checking the checkpoint against the model");
    if (!st) st = smp__ckpt_agree(&pl, smp__ckpt_verify_local(&pl, files), "verifying the checkpoint's checksums");
    if (!st) {
        smp_status cs = SMP_OK;
        for (int i = 0; i < pl.n; i++) {
            const smp__ckpt_item *it = &pl.items[i];
            for (int k = 0; it->mine && k < it->nsrc; k++) {
                const smp__ckpt_src *src = &pl.srcs[it->src0 + k];
                if (!src->bytes) continue; /* shares nothing with this rank's piece */
                smp_status s2 = smp__ckpt_overlap(it, &it->mine_pc, (uint8_t *)it->mine->data, it->mine->device,
                                                  &src->pc, src->bytes, NULL);
                if (!cs) cs = s2;
            }
        }
        st = smp__ckpt_agree(&pl, cs, "copying the checkpoint into the model");
    }
    if (!st && d.on_meta) {
        for (int i = 0; i < smp_ckpt_meta_count(files[0]); i++) {
            const char *k, *v;
            smp_ckpt_meta_at(files[0], i, &k, &v);
            if (strncmp(k, "smp.", 4)) d.on_meta(k, v, d.user);
        }
    }
    for (int i = 0; i < nf; i++) smp_ckpt_close(files[i]);
    smp__free(files);
    smp__ckpt_plan_free(&pl);
    return st;
}

/* ---------------------------------------------------------------- state dicts */
SMPDEF smp_status smp_model_local_state_dict(smp_model *m, const smp_optimizer *opt, smp_state_dict *out) {
    if (!out) return smp_error(SMP_ERR_ARG, "smp_model_local_state_dict: out is NULL");
    memset(out, 0, sizeof *out);
    if (!m) return smp_error(SMP_ERR_ARG, "smp_model_local_state_dict: model is NULL");
    if (!smp_model_is_partitioned(m))
        return smp_error(SMP_ERR_STATE, "smp_model_local_state_dict: the model is not partitioned yet");
    int np = smp_model_num_global_params(m, true), n = 0;
    smp_status st = SMP_OK;
    out->entries = (smp_named_tensor *)smp__alloc_or(
        &st, sizeof(smp_named_tensor) * (size_t)(np + (opt ? opt->n : 0) + 1), SMP__ALLOC_OTHER | SMP__UNINIT,
        "the entries of smp_model_local_state_dict's result");
    if (!out->entries) return st;
    for (int i = 0; i < np; i++) {
        smp_param *p = smp_model_global_param(m, i, true);
        if (!smp_module_is_local(smp_param_module(p))) continue;
        out->entries[n].name = smp_param_name(p);
        out->entries[n].tensor = *smp_param_value(p);
        n++;
    }
    for (int i = 0; opt && i < opt->n; i++) {
        out->entries[n].name = opt->s[i].full;
        out->entries[n].tensor = opt->s[i].t;
        n++;
    }
    out->n = n;
    out->partial = true;
    return SMP_OK;
}

static smp_status smp__ckpt_mem_sink(void *ctx, int item, uint64_t off, const void *bytes, size_t n) {
    smp_state_dict *sd = (smp_state_dict *)ctx;
    memcpy((uint8_t *)sd->entries[item].tensor.data + off, bytes, n);
    return SMP_OK;
}

SMPDEF smp_status smp_model_state_dict(smp_model *m, const smp_optimizer *opt, int root, smp_state_dict *out) {
    smp__ckpt_plan pl;
    smp__ckpt_rx rx;
    smp_status st = SMP_OK;
    if (!smp_is_initialized()) return smp_error(SMP_ERR_STATE, "smp_model_state_dict called before smp_init");
    if (out) memset(out, 0, sizeof *out);
    if (!out || !m) st = smp_error(SMP_ERR_ARG, "smp_model_state_dict: model and out must not be NULL");
    else if (!smp_model_is_partitioned(m))
        st = smp_error(SMP_ERR_STATE, "smp_model_state_dict: the model is not partitioned yet");
    else if (root < 0 || root >= smp_size())
        st = smp_error(SMP_ERR_ARG, "smp_model_state_dict: root %d is outside the world (size %d)", root, smp_size());
    else if (opt && opt->model != m)
        st = smp_error(SMP_ERR_ARG, "smp_model_state_dict: the optimizer registry belongs to another model");
    st = smp__agree_on(smp_group_comm(SMP_WORLD), st, "smp_model_state_dict arguments");
    if (st) return st;
    memset(&rx, 0, sizeof rx);
    st = smp__ckpt_plan_init(&pl, m, opt, 0);
    for (int i = 0; i < pl.n && !st; i++)
        if ((pl.items[i].kind == SMP__CKPT_OPTIM || pl.items[i].kind == SMP__CKPT_GLOBAL) && !pl.items[i].saver_has &&
            !pl.items[i].elementwise)
            st = smp_error(SMP_ERR_ARG,
                           "optimizer state '%s' is not registered on world rank %d, which holds it for all",
                           pl.items[i].name, pl.saver[pl.items[i].mp]);
    if (!st && pl.rank == root) { /* names and data, owned by the dict */
        size_t names = 0, at = 0;
        char *blob;
        for (int i = 0; i < pl.n; i++) names += strlen(pl.items[i].name) + 1;
        out->entries = (smp_named_tensor *)smp__alloc_or(&st, sizeof(smp_named_tensor) * (size_t)(pl.n + 1),
                                                         SMP__ALLOC_OTHER | SMP__UNINIT,
                                                         "the entries of smp_model_state_dict's result");
        blob = (char *)smp__alloc_or(&st, names + 1, SMP__ALLOC_OTHER | SMP__UNINIT,
                                     "the names in smp_model_state_dict's result");
        out->storage_ = blob;
        if (out->entries) memset(out->entries, 0, sizeof(smp_named_tensor) * (size_t)(pl.n + 1));
        for (int i = 0; i < pl.n && !st; i++) {
            const smp__ckpt_item *it = &pl.items[i];
            smp_named_tensor *e = &out->entries[i];
            size_t k = strlen(it->name) + 1;
            memcpy(blob + at, it->name, k);
            e->name = blob + at;
            at += k;
            e->tensor = smp_tensor_make(NULL, it->dtype, it->ndim, it->shape);
            e->tensor.data = smp__alloc(it->nbytes ? (size_t)it->nbytes : 1, SMP__ALLOC_OTHER);
            out->n = i + 1;
            if (!e->tensor.data) {
                char what[400];
                snprintf(what, sizeof what, "tensor '%s' in smp_model_state_dict's result", it->name);
                st = smp__nomem((size_t)it->nbytes, what);
            }
        }
    }
    st = smp__ckpt_agree(&pl, st, "preparing the state dict");
    if (!st) st = smp__ckpt_assemble(&pl);
    if (!st) st = smp__ckpt_stream_prepare(&pl, root, &rx);
    st = smp__ckpt_agree(&pl, st, "preparing the state dict");
    if (!st) st = smp__ckpt_agree(&pl, smp__ckpt_stream(&rx, smp__ckpt_mem_sink, out, 0), "gathering the state dict");
    if (st) smp_state_dict_free(out);
    else if (pl.rank != root) memset(out, 0, sizeof *out);
    smp__ckpt_stream_free(&rx);
    smp__ckpt_plan_free(&pl);
    return st;
}

SMPDEF void smp_state_dict_free(smp_state_dict *sd) {
    if (!sd) return;
    if (sd->storage_ && sd->entries)
        for (int i = 0; i < sd->n; i++) smp__free(sd->entries[i].tensor.data);
    smp__free(sd->storage_);
    smp__free(sd->entries);
    memset(sd, 0, sizeof *sd);
}

SMPDEF const smp_tensor *smp_state_dict_find(const smp_state_dict *sd, const char *name) {
    if (!sd || !name) return NULL;
    for (int i = 0; i < sd->n; i++)
        if (!strcmp(sd->entries[i].name, name)) return &sd->entries[i].tensor;
    return NULL;
}

#ifdef __cplusplus
}
#endif
#endif /* SMP_IMPLEMENTATION */
