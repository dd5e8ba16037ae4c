/* Heartbeats over UDP on their own thread (sched/hb_udp.h): a socket, a record of its addresses,
 * and a loop that sends each member its datagrams when due and takes the ones that arrive. */
#include "sched/hb_udp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sched/clock.h"
#include "sched/error.h"

typedef struct mf_hb_msg {   /* a heartbeat's 16 bytes (host order: the members share a job, not a byte order check) */
    uint64_t job;
    int32_t from, to;
} mf_hb_msg;

struct mf_hb_udp {
    uint64_t job;
    int self, n, fd;
    int64_t period_ns;
    mf_hb_record *recs;          /* every member's, from start */
    _Atomic int64_t *heard;      /* per member */
    pthread_t thread;
    int started;
    atomic_int stop;
};

int mf_hb_udp_open(uint64_t job, int self, int n, int64_t period_ns, mf_hb_udp **out, mf_hb_record *rec)
{
    *out = NULL;
    memset(rec, 0, sizeof *rec);
    if (n < 1 || self < 0 || self >= n || period_ns <= 0)
        return mf_error(-EINVAL, "heartbeats: member %d of %d, period %lld ns", self, n, (long long)period_ns);
    mf_hb_udp *h = calloc(1, sizeof *h);
    if (!h) return mf_error(-ENOMEM, "heartbeats: out of memory");
    h->heard = calloc((size_t)n, sizeof *h->heard);
    h->recs = calloc((size_t)n, sizeof *h->recs);
    h->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int rc = 0;
    if (!h->heard || !h->recs) rc = mf_error(-ENOMEM, "heartbeats: out of memory");
    else if (h->fd < 0) rc = mf_error(-errno, "heartbeats: socket(AF_INET, SOCK_DGRAM): %s", strerror(errno));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = 0};
    socklen_t sl = sizeof sa;
    if (!rc && (bind(h->fd, (struct sockaddr *)&sa, sizeof sa) || getsockname(h->fd, (struct sockaddr *)&sa, &sl)))
        rc = mf_error(-errno, "heartbeats: binding a UDP socket to any port: %s", strerror(errno));
    struct ifaddrs *ifs = NULL;
    if (!rc && getifaddrs(&ifs)) rc = mf_error(-errno, "heartbeats: getifaddrs: %s", strerror(errno));
    if (rc) {
        if (h->fd >= 0) close(h->fd);
        free(h->heard);
        free(h->recs);
        free(h);
        return rc;
    }
    rec->port = sa.sin_port;
    for (struct ifaddrs *i = ifs; i && rec->n_addr < MF_HB_MAX_ADDRS; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP))
            rec->addr[rec->n_addr++] = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
    freeifaddrs(ifs);
    h->job = job;
    h->self = self;
    h->n = n;
    h->period_ns = period_ns;
    *out = h;
    return 0;
}

/* Sends member p's datagram to each of its addresses (errors ignored: an address this host cannot
 * reach is one of several). */
static void mf_hb_send(mf_hb_udp *h, int p)
{
    mf_hb_msg m = {.job = h->job, .from = h->self, .to = p};
    const mf_hb_record *r = &h->recs[p];
    for (int a = 0; a < r->n_addr && a < MF_HB_MAX_ADDRS; a++) {
        struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = r->port, .sin_addr.s_addr = r->addr[a]};
        (void)sendto(h->fd, &m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&to, sizeof to);
    }
}

/* Takes every datagram waiting: this job's, addressed to this member, from another member. */
static void mf_hb_take(mf_hb_udp *h)
{
    for (;;) {
        mf_hb_msg m;
        ssize_t got = recv(h->fd, &m, sizeof m, MSG_DONTWAIT);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return;   /* EAGAIN: nothing more (an ICMP error of a send shows here too) */
        if (got == (ssize_t)sizeof m && m.job == h->job && m.to == h->self && m.from >= 0 && m.from < h->n &&
            m.from != h->self)
            atomic_store(&h->heard[m.from], mf_now_ns());
    }
}

static void *mf_hb_loop(void *arg)
{
    mf_hb_udp *h = arg;
    int64_t next = 0;
    while (!atomic_load(&h->stop)) {
        int64_t now = mf_now_ns();
        if (now >= next) {
            for (int p = 0; p < h->n; p++)
                if (p != h->self) mf_hb_send(h, p);
            next = now + h->period_ns;
        }
        mf_hb_take(h);
        /* wake for the next datagram, the next send or, at least every 50 ms, to see stop */
        int64_t wait_ms = (next - mf_now_ns()) / 1000000 + 1;
        struct pollfd pf = {.fd = h->fd, .events = POLLIN};
        (void)poll(&pf, 1, (int)(wait_ms < 1 ? 1 : wait_ms > 50 ? 50 : wait_ms));
    }
    return NULL;
}

int mf_hb_udp_start(mf_hb_udp *h, const mf_hb_record *recs)
{
    memcpy(h->recs, recs, sizeof *recs * (size_t)h->n);
    if (h->n < 2) return 0;
    if (pthread_create(&h->thread, NULL, mf_hb_loop, h)) return mf_error(-EAGAIN, "heartbeats: cannot start the thread");
    h->started = 1;
    return 0;
}

int64_t mf_hb_udp_heard(const mf_hb_udp *h, int p)
{
    return p >= 0 && p < h->n ? atomic_load(&h->heard[p]) : 0;
}

void mf_hb_udp_close(mf_hb_udp *h)
{
    if (!h) return;
    atomic_store(&h->stop, 1);
    if (h->started) pthread_join(h->thread, NULL);
    close(h->fd);
    free(h->heard);
    free(h->recs);
    free(h);
}
