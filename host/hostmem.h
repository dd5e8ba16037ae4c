/* Host memory for weights: anonymous mappings, optionally asked to be backed by 2 MiB pages
 * (transparent huge pages), so that streaming hundreds of MB a step (the head, resident experts)
 * walks one TLB entry per 2 MiB instead of per 4 KiB. */
#ifndef MF_HOSTMEM_H
#define MF_HOSTMEM_H

#include <stddef.h>

/* Maps n bytes (at least 1) of zeroed, private anonymous memory, reserved lazily (MAP_NORESERVE).
 * With huge, the mapping starts on a 2 MiB boundary and is advised MADV_HUGEPAGE: where the kernel
 * has transparent huge pages set to "always" or "madvise" it backs the pages by 2 MiB ones as they
 * are first touched; where it has them off the advice is refused and ignored (4 KiB pages, same
 * contents). Returns NULL when the mapping fails (errno set). Release with mf_hostmem_unmap. */
void *mf_hostmem_map(size_t n, int huge);
/* Unmaps what mf_hostmem_map returned for the same n and huge; NULL is ignored. */
void mf_hostmem_unmap(void *p, size_t n, int huge);

#endif
