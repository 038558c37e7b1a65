/* IDX files (the MNIST family's format), plain or gzip-compressed.
 *
 * Layout: two zero bytes, a type byte (0x08 = unsigned byte, the only type accepted here),
 * the number of dimensions, one big-endian uint32 per dimension, then the elements in
 * row-major order. Compressed and uncompressed files are read alike (zlib's gzread passes
 * uncompressed data through). */
#ifndef BIE_TOOL_IDX_H
#define BIE_TOOL_IDX_H

#include <stdint.h>

#define IDX_MAX_DIMS 4

typedef struct idx_array {
    uint8_t *data; /* malloc'ed, dims[0] * ... * dims[ndim - 1] bytes */
    int ndim;
    int64_t dims[IDX_MAX_DIMS];
} idx_array;

/* At most this many elements (bytes of data) per file: 1 GiB, about 1.37 million 28x28
 * images (Fashion-MNIST's training set is 47 MB). */
#define IDX_MAX_ELEMENTS (INT64_C(1) << 30)

/* Read an unsigned-byte IDX file with `expected_ndim` dimensions. Errors (returns -1, see
 * tool_error): file missing or unreadable, not a regular file (a directory, FIFO or device
 * is refused before reading), corrupt gzip stream, wrong magic or type, rank, sizes above
 * IDX_MAX_ELEMENTS, truncated data or trailing bytes. *out is untouched on error.
 *
 * Cost: the header is read and checked first; a compressed file whose header promises more
 * than its stream can hold (deflate expands at most 1032:1) is refused before decompressing;
 * no more than the promised bytes plus one are decompressed, and memory grows with the data
 * actually read (at most twice it), so time and memory follow the file's real content. */
int idx_read_u8(const char *path, int expected_ndim, idx_array *out);

/* Parse an IDX image held in memory (uncompressed); same checks as idx_read_u8. */
int idx_parse_u8(const uint8_t *bytes, int64_t size, int expected_ndim, const char *name,
                 idx_array *out);

void idx_free(idx_array *a);

#endif
