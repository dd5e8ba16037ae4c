/* Test fixture: writes a synthetic checkpoint of config `c` (seed 0, the tiny preset's shard
 * count, quiet, replacing an earlier run's files) into $MOEFLOW_TMP/<name>, or /tmp/<name>, and
 * opens one: its model, reference forward and scheduled engine. */
#ifndef MF_TEST_TINY_CKPT_H
#define MF_TEST_TINY_CKPT_H

#include <stdio.h>
#include <stdlib.h>

#include "graphs/gen/gen.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"

/* The directory goes to dir[0..n). Returns 0, or 1 with the reason on stderr. */
static inline int mf_test_gen_ckpt(const mf_config *c, const char *name, char *dir, size_t n)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(dir, n, "%s/%s", tmp ? tmp : "/tmp", name);
    mf_gen_opts go;
    mf_gen_preset_opts("tiny", &go);
    go.force = 1;
    go.quiet = 1;
    if (mf_gen_write(c, dir, &go)) {
        fprintf(stderr, "gen %s: %s\n", dir, mf_last_error());
        return 1;
    }
    return 0;
}

/* Opens the checkpoint in dir: the model (with its draft stages when draft), its reference forward
 * and the scheduled engine on 2 threads (with the draft round when draft). Returns 0, or 1 with the
 * reason on stderr; what was opened is the caller's to free either way. */
static inline int mf_test_open(const char *dir, int draft, mf_model **m, mf_ref **r, mf_step **e)
{
    *m = NULL, *r = NULL, *e = NULL;
    if (mf_model_load(dir, &(mf_model_opts){.quiet = 1, .load_draft = draft}, m) || mf_ref_new(*m, NULL, r) ||
        mf_step_new(*r, &(mf_step_opts){.n_threads = 2, .draft = draft}, e)) {
        fprintf(stderr, "setup %s: %s\n", dir, mf_last_error());
        return 1;
    }
    return 0;
}

#endif
