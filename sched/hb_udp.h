/* Heartbeats over UDP, on a thread of their own that never calls MPI (sched/link_mpi.c uses them
 * beside its MPI heartbeats; docs/pipeline.md "Failures"). A link over MPI hears a rank only
 * through MPI's progress engine, which can stall for seconds on a dead peer's connection: a live
 * rank then goes quiet to the others and is named lost. These heartbeats do not share that engine.
 *
 * Each member of a job of n members opens a UDP socket (any port, every IPv4 interface) and hands
 * out its record (its port and its interfaces' IPv4 addresses, loopback included); the records
 * travel by other means (MPI_Allgather); once started, the thread sends every other member a
 * datagram every period_ns to each of its addresses (16 bytes: the job's id, the sender, the
 * addressee) and takes theirs, ignoring what another job or another addressee sent. A member's
 * heard time is when one of its datagrams last arrived; 0 until the first. Where UDP does not get
 * through (a firewall, IPv6 only) nothing is heard and the caller goes by its other channel. */
#ifndef MF_HB_UDP_H
#define MF_HB_UDP_H

#include <stdint.h>

#define MF_HB_MAX_ADDRS 8   /* IPv4 addresses a record holds (the first ones getifaddrs lists) */

typedef struct mf_hb_record {   /* what a member hands the others: plain bytes, network order */
    uint32_t addr[MF_HB_MAX_ADDRS];
    uint16_t port;
    uint16_t n_addr;
} mf_hb_record;

typedef struct mf_hb_udp mf_hb_udp;

/* A socket for member `self` of `n` in job `job` (an id every member shares, different from other
 * jobs'), heartbeats every period_ns, and this member's record in *rec. 0, or a negative code
 * naming what failed (socket, bind, getifaddrs). */
int mf_hb_udp_open(uint64_t job, int self, int n, int64_t period_ns, mf_hb_udp **out, mf_hb_record *rec);
/* Starts the thread with every member's record (recs[self] is this one's, not used). 0 or -EAGAIN. */
int mf_hb_udp_start(mf_hb_udp *h, const mf_hb_record *recs);
/* When a datagram of member p last arrived (mf_now_ns), 0 if none yet. Any thread. */
int64_t mf_hb_udp_heard(const mf_hb_udp *h, int p);
/* Stops the thread (when started) and frees h; NULL is a no-op. */
void mf_hb_udp_close(mf_hb_udp *h);

#endif
