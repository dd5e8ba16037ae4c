/* The startup self-check of a card: before a card takes work, each of its kernels (device/dev.h:
 * fp8 matmul, fp4 matmul on the fp32 and int8 paths, the int8 expert FFN, bf16 matmul, and the
 * dense sublayers' ops: strided FP8 linear of a row slice, BF16 and grouped FP8 linears with
 * reference sums, the dense FFN phase 1, bf16 rounding, the exact gating; the indexer's scores; where the
 * card has tensor cores, the cuBLASLt path's dequantization, linear and expert FFN) runs once on fresh
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
/* The cuBLASLt path (mf_dev_dequant, MF_DEV_LIN_CUBLASLT, mf_dev_expert_ffn_lt) against the host's
 * FP8 / FP4 fp32 kernels on the activations as the card casts them: the products are exact and both
 * sides sum in fp32, but in another order, and tensor cores before sm_90 align and truncate their
 * fp32 additions instead of rounding each (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of
 * NVIDIA tensor cores", PeerJ Comput. Sci. 2021): with K = 256 to 7,168 such additions a sum may
 * drift by K x 2^-24 of its terms' magnitude, amplified where they cancel, so 1e-3 (the FP4 int8
 * FFN's bound); the expert FFN also casts h to 16 bits after its sums, where an h value may round
 * the other way (one bf16 step, 2^-8 of that value): 4e-3. Emulated cards: bit for bit. */
#define MF_DEV_CHECK_TOL_LT 1e-3
#define MF_DEV_CHECK_TOL_LT_FFN 4e-3

/* Checks every kernel of card `card` of d once at 1 and 3 tokens (data from `seed`), on that
 * card's compute stream, waiting for it. 0 when all agree within the bounds; otherwise -EIO
 * ("card 1 (emu): kernel fp8 matmul: relative error 3.1e-02 at 3 tokens (bound 1e-05)") or the
 * failing call's code, with a message naming the card, the kernel and the error; -ENOMEM when
 * the card cannot hold the check's buffers (about 180 KB). The card's
 * streams are synced; a failed card may keep a sticky error (CUDA). Not thread-safe per card. */
int mf_dev_selfcheck(mf_dev *d, int card, uint64_t seed);

#endif
