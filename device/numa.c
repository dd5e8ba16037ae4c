/* NUMA-placed staging memory (see numa.h): mmap, mbind(MPOL_BIND) by raw syscall (no libnuma),
 * then one write per page so placement happens now, not on the first copy. */
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "device/numa.h"
#include "sched/error.h"

#define MF_MPOL_BIND 2
#define MF_MPOL_F_NODE 1
#define MF_MPOL_F_ADDR 2
#define MF_NODE_BITS 1024

static size_t mf_page_bytes(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

int mf_dev_numa_alloc(size_t n_bytes, int node, void **out)
{
    *out = NULL;
    if (node >= MF_NODE_BITS) return mf_error(-EINVAL, "numa staging: node %d out of range", node);
    size_t pg = mf_page_bytes(), n = (n_bytes + pg - 1) / pg * pg;
    if (!n_bytes || n < n_bytes) return mf_error(-EINVAL, "numa staging: bad size %zu", n_bytes);
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return mf_error(-ENOMEM, "numa staging: mmap of %zu bytes: %s", n, strerror(errno));
    if (node >= 0) {
        unsigned long mask[MF_NODE_BITS / (8 * sizeof(unsigned long))] = {0};
        mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
        /* the kernel reads maxnode - 1 bits (libnuma passes bits + 1 too) */
        if (syscall(SYS_mbind, p, n, MF_MPOL_BIND, mask, (unsigned long)MF_NODE_BITS + 1, 0) != 0) {
            int e = errno;
            munmap(p, n);
            return mf_error(e == EINVAL ? -EINVAL : -e, "numa staging: binding %zu bytes to node %d: "
                            "%s", n, node, strerror(e));
        }
    }
    for (size_t off = 0; off < n; off += pg) ((volatile char *)p)[off] = 0;
    *out = p;
    return 0;
}

void mf_dev_numa_free(void *p, size_t n_bytes)
{
    if (!p) return;
    size_t pg = mf_page_bytes();
    munmap(p, (n_bytes + pg - 1) / pg * pg);
}

int mf_dev_numa_node_of(const void *addr)
{
    int node = -1;
    if (syscall(SYS_get_mempolicy, &node, NULL, 0UL, addr, MF_MPOL_F_NODE | MF_MPOL_F_ADDR) != 0)
        return mf_error(errno == ENOSYS ? -ENOSYS : -errno, "get_mempolicy(%p): %s", addr,
                        strerror(errno));
    return node;
}

int mf_dev_pci_numa_node(const char *pci_bus_id)
{
    char id[64], path[128];
    size_t i = 0;
    for (; pci_bus_id[i] && i + 1 < sizeof id; i++) id[i] = (char)tolower((unsigned char)pci_bus_id[i]);
    id[i] = 0;
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", id);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int node = -1;
    if (fscanf(f, "%d", &node) != 1) node = -1;
    fclose(f);
    return node < 0 ? -1 : node;
}
