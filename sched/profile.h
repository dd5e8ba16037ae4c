/* Hardware profiles: the rates and latencies of one machine's lanes (host threads and memory, the
 * disk, PCIe per card, the cards' kernels) in a small text format (docs/profiles.md), every figure
 * with its source beside it. `moeflow calibrate` writes one for the machine it runs on; the
 * simulator (graphs/sim/plan.h) turns a profile into the cost models of a step's tasks. */
#ifndef MF_PROFILE_H
#define MF_PROFILE_H

#include <stdint.h>
#include <stdio.h>

/* Kernel families whose rates a profile gives, on the host (per thread) and on a card. */
typedef enum mf_profile_kfam {
    MF_KF_FP4 = 0,   /* fused packed-fp4 (E2M1 x E8M0) matmul: routed experts */
    MF_KF_FP8,       /* fp8 32x32-tile matmul: attention and shared-expert linears */
    MF_KF_BF16,      /* bf16 matmul: the head, small dense matrices */
    MF_KF_REF,       /* plain scalar code (attention scores, norms, mixes, routing): flops */
    MF_KF_N
} mf_profile_kfam;

/* A kernel's time for a matrix of `bytes` weight bytes and `macs` multiply-adds per token over
 * n tokens: latency_ns + bytes / bytes_per_s + (n - 1) * macs / macs_per_s. For MF_KF_REF,
 * bytes_per_s is 0 and the time is latency_ns + n * flops / macs_per_s (flops counted as MACs). */
typedef struct mf_profile_kern {
    double bytes_per_s;
    double macs_per_s;
    double latency_ns;
} mf_profile_kern;

#define MF_PROFILE_MAX_KEYS 96

typedef struct mf_profile {
    char name[64];
    char path[256];              /* the file it came from ("" when built in memory) */
    /* host */
    int n_sockets;
    int threads_per_socket;      /* worker threads the engine may run per socket (NUMA node) */
    double mem_bytes_per_s;      /* streaming read bandwidth of one socket, all its threads */
    double cross_socket_factor;  /* a thread reading the other socket's memory: this fraction of local */
    double task_overhead_ns;     /* executor cost per task on a critical path (start, finish) */
    double worker_spin_ns;       /* an idle CPU worker spins this long, then sleeps (0: never sleeps) */
    double worker_wake_ns;       /* a sleeping worker starts a task released to it this much later */
    mf_profile_kern host[MF_KF_N];   /* one thread, data out of cache */
    /* the engine's fp32 16-lane vector code (host/kernels.h mf_kern_vec_*: the fast attention
     * heads, index scores and hyper-connection mixes) per thread while every thread of a socket
     * runs it, data in cache: macs_per_s and latency_ns as MF_KF_REF's (bytes_per_s 0) */
    mf_profile_kern host_vec;
    /* disk (expert store and streamed Engram tables) */
    double disk_bytes_per_s;
    double disk_latency_ns;      /* per request at depth 1 */
    int disk_queue_depth;        /* requests in flight that still add throughput */
    /* cards (n_cards 0: none) */
    int n_cards;
    int cards_emulated;          /* 1: emulated cards, whose kernels run on the host's cores */
    uint64_t card_mem_bytes;     /* per card, usable for the expert cache */
    double h2d_bytes_per_s, h2d_latency_ns;   /* pinned host-to-device, per card */
    double d2h_bytes_per_s, d2h_latency_ns;
    double h2d_total_bytes_per_s;  /* all cards copying at once (shared root complex / memory) */
    double act_copy_latency_ns;    /* one small copy of activations (tens of KB, either way) between a
                                    * dense sublayer on a card and the host; 0: the h2d / d2h latency */
    mf_profile_kern card[MF_KF_N];
    /* the card's tensor cores: a GEMM's multiply-adds per second with 16-bit floating-point inputs
     * (fp16, or bf16 from sm_80) and fp32 accumulation, as cublasLtMatmul reaches at prefill sizes
     * (the cuBLASLt path of device/dev.h, MF_DEV_LIN_CUBLASLT). Optional in the file; 0: no tensor
     * cores, the cost model never prices that path. */
    double card_tc_macs_per_s;
    /* every key read or set, in file order, with its value text and its source ("" if none) */
    int n_keys;
    struct {
        char key[48];
        char value[48];
        char source[200];
    } keys[MF_PROFILE_MAX_KEYS];
} mf_profile;

/* Reads a profile file. Format: one `key = value` per line, `# source: ...` after the value is
 * that figure's source, other `#` text is a comment; values take unit suffixes where the key ends
 * in _bytes or _per_s (K, M, G, T = 1000^k; Ki, Mi, Gi, Ti = 1024^k). Every key of the format
 * must be present exactly once, except the optional ones (card_tc_macs_per_s: 0 when absent); unknown keys, bad numbers and out-of-range values fail with
 * -EINVAL naming path:line and the key. */
int mf_profile_load(const char *path, mf_profile *out);
/* The same from text in memory; `what` names it in errors. */
int mf_profile_parse(const char *text, const char *what, mf_profile *out);
/* Writes p in the format above, each key with its source (keys[]) when it has one. 0 or a
 * negative code naming the path; written to a temporary name and renamed. */
int mf_profile_write(const mf_profile *p, const char *path);
/* The same with `header` (may be NULL; one or more lines) written first as `#` comment lines,
 * e.g. which machine and when. */
int mf_profile_write_header(const mf_profile *p, const char *path, const char *header);
/* Sets a key's source text (for writers such as calibrate); -ENOENT for an unknown key. */
int mf_profile_set_source(mf_profile *p, const char *key, const char *source);
/* The source of a key ("" when it has none, NULL for an unknown key). */
const char *mf_profile_source(const mf_profile *p, const char *key);
/* Prints the profile as a table (key, value, source). */
void mf_profile_print(const mf_profile *p, FILE *f);
/* Prints the profile as one JSON object: {"name": .., "path": .., "keys": [{"key", "value" (a
 * number; the name a string), "text" (as the file writes it), "source"}, ..]} in format order. */
void mf_profile_print_json(const mf_profile *p, FILE *f);

#endif
