/* The expert FFN as one fused unit in two row-split phases (v41-flash step 5), plus the format
 * dispatch every caller uses. Phase 1 computes w1 and w3 rows chunk by chunk (16 rows at 64 tokens,
 * up to 1,024 at one; all tokens) into L1 buffers and writes only the gated hidden h; phase 2 is w2 h. Routed experts are FP4,
 * the shared expert FP8; each phase reads its weights once per call. */
#include "host/kern_internal.h"
#include "host/kern_gate.h"

#include <math.h>

#include "sched/error.h"

#define FFN_CHUNK 16   /* hidden rows per phase-1 step at MF_KERN_TOK_PASS tokens */
/* Floats of each of the g and u buffers: a phase-1 step covers FFN_BUF / nt rows (a multiple of
 * FFN_CHUNK), so a call of few tokens (batch-1 decode) runs w1's rows, then w3's, as long
 * streams: alternating the two matrices every 16 rows read 8-15% slower on an Intel VM (two
 * threads, 300 distinct experts of 1,536 x 1,024 FP4). Each row's sums are the same whatever the
 * step, so the bits are too. */
#define FFN_BUF 1024

static int mf_kern_check_in(const char *who, const mf_kern_mat *m, const mf_kern_in *in)
{
    if (!m || !in || !in->x)
        return mf_error(-EINVAL, "%s: NULL %s", who, !m ? "matrix" : "input");
    if (in->q8 && (in->q8->n_tok != in->n_tok || in->q8->n_in != m->n_in || !in->q8->q))
        return mf_error(-EINVAL, "%s: quantized input is %d x %d, expected %d x %d", who,
                        in->q8->n_tok, in->q8->n_in, in->n_tok, m->n_in);
    if (m->fmt != MF_KERN_BF16 && m->fmt != MF_KERN_FP8 && m->fmt != MF_KERN_FP4)
        return mf_error(-EINVAL, "%s: unknown weight format %d", who, (int)m->fmt);
    return 0;
}

/* Unchecked dispatch over a token window [t0, t0 + nt) of `in`. */
static void mf_kern_rows(const mf_kern_mat *m, const mf_kern_in *in, int t0, int nt, float *y,
                         int ld_y, int y_row0, int r0, int r1)
{
    const float *x = in->x + (size_t)t0 * in->ld_x;
    switch (m->fmt) {
    case MF_KERN_BF16:
        mf_kern_bf16_rows(m, x, nt, in->ld_x, y, ld_y, y_row0, r0, r1);
        break;
    case MF_KERN_FP8:
        mf_kern_fp8_rows(m, x, nt, in->ld_x, y, ld_y, y_row0, r0, r1);
        break;
    case MF_KERN_FP4:
        if (in->q8) {
            mf_kern_q8 sub = *in->q8;
            sub.n_tok = nt;
            sub.q += (size_t)t0 * sub.row_bytes;
            sub.scale += (size_t)t0 * sub.n_sb;
            mf_kern_fp4_rows(m, &sub, y, ld_y, y_row0, r0, r1);
        } else {
            mf_kern_fp4_rows_f32(m, x, nt, in->ld_x, y, ld_y, y_row0, r0, r1);
        }
        break;
    }
}

int mf_kern_matmul(const mf_kern_mat *m, const mf_kern_in *in, float *y, int ld_y, int r0, int r1)
{
    int rc = mf_kern_check_in("matmul", m, in);
    if (!rc)
        rc = mf_kern_check("matmul", m->w, m->scale, m->fmt != MF_KERN_BF16, m->n_out, m->n_in,
                           in->x, in->n_tok, in->ld_x, y, ld_y, r0, r1);
    if (rc)
        return rc;
    mf_kern_rows(m, in, 0, in->n_tok, y, ld_y, 0, r0, r1);
    return 0;
}

int mf_kern_ffn_up(const mf_kern_mat *w1, const mf_kern_mat *w3, const mf_kern_in *x,
                   const float *tok_weight, float limit, float *h, int ld_h, int r0, int r1)
{
    int rc = mf_kern_check_in("ffn up (w1)", w1, x);
    if (!rc)
        rc = mf_kern_check_in("ffn up (w3)", w3, x);
    if (!rc)
        rc = mf_kern_check("ffn up (w1)", w1->w, w1->scale, w1->fmt != MF_KERN_BF16, w1->n_out,
                           w1->n_in, x->x, x->n_tok, x->ld_x, h, ld_h, r0, r1);
    if (!rc)
        rc = mf_kern_check("ffn up (w3)", w3->w, w3->scale, w3->fmt != MF_KERN_BF16, w3->n_out,
                           w3->n_in, x->x, x->n_tok, x->ld_x, h, ld_h, r0, r1);
    if (rc)
        return rc;
    if (w1->n_out != w3->n_out || w1->n_in != w3->n_in || w1->fmt != w3->fmt)
        return mf_error(-EINVAL, "ffn up: w1 [%d, %d] fmt %d and w3 [%d, %d] fmt %d differ",
                        w1->n_out, w1->n_in, (int)w1->fmt, w3->n_out, w3->n_in, (int)w3->fmt);
    if (!(limit > 0.0f))
        return mf_error(-EINVAL, "ffn up: swiglu limit %g, expected > 0", (double)limit);

    _Static_assert(FFN_BUF >= MF_KERN_TOK_PASS * FFN_CHUNK, "g and u hold a full pass's chunk");
    _Alignas(32) float g[FFN_BUF], u[FFN_BUF];
    for (int t0 = 0; t0 < x->n_tok; t0 += MF_KERN_TOK_PASS) {
        int nt = x->n_tok - t0 < MF_KERN_TOK_PASS ? x->n_tok - t0 : MF_KERN_TOK_PASS;
        int chunk = FFN_BUF / nt / FFN_CHUNK * FFN_CHUNK;   /* rows per step, ld of g and u */
        for (int c0 = r0; c0 < r1; c0 += chunk) {
            int c1 = r1 - c0 < chunk ? r1 : c0 + chunk;
            mf_kern_rows(w1, x, t0, nt, g, chunk, c0, c0, c1);
            mf_kern_rows(w3, x, t0, nt, u, chunk, c0, c0, c1);
            for (int t = 0; t < nt; t++) {
                float wt = tok_weight ? tok_weight[t0 + t] : 1.0f;
                float *ht = h + (size_t)(t0 + t) * ld_h;
                for (int r = c0; r < c1; r++) {
                    ht[r] = mf_kern_gate(g[t * chunk + (r - c0)], u[t * chunk + (r - c0)], limit) * wt;
                }
            }
        }
    }
    return 0;
}

int mf_kern_ffn_down(const mf_kern_mat *w2, const mf_kern_in *h, float *y, int ld_y, int r0, int r1)
{
    return mf_kern_matmul(w2, h, y, ld_y, r0, r1);
}
