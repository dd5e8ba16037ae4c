/* The UDP heartbeats (sched/hb_udp.h) in one process over loopback: two members of a job hear
 * each other and keep hearing; a closed member goes quiet; a datagram of another job, one for
 * another member and one of the wrong size are ignored; bad arguments are refused. Waits are
 * bounded by seconds, not asserted as timings (a loaded machine delays, never fails, them). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "sched/clock.h"
#include "sched/hb_udp.h"
#include "tests/check.h"

#define PERIOD_NS 10000000LL   /* 10 ms */

static void nap_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Waits up to s seconds for member p's heard time on h to pass `after`; its value then (or 0). */
static int64_t heard_after(const mf_hb_udp *h, int p, int64_t after, int s)
{
    for (int i = 0; i < s * 100; i++) {
        int64_t t = mf_hb_udp_heard(h, p);
        if (t > after) return t;
        nap_ms(10);
    }
    return 0;
}

typedef struct hb_wire {   /* a heartbeat's bytes as sched/hb_udp.c sends them */
    uint64_t job;
    int32_t from, to;
} hb_wire;

/* Waits up to s seconds for member p's heard time on h to hold still for 300 ms: 1 if it did.
 * Meanwhile, every 10 ms, sends `odd` and a 3-byte datagram from fd to `to` (fd < 0: not). */
static int goes_quiet(const mf_hb_udp *h, int p, int s, int fd, const struct sockaddr_in *to, const hb_wire *odd)
{
    for (int i = 0; i < s * 10 / 3; i++) {
        int64_t t = mf_hb_udp_heard(h, p);
        for (int k = 0; k < 30; k++) {
            if (fd >= 0) {
                sendto(fd, odd, sizeof *odd, 0, (const struct sockaddr *)to, sizeof *to);
                sendto(fd, "abc", 3, 0, (const struct sockaddr *)to, sizeof *to);
            }
            nap_ms(10);
        }
        if (mf_hb_udp_heard(h, p) == t) return 1;
    }
    return 0;
}

int main(void)
{
    const uint64_t job = 0x6d6f65666c6f7731ULL;
    mf_hb_udp *a = NULL, *b = NULL, *c = NULL;
    mf_hb_record rec[2], rc;
    int ra = mf_hb_udp_open(job, 0, 2, PERIOD_NS, &a, &rec[0]);
    if (ra == -EAFNOSUPPORT || ra == -EPERM || ra == -EACCES) {
        printf("SKIP: no UDP socket here (%d)\n", ra);
        return 77;
    }
    CHECK(ra == 0 && a, "open member 0: %d", ra);
    CHECK(mf_hb_udp_open(job, 1, 2, PERIOD_NS, &b, &rec[1]) == 0 && b, "open member 1");
    if (!a || !b) return mf_check_exit("test_sched_hb");
    CHECK(rec[0].n_addr >= 1 && rec[0].port != 0, "member 0's record: %d addresses, port %u", rec[0].n_addr,
          ntohs(rec[0].port));
    int has_lo = 0;
    for (int i = 0; i < rec[0].n_addr; i++) has_lo |= rec[0].addr[i] == htonl(INADDR_LOOPBACK);
    CHECK(has_lo, "member 0's record lacks 127.0.0.1");
    CHECK(mf_hb_udp_start(a, rec) == 0 && mf_hb_udp_start(b, rec) == 0, "start");

    /* hearing, both ways, and again */
    int64_t t_ab = heard_after(a, 1, 0, 10), t_ba = heard_after(b, 0, 0, 10);
    CHECK(t_ab > 0 && t_ba > 0, "no heartbeat within 10 s: member 0 heard 1 at %lld, 1 heard 0 at %lld",
          (long long)t_ab, (long long)t_ba);
    CHECK(mf_hb_udp_heard(a, 0) == 0 && mf_hb_udp_heard(b, 1) == 0, "a member heard itself");
    CHECK(mf_hb_udp_heard(a, 2) == 0 && mf_hb_udp_heard(a, -1) == 0, "a member out of range heard");
    CHECK(heard_after(a, 1, t_ab, 10) > t_ab, "member 0 stopped hearing member 1");

    /* strangers beside it: member 1 of another job sends to member 0's addresses; a datagram of
     * the right size for member 1 and a short one, by hand */
    mf_hb_record rc2[2] = {rec[0], rec[0]};   /* [1]: the stranger's, set below */
    CHECK(mf_hb_udp_open(job + 1, 1, 2, PERIOD_NS, &c, &rc) == 0, "open the stranger");
    rc2[1] = rc;
    CHECK(c && mf_hb_udp_start(c, rc2) == 0, "start the stranger");
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = rec[0].port, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    hb_wire wrong_to = {job, 1, 1};   /* member 1's, addressed to member 1 */
    CHECK(fd >= 0, "a plain UDP socket");

    /* member 1 closed: member 0 goes on hearing nothing of it, the strangers sending meanwhile */
    mf_hb_udp_close(b);
    b = NULL;
    CHECK(goes_quiet(a, 1, 10, fd, &to, &wrong_to), "member 0 still hears member 1 10 s after it closed (a "
          "stranger's datagram taken?)");
    CHECK(mf_hb_udp_heard(c, 0) == 0, "the stranger heard member 0 of another job");
    if (fd >= 0) close(fd);
    mf_hb_udp_close(c);
    mf_hb_udp_close(a);
    mf_hb_udp_close(NULL);

    mf_hb_udp *bad = NULL;
    CHECK(mf_hb_udp_open(job, 2, 2, PERIOD_NS, &bad, &rc) == -EINVAL && !bad, "member 2 of 2 taken");
    CHECK(mf_hb_udp_open(job, 0, 2, 0, &bad, &rc) == -EINVAL && !bad, "period 0 taken");
    return mf_check_exit("test_sched_hb");
}
