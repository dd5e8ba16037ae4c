/* The cost model (sched/cost.h): a task's work priced from a hardware profile, on the host or on a
 * card, and the built-in machine for an engine given no profile. */
#include "sched/cost.h"

static const mf_profile mf_cost_builtin = {
    .name = "built-in",
    .n_sockets = 1,
    .threads_per_socket = 64,
    .host = {[MF_KF_FP4] = {.bytes_per_s = 20e9, .macs_per_s = 0, .latency_ns = 2000},
             [MF_KF_FP8] = {.bytes_per_s = 20e9, .macs_per_s = 0, .latency_ns = 2000},
             [MF_KF_BF16] = {.bytes_per_s = 20e9, .macs_per_s = 0, .latency_ns = 2000},
             [MF_KF_REF] = {.macs_per_s = 1e9}},
    .host_vec = {.macs_per_s = 8e9},
    .disk_bytes_per_s = 1e9,
    .disk_latency_ns = 100000,
    .disk_queue_depth = 1,
    .h2d_bytes_per_s = 25e9,
    .h2d_latency_ns = 10000,
    .d2h_bytes_per_s = 25e9,
    .d2h_latency_ns = 10000,
    .h2d_total_bytes_per_s = 25e9,
    .card = {[MF_KF_FP4] = {.bytes_per_s = 20e9, .latency_ns = 5000},
             [MF_KF_FP8] = {.bytes_per_s = 20e9, .latency_ns = 5000},
             [MF_KF_BF16] = {.bytes_per_s = 20e9, .latency_ns = 5000},
             [MF_KF_REF] = {.macs_per_s = 1e9}},
};

const mf_profile *mf_cost_default_profile(void) { return &mf_cost_builtin; }

double mf_cost_thread_share(const mf_profile *p, int n_threads)
{
    if (n_threads < 1) n_threads = 1;
    int tps = p->threads_per_socket > 0 ? p->threads_per_socket : 1;
    int sockets = (n_threads + tps - 1) / tps;
    if (sockets > p->n_sockets) sockets = p->n_sockets > 0 ? p->n_sockets : 1;
    return p->mem_bytes_per_s * sockets / n_threads;
}

double mf_cost_kern(const mf_profile_kern *k, double bytes_per_s, double bytes, double macs, int n)
{
    double ns = k->latency_ns;
    if (bytes_per_s > 0) ns += bytes / bytes_per_s * 1e9;
    if (n > 1 && k->macs_per_s > 0) ns += (n - 1) * macs / k->macs_per_s * 1e9;
    return ns;
}

double mf_cost_ref(const mf_profile *p, int card, double flops)
{
    const mf_profile_kern *k = card ? &p->card[MF_KF_REF] : &p->host[MF_KF_REF];
    return k->macs_per_s > 0 ? flops / k->macs_per_s * 1e9 : 0;
}

/* w's kernels over n tokens on `kern` (a host thread's or a card's), bytes at most `cap` (0: none). */
static double mf_cost_kernels(const mf_profile_kern *kern, double cap, const mf_work *w, int n)
{
    double ns = 0;
    for (int f = 0; f < MF_KF_REF; f++) {
        if (!(w->calls[f] > 0)) continue;
        const mf_profile_kern *k = &kern[f];
        double bps = k->bytes_per_s;
        if (cap > 0 && cap < bps) bps = cap;
        ns += mf_cost_kern(k, bps, w->w_bytes[f], w->macs[f], n) + (w->calls[f] - 1) * k->latency_ns;
    }
    return ns;
}

double mf_cost_vec(const mf_cost_model *m, double flops, double bytes)
{
    double rate = m->p->host_vec.macs_per_s, ns = rate > 0 ? flops / rate * 1e9 : 0;
    double bns = m->host_bytes_per_s > 0 ? bytes / m->host_bytes_per_s * 1e9 : 0;
    return ns > bns ? ns : bns;
}

double mf_cost_host(const mf_cost_model *m, const mf_work *w, int n, double extra_flops)
{
    double ref = w->ref_flops + w->ref_flops_tok * n + (w->extra_vec ? 0 : extra_flops);
    double ns = mf_cost_kernels(m->p->host, m->host_bytes_per_s, w, n) + mf_cost_ref(m->p, 0, ref);
    if (w->vec_flops > 0 || w->vec_bytes > 0 || (w->extra_vec && extra_flops > 0))
        ns += mf_cost_vec(m, w->vec_flops + (w->extra_vec ? extra_flops : 0), w->vec_bytes);
    return ns;
}

double mf_cost_card_dequant(const mf_cost_model *m, int fam, double bytes, double macs, double calls)
{
    const mf_profile *p = m->p;
    if (!(p->card_tc_macs_per_s > 0) || (fam != MF_KF_FP8 && fam != MF_KF_FP4)) return 0;
    /* the bytes stream at the dense kernels' rate (card_fp8_bytes_per_s: a fraction of the card's
     * memory bandwidth), whichever family: the dequantization reads and writes plainly */
    double ns = calls * (fam == MF_KF_FP8 ? MF_COST_LT_DEQUANT_FP8 : MF_COST_LT_DEQUANT_FP4) * p->card[fam].latency_ns;
    double bps = p->card[MF_KF_FP8].bytes_per_s;
    return ns + (bps > 0 ? (bytes + 2 * macs) / bps * 1e9 : 0);
}

double mf_cost_card_lt_gemm(const mf_cost_model *m, int fam, double macs, double calls, int n)
{
    const mf_profile *p = m->p;
    if (!(p->card_tc_macs_per_s > 0) || (fam != MF_KF_FP8 && fam != MF_KF_FP4)) return 0;
    double launches = fam == MF_KF_FP8 ? MF_COST_LT_LAUNCHES_FP8 - MF_COST_LT_DEQUANT_FP8
                                       : MF_COST_LT_LAUNCHES_FP4 - MF_COST_LT_DEQUANT_FP4;
    double ns = calls * launches * p->card[fam].latency_ns + (double)n * macs / p->card_tc_macs_per_s * 1e9;
    double bps = p->card[MF_KF_FP8].bytes_per_s;
    return ns + (bps > 0 ? 2 * macs / bps * 1e9 : 0);
}

double mf_cost_card_lt(const mf_cost_model *m, int fam, double bytes, double macs, double calls, int n)
{
    double g = mf_cost_card_lt_gemm(m, fam, macs, calls, n);
    return g > 0 ? mf_cost_card_dequant(m, fam, bytes, macs, calls) + g : 0;
}

double mf_cost_card_paths(const mf_cost_model *m, const mf_work *w, int n, int *lt_fams)
{
    double ns = 0;
    int lt = 0;
    for (int f = 0; f < MF_KF_REF; f++) {
        if (!(w->calls[f] > 0)) continue;
        mf_work one = {0};
        one.w_bytes[f] = w->w_bytes[f], one.macs[f] = w->macs[f], one.calls[f] = w->calls[f];
        double core = mf_cost_kernels(m->p->card, 0, &one, n);
        double alt = mf_cost_card_lt(m, f, w->w_bytes[f], w->macs[f], w->calls[f], n);
        if (alt > 0 && alt < core) {
            ns += alt;
            lt |= 1 << f;
        } else {
            ns += core;
        }
    }
    if (lt_fams) *lt_fams = lt;
    return ns + mf_cost_ref(m->p, 1, w->ref_flops + w->ref_flops_tok * n);
}

double mf_cost_card(const mf_cost_model *m, const mf_work *w, int n) { return mf_cost_card_paths(m, w, n, NULL); }

double mf_cost_card_on(const mf_cost_model *m, const mf_work *w, int n, int lt_fams)
{
    double ns = 0;
    for (int f = 0; f < MF_KF_REF; f++) {
        if (!(w->calls[f] > 0)) continue;
        double g = lt_fams & (1 << f) ? mf_cost_card_lt_gemm(m, f, w->macs[f], w->calls[f], n) : 0;
        if (g > 0) {
            ns += g;
            continue;
        }
        mf_work one = {0};
        one.w_bytes[f] = w->w_bytes[f], one.macs[f] = w->macs[f], one.calls[f] = w->calls[f];
        ns += mf_cost_kernels(m->p->card, 0, &one, n);
    }
    return ns + mf_cost_ref(m->p, 1, w->ref_flops + w->ref_flops_tok * n);
}

double mf_cost_disk(const mf_cost_model *m, double bytes, int reads)
{
    const mf_profile *p = m->p;
    double ns = reads * p->disk_latency_ns / (p->disk_queue_depth > 0 ? p->disk_queue_depth : 1);
    return ns + (p->disk_bytes_per_s > 0 ? bytes / p->disk_bytes_per_s * 1e9 : 0);
}

double mf_cost_copy(const mf_cost_model *m, int dir, double n_copies, double bytes)
{
    const mf_profile *p = m->p;
    double lat = dir ? p->d2h_latency_ns : p->h2d_latency_ns, bps = dir ? p->d2h_bytes_per_s : p->h2d_bytes_per_s;
    return n_copies * lat + (bps > 0 ? bytes / bps * 1e9 : 0);
}

double mf_cost_act_copy(const mf_cost_model *m, int dir, double bytes)
{
    const mf_profile *p = m->p;
    double lat = p->act_copy_latency_ns > 0 ? p->act_copy_latency_ns : dir ? p->d2h_latency_ns : p->h2d_latency_ns;
    double bps = dir ? p->d2h_bytes_per_s : p->h2d_bytes_per_s;
    return lat + (bps > 0 ? bytes / bps * 1e9 : 0);
}
