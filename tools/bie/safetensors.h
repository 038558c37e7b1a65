/* The safetensors file format (as written and read by Hugging Face's `safetensors` and
 * PyTorch tools): an 8-byte little-endian header length N, N bytes of a JSON object, then
 * the tensor data. Each JSON key except "__metadata__" names a tensor:
 *   {"dtype": "F32", "shape": [out, in], "data_offsets": [begin, end]}
 * with offsets relative to the start of the data; "__metadata__" maps strings to strings.
 * Tensors are little-endian and row-major.
 *
 * The reader validates everything before anyone looks at a tensor: header length within the
 * file, a JSON object, known dtypes, shapes of non-negative extents, offsets inside the data,
 * byte lengths equal to numel x dtype size, tensors neither overlapping nor leaving gaps, no
 * duplicate names, metadata values that are strings. */
#ifndef BIE_TOOL_SAFETENSORS_H
#define BIE_TOOL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "bie.h"

#define ST_MAX_DIMS 8
/* Headers larger than this are refused (the reference implementation's limit). */
#define ST_MAX_HEADER_BYTES (100u << 20)

typedef enum st_dtype {
    ST_BOOL,
    ST_U8,
    ST_I8,
    ST_U16,
    ST_I16,
    ST_F16,
    ST_BF16,
    ST_U32,
    ST_I32,
    ST_F32,
    ST_U64,
    ST_I64,
    ST_F64,
    ST_DTYPE_COUNT
} st_dtype;

typedef struct st_tensor {
    const char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data; /* into the file's buffer */
    size_t nbytes;
} st_tensor;

typedef struct st_file {
    uint8_t *buffer; /* the whole file */
    size_t size;
    st_tensor *tensors; /* in data order */
    size_t count;
    const st_tensor **by_name; /* the tensors sorted by name (for st_find) */
    char **meta_keys;          /* __metadata__, in file order */
    char **meta_values;
    size_t meta_count;
    char *path;
} st_file;

/* "F32", "I8", ... */
const char *st_dtype_name(st_dtype dtype);
size_t st_dtype_size(st_dtype dtype);
/* The safetensors dtype of a bie dtype (F32, I8, U8, U32, U64, I32, BF16, F16); -1 if none. */
int st_dtype_from_bie(bie_dtype dtype);

/* Read and validate a file. Errors (-1, tool_error names the file and the problem): cannot
 * read, not a regular file (a directory, FIFO or device is refused before reading),
 * truncated, header length out of range, invalid JSON, any rule above broken.
 * *out is untouched on error. */
int st_read(const char *path, st_file *out);
/* st_read with a smaller limit on the header's length (at most ST_MAX_HEADER_BYTES). */
int st_read_max(const char *path, size_t max_header_bytes, st_file *out);
/* Validate a file image in memory; on success *out owns `buffer` (malloc'ed), on error the
 * caller still does. `name` is used in messages. */
int st_parse(uint8_t *buffer, size_t size, const char *name, st_file *out);
int st_parse_max(uint8_t *buffer, size_t size, const char *name, size_t max_header_bytes,
                 st_file *out);
void st_close(st_file *f);

/* The tensor called `name`, or NULL (a binary search). */
const st_tensor *st_find(const st_file *f, const char *name);
/* The tensor called `name` with the given dtype and shape (ndim extents); NULL with a
 * message (missing, wrong dtype, wrong shape) otherwise. */
const st_tensor *st_expect(const st_file *f, const char *name, st_dtype dtype, int ndim,
                           const int64_t *shape);
/* The metadata value of `key`, or NULL. */
const char *st_meta(const st_file *f, const char *key);

/* Writing: collect tensors (not copied: the data must live until st_writer_save) and
 * metadata, then write the file (to a temporary name, renamed into place when complete). */
typedef struct st_writer st_writer;
int st_writer_create(st_writer **out);
void st_writer_free(st_writer *w);
/* Errors: duplicate or empty name, "__metadata__", bad dtype, ndim > ST_MAX_DIMS, negative
 * extents, overflowing size. */
int st_writer_add(st_writer *w, const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                  const void *data);
/* Add a bie tensor (CPU, contiguous) under `name`. */
int st_writer_add_bie(st_writer *w, const char *name, const bie_tensor *t);
int st_writer_meta(st_writer *w, const char *key, const char *value);
/* Errors: cannot create or write the file. */
int st_writer_save(st_writer *w, const char *path);

#endif
