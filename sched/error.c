/* Thread-local error message storage behind mf_error()/mf_last_error(). */
#include "sched/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char mf_err_msg[MF_ERROR_MSG_BYTES];

int mf_error(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(mf_err_msg, sizeof mf_err_msg, fmt, ap);
    va_end(ap);
    return code;
}

int mf_error_wrap(int code, const char *fmt, ...)
{
    char prefix[MF_ERROR_MSG_BYTES], old[MF_ERROR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, mf_err_msg, sizeof old);
    /* prefix, ": ", old message; truncated to the buffer */
    size_t n = strlen(prefix);
    if (n > sizeof mf_err_msg - 3) n = sizeof mf_err_msg - 3;
    memcpy(mf_err_msg, prefix, n);
    memcpy(mf_err_msg + n, ": ", 2);
    size_t room = sizeof mf_err_msg - n - 3, m = strlen(old);
    if (m > room) m = room;
    memcpy(mf_err_msg + n + 2, old, m);
    mf_err_msg[n + 2 + m] = '\0';
    return code;
}

const char *mf_last_error(void) { return mf_err_msg; }

void mf_error_clear(void) { mf_err_msg[0] = '\0'; }
