/* Helpers shared by the safetensors reader and writer: tensor sizes with overflow checks and
 * positioned I/O loops that retry on EINTR and short transfers (see st_internal.h). */
#include "host/st_internal.h"

#include <errno.h>
#include <unistd.h>

int mf_st_shape_bytes(mf_dtype dt, int n_dims, const int64_t *shape, uint64_t *out)
{
    int bits = mf_dtype_bits(dt);
    if (bits <= 0) return -1;
    int64_t n_elems = 1;
    for (int d = 0; d < n_dims; d++) {
        if (shape[d] < 0) return -1;
        if (shape[d] != 0 && n_elems > INT64_MAX / shape[d]) return -1;
        n_elems *= shape[d];
    }
    if (n_elems > INT64_MAX / 64) return -1;
    if ((n_elems * bits) % 8 != 0) return -2;
    *out = (uint64_t)(n_elems * bits / 8);
    return 0;
}

int mf_st_pwrite_all(int fd, const void *buf, size_t n, uint64_t offset)
{
    const char *p = buf;
    while (n > 0) {
        if (offset > (uint64_t)INT64_MAX - n) return -EFBIG;
        ssize_t w = pwrite(fd, p, n, (off_t)offset);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (w == 0) return -EIO;
        p += w;
        n -= (size_t)w;
        offset += (uint64_t)w;
    }
    return 0;
}

int64_t mf_st_pread_all(int fd, void *buf, size_t n, uint64_t offset)
{
    char *p = buf;
    size_t done = 0;
    while (done < n) {
        if (offset > (uint64_t)INT64_MAX || done > (uint64_t)INT64_MAX - offset) break;  /* past EOF */
        ssize_t r = pread(fd, p + done, n - done, (off_t)(offset + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) break;
        done += (size_t)r;
    }
    return (int64_t)done;
}
