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
    snprintf(mf_err_msg, sizeof mf_err_msg, "%s: %s", prefix, old);
    return code;
}

const char *mf_last_error(void) { return mf_err_msg; }

void mf_error_clear(void) { mf_err_msg[0] = '\0'; }
