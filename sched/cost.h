/* The cost model: what one task's work is (mf_work: weight bytes and multiply-adds per kernel
 * family, scalar work, host<->card copies, disk reads) and what it takes on a machine described by
 * a hardware profile (sched/profile.h), on the host or on a card. The simulator prices every
 * task's record with it (graphs/sim/plan.c) and the step graph's builder sets the executor's
 * priorities from the same prices (graphs/step/stepgraph.c). Formulas: docs/sim.md "Cost
 * formulas". Nothing here knows about models; all functions are pure. */
#ifndef MF_COST_H
#define MF_COST_H

#include "sched/profile.h"

/* The work of one task. Kernel families as sched/profile.h (MF_KF_*; the MF_KF_REF entries of
 * the arrays unused: scalar work is ref_flops). Token-scaled terms multiply by the task's tokens
 * (the caller says which: the items it runs over, or an expert slot's tokens of the step). */
typedef struct mf_work {
    double w_bytes[MF_KF_N];   /* weight bytes read (codes + scales) */
    double macs[MF_KF_N];      /* multiply-adds per token */
    double calls[MF_KF_N];     /* kernel calls (each pays the family's latency) */
    double ref_flops;          /* plain scalar code, in REF multiply-adds, for the whole task */
    double ref_flops_tok;      /* the same per token */
    double vec_flops;          /* the engine's fp32 vector code (host/kernels.h mf_kern_vec_*: the fast
                                * attention heads, index scores, mixes), multiply-adds, whole task */
    double vec_bytes;          /* fp32 data that vector code streams from memory (the mixes' weights) */
    int extra_vec;             /* 1: mf_cost_host's extra_flops (a task's positional work) are vector
                                * code, priced with vec_flops; 0: scalar, with ref_flops */
    double copy_bytes;         /* host<->card: the packed expert, on a cache miss */
    int copies;                /* the host->card copies copy_bytes take (0: one per expert part) */
    double copy_bytes_tok;     /* host<->card per token */
    double io_bytes;           /* disk: the aligned extents, when read */
    int io_reads;              /* disk requests (each pays the disk's latency) */
} mf_work;

/* What prices work on a machine: its profile and the cap on one host thread's weight-byte rate
 * (its share of the socket's memory bandwidth when all workers stream; 0: no cap). */
typedef struct mf_cost_model {
    const mf_profile *p;
    double host_bytes_per_s;
} mf_cost_model;

/* The built-in machine for an engine given no profile (graphs/step/step.h mf_step_opts.profile
 * NULL): host kernels at 20 GB/s of weights and 2 us a call, scalar code at 1 G MACs/s, vector code
 * at 8 G MACs/s, copies at
 * 25 GB/s and 10 us either way, card kernels at 20 GB/s and 5 us, no memory-bandwidth cap, one
 * socket of 64 threads; rough, for priorities and hybrid placement only. Static, never NULL. */
const mf_profile *mf_cost_default_profile(void);

/* One host thread's share of the memory bandwidth when n_threads workers stream weights:
 * mem_bytes_per_s times the sockets they span (of threads_per_socket each, at most n_sockets)
 * over n_threads; 0 when the profile gives no memory bandwidth. */
double mf_cost_thread_share(const mf_profile *p, int n_threads);

/* A kernel of `bytes` weight bytes and `macs` multiply-adds per token over n tokens at byte rate
 * bytes_per_s (0: bytes cost nothing): latency + bytes / rate + (n - 1) * macs / mac rate. */
double mf_cost_kern(const mf_profile_kern *k, double bytes_per_s, double bytes, double macs, int n);

/* Scalar work of `flops` REF multiply-adds at the host's (card 0) or a card's (card 1) REF rate,
 * no latency of its own; 0 where the profile has no such rate. */
double mf_cost_ref(const mf_profile *p, int card, double flops);

/* Vector code of `flops` multiply-adds streaming `bytes` from memory on one host thread: the larger
 * of flops at the profile's host_vec rate and bytes at m->host_bytes_per_s (0: bytes cost
 * nothing), no latency of its own; 0 where the profile has no vec rate and no bytes are priced. */
double mf_cost_vec(const mf_cost_model *m, double flops, double bytes);

/* w on one host thread over n tokens: per kernel family with calls its calls' latencies, its
 * bytes at the thread's rate (capped at m->host_bytes_per_s), its multiply-adds; then the scalar
 * work ref_flops + n ref_flops_tok (+ extra_flops unless w->extra_vec) at the host's REF rate;
 * then the vector code mf_cost_vec(vec_flops (+ extra_flops with w->extra_vec), vec_bytes). */
double mf_cost_host(const mf_cost_model *m, const mf_work *w, int n, double extra_flops);

/* w on a card over n tokens: its kernels as mf_cost_host's at the card's rates (no cap), its
 * scalar work ref_flops + n ref_flops_tok at the card's REF rate. Where the profile gives the
 * card's tensor cores a rate (card_tc_macs_per_s > 0), the FP8 work (dense linears) and the FP4
 * work (routed experts) each take the cheaper of that price (the CUDA-core kernels: warp-per-row,
 * tiled from MF_DEV_LIN_TILED_MIN_TOK tokens) and mf_cost_card_lt's (the cuBLASLt path). */
double mf_cost_card(const mf_cost_model *m, const mf_work *w, int n);
/* As mf_cost_card; *lt_fams (when not NULL) gets a bit per kernel family (1 << MF_KF_FP8, 1 <<
 * MF_KF_FP4) priced on the cuBLASLt path. */
double mf_cost_card_paths(const mf_cost_model *m, const mf_work *w, int n, int *lt_fams);

/* Launches of one call on the cuBLASLt path, each paying the family's card latency: a dense FP8
 * linear dequantizes, casts and multiplies (3); an expert FFN dequantizes w1, w3, w2, casts x,
 * multiplies, gates, casts h, multiplies (8). Of those, the dequantization's: one a matrix (FP8 1,
 * FP4 3). */
#define MF_COST_LT_LAUNCHES_FP8 3
#define MF_COST_LT_LAUNCHES_FP4 8
#define MF_COST_LT_DEQUANT_FP8 1
#define MF_COST_LT_DEQUANT_FP4 3
/* The cuBLASLt path (device/dev.h MF_DEV_LIN_CUBLASLT, mf_dev_expert_ffn_lt) for family fam (FP8 or
 * FP4) of `bytes` stored weight bytes and `macs` multiply-adds per token (one per weight) over n
 * tokens on a card: mf_cost_card_dequant + mf_cost_card_lt_gemm. 0 where the profile has no
 * tensor-core rate or fam is neither. */
double mf_cost_card_lt(const mf_cost_model *m, int fam, double bytes, double macs, double calls, int n);
/* Its two parts. The dequantization: calls x its launches x latency, the stored bytes read and 2
 * bytes a weight written at card_fp8_bytes_per_s (the dense kernels' streaming rate, which every
 * family's plain reads and writes reach: the FP4 kernel's own byte rate is its unpacking's, not the
 * memory's). The GEMM: calls x the other launches x latency, the 2 bytes a weight read once at that
 * rate, n x macs at card_tc_macs_per_s; the activations' cast (6 bytes a value) is not priced. A
 * dense layer's dequantization is its own task on the card's copy-in lane (graphs/step/stepgraph.h
 * MF_SG_DENSE_DEQ), overlapping the previous layer's GEMMs; an expert's is inside its FFN. 0 where
 * the profile has no tensor-core rate or fam is neither. */
double mf_cost_card_dequant(const mf_cost_model *m, int fam, double bytes, double macs, double calls);
double mf_cost_card_lt_gemm(const mf_cost_model *m, int fam, double macs, double calls, int n);
/* w on a card over n tokens on the paths a caller chose: the families in lt_fams (bits 1 << MF_KF_*)
 * on the cuBLASLt GEMM (mf_cost_card_lt_gemm: weights dequantized elsewhere), the others on the CUDA
 * cores (mf_cost_card's kernel price), then the scalar work. A family in lt_fams without a
 * tensor-core price (0) is priced on the CUDA cores. */
double mf_cost_card_on(const mf_cost_model *m, const mf_work *w, int n, int lt_fams);

/* Disk: `reads` requests of `bytes` in all, their latency overlapped over the queue depth:
 * reads * disk_latency / depth + bytes / disk rate. */
double mf_cost_disk(const mf_cost_model *m, double bytes, int reads);

/* Host-to-card (dir 0) or card-to-host (dir 1) copies: n_copies latencies + bytes / rate. */
double mf_cost_copy(const mf_cost_model *m, int dir, double n_copies, double bytes);

/* One small copy of activations between a dense sublayer on a card and the host (dir as
 * mf_cost_copy): act_copy_latency (0 in the profile: the direction's latency) + bytes / rate. */
double mf_cost_act_copy(const mf_cost_model *m, int dir, double bytes);

#endif
