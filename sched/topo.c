/* Worker placement with hwloc: how many workers a CPU lane gets (all cores of its NUMA node when
 * its concurrency is 0), the core each is pinned to, and the default lane table (one CPU lane per
 * NUMA node plus an IO lane). */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/sched_impl.h"

int mf_topo_load(const char *desc, hwloc_topology_t *out)
{
    hwloc_topology_t t;
    *out = NULL;
    if (hwloc_topology_init(&t) < 0)
        return mf_error(-ENOMEM, "sched: hwloc_topology_init failed (%s:%d)", __FILE__, __LINE__);
    int rc = 0;
    if (desc && *desc) {
        size_t n = strlen(desc);
        int xml = n > 4 && !strcmp(desc + n - 4, ".xml");
        if ((xml ? hwloc_topology_set_xml(t, desc) : hwloc_topology_set_synthetic(t, desc)) < 0 ||
            hwloc_topology_set_flags(t, HWLOC_TOPOLOGY_FLAG_IS_THISSYSTEM) < 0)
            rc = mf_error(-EINVAL, "sched: hwloc refuses the %s topology '%s' (%s:%d)",
                          xml ? "XML" : "synthetic", desc, __FILE__, __LINE__);
    }
    if (!rc && hwloc_topology_load(t) < 0)
        rc = mf_error(errno ? -errno : -EIO, "sched: hwloc cannot load the topology '%s' (%s:%d)",
                      desc && *desc ? desc : "of this machine", __FILE__, __LINE__);
    if (rc) {
        hwloc_topology_destroy(t);
        return rc;
    }
    *out = t;
    return 0;
}

int mf_topo_sockets_of(const char *topology, mf_topo_sockets *out)
{
    memset(out, 0, sizeof *out);
    hwloc_topology_t t;
    int rc = mf_topo_load(topology, &t);
    if (rc) return rc;
    int n = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
    for (int i = 0; i < n && out->n < MF_TOPO_MAX_SOCKETS; i++) {
        hwloc_obj_t o = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, (unsigned)i);
        if (!o || !o->cpuset || hwloc_bitmap_iszero(o->cpuset)) continue;
        int c = hwloc_get_nbobjs_inside_cpuset_by_type(t, o->cpuset, HWLOC_OBJ_CORE);
        if (c <= 0) c = hwloc_get_nbobjs_inside_cpuset_by_type(t, o->cpuset, HWLOC_OBJ_PU);
        out->cores[out->n] = c > 0 ? c : 1;
        out->numa[out->n] = i;
        out->node[out->n++] = (int)o->os_index;
    }
    if (!out->n) {   /* no node with cores: the machine is one socket */
        int c = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
        out->n = 1;
        out->cores[0] = c > 0 ? c : 1;
        out->node[0] = out->numa[0] = -1;
    }
    hwloc_topology_destroy(t);
    return 0;
}

/* The cpuset serving a lane: its NUMA node's, or the whole machine's for node -1. */
static hwloc_const_cpuset_t mf_topo_lane_set(mf_sched *s, const mf_lane_rt *L)
{
    if (L->numa_node < 0) return hwloc_topology_get_topology_cpuset(s->topo);
    hwloc_obj_t node = hwloc_get_obj_by_type(s->topo, HWLOC_OBJ_NUMANODE, (unsigned)L->numa_node);
    return node ? node->cpuset : NULL;
}

int mf_topo_plan(mf_sched *s, mf_lane_rt *L)
{
    hwloc_const_cpuset_t set = mf_topo_lane_set(s, L);
    if (!set || hwloc_bitmap_iszero(set))
        return mf_error(-EINVAL, "sched: CPU lane '%s' asks for NUMA node %d; this machine has %d "
                        "node(s) with cores", L->desc.name ? L->desc.name : "?", L->numa_node,
                        hwloc_get_nbobjs_by_type(s->topo, HWLOC_OBJ_NUMANODE));
    int n_cores = hwloc_get_nbobjs_inside_cpuset_by_type(s->topo, set, HWLOC_OBJ_CORE);
    hwloc_obj_type_t unit = HWLOC_OBJ_CORE;
    if (n_cores <= 0) {
        n_cores = hwloc_get_nbobjs_inside_cpuset_by_type(s->topo, set, HWLOC_OBJ_PU);
        unit = HWLOC_OBJ_PU;
    }
    if (n_cores <= 0) n_cores = 1;
    L->n_workers = L->desc.concurrency ? L->desc.concurrency : n_cores;
    L->stash = L->n_workers <= hwloc_get_nbobjs_inside_cpuset_by_type(s->topo, set, HWLOC_OBJ_PU);
    if (!s->pin) return 0;
    L->bind = calloc((size_t)L->n_workers, sizeof *L->bind);
    if (!L->bind) return mf_error(-ENOMEM, "sched: out of memory");
    for (int i = 0; i < L->n_workers; i++) {
        hwloc_obj_t o = hwloc_get_obj_inside_cpuset_by_type(s->topo, set, unit,
                                                             (unsigned)(i % n_cores));
        L->bind[i] = hwloc_bitmap_dup(o ? o->cpuset : set);
        if (!L->bind[i]) return mf_error(-ENOMEM, "sched: out of memory");
    }
    return 0;
}

int mf_topo_bind(mf_sched *s, mf_lane_rt *L, int w)
{
    if (hwloc_set_thread_cpubind(s->topo, L->workers[w].thread, L->bind[w],
                                 HWLOC_CPUBIND_THREAD) < 0) {
        int e = errno ? errno : EINVAL;
        char buf[128];
        hwloc_bitmap_snprintf(buf, sizeof buf, L->bind[w]);
        return mf_error(-e, "sched: lane '%s' worker %d: hwloc_set_thread_cpubind to cpus %s: %s "
                        "(%s:%d)", L->desc.name ? L->desc.name : "?", w, buf, strerror(e),
                        __FILE__, __LINE__);
    }
    return 0;
}

int mf_lanes_default(mf_lane_desc *lanes, int max, int threads_per_node, int io_depth)
{
    static const char *const names[] = {"cpu0", "cpu1", "cpu2", "cpu3", "cpu4", "cpu5", "cpu6",
                                        "cpu7", "cpu8", "cpu9", "cpu10", "cpu11", "cpu12", "cpu13",
                                        "cpu14", "cpu15"};
    int n_nodes = 1;
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) == 0) {
        if (hwloc_topology_load(topo) == 0) {
            int k = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
            if (k > 0) n_nodes = k;
        }
        hwloc_topology_destroy(topo);
    }
    int n = 0;
    for (int i = 0; i < n_nodes && n < max; i++)
        lanes[n++] = (mf_lane_desc){.kind = MF_LANE_CPU,
                                    .name = i < 16 ? names[i] : "cpu",
                                    .concurrency = threads_per_node,
                                    .numa_node = n_nodes > 1 ? i : -1,
                                    .device = -1};
    if (n < max)
        lanes[n++] = (mf_lane_desc){.kind = MF_LANE_IO, .name = "io", .concurrency = io_depth,
                                    .numa_node = -1, .device = -1};
    return n;
}

int mf_topo_bind_shares(uint8_t *base, uint64_t n_bytes, int n_sockets, const int *node, int64_t n_ranges,
                        mf_topo_share_fn share, void *ctx, const char *who, const char *what, int quiet)
{
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) < 0 || hwloc_topology_load(topo) < 0) {
        if (!quiet) fprintf(stderr, "%s: hwloc cannot load the topology; the sockets' shares of %s stay first touch\n",
                            who, what);
        return 0;
    }
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    int n_bound = 0;
    for (int k = 0; k < n_sockets; k++) {
        int ok = 1;
        hwloc_obj_t obj = node[k] >= 0 ? hwloc_get_numanode_obj_by_os_index(topo, (unsigned)node[k]) : NULL;
        for (int64_t i = 0; obj && ok && i < n_ranges; i++) {
            uint64_t a, b;
            int first;
            share(ctx, k, i, &a, &b, &first);
            mf_topo_share_pages(&a, &b, first, pg);
            if (b > n_bytes) b = n_bytes;
            if (b <= a) continue;
            ok = hwloc_set_area_membind(topo, base + a, (size_t)(b - a), obj->nodeset, HWLOC_MEMBIND_BIND,
                                        HWLOC_MEMBIND_BYNODESET) == 0;
        }
        if (obj && ok) {
            n_bound++;
            continue;
        }
        if (!quiet)
            fprintf(stderr, "%s: socket %d's share of %s not bound to NUMA node %d (%s); first touch\n", who, k, what,
                    node[k], node[k] < 0 ? "it has none of its own" : !obj ? "no such node" : strerror(errno));
    }
    hwloc_topology_destroy(topo);
    return n_bound;
}
