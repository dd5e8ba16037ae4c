/* mkdir -p for the library's writers (sched/path.h): walks the path from its first component,
 * creating what is missing, so every writer reports the same error for the same cause. */
#include "sched/path.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sched/error.h"

/* mkdir of one prefix; EEXIST is fine only when it is a folder */
static int mf_path_mkdir1(const char *p)
{
    if (mkdir(p, 0755) == 0) return 0;
    int e = errno;
    struct stat st;
    if (e == EEXIST || e == EACCES || e == EROFS) {
        /* an existing folder we may not write into is fine as a prefix */
        if (stat(p, &st) == 0) {
            if (S_ISDIR(st.st_mode)) return 0;
            return mf_error(-ENOTDIR, "%s: exists and is not a directory", p);
        }
    }
    return mf_error(-e, "%s: cannot create directory: %s", p, strerror(e));
}

int mf_path_mkdirs(const char *dir)
{
    if (!dir || !*dir) return 0;
    char p[4096];
    size_t n = strlen(dir);
    if (n >= sizeof p) return mf_error(-ENAMETOOLONG, "%.64s...: path too long", dir);
    memcpy(p, dir, n + 1);
    while (n > 1 && p[n - 1] == '/') p[--n] = 0;   /* "a/b/" -> "a/b" */
    struct stat st;
    if (stat(p, &st) == 0) {
        if (S_ISDIR(st.st_mode)) return 0;
        return mf_error(-ENOTDIR, "%s: exists and is not a directory", p);
    }
    for (size_t i = 1; i < n; i++) {
        if (p[i] != '/' || p[i - 1] == '/') continue;
        p[i] = 0;
        int rc = mf_path_mkdir1(p);
        p[i] = '/';
        if (rc) return rc;
    }
    return mf_path_mkdir1(p);
}

int mf_path_make_parent(const char *path)
{
    if (!path) return 0;
    const char *slash = strrchr(path, '/');
    if (!slash || slash == path) return 0;   /* "file" or "/file": nothing to make */
    char dir[4096];
    size_t n = (size_t)(slash - path);
    if (n >= sizeof dir) return mf_error(-ENAMETOOLONG, "%.64s...: path too long", path);
    memcpy(dir, path, n);
    dir[n] = 0;
    int rc = mf_path_mkdirs(dir);
    if (rc) return mf_error_wrap(rc, "%s: cannot make its folder", path);
    return 0;
}

int mf_path_open_tmp(const char *path, char *tmp, size_t cap, FILE **f)
{
    *f = NULL;
    int rc = mf_path_make_parent(path);
    if (rc) return rc;
    snprintf(tmp, cap, "%s.tmp.%d", path, (int)getpid());
    *f = fopen(tmp, "wb");
    if (!*f) {
        int e = errno;
        return mf_error(-e, "%s: cannot create: %s", tmp, strerror(e));
    }
    return 0;
}

int mf_path_commit_tmp(FILE *f, const char *tmp, const char *path)
{
    int ok = !ferror(f);
    ok = (fclose(f) == 0) && ok;
    if (!ok) {
        unlink(tmp);
        return mf_error(-EIO, "%s: write failed", tmp);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return mf_error(-e, "%s: cannot rename into place: %s", path, strerror(e));
    }
    return 0;
}

int mf_path_read(const char *path, size_t max, char **text, size_t *n)
{
    *text = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return mf_error(-ENOENT, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 14, len = 0, k;
    char *p = malloc(cap);
    while (p && (k = fread(p + len, 1, cap - len - 1, f)) > 0) {
        len += k;
        if (len + 1 == cap) {
            char *q = cap < max ? realloc(p, cap *= 2) : NULL;
            if (!q) free(p);
            p = q;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (!p) return mf_error(-ENOMEM, "%s: cannot read (out of memory, or over %zu bytes)", path, max);
    if (bad) {
        free(p);
        return mf_error(-EIO, "%s: read error", path);
    }
    p[len] = 0;
    *text = p;
    *n = len;
    return 0;
}
