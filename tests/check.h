/* Minimal checking for test executables: CHECK records a failure with file and line and goes on;
 * a test's main returns mf_check_exit() (1 when anything failed). Every test that includes this
 * has its stdout line-buffered from the start, so a test killed by its timeout leaves its log. */
#ifndef MF_TEST_CHECK_H
#define MF_TEST_CHECK_H

#include <stdio.h>

/* 1 in a ThreadSanitizer build (gcc's __SANITIZE_THREAD__, clang's __has_feature): tests run their
 * concurrent paths there on the smallest configuration that still exercises them (TSan makes
 * them 5-20x slower), and keep the full sweep in the normal and ASan builds. */
#if defined(__SANITIZE_THREAD__)
#define MF_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MF_TEST_TSAN 1
#endif
#endif
#ifndef MF_TEST_TSAN
#define MF_TEST_TSAN 0
#endif

/* Line-buffered stdout in every test, so a test killed by its timeout still leaves its log. */
__attribute__((constructor)) static void mf_check_line_buffer(void) { setvbuf(stdout, NULL, _IOLBF, 0); }

static int mf_check_failures;
static int mf_check_count;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        mf_check_count++;                                                                  \
        if (!(cond)) {                                                                     \
            mf_check_failures++;                                                           \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);       \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fputc('\n', stderr);                                                           \
        }                                                                                  \
    } while (0)

static inline int mf_check_exit(const char *name)
{
    printf("%s: %d checks, %d failed\n", name, mf_check_count, mf_check_failures);
    return mf_check_failures ? 1 : 0;
}

#endif
