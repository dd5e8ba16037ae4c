/* Replays the fuzz seed corpus (tests/fuzz/corpus) through the fuzz target in every build, so the
 * corpus is a regression test without clang or libFuzzer: no file may crash or trip an invariant,
 * files named valid_* must parse and files named invalid_* must be refused. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/path.h"
#include "tests/check.h"
#include "tests/fuzz/fuzz_st_header.c"

#ifndef MF_SOURCE_DIR
#error "MF_SOURCE_DIR must name the source tree (tests/CMakeLists.txt defines it)"
#endif

int main(void)
{
    const char *dir = MF_SOURCE_DIR "/tests/fuzz/corpus";
    DIR *d = opendir(dir);
    CHECK(d != NULL, "cannot open %s", dir);
    if (!d) return mf_check_exit("test_fuzz_replay");
    int n_valid = 0, n_invalid = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        size_t n = 0;
        char *text = NULL;
        mf_path_read(path, (size_t)1 << 26, &text, &n);
        unsigned char *buf = (unsigned char *)text;
        CHECK(buf != NULL, "cannot read %s", path);
        if (!buf) continue;
        LLVMFuzzerTestOneInput(buf, n);   /* aborts on a broken invariant */
        mf_st_tensor *t = NULL;
        int n_t = 0;
        int rc = mf_st_parse_image(e->d_name, buf, n, &t, &n_t);
        if (strncmp(e->d_name, "valid_", 6) == 0) {
            CHECK(rc == 0, "%s should parse: %s", e->d_name, mf_last_error());
            n_valid++;
        } else if (strncmp(e->d_name, "invalid_", 8) == 0) {
            CHECK(rc < 0 && strstr(mf_last_error(), e->d_name), "%s should be refused by name",
                  e->d_name);
            n_invalid++;
        }
        if (rc == 0) mf_st_tensors_free(t, n_t);
        free(buf);
    }
    closedir(d);
    CHECK(n_valid >= 5 && n_invalid >= 10, "corpus too small: %d valid, %d invalid", n_valid,
          n_invalid);
    printf("replayed %d valid and %d invalid seeds\n", n_valid, n_invalid);
    return mf_check_exit("test_fuzz_replay");
}
