/* Staging memory on a card's NUMA node: page-aligned anonymous memory bound (mbind) to one node
 * and touched so its pages are placed at allocation, for the CUDA backend to pin with
 * cudaHostRegister; and the node a PCI device (a card) sits on, from sysfs. Host-only code, so
 * it is tested on any machine. */
#ifndef MF_DEV_NUMA_H
#define MF_DEV_NUMA_H

#include <stddef.h>

/* n_bytes (rounded up to pages) on node `node` (-1: no binding). -EINVAL with a message for a node
 * the kernel refuses, -ENOMEM when the mapping fails. Free with mf_dev_numa_free(p, n_bytes). */
int mf_dev_numa_alloc(size_t n_bytes, int node, void **out);
void mf_dev_numa_free(void *p, size_t n_bytes);

/* The NUMA node of the page holding addr, or a negative code (-ENOSYS without NUMA support). */
int mf_dev_numa_node_of(const void *addr);

/* The NUMA node of PCI device pci_bus_id ("0000:3B:00.0", any case) from
 * /sys/bus/pci/devices/<id>/numa_node; -1 when unknown (no such file, or the kernel says -1). */
int mf_dev_pci_numa_node(const char *pci_bus_id);

#endif
