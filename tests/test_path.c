/* Output paths: `mkdir -p` for every writer (sched/path.h). gen --out a/b/c with missing parents,
 * a path through a file refused with ENOTDIR and the file named, a non-empty folder still refused
 * without --force; and the other writers (profiles, routing traces, Chrome traces through the
 * CLI) create the folders above their files too. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "graphs/model/config.h"
#include "graphs/gen/gen.h"
#include "graphs/sim/routing.h"
#include "sched/error.h"
#include "sched/path.h"
#include "sched/profile.h"

static char tmp[2048];

static int is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static void rm_rf(const char *p)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
    if (system(cmd) != 0) fprintf(stderr, "warning: %s failed\n", cmd);
}

static void touch(const char *p)
{
    FILE *f = fopen(p, "w");
    if (f) fclose(f);
}

static void check_mkdirs(const char *base)
{
    char p[4096], q[4096];
    snprintf(p, sizeof p, "%s/m/a/b//c/", base);
    CHECK(mf_path_mkdirs(p) == 0, "mkdirs %s: %s", p, mf_last_error());
    snprintf(q, sizeof q, "%s/m/a/b/c", base);
    CHECK(is_dir(q), "%s not made", q);
    CHECK(mf_path_mkdirs(p) == 0, "mkdirs of an existing folder: %s", mf_last_error());
    /* a prefix that is a file */
    snprintf(q, sizeof q, "%s/m/file", base);
    touch(q);
    snprintf(p, sizeof p, "%s/m/file/x/y", base);
    CHECK(mf_path_mkdirs(p) == -ENOTDIR && strstr(mf_last_error(), q), "through a file: %s",
          mf_last_error());
    CHECK(mf_path_mkdirs(q) == -ENOTDIR, "a file as the folder: %s", mf_last_error());
    snprintf(p, sizeof p, "%s/m/file/out.json", base);
    CHECK(mf_path_make_parent(p) == -ENOTDIR && strstr(mf_last_error(), p), "parent is a file: %s",
          mf_last_error());
    CHECK(mf_path_make_parent("plain-name.json") == 0, "bare name: %s", mf_last_error());
}

static void check_gen(const char *base)
{
    mf_config cfg;
    mf_gen_opts o;
    CHECK(mf_config_preset("tiny", &cfg) == 0 && mf_gen_preset_opts("tiny", &o) == 0, "preset");
    o.quiet = 1;
    char p[2200], f[2400];
    snprintf(p, sizeof p, "%s/g/a/b/c", base);
    CHECK(mf_gen_write(&cfg, p, &o) == 0, "gen into missing parents: %s", mf_last_error());
    snprintf(f, sizeof f, "%s/config.json", p);
    CHECK(is_file(f), "%s missing", f);
    /* still refused: a non-empty folder without force, and a path that is a file */
    CHECK(mf_gen_write(&cfg, p, &o) == -EEXIST && strstr(mf_last_error(), "--force"),
          "non-empty: %s", mf_last_error());
    CHECK(mf_gen_write(&cfg, f, &o) == -ENOTDIR, "onto a file: %s", mf_last_error());
    snprintf(f, sizeof f, "%s/g/a/b/c/config.json/deeper", base);
    CHECK(mf_gen_write(&cfg, f, &o) == -ENOTDIR && strstr(mf_last_error(), "config.json"),
          "through a file: %s", mf_last_error());
    /* the CLI, as the demo calls it on a fresh machine */
    const char *bin = getenv("MOEFLOW_BIN");
    if (bin) {
        char cmd[10000];
        snprintf(p, sizeof p, "%s/cli/x/y", base);
        snprintf(cmd, sizeof cmd, "'%s' gen --preset tiny --out '%s' --quiet", bin, p);
        CHECK(system(cmd) == 0, "%s failed", cmd);
        snprintf(f, sizeof f, "%s/tokenizer.json", p);
        CHECK(is_file(f), "CLI gen into missing parents: %s missing", f);
        /* --trace into missing parents */
        snprintf(f, sizeof f, "%s/traces/t/step.json", base);
        snprintf(cmd, sizeof cmd, "'%s' decode --checkpoint '%s' --tokens 1,2,3 --max-new-tokens 2 "
                 "--quiet --trace '%s' >/dev/null", bin, p, f);
        CHECK(system(cmd) == 0 && is_file(f), "%s: no trace", cmd);
        /* --output (JSON lines) and --record-routing into missing folders */
        char g[2400];
        snprintf(f, sizeof f, "%s/out/o/run.jsonl", base);
        snprintf(g, sizeof g, "%s/out/r/route.trace", base);
        snprintf(cmd, sizeof cmd, "'%s' decode --checkpoint '%s' --tokens 1,2,3 --max-new-tokens 2 "
                 "--quiet --output '%s' --record-routing '%s' >/dev/null", bin, p, f, g);
        CHECK(system(cmd) == 0 && is_file(f) && is_file(g), "%s: no output or routing trace", cmd);
    }
}

static void check_writers(const char *base)
{
    char p[4096], src[4096];
    mf_routing_rec *w = NULL;
    snprintf(p, sizeof p, "%s/w/r/route.txt", base);
    CHECK(mf_routing_rec_open(p, 2, 8, 2, &w) == 0, "routing trace: %s", mf_last_error());
    if (w) {
        int32_t ex[2] = {1, 5};
        CHECK(mf_routing_rec_add(w, 0, 0, 1, ex, 2) == 0, "add: %s", mf_last_error());
        CHECK(mf_routing_rec_close(w) == 0 && is_file(p), "close: %s", mf_last_error());
    }
    mf_profile prof;
    snprintf(src, sizeof src, "%s/tools/profiles/this-machine.prof", MF_SOURCE_DIR);
    CHECK(mf_profile_load(src, &prof) == 0, "load %s: %s", src, mf_last_error());
    snprintf(p, sizeof p, "%s/w/p/q/copy.prof", base);
    CHECK(mf_profile_write(&prof, p) == 0 && is_file(p), "profile write: %s", mf_last_error());
    /* a folder that cannot be made: the message names it */
    snprintf(src, sizeof src, "%s/w/p/q/copy.prof/x.prof", base);
    CHECK(mf_profile_write(&prof, src) == -ENOTDIR && strstr(mf_last_error(), "copy.prof"),
          "profile under a file: %s", mf_last_error());
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *t = getenv("MOEFLOW_TMP");
    snprintf(tmp, sizeof tmp, "%s/path_%d", t ? t : "/tmp", (int)getpid());
    rm_rf(tmp);
    check_mkdirs(tmp);
    check_gen(tmp);
    check_writers(tmp);
    if (!mf_check_failures) rm_rf(tmp);
    return mf_check_exit("test_path");
}
