/* Anonymous host mappings for weights, with the transparent-huge-page advice (host/hostmem.h). */
#define _GNU_SOURCE
#include "host/hostmem.h"

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define MF_HOSTMEM_HUGE ((size_t)2 << 20)

void *mf_hostmem_map(size_t n, int huge)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), nn = ((n ? n : 1) + pg - 1) / pg * pg;
    size_t len = nn + (huge ? MF_HOSTMEM_HUGE : 0);
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (!huge) return p;
    /* start on a 2 MiB boundary; the slack before it and after the (page-rounded) end is unmapped */
    char *a = (char *)(((uintptr_t)p + MF_HOSTMEM_HUGE - 1) & ~(uintptr_t)(MF_HOSTMEM_HUGE - 1));
    size_t head = (size_t)(a - p);
    if (head) munmap(p, head);
    if (MF_HOSTMEM_HUGE - head) munmap(a + nn, MF_HOSTMEM_HUGE - head);
    (void)madvise(a, nn, MADV_HUGEPAGE);   /* advice only: refused where THP is off */
    return a;
}

void mf_hostmem_unmap(void *p, size_t n, int huge)
{
    (void)huge;
    if (p) munmap(p, n ? n : 1);
}
