#include "idx.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "errors.h"
#include "file_read.h"

enum { IDX_TYPE_U8 = 0x08 };
/* Deflate's largest expansion (zlib's documentation: 1032:1), plus room for the gzip
 * header and trailer. */
#define IDX_DEFLATE_RATIO 1032
#define IDX_GZIP_SLACK 4096

/* Check the header in bytes[0..size) (size >= 4 + 4 * ndim once the rank is known): fills
 * a's rank and extents, *header its length and *count the number of elements. */
static int parse_header(const uint8_t *bytes, int64_t size, int expected_ndim, const char *name,
                        idx_array *a, int64_t *header, int64_t *count) {
    if (size < 4 || bytes[0] != 0 || bytes[1] != 0)
        return tool_fail("%s: not an IDX file (bad magic number)", name);
    if (bytes[2] != IDX_TYPE_U8)
        return tool_fail("%s: IDX element type 0x%02x, expected 0x08 (unsigned byte)", name,
                         bytes[2]);
    int ndim = bytes[3];
    if (ndim != expected_ndim)
        return tool_fail("%s: IDX file has %d dimensions, expected %d", name, ndim, expected_ndim);
    *header = 4 + 4 * (int64_t)ndim;
    if (size < *header) return tool_fail("%s: truncated IDX header", name);
    memset(a, 0, sizeof *a);
    a->ndim = ndim;
    *count = 1;
    for (int d = 0; d < ndim; d++) {
        const uint8_t *p = bytes + 4 + 4 * d;
        a->dims[d] = ((int64_t)p[0] << 24) | ((int64_t)p[1] << 16) | ((int64_t)p[2] << 8) | p[3];
        if (a->dims[d] == 0) return tool_fail("%s: IDX dimension %d is zero", name, d);
        *count *= a->dims[d];
        if (*count > IDX_MAX_ELEMENTS)
            return tool_fail("%s: IDX file too large: the header claims more than %lld elements "
                             "(the limit)",
                             name, (long long)IDX_MAX_ELEMENTS);
    }
    return 0;
}

int idx_parse_u8(const uint8_t *bytes, int64_t size, int expected_ndim, const char *name,
                 idx_array *out) {
    idx_array a;
    int64_t header = 0, count = 0;
    TOOL_TRY(parse_header(bytes, size, expected_ndim, name, &a, &header, &count));
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

/* Read up to n bytes (fewer only at the end of the stream): bytes read, or -1. */
static int64_t gz_read_some(gzFile f, const char *path, uint8_t *buf, int64_t n) {
    int64_t done = 0;
    while (done < n) {
        int64_t chunk = n - done < (1 << 30) ? n - done : (1 << 30);
        int got = gzread(f, buf + done, (unsigned)chunk);
        if (got < 0) {
            int code;
            const char *msg = gzerror(f, &code);
            return tool_fail("%s: corrupt or truncated gzip data (%s)", path, msg);
        }
        if (got == 0) break;
        done += got;
    }
    return done;
}

/* The data after the header: exactly `count` bytes, then the end of the stream. */
static int read_data(gzFile f, const char *path, int64_t count, uint8_t **data) {
    int64_t cap = count < (1 << 20) ? count : (1 << 20), len = 0;
    uint8_t *buf = malloc((size_t)cap);
    if (!buf) return tool_fail("%s: out of memory", path);
    while (len < count) {
        if (len == cap) {
            int64_t grown_cap = cap * 2 < count ? cap * 2 : count;
            uint8_t *grown = realloc(buf, (size_t)grown_cap);
            if (!grown) {
                free(buf);
                return tool_fail("%s: out of memory", path);
            }
            buf = grown;
            cap = grown_cap;
        }
        int64_t got = gz_read_some(f, path, buf + len, cap - len);
        if (got < 0 || got < cap - len) {
            free(buf);
            if (got < 0) return -1;
            return tool_fail("%s: truncated: %lld of %lld data bytes present", path,
                             (long long)(len + got), (long long)count);
        }
        len += got;
    }
    uint8_t extra;
    int64_t more = gz_read_some(f, path, &extra, 1);
    if (more != 0) {
        free(buf);
        return more < 0 ? -1
                        : tool_fail("%s: unexpected bytes after the %lld data bytes", path,
                                    (long long)count);
    }
    *data = buf;
    return 0;
}

static int read_stream(gzFile f, const char *path, int64_t file_size, int expected_ndim,
                       idx_array *out) {
    uint8_t head[4 + 4 * 255];
    int64_t have = gz_read_some(f, path, head, 4);
    if (have < 0) return -1;
    if (have < 4)
        return tool_fail("%s: truncated or not an IDX file (%lld bytes of data)", path,
                         (long long)have);
    if (have == 4 && head[2] == IDX_TYPE_U8 && head[3] == expected_ndim) {
        int64_t got = gz_read_some(f, path, head + 4, 4 * (int64_t)head[3]);
        if (got < 0) return -1;
        have += got;
    }
    idx_array a;
    int64_t header = 0, count = 0;
    TOOL_TRY(parse_header(head, have, expected_ndim, path, &a, &header, &count));
    if (gzdirect(f)) {
        /* Not compressed: the file's size says at once whether the data is all there. */
        if (file_size - header != count)
            return tool_fail(file_size - header < count
                                 ? "%s: truncated: %lld of %lld data bytes present"
                                 : "%s: %lld bytes of data where the header promises %lld "
                                   "(unexpected bytes after the data)",
                             path, (long long)(file_size - header), (long long)count);
    } else if (count + header > (int64_t)IDX_DEFLATE_RATIO * file_size + IDX_GZIP_SLACK) {
        return tool_fail("%s: truncated: the header promises %lld data bytes, more than a "
                         "%lld-byte gzip file can hold",
                         path, (long long)count, (long long)file_size);
    }
    TOOL_TRY(read_data(f, path, count, &a.data));
    *out = a;
    return 0;
}

int idx_read_u8(const char *path, int expected_ndim, idx_array *out) {
    int fd;
    int64_t file_size;
    TOOL_TRY(tool_open_regular(path, &fd, &file_size));
    gzFile f = gzdopen(fd, "rb");
    if (!f) {
        close(fd);
        return tool_fail("cannot open %s: out of memory", path);
    }
    idx_array a;
    int status = read_stream(f, path, file_size, expected_ndim, &a);
    /* A gzip stream cut short reads as a short, error-free stream in some zlib versions:
     * gzclose_r reports it (Z_BUF_ERROR) when the last member was incomplete. */
    int close_status = gzclose_r(f);
    if (status == 0 && close_status != Z_OK) {
        idx_free(&a);
        status = tool_fail("%s: corrupt or truncated gzip data", path);
    }
    if (status == 0) *out = a;
    return status;
}

void idx_free(idx_array *a) {
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}
