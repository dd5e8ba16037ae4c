/* `moeflow serve`'s front door (tools/serve_door.c): the listening socket and one thread that
 * accepts connections, counts them (in all and per client address) and holds each new one until
 * its first request head has arrived whole: the head is peeked, not read, checked
 * (tools/serve_head.h), and the connection handed to libmicrohttpd (MHD_add_connection), which
 * reads it from there. What the door refuses it answers itself with an OpenAI error object and
 * closes. A slow or idle client thus costs a socket and a record here, never a libmicrohttpd
 * connection or a thread. The same thread keeps every connection's deadlines (libmicrohttpd's own
 * timeout is an idle timeout, which a byte every few seconds resets):
 *   - a request's head and body must arrive within request_timeout_s of its start (the accept,
 *     or its request line on a kept-alive connection): else 408, closed;
 *   - a kept-alive connection must begin its next request within idle_timeout_s: else closed.
 * and calls the server's tick every 100 ms. docs/serve.md, "Hostile clients". */
#ifndef MF_SERVE_DOOR_H
#define MF_SERVE_DOOR_H

#include <microhttpd.h>
#include <netinet/in.h>

typedef struct mf_door mf_door;

typedef struct mf_door_opts {
    struct sockaddr_in addr;     /* where to listen (port 0: a free one) */
    int max_conns;               /* open connections in all (held here or by libmicrohttpd); more: 503 */
    int max_per_addr;            /* open connections of one client address (0: no limit); more: 429 */
    int request_timeout_s, idle_timeout_s;
    /* every refusal the door answers (on its thread): the error object's code */
    void (*refused)(void *user, const char *code);
    void (*tick)(void *user);    /* every 100 ms, on the door's thread */
    void *user;
} mf_door_opts;

/* Binds and listens (backlog 1024). -EADDRINUSE (the address is in use or not this machine's),
 * -EINVAL (max_conns past the descriptors the process may open), -ENOMEM. */
int mf_door_open(const mf_door_opts *o, mf_door **out);
unsigned mf_door_port(const mf_door *d);
/* Starts the door's thread, which hands connections to mhd (a daemon started with
 * MHD_USE_NO_LISTEN_SOCKET and MHD_USE_ITC). 0 or -EAGAIN. */
int mf_door_start(mf_door *d, struct MHD_Daemon *mhd);
/* Stops accepting: the listening socket closes, the connections held here get 503
 * (shutting_down); returns once the door's thread has done so (no connection is handed to
 * libmicrohttpd after it: MHD_stop_daemon may follow). The deadlines and the tick go on until
 * mf_door_close. NULL is fine. */
void mf_door_quiesce(mf_door *d);
/* Stops the thread and closes what it holds (call after MHD_stop_daemon). NULL is fine. */
void mf_door_close(mf_door *d);
/* Open connections: held by the door (their first head arriving), by libmicrohttpd. */
void mf_door_counts(mf_door *d, int *held, int *served);

/* libmicrohttpd's side, by the connection's socket (thread-safe). */
void mf_door_conn_closed(mf_door *d, int fd);   /* MHD_CONNECTION_NOTIFY_CLOSED */
void mf_door_request_line(mf_door *d, int fd);  /* the URI log callback: a request begins */
/* The access handler's first call for a request (its head is in): 1 when its deadline has
 * already passed (answer 408), else 0. Later calls, with body bytes: the same answer. */
int mf_door_request_late(mf_door *d, int fd);
/* The request is read (or answered before its body): its deadline ends. 0, or -ETIMEDOUT when
 * the door has already answered it with 408 (the handler then returns MHD_NO). */
int mf_door_request_read(mf_door *d, int fd);
void mf_door_request_done(mf_door *d, int fd);  /* MHD_OPTION_NOTIFY_COMPLETED: idle again */
/* The request was answered before its body was read (libmicrohttpd closes the connection after
 * the answer): once it has, the door drains what the client still sends, for up to 2 s, before
 * the socket closes, so that the client, still sending, reads the answer instead of a reset. */
void mf_door_linger(mf_door *d, int fd);

#endif
