/* Hardware calibration (graphs/calib/hwcal.h, `moeflow calibrate`): a quick calibration with emulated
 * cards writes a profile that loads, has a source for every figure and plausible values (not
 * speed: any machine passes); --json has every key; without cards every card figure is 0; bad
 * arguments fail with a message. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "graphs/calib/hwcal.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tests/check.h"

static char g_dir[512];

static int cli(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s", getenv("MOEFLOW_BIN"), args);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

static int plausible_rate(double v) { return v >= 1e5 && v <= 1e14; }

/* Plausibility of a calibrated profile (values a real machine could have, not targets). */
static void check_profile(const mf_profile *p, int n_cards, const char *what)
{
    CHECK(p->n_sockets >= 1 && p->threads_per_socket >= 1, "%s: topology", what);
    CHECK(plausible_rate(p->mem_bytes_per_s), "%s: mem %g", what, p->mem_bytes_per_s);
    CHECK(p->cross_socket_factor > 0 && p->cross_socket_factor <= 1, "%s: cross-socket factor", what);
    CHECK(p->task_overhead_ns > 0 && p->task_overhead_ns < 1e6, "%s: task overhead %g ns", what, p->task_overhead_ns);
    CHECK(p->worker_spin_ns > 0 && p->worker_spin_ns < 1e8, "%s: worker spin %g ns", what, p->worker_spin_ns);
    CHECK(p->worker_wake_ns >= 0 && p->worker_wake_ns < 1e8 && (p->threads_per_socket * p->n_sockets > 1 ||
                                                               p->worker_wake_ns == 0),
          "%s: worker wake-up %g ns", what, p->worker_wake_ns);
    for (int k = 0; k < MF_KF_N; k++) {
        CHECK(k == MF_KF_REF ? p->host[k].bytes_per_s == 0 : plausible_rate(p->host[k].bytes_per_s),
              "%s: host kernel %d bytes/s %g", what, k, p->host[k].bytes_per_s);
        CHECK(plausible_rate(p->host[k].macs_per_s), "%s: host kernel %d macs/s %g", what, k, p->host[k].macs_per_s);
        CHECK(p->host[k].latency_ns >= 0 && p->host[k].latency_ns < 1e7, "%s: host kernel %d latency", what, k);
    }
    CHECK(p->host_vec.bytes_per_s == 0 && plausible_rate(p->host_vec.macs_per_s), "%s: host vec macs/s %g", what,
          p->host_vec.macs_per_s);
    CHECK(p->host_vec.latency_ns >= 0 && p->host_vec.latency_ns < 1e7, "%s: host vec latency", what);
    CHECK(mf_profile_source(p, "host_vec_macs_per_s") && strstr(mf_profile_source(p, "host_vec_macs_per_s"),
                                                                  "mf_kern_vec_attn"),
          "%s: host vec source names what it timed", what);
    /* a per-thread fp4 stream should not beat the whole socket by much, but the two are timed at
     * different moments: on a busy machine either can be preempted, so this is reported, never
     * asserted (no timing assertions in unit tests) */
    if (p->host[MF_KF_FP4].bytes_per_s >= 4 * p->mem_bytes_per_s)
        printf("%s: note: fp4 %g B/s per thread vs memory %g B/s (a busy machine?)\n", what,
               p->host[MF_KF_FP4].bytes_per_s, p->mem_bytes_per_s);
    CHECK(plausible_rate(p->disk_bytes_per_s), "%s: disk %g", what, p->disk_bytes_per_s);
    CHECK(p->disk_latency_ns > 100 && p->disk_latency_ns < 1e9, "%s: disk latency %g", what, p->disk_latency_ns);
    CHECK(p->disk_queue_depth >= 1 && p->disk_queue_depth <= 64, "%s: queue depth", what);
    CHECK(p->n_cards == n_cards, "%s: %d cards", what, p->n_cards);
    if (n_cards) {
        CHECK(p->cards_emulated == 1, "%s: emulated", what);
        CHECK(p->card_mem_bytes == 1ull << 30, "%s: card memory from mem=1G: %llu", what,
              (unsigned long long)p->card_mem_bytes);
        CHECK(plausible_rate(p->h2d_bytes_per_s) && plausible_rate(p->d2h_bytes_per_s) &&
              plausible_rate(p->h2d_total_bytes_per_s), "%s: copy rates", what);
        /* emulated copies are modelled at bw=4e9 bytes/s: the measurement cannot beat the model */
        CHECK(p->h2d_bytes_per_s < 4.4e9 && p->d2h_bytes_per_s < 4.4e9, "%s: copies faster than the emu model: %g %g",
              what, p->h2d_bytes_per_s, p->d2h_bytes_per_s);
        /* and each copy takes at least the model's lat_ns=20000 */
        CHECK(p->h2d_latency_ns >= 15000 && p->d2h_latency_ns >= 15000, "%s: copy latency %g / %g ns below the "
              "emu model's 20000", what, p->h2d_latency_ns, p->d2h_latency_ns);
        for (int k = 0; k < MF_KF_N; k++)
            CHECK(plausible_rate(p->card[k].macs_per_s), "%s: card kernel %d", what, k);
    } else {
        CHECK(p->card_mem_bytes == 0 && p->h2d_bytes_per_s == 0 && p->card[MF_KF_FP4].bytes_per_s == 0,
              "%s: no cards, no card figures", what);
    }
    for (int i = 0; i < p->n_keys; i++)
        if (strcmp(p->keys[i].key, "name") != 0) {
            CHECK(p->keys[i].source[0] != '\0', "%s: %s has no source", what, p->keys[i].key);
        }
    CHECK(strstr(mf_profile_source(p, "host_fp4_bytes_per_s"), "measured by moeflow calibrate on ") ==
              mf_profile_source(p, "host_fp4_bytes_per_s"), "%s: source form '%s'", what,
          mf_profile_source(p, "host_fp4_bytes_per_s"));
}

static void test_cli(void)
{
    if (!getenv("MOEFLOW_BIN")) {
        printf("test_calibrate: MOEFLOW_BIN unset, CLI checks skipped\n");
        return;
    }
    static char out[65536];
    char args[2048], path[700];
    snprintf(path, sizeof path, "%s/quick.prof", g_dir);
    snprintf(args, sizeof args, "calibrate --quick --quiet --devices emu:2,mem=1G,bw=4e9,lat_ns=20000 --dir %s "
             "--disk-mib 16 --name quick-test --out %s", g_dir, path);
    int rc = cli(args, out, sizeof out);
    CHECK(rc == 0, "calibrate failed (%d): %s", rc, out);
    CHECK(strstr(out, "host_fp4_bytes_per_s") != NULL, "the table is printed");
    mf_profile p;
    rc = mf_profile_load(path, &p);
    CHECK(rc == 0, "load the calibrated profile: %s", mf_last_error());
    if (!rc) {
        CHECK(strcmp(p.name, "quick-test") == 0, "name '%s'", p.name);
        check_profile(&p, 2, "CLI emu:2");
    }
    /* the temporary disk file is gone: only the profile is left */
    snprintf(args, sizeof args, "ls -A %s", g_dir);
    FILE *ls = popen(args, "r");
    size_t n = ls ? fread(out, 1, sizeof out - 1, ls) : 0;
    out[n] = 0;
    CHECK(ls && pclose(ls) == 0 && strcmp(out, "quick.prof\n") == 0, "files in %s: '%s'", g_dir, out);

    /* --json: every key, each with a value and a source */
    char err_path[1200], err[2048] = "";
    snprintf(err_path, sizeof err_path, "%s/calibrate-json.err", g_dir);
    snprintf(args, sizeof args, "calibrate --quick --quiet --json --dir %s --disk-mib 16 2>%s", g_dir, err_path);
    rc = cli(args, out, sizeof out);
    FILE *ef = fopen(err_path, "r");
    if (ef) {
        err[fread(err, 1, sizeof err - 1, ef)] = 0;
        fclose(ef);
    }
    remove(err_path);
    json_error_t e;
    json_t *j = rc == 0 ? json_loads(out, 0, &e) : NULL;
    CHECK(j != NULL, "--json output parses: rc %d, stderr: %s", rc, err);
    json_t *keys = json_object_get(j, "keys");
    CHECK(json_is_array(keys) && json_array_size(keys) == 45, "--json has the 45 keys (44 and the optional card_tc_macs_per_s)");
    size_t i;
    json_t *k;
    int ok = 1;
    json_array_foreach(keys, i, k) ok &= json_is_string(json_object_get(k, "key")) &&
                                        json_object_get(k, "value") && json_is_string(json_object_get(k, "source"));
    CHECK(ok, "--json entries have key, value and source");
    json_decref(j);

    /* refusals */
    rc = cli("calibrate --quick --dir /nonexistent-dir/calibrate-test 2>&1", out, sizeof out);
    CHECK(rc != 0 && strstr(out, "/nonexistent-dir/calibrate-test"), "bad --dir: %s", out);
    snprintf(args, sizeof args, "calibrate --quick --quiet --dir %s --devices emu:0 2>&1", g_dir);
    rc = cli(args, out, sizeof out);
    CHECK(rc != 0 && strstr(out, "emu:0"), "bad --devices: %s", out);
    rc = cli("calibrate --disk-mib 3 2>&1", out, sizeof out);
    CHECK(rc != 0 && strstr(out, "--disk-mib"), "bad --disk-mib: %s", out);
    rc = cli("calibrate --help", out, sizeof out);
    CHECK(rc == 0 && strstr(out, "O_DIRECT") && strstr(out, "--devices"), "--help");
}

/* In process, without cards: every card figure 0, the profile writes and reads back. */
static void test_library(void)
{
    mf_profile *p = malloc(sizeof *p), *q = malloc(sizeof *q);
    mf_hwcal_opts o = {.dir = g_dir, .quick = 1, .quiet = 1, .disk_bytes = 16u << 20};
    int rc = mf_hwcal_run(&o, p);
    CHECK(rc == 0, "mf_hwcal_run: %s", mf_last_error());
    if (!rc) {
        check_profile(p, 0, "library, no cards");
        char path[700];
        snprintf(path, sizeof path, "%s/nocards.prof", g_dir);
        CHECK(mf_profile_write(p, path) == 0, "write: %s", mf_last_error());
        CHECK(mf_profile_load(path, q) == 0 && q->mem_bytes_per_s == p->mem_bytes_per_s &&
              q->host[MF_KF_FP8].macs_per_s == p->host[MF_KF_FP8].macs_per_s, "read back: %s", mf_last_error());
    }
    o.name = "a#b";
    CHECK(mf_hwcal_run(&o, p) == -EINVAL, "a name with '#' is refused");
    free(p);
    free(q);
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/calibrate.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror(g_dir);
        return 1;
    }
    test_cli();
    test_library();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return mf_check_exit("test_calibrate");
}
