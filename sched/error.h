/* Errors for the whole library: functions return 0 or a negative errno-style code and leave a
 * message the user can act on (which file, which tensor, what was expected, what was found) in a
 * thread-local buffer read with mf_last_error(). Nothing in the library exits or aborts on input. */
#ifndef MF_ERROR_H
#define MF_ERROR_H

#include <errno.h>

#define MF_ERROR_MSG_BYTES 1024

/* Records a formatted message for this thread and returns `code` (a negative errno value,
 * e.g. -EINVAL), so a failing path reads `return mf_error(-EINVAL, "%s: ...", path);`. */
int mf_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prepends "context: " to the current message and returns `code`; used by callers that add
 * what they were doing (e.g. which tensor) to an error raised below them. */
int mf_error_wrap(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The last message recorded on this thread ("" when none). */
const char *mf_last_error(void);

/* Forgets the last message on this thread. */
void mf_error_clear(void);

#endif
