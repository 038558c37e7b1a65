#include "idx.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "errors.h"

enum { IDX_TYPE_U8 = 0x08 };
/* Far above any data set this tool reads; guards the size arithmetic. */
#define IDX_MAX_ELEMENTS (INT64_C(1) << 31)

int idx_parse_u8(const uint8_t *bytes, int64_t size, int expected_ndim, const char *name,
                 idx_array *out) {
    if (size < 4 || bytes[0] != 0 || bytes[1] != 0)
        return tool_fail("%s: not an IDX file (bad magic number)", name);
    if (bytes[2] != IDX_TYPE_U8)
        return tool_fail("%s: IDX element type 0x%02x, expected 0x08 (unsigned byte)", name,
                         bytes[2]);
    int ndim = bytes[3];
    if (ndim != expected_ndim)
        return tool_fail("%s: IDX file has %d dimensions, expected %d", name, ndim, expected_ndim);
    int64_t header = 4 + 4 * (int64_t)ndim;
    if (size < header) return tool_fail("%s: truncated IDX header", name);
    idx_array a = {.ndim = ndim};
    int64_t count = 1;
    for (int d = 0; d < ndim; d++) {
        const uint8_t *p = bytes + 4 + 4 * d;
        a.dims[d] = ((int64_t)p[0] << 24) | ((int64_t)p[1] << 16) | ((int64_t)p[2] << 8) | p[3];
        if (a.dims[d] == 0) return tool_fail("%s: IDX dimension %d is zero", name, d);
        count *= a.dims[d];
        if (count > IDX_MAX_ELEMENTS) return tool_fail("%s: IDX file too large", name);
    }
    if (size - header < count)
        return tool_fail("%s: truncated: %lld of %lld data bytes present", name,
                         (long long)(size - header), (long long)count);
    if (size - header > count)
        return tool_fail("%s: %lld unexpected bytes after the data", name,
                         (long long)(size - header - count));
    a.data = malloc((size_t)count);
    if (!a.data) return tool_fail("%s: out of memory", name);
    memcpy(a.data, bytes + header, (size_t)count);
    *out = a;
    return 0;
}

/* Read a whole (possibly gzip-compressed) file into memory. */
static int read_all_gz(const char *path, uint8_t **bytes, int64_t *size) {
    gzFile f = gzopen(path, "rb");
    if (!f) {
        return tool_fail("cannot open %s: %s", path, errno ? strerror(errno) : "out of memory");
    }
    size_t cap = 1 << 20, len = 0;
    uint8_t *buf = malloc(cap);
    int status = buf ? 0 : tool_fail("%s: out of memory", path);
    while (status == 0) {
        if (len == cap) {
            if (cap > (size_t)IDX_MAX_ELEMENTS) {
                status = tool_fail("%s: file too large for an IDX data set", path);
                break;
            }
            uint8_t *grown = realloc(buf, cap * 2);
            if (!grown) {
                status = tool_fail("%s: out of memory", path);
                break;
            }
            buf = grown;
            cap *= 2;
        }
        int n = gzread(f, buf + len, (unsigned)(cap - len));
        if (n < 0) {
            int code;
            const char *msg = gzerror(f, &code);
            status = tool_fail("%s: corrupt or truncated gzip data (%s)", path, msg);
        } else if (n == 0) {
            break;
        } else {
            len += (size_t)n;
        }
    }
    /* A gzip stream cut short reads as a short, error-free stream in some zlib versions:
     * gzclose_r reports it (Z_BUF_ERROR) when the last member was incomplete. */
    int close_status = gzclose_r(f);
    if (status == 0 && close_status != Z_OK)
        status = tool_fail("%s: corrupt or truncated gzip data", path);
    if (status != 0) {
        free(buf);
        return -1;
    }
    *bytes = buf;
    *size = (int64_t)len;
    return 0;
}

int idx_read_u8(const char *path, int expected_ndim, idx_array *out) {
    uint8_t *bytes = NULL;
    int64_t size = 0;
    errno = 0;
    TOOL_TRY(read_all_gz(path, &bytes, &size));
    int status = idx_parse_u8(bytes, size, expected_ndim, path, out);
    free(bytes);
    return status;
}

void idx_free(idx_array *a) {
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}
