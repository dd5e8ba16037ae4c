/* `moeflow serve`'s front door (tools/serve_door.h): accepting, counting and holding connections
 * until their first request head is in, the refusals it answers itself, and the deadlines of
 * every connection, on one thread with its own epoll set. */
#define _GNU_SOURCE
#include "tools/serve_door.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sched/clock.h"
#include "sched/error.h"
#include "tools/serve_head.h"

#define MF_DOOR_CLOSING_MAX 256          /* refused sockets draining at once (more: closed at once) */
#define MF_DOOR_LINGER_NS 2000000000LL   /* a refused socket is drained this long before it closes */
#define MF_DOOR_GRACE_NS 1000000000LL    /* libmicrohttpd may still be writing 100 Continue */
#define MF_DOOR_DRAIN_BYTES (16 << 20)    /* a refused socket is drained of at most this much */
#define MF_DOOR_TICK_NS 100000000LL

/* Where a connection is. HELD and CLOSING sockets are the door's; the others libmicrohttpd's. */
enum {
    MF_DOOR_FREE = 0,
    MF_DOOR_HELD,      /* its first head arriving, in the door's epoll set */
    MF_DOOR_CLOSING,   /* refused: the answer sent, what the client still sends drained, then closed */
    MF_DOOR_READING,   /* a request's head or body arriving (libmicrohttpd) */
    MF_DOOR_BUSY,      /* a request read, being answered */
    MF_DOOR_IDLE,      /* kept alive between requests */
    MF_DOOR_DEAD       /* shut down by the door (408 or idle), libmicrohttpd closing it */
};

typedef struct mf_door_conn {
    uint8_t state;
    uint8_t linger;            /* served: answered before its body was read; drained after libmicrohttpd closes it */
    uint32_t addr;             /* the client's IPv4 address (network order) */
    int64_t deadline_ns;       /* 0: none */
    int64_t handler_ns;        /* READING: the access handler's first call for the request (0: not yet) */
    size_t seen;               /* HELD: bytes of the head peeked so far; CLOSING: bytes drained */
    struct sockaddr_in sa;
} mf_door_conn;

struct mf_door {
    mf_door_opts o;
    int lfd, ep, wake, reserve;
    unsigned port;
    struct MHD_Daemon *mhd;
    pthread_t th;
    int started;
    pthread_mutex_t mu;        /* conns, the counts, the address table, quiesce, stop */
    mf_door_conn *conns;       /* by socket */
    int cap, top;              /* sockets cap and over; top: 1 + the highest in use */
    int n_held, n_served, n_closing, quiesce, quiesced, stop;
    /* open connections per client address: open addressing, linear probing, 2^hbits slots */
    uint32_t *ha;
    int32_t *hc;
    int hbits;
    char buf[MF_HTTP_MAX_HEAD + 1];   /* the door thread's peeks */
};

/* ---- open connections per client address -------------------------------------------------- */

static uint32_t mf_door_slot(const mf_door *d, uint32_t a) { return (a * 0x9E3779B1u) >> (32 - d->hbits); }

/* Counts one more connection of address a, unless it has max_per_addr already: 0 or -EBUSY. */
static int mf_door_addr_add(mf_door *d, uint32_t a)
{
    uint32_t m = (1u << d->hbits) - 1, i = mf_door_slot(d, a);
    while (d->hc[i] && d->ha[i] != a) i = (i + 1) & m;
    if (d->o.max_per_addr > 0 && d->hc[i] >= d->o.max_per_addr) return -EBUSY;
    d->ha[i] = a;
    d->hc[i]++;
    return 0;
}

/* One connection of a less; a slot that reaches 0 is removed (backward shift, so that no probe
 * sequence is cut). */
static void mf_door_addr_del(mf_door *d, uint32_t a)
{
    uint32_t m = (1u << d->hbits) - 1, i = mf_door_slot(d, a);
    while (d->hc[i] && d->ha[i] != a) i = (i + 1) & m;
    if (!d->hc[i] || --d->hc[i]) return;
    for (uint32_t j = (i + 1) & m; d->hc[j]; j = (j + 1) & m) {
        uint32_t h = mf_door_slot(d, d->ha[j]);
        if (((j - h) & m) >= ((j - i) & m)) {   /* j's home is at or before i: move it into the hole */
            d->ha[i] = d->ha[j];
            d->hc[i] = d->hc[j];
            d->hc[j] = 0;
            i = j;
        }
    }
}

/* ---- records ------------------------------------------------------------------------------- */

/* Forgets socket fd's record (under mu), fixing the counts. */
static void mf_door_forget(mf_door *d, int fd)
{
    mf_door_conn *c = &d->conns[fd];
    if (c->state == MF_DOOR_FREE) return;
    if (c->state == MF_DOOR_HELD) d->n_held--;
    else if (c->state == MF_DOOR_CLOSING) d->n_closing--;
    else d->n_served--;
    if (c->state != MF_DOOR_CLOSING) mf_door_addr_del(d, c->addr);
    memset(c, 0, sizeof *c);
}

/* An HTTP/1.1 response with an OpenAI error object, sent without blocking (a fresh socket's
 * buffer takes it whole; a socket that cannot take it is left without an answer). */
static void mf_door_send_error(int fd, int status, const char *code, const char *msg, const char *retry_after)
{
    const char *type = status == 429 ? "rate_limit_error" : status >= 500 ? "server_error" : "invalid_request_error";
    json_t *o = json_pack("{s:{s:s, s:s, s:n, s:s}}", "error", "message", msg, "type", type, "param", "code", code);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!body) return;
    char head[512];
    const char *reason = MHD_get_reason_phrase_for((unsigned)status);
    int k = snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n%s%s%s\r\n", status, reason && *reason ? reason : "Error", strlen(body),
                     retry_after ? "Retry-After: " : "", retry_after ? retry_after : "", retry_after ? "\r\n" : "");
    struct iovec iov[2] = {{head, (size_t)k}, {body, strlen(body)}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    (void)!sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    free(body);
}

/* Answers socket fd (the door's, in its epoll set: held, or just accepted and not counted) with an
 * error, then drains it for a while before it closes: closing a socket with unread bytes resets
 * it, and the client could lose the answer. Under mu. */
static void mf_door_refuse(mf_door *d, int fd, int status, const char *code, const char *msg, const char *retry_after)
{
    mf_door_send_error(fd, status, code, msg, retry_after);
    if (d->o.refused) d->o.refused(d->o.user, code);
    mf_door_conn *c = &d->conns[fd];
    if (c->state == MF_DOOR_HELD) {
        d->n_held--;
        mf_door_addr_del(d, c->addr);
    }
    if (d->n_closing >= MF_DOOR_CLOSING_MAX) {   /* a flood: no draining */
        epoll_ctl(d->ep, EPOLL_CTL_DEL, fd, NULL);
        memset(c, 0, sizeof *c);
        close(fd);
        return;
    }
    shutdown(fd, SHUT_WR);
    c->state = MF_DOOR_CLOSING;
    c->deadline_ns = mf_now_ns() + MF_DOOR_LINGER_NS;
    d->n_closing++;
}

/* ---- the door's thread --------------------------------------------------------------------- */

/* A new socket: counted and held, or refused (over the limits, or shutting down). Under mu. */
static void mf_door_admit(mf_door *d, int fd, const struct sockaddr_in *sa)
{
    int one = 1, idle = 10, intvl = 5, cnt = 3;   /* vanished clients surface as errors (docs/serve.md) */
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    if (fd >= d->cap) {
        mf_door_send_error(fd, 503, "server_busy", "the server has no room for another connection", "1");
        if (d->o.refused) d->o.refused(d->o.user, "server_busy");
        close(fd);
        return;
    }
    mf_door_forget(d, fd);   /* a record left by a socket libmicrohttpd closed without telling */
    if (fd >= d->top) d->top = fd + 1;
    mf_door_conn *c = &d->conns[fd];
    *c = (mf_door_conn){.addr = sa->sin_addr.s_addr, .sa = *sa};
    if (epoll_ctl(d->ep, EPOLL_CTL_ADD, fd, &(struct epoll_event){.events = EPOLLIN | EPOLLRDHUP | EPOLLET,
                                                                  .data.fd = fd})) {
        close(fd);
        return;
    }
    char m[200];
    if (d->n_held + d->n_served >= d->o.max_conns) {
        snprintf(m, sizeof m, "the server holds %d connections, its limit (--max-connections); retry later",
                 d->o.max_conns);
        mf_door_refuse(d, fd, 503, "server_busy", m, "1");
    } else if (mf_door_addr_add(d, c->addr)) {
        snprintf(m, sizeof m, "this address holds %d connections, the limit for one client "
                 "(--max-connections-per-addr); retry later", d->o.max_per_addr);
        mf_door_refuse(d, fd, 429, "too_many_connections", m, "1");
    } else {
        c->state = MF_DOOR_HELD;
        c->deadline_ns = mf_now_ns() + (int64_t)d->o.request_timeout_s * 1000000000;
        d->n_held++;
        if (d->quiesce) mf_door_refuse(d, fd, 503, "shutting_down", "the server is shutting down", "5");
    }
}

static void mf_door_accept(mf_door *d)
{
    for (int k = 0; k < 256; k++) {   /* at most this many a round, so the deadlines keep their time */
        struct sockaddr_in sa;
        socklen_t sl = sizeof sa;
        int fd = accept4(d->lfd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE) && d->reserve >= 0) {
            /* out of descriptors: the reserve makes room to answer one, so the backlog moves */
            close(d->reserve);
            fd = accept4(d->lfd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd >= 0) {
                mf_door_send_error(fd, 503, "server_busy", "the server is out of file descriptors", "1");
                if (d->o.refused) d->o.refused(d->o.user, "server_busy");
                close(fd);
            }
            d->reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
            continue;
        }
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return;   /* EAGAIN, or nothing to be done now */
        }
        if (sl != sizeof sa || sa.sin_family != AF_INET) {
            close(fd);
            continue;
        }
        pthread_mutex_lock(&d->mu);
        mf_door_admit(d, fd, &sa);
        pthread_mutex_unlock(&d->mu);
    }
}

/* Socket fd (held or closing) has news: a held one's head is peeked and checked, then handed to
 * libmicrohttpd or refused; a closing one is drained. Under mu. */
static void mf_door_readable(mf_door *d, int fd, uint32_t events)
{
    mf_door_conn *c = &d->conns[fd];
    if (c->state == MF_DOOR_CLOSING) {   /* drained, a bounded amount per round and in all */
        char sink[16384];
        ssize_t r = 1;
        for (int k = 0; k < 16 && (r = recv(fd, sink, sizeof sink, 0)) > 0; k++) c->seen += (size_t)r;
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR) || (events & (EPOLLHUP | EPOLLERR)) ||
            c->seen > MF_DOOR_DRAIN_BYTES) {
            epoll_ctl(d->ep, EPOLL_CTL_DEL, fd, NULL);
            mf_door_forget(d, fd);
            close(fd);
        }
        return;
    }
    if (c->state != MF_DOOR_HELD) return;
    int avail = 0;
    if (!(events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) && !ioctl(fd, FIONREAD, &avail) && (size_t)avail <= c->seen)
        return;   /* nothing new to look at */
    ssize_t r = recv(fd, d->buf, MF_HTTP_MAX_HEAD, MSG_PEEK);
    if (r <= 0) {
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
        epoll_ctl(d->ep, EPOLL_CTL_DEL, fd, NULL);   /* gone before a request: nobody to answer */
        mf_door_forget(d, fd);
        close(fd);
        return;
    }
    c->seen = (size_t)r;
    mf_http_head h;
    if (!mf_http_head_check(d->buf, (size_t)r, &h)) {
        if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))
            mf_door_refuse(d, fd, 400, "bad_request", "the request head ended before its blank line", NULL);
        return;
    }
    if (h.status) {
        mf_door_refuse(d, fd, h.status, h.code, h.message, NULL);
        return;
    }
    epoll_ctl(d->ep, EPOLL_CTL_DEL, fd, NULL);   /* libmicrohttpd's from here */
    c->state = MF_DOOR_READING;
    c->seen = 0;
    d->n_held--;
    d->n_served++;
    struct sockaddr_in sa = c->sa;
    pthread_mutex_unlock(&d->mu);   /* MHD_add_connection may close the socket (its own limit) */
    int ok = MHD_add_connection(d->mhd, fd, (const struct sockaddr *)&sa, sizeof sa) == MHD_YES;
    pthread_mutex_lock(&d->mu);
    if (!ok && d->conns[fd].state == MF_DOOR_READING) {
        mf_door_forget(d, fd);
        if (d->o.refused) d->o.refused(d->o.user, "server_busy");
    }
}

/* The deadlines (under mu): held heads and requests past request_timeout_s get 408, kept-alive
 * connections past idle_timeout_s close, refused sockets past their drain close. */
static void mf_door_sweep(mf_door *d, int64_t now)
{
    char m[160];
    snprintf(m, sizeof m, "the request did not arrive within %d s (--request-timeout)", d->o.request_timeout_s);
    for (int fd = 0; fd < d->top; fd++) {
        mf_door_conn *c = &d->conns[fd];
        if (c->state == MF_DOOR_FREE || !c->deadline_ns || now < c->deadline_ns) continue;
        switch (c->state) {
        case MF_DOOR_HELD:
            mf_door_refuse(d, fd, 408, "request_timeout", m, NULL);
            break;
        case MF_DOOR_CLOSING:
            epoll_ctl(d->ep, EPOLL_CTL_DEL, fd, NULL);
            mf_door_forget(d, fd);
            close(fd);
            break;
        case MF_DOOR_READING:   /* unless libmicrohttpd may be writing 100 Continue right now */
            if (c->handler_ns && now - c->handler_ns < MF_DOOR_GRACE_NS) break;
            mf_door_send_error(fd, 408, "request_timeout", m, NULL);
            if (d->o.refused) d->o.refused(d->o.user, "request_timeout");
            /* fall through */
        case MF_DOOR_IDLE:
            shutdown(fd, SHUT_RDWR);   /* libmicrohttpd reads the end and closes it */
            c->state = MF_DOOR_DEAD;
            c->deadline_ns = 0;
            break;
        default:
            break;
        }
    }
    while (d->top > 0 && d->conns[d->top - 1].state == MF_DOOR_FREE) d->top--;
}

/* After mf_door_quiesce: no more accepting; the held connections get 503. Under mu. */
static void mf_door_shut_entry(mf_door *d)
{
    if (d->lfd >= 0) {
        epoll_ctl(d->ep, EPOLL_CTL_DEL, d->lfd, NULL);
        close(d->lfd);
        d->lfd = -1;
    }
    for (int fd = 0; fd < d->top; fd++)
        if (d->conns[fd].state == MF_DOOR_HELD)
            mf_door_refuse(d, fd, 503, "shutting_down", "the server is shutting down", "5");
    d->quiesced = 1;
}

static void *mf_door_main(void *arg)
{
    mf_door *d = arg;
    struct epoll_event ev[128];
    int64_t next_tick = 0;
    for (;;) {
        int n = epoll_wait(d->ep, ev, 128, 50);
        pthread_mutex_lock(&d->mu);
        int stop = d->stop;
        if (d->quiesce && d->lfd >= 0) mf_door_shut_entry(d);
        pthread_mutex_unlock(&d->mu);
        if (stop) break;
        for (int i = 0; i < n; i++) {
            int fd = ev[i].data.fd;
            if (fd == d->wake) {
                uint64_t x;
                (void)!read(d->wake, &x, sizeof x);
            } else if (fd == d->lfd) {
                mf_door_accept(d);
            } else {
                pthread_mutex_lock(&d->mu);
                mf_door_readable(d, fd, ev[i].events);
                pthread_mutex_unlock(&d->mu);
            }
        }
        int64_t now = mf_now_ns();
        if (now >= next_tick) {
            pthread_mutex_lock(&d->mu);
            mf_door_sweep(d, now);
            pthread_mutex_unlock(&d->mu);
            if (d->o.tick) d->o.tick(d->o.user);
            next_tick = now + MF_DOOR_TICK_NS;
        }
    }
    return NULL;
}

/* ---- the door's life ----------------------------------------------------------------------- */

int mf_door_open(const mf_door_opts *o, mf_door **out)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) rl.rlim_cur = 1024;
    int reserve = 64 + MF_DOOR_CLOSING_MAX;   /* the model, libmicrohttpd, the refused sockets */
    if (o->max_conns < 1 || (rl.rlim_cur != RLIM_INFINITY && (rlim_t)o->max_conns + reserve > rl.rlim_cur))
        return mf_error(-EINVAL, "--max-connections %d: this process may open %llu descriptors, so at most %lld "
                        "connections (raise ulimit -n)", o->max_conns, (unsigned long long)rl.rlim_cur,
                        (long long)rl.rlim_cur - reserve);
    mf_door *d = calloc(1, sizeof *d);
    if (!d) return mf_error(-ENOMEM, "out of memory");
    d->o = *o;
    d->lfd = d->ep = d->wake = d->reserve = -1;
    pthread_mutex_init(&d->mu, NULL);
    d->cap = o->max_conns + reserve + 1024;
    if (rl.rlim_cur != RLIM_INFINITY && (rlim_t)d->cap > rl.rlim_cur) d->cap = (int)rl.rlim_cur;
    for (d->hbits = 4; (1 << d->hbits) < 2 * (o->max_conns + MF_DOOR_CLOSING_MAX + 1); d->hbits++) {}
    d->conns = calloc((size_t)d->cap, sizeof *d->conns);
    d->ha = calloc((size_t)1 << d->hbits, sizeof *d->ha);
    d->hc = calloc((size_t)1 << d->hbits, sizeof *d->hc);
    int rc = 0;
    if (!d->conns || !d->ha || !d->hc) rc = mf_error(-ENOMEM, "out of memory");
    int one = 1;
    if (!rc && ((d->lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0 ||
                setsockopt(d->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
                bind(d->lfd, (const struct sockaddr *)&o->addr, sizeof o->addr) || listen(d->lfd, 1024)))
        rc = mf_error(-EADDRINUSE, "cannot listen: %s", strerror(errno));
    struct sockaddr_in sa;
    socklen_t sl = sizeof sa;
    if (!rc && getsockname(d->lfd, (struct sockaddr *)&sa, &sl)) rc = mf_error(-errno, "getsockname: %s", strerror(errno));
    if (!rc) d->port = ntohs(sa.sin_port);
    if (!rc && ((d->ep = epoll_create1(EPOLL_CLOEXEC)) < 0 || (d->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0))
        rc = mf_error(-errno, "epoll: %s", strerror(errno));
    if (!rc && (epoll_ctl(d->ep, EPOLL_CTL_ADD, d->lfd, &(struct epoll_event){.events = EPOLLIN, .data.fd = d->lfd}) ||
                epoll_ctl(d->ep, EPOLL_CTL_ADD, d->wake, &(struct epoll_event){.events = EPOLLIN, .data.fd = d->wake})))
        rc = mf_error(-errno, "epoll: %s", strerror(errno));
    d->reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (rc) {
        mf_door_close(d);
        return rc;
    }
    *out = d;
    return 0;
}

unsigned mf_door_port(const mf_door *d) { return d->port; }

int mf_door_start(mf_door *d, struct MHD_Daemon *mhd)
{
    d->mhd = mhd;
    if (pthread_create(&d->th, NULL, mf_door_main, d)) return mf_error(-EAGAIN, "cannot start the door's thread");
    d->started = 1;
    return 0;
}

static void mf_door_wake(mf_door *d)
{
    uint64_t one = 1;
    if (d->wake >= 0) (void)!write(d->wake, &one, sizeof one);
}

void mf_door_quiesce(mf_door *d)
{
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    d->quiesce = 1;
    pthread_mutex_unlock(&d->mu);
    mf_door_wake(d);
    for (int k = 0; d->started && k < 500; k++) {   /* the thread has shut the entry: no more hand-offs */
        pthread_mutex_lock(&d->mu);
        int done = d->quiesced;
        pthread_mutex_unlock(&d->mu);
        if (done) break;
        usleep(2000);
    }
}

void mf_door_close(mf_door *d)
{
    if (!d) return;
    if (d->started) {
        pthread_mutex_lock(&d->mu);
        d->stop = 1;
        pthread_mutex_unlock(&d->mu);
        mf_door_wake(d);
        pthread_join(d->th, NULL);
    }
    for (int fd = 0; d->conns && fd < d->top; fd++)
        if (d->conns[fd].state == MF_DOOR_HELD || d->conns[fd].state == MF_DOOR_CLOSING) close(fd);
    if (d->lfd >= 0) close(d->lfd);
    if (d->ep >= 0) close(d->ep);
    if (d->wake >= 0) close(d->wake);
    if (d->reserve >= 0) close(d->reserve);
    pthread_mutex_destroy(&d->mu);
    free(d->conns);
    free(d->ha);
    free(d->hc);
    free(d);
}

void mf_door_counts(mf_door *d, int *held, int *served)
{
    pthread_mutex_lock(&d->mu);
    *held = d->n_held;
    *served = d->n_served;
    pthread_mutex_unlock(&d->mu);
}

/* ---- libmicrohttpd's side ------------------------------------------------------------------ */

/* The record of a socket libmicrohttpd serves (under mu), or NULL. */
static mf_door_conn *mf_door_served(mf_door *d, int fd)
{
    if (fd < 0 || fd >= d->cap) return NULL;
    mf_door_conn *c = &d->conns[fd];
    return c->state >= MF_DOOR_READING ? c : NULL;
}

void mf_door_conn_closed(mf_door *d, int fd)
{
    pthread_mutex_lock(&d->mu);
    mf_door_conn *c = mf_door_served(d, fd);
    int linger = c && c->linger;
    if (c) mf_door_forget(d, fd);
    /* answered before its body was read: libmicrohttpd has sent the answer and shut the socket for
     * writing, and closes it next; a duplicate keeps it open while the door drains what the client
     * still sends, so that closing it resets nothing and the client reads the answer */
    int nfd = linger && d->n_closing < MF_DOOR_CLOSING_MAX ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    if (nfd >= 0 && (nfd >= d->cap || epoll_ctl(d->ep, EPOLL_CTL_ADD, nfd, &(struct epoll_event){
                                                   .events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = nfd}))) {
        close(nfd);
        nfd = -1;
    }
    if (nfd >= 0) {
        mf_door_forget(d, nfd);
        if (nfd >= d->top) d->top = nfd + 1;
        d->conns[nfd] = (mf_door_conn){.state = MF_DOOR_CLOSING, .deadline_ns = mf_now_ns() + MF_DOOR_LINGER_NS};
        d->n_closing++;
    }
    pthread_mutex_unlock(&d->mu);
}

void mf_door_linger(mf_door *d, int fd)
{
    pthread_mutex_lock(&d->mu);
    mf_door_conn *c = mf_door_served(d, fd);
    if (c) c->linger = 1;
    pthread_mutex_unlock(&d->mu);
}

void mf_door_request_line(mf_door *d, int fd)
{
    pthread_mutex_lock(&d->mu);
    mf_door_conn *c = mf_door_served(d, fd);
    if (c && c->state == MF_DOOR_IDLE) {
        c->state = MF_DOOR_READING;
        c->handler_ns = 0;
        c->deadline_ns = mf_now_ns() + (int64_t)d->o.request_timeout_s * 1000000000;
    }
    pthread_mutex_unlock(&d->mu);
}

int mf_door_request_late(mf_door *d, int fd)
{
    int64_t now = mf_now_ns();
    pthread_mutex_lock(&d->mu);
    mf_door_conn *c = mf_door_served(d, fd);
    int late = 0;
    if (c && c->state == MF_DOOR_READING) {
        if (!c->handler_ns) c->handler_ns = now;
        late = c->deadline_ns && now >= c->deadline_ns;
    }
    pthread_mutex_unlock(&d->mu);
    return late;
}

int mf_door_request_read(mf_door *d, int fd)
{
    pthread_mutex_lock(&d->mu);
    mf_door_conn *c = mf_door_served(d, fd);
    int rc = 0;
    if (c && c->state == MF_DOOR_DEAD) rc = -ETIMEDOUT;
    else if (c && c->state == MF_DOOR_READING) c->state = MF_DOOR_BUSY, c->deadline_ns = 0;
    pthread_mutex_unlock(&d->mu);
    return rc;
}

void mf_door_request_done(mf_door *d, int fd)
{
    pthread_mutex_lock(&d->mu);
    mf_door_conn *c = mf_door_served(d, fd);
    if (c && (c->state == MF_DOOR_BUSY || c->state == MF_DOOR_READING)) {
        c->state = MF_DOOR_IDLE;
        c->deadline_ns = mf_now_ns() + (int64_t)d->o.idle_timeout_s * 1000000000;
    }
    pthread_mutex_unlock(&d->mu);
}
