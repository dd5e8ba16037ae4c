/* Paths of files the library writes (checkpoints, traces, profiles, routing traces): every writer
 * creates the folders above its output the way `mkdir -p` does, so a first run on a fresh machine
 * (no ~/.cache yet) works, and a failure names the folder that could not be made. */
#ifndef MF_PATH_H
#define MF_PATH_H

#include <stddef.h>
#include <stdio.h>

/* Creates `dir` and every missing folder above it (mode 0755, as `mkdir -p`). 0 when it exists
 * as a folder afterwards; -ENOTDIR when it or a prefix is a file; otherwise the negative errno of
 * the failing mkdir, with a message naming that folder (mf_last_error). */
int mf_path_mkdirs(const char *dir);

/* Creates the folders above the file `path` (nothing for a bare file name). Same codes as
 * mf_path_mkdirs; the message says which file's folder could not be made. */
int mf_path_make_parent(const char *path);

/* Writing a file whole or not at all: mf_path_open_tmp makes the folders above `path` and opens
 * `path`.tmp.PID (named into tmp, cap bytes) for writing into *f: 0, or the negative errno with a
 * message. mf_path_commit_tmp closes f and renames tmp onto path when every write succeeded (no
 * error on the stream), else removes tmp: 0, or -EIO / the rename's negative errno with a message
 * naming the file. */
int mf_path_open_tmp(const char *path, char *tmp, size_t cap, FILE **f);
int mf_path_commit_tmp(FILE *f, const char *tmp, const char *path);

/* Reads the file `path` whole into a malloc'ed, NUL-terminated buffer *text of *n bytes (the NUL
 * not counted): 0, or -ENOENT (cannot open) / -ENOMEM (out of memory, or over max bytes) / -EIO
 * (a read error) with a message naming the file; *text is NULL then. */
int mf_path_read(const char *path, size_t max, char **text, size_t *n);

#endif
