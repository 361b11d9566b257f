/* memory_peaks.h - what the smp examples print at the end: the memory
   account's peaks (smp_memory_report), so a user sees what each setting
   (--shard-optimizer, --offload, --recompute, ...) saved. Shared by
   gpt_shared.h and fmnist_shared.h. Include after smp.h. */
#ifndef MEMORY_PEAKS_H
#define MEMORY_PEAKS_H
#include <stdio.h>
#include <stdlib.h>

/* The memory account's peaks per category, one line per rank in rank
   order, printed by rank 0 ("memory peak rank R: parameters X MiB, ...";
   device memory counts with host memory): what each setting saved.
   Collective. */
static inline smp_status print_memory_peaks(const char *title) {
    smp_memory_stats *all = (smp_memory_stats *)calloc((size_t)smp_size(), sizeof *all);
    smp_status st = all ? smp_memory_report(title, all) : smp_error(SMP_ERR_NOMEM, "out of memory");
    for (int r = 0; !st && smp_rank() == 0 && r < smp_size(); r++) {
        char line[512];
        smp_memory_format(&all[r], true, line, sizeof line);
        printf("memory peak rank %d: %s\n", r, line);
    }
    fflush(stdout);
    free(all);
    return st;
}
#endif
