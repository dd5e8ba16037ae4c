/* The startup self-check of a card: before a card takes work, each of its kernels (device/dev.h:
 * fp8 matmul, fp4 matmul on the fp32 and int8 paths, the int8 expert FFN, bf16 matmul, and the
 * dense sublayers' ops: strided FP8 linear of a row slice, BF16 and grouped FP8 linears with
 * reference sums, the dense FFN phase 1, bf16 rounding, the exact gating; the indexer's scores) runs once on fresh
 * random data against the host kernels (host/kernels.h, device/dense_host.h). The engine (graphs/step/step.c) refuses a card
 * that fails and continues on the others or the host; tools/device-check.sh runs it on a GPU. */
#ifndef MF_DEV_CHECK_H
#define MF_DEV_CHECK_H

#include <stdint.h>

#include "device/dev.h"

/* Relative error bounds (max |card - host| / max |host|, float64): the CUDA kernels' stated
 * bounds (docs/device.md); emulated cards match bit for bit. */
#define MF_DEV_CHECK_TOL_MM 1e-5
#define MF_DEV_CHECK_TOL_FFN 1e-3
/* An op whose outputs are rounded to bf16 after a computation the card does in another order
 * (the exact gating): one bf16 step of the largest value, 2^-8, with room: 8e-3. The rounding
 * alone must match bit for bit (bound 0). */
#define MF_DEV_CHECK_TOL_BF16 8e-3

/* Checks every kernel of card `card` of d once at 1 and 3 tokens (data from `seed`), on that
 * card's compute stream, waiting for it. 0 when all agree within the bounds; otherwise -EIO
 * ("card 1 (emu): kernel fp8 matmul: relative error 3.1e-02 at 3 tokens (bound 1e-05)") or the
 * failing call's code, with a message naming the card, the kernel and the error; -ENOMEM when
 * the card cannot hold the check's buffers (about 180 KB). The card's
 * streams are synced; a failed card may keep a sticky error (CUDA). Not thread-safe per card. */
int mf_dev_selfcheck(mf_dev *d, int card, uint64_t seed);

#endif
