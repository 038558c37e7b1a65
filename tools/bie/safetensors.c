#include "safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "file_read.h"

static const struct {
    const char *name;
    size_t size;
} dtype_table[ST_DTYPE_COUNT] = {
    [ST_BOOL] = {"BOOL", 1}, [ST_U8] = {"U8", 1},   [ST_I8] = {"I8", 1},     [ST_U16] = {"U16", 2},
    [ST_I16] = {"I16", 2},   [ST_F16] = {"F16", 2}, [ST_BF16] = {"BF16", 2}, [ST_U32] = {"U32", 4},
    [ST_I32] = {"I32", 4},   [ST_F32] = {"F32", 4}, [ST_U64] = {"U64", 8},   [ST_I64] = {"I64", 8},
    [ST_F64] = {"F64", 8},
};

const char *st_dtype_name(st_dtype dtype) {
    return (unsigned)dtype < ST_DTYPE_COUNT ? dtype_table[dtype].name : "?";
}

size_t st_dtype_size(st_dtype dtype) {
    return (unsigned)dtype < ST_DTYPE_COUNT ? dtype_table[dtype].size : 0;
}

int st_dtype_from_bie(bie_dtype dtype) {
    switch (dtype) {
    case BIE_F32: return ST_F32;
    case BIE_BF16: return ST_BF16;
    case BIE_F16: return ST_F16;
    case BIE_I8: return ST_I8;
    case BIE_U8: return ST_U8;
    case BIE_U32: return ST_U32;
    case BIE_U64: return ST_U64;
    case BIE_I32: return ST_I32;
    case BIE_F64: return ST_F64;
    }
    return -1;
}

static int dtype_from_name(const char *name) {
    for (int d = 0; d < ST_DTYPE_COUNT; d++)
        if (strcmp(name, dtype_table[d].name) == 0) return d;
    return -1;
}

/* ------------------------------------------------------------------ reading */

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && used < cap; d++)
        used +=
            (size_t)snprintf(buf + used, cap - used, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (used < cap) snprintf(buf + used, cap - used, "]");
}

/* A JSON integer >= 0, or -1. */
static int64_t json_nonnegative(const json_t *v) {
    if (!json_is_integer(v)) return -1;
    json_int_t i = json_integer_value(v);
    return i < 0 ? -1 : (int64_t)i;
}

static int parse_tensor_entry(const char *file, const char *name, json_t *entry, size_t data_size,
                              st_tensor *t) {
    if (!json_is_object(entry))
        return tool_fail("%s: tensor '%s': entry is not a JSON object", file, name);
    const char *allowed[] = {"dtype", "shape", "data_offsets"};
    const char *key;
    json_t *value;
    json_object_foreach(entry, key, value) {
        int known = 0;
        for (int i = 0; i < 3; i++) known |= strcmp(key, allowed[i]) == 0;
        if (!known) return tool_fail("%s: tensor '%s': unknown field '%s'", file, name, key);
    }
    json_t *dtype = json_object_get(entry, "dtype");
    json_t *shape = json_object_get(entry, "shape");
    json_t *offsets = json_object_get(entry, "data_offsets");
    if (!json_is_string(dtype) || !json_is_array(shape) || !json_is_array(offsets))
        return tool_fail("%s: tensor '%s': needs string 'dtype', array 'shape' and array "
                         "'data_offsets'",
                         file, name);
    int d = dtype_from_name(json_string_value(dtype));
    if (d < 0)
        return tool_fail("%s: tensor '%s': unknown dtype '%s'", file, name,
                         json_string_value(dtype));
    t->name = name;
    t->dtype = (st_dtype)d;
    size_t rank = json_array_size(shape);
    if (rank > ST_MAX_DIMS)
        return tool_fail("%s: tensor '%s': %zu dimensions (at most %d)", file, name, rank,
                         ST_MAX_DIMS);
    t->ndim = (int)rank;
    int64_t numel = 1;
    for (size_t i = 0; i < rank; i++) {
        int64_t e = json_nonnegative(json_array_get(shape, i));
        if (e < 0)
            return tool_fail("%s: tensor '%s': shape entries must be integers >= 0", file, name);
        t->shape[i] = e;
        if (__builtin_mul_overflow(numel, e, &numel))
            return tool_fail("%s: tensor '%s': shape too large", file, name);
    }
    if (json_array_size(offsets) != 2)
        return tool_fail("%s: tensor '%s': data_offsets must be [begin, end]", file, name);
    int64_t begin = json_nonnegative(json_array_get(offsets, 0));
    int64_t end = json_nonnegative(json_array_get(offsets, 1));
    if (begin < 0 || end < 0 || begin > end)
        return tool_fail("%s: tensor '%s': data_offsets must be integers 0 <= begin <= end", file,
                         name);
    if ((uint64_t)end > data_size)
        return tool_fail("%s: tensor '%s': data_offsets [%lld, %lld] past the end of the data "
                         "(%zu bytes; file truncated?)",
                         file, name, (long long)begin, (long long)end, data_size);
    int64_t expected;
    if (__builtin_mul_overflow(numel, (int64_t)st_dtype_size(t->dtype), &expected) ||
        expected != end - begin) {
        char s[160];
        format_shape(s, sizeof s, t->ndim, t->shape);
        return tool_fail("%s: tensor '%s': %s %s needs %lld bytes but data_offsets span %lld", file,
                         name, st_dtype_name(t->dtype), s, (long long)expected,
                         (long long)(end - begin));
    }
    t->data = (const void *)(uintptr_t)begin; /* made absolute once the data start is known */
    t->nbytes = (size_t)(end - begin);
    return 0;
}

static int parse_metadata(const char *file, json_t *meta, st_file *f) {
    if (!json_is_object(meta)) return tool_fail("%s: __metadata__ is not a JSON object", file);
    size_t n = json_object_size(meta);
    f->meta_keys = calloc(n ? n : 1, sizeof(char *));
    f->meta_values = calloc(n ? n : 1, sizeof(char *));
    if (!f->meta_keys || !f->meta_values) return tool_fail("%s: out of memory", file);
    const char *key;
    json_t *value;
    json_object_foreach(meta, key, value) {
        if (!json_is_string(value))
            return tool_fail("%s: __metadata__ value of '%s' is not a string", file, key);
        f->meta_keys[f->meta_count] = strdup(key);
        f->meta_values[f->meta_count] = strdup(json_string_value(value));
        f->meta_count++;
        if (!f->meta_keys[f->meta_count - 1] || !f->meta_values[f->meta_count - 1])
            return tool_fail("%s: out of memory", file);
    }
    return 0;
}

static int compare_offsets(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const st_tensor *)a)->data;
    uintptr_t y = (uintptr_t)((const st_tensor *)b)->data;
    return x < y ? -1 : x > y;
}

/* Tensors must tile the data exactly: sorted by offset, each starts where the last ended. */
static int check_layout(const char *file, st_file *f, size_t data_size) {
    qsort(f->tensors, f->count, sizeof *f->tensors, compare_offsets);
    size_t expected = 0;
    for (size_t i = 0; i < f->count; i++) {
        size_t begin = (size_t)(uintptr_t)f->tensors[i].data;
        if (begin < expected)
            return tool_fail("%s: tensor '%s' overlaps the tensor before it", file,
                             f->tensors[i].name);
        if (begin > expected)
            return tool_fail("%s: %zu unused bytes before tensor '%s'", file, begin - expected,
                             f->tensors[i].name);
        expected = begin + f->tensors[i].nbytes;
    }
    if (expected != data_size)
        return tool_fail("%s: %zu bytes after the last tensor (expected %zu bytes of data)", file,
                         data_size - expected, expected);
    return 0;
}

/* Free what parsing allocated (not the buffer). */
static void free_parsed(st_file *f) {
    for (size_t i = 0; i < f->meta_count; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->meta_keys);
    free(f->meta_values);
    for (size_t i = 0; i < f->count; i++) free((char *)f->tensors[i].name);
    free(f->tensors);
    free(f->by_name);
    free(f->path);
}

static int compare_names(const void *a, const void *b) {
    return strcmp((*(const st_tensor *const *)a)->name, (*(const st_tensor *const *)b)->name);
}

static int index_names(const char *name, st_file *f) {
    f->by_name = malloc((f->count ? f->count : 1) * sizeof *f->by_name);
    if (!f->by_name) return tool_fail("%s: out of memory", name);
    for (size_t i = 0; i < f->count; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, f->count, sizeof *f->by_name, compare_names);
    return 0;
}

static int parse_header(const char *name, json_t *root, size_t data_size, st_file *f) {
    size_t entries = json_object_size(root);
    f->tensors = calloc(entries ? entries : 1, sizeof *f->tensors);
    if (!f->tensors) return tool_fail("%s: out of memory", name);
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        if (strcmp(key, "__metadata__") == 0) {
            TOOL_TRY(parse_metadata(name, value, f));
            continue;
        }
        if (!*key) return tool_fail("%s: a tensor has an empty name", name);
        char *owned = strdup(key);
        if (!owned) return tool_fail("%s: out of memory", name);
        f->tensors[f->count].name = owned;
        f->count++;
        TOOL_TRY(parse_tensor_entry(name, owned, value, data_size, &f->tensors[f->count - 1]));
    }
    TOOL_TRY(check_layout(name, f, data_size));
    return index_names(name, f);
}

int st_parse(uint8_t *buffer, size_t size, const char *name, st_file *out) {
    return st_parse_max(buffer, size, name, ST_MAX_HEADER_BYTES, out);
}

int st_parse_max(uint8_t *buffer, size_t size, const char *name, size_t max_header_bytes,
                 st_file *out) {
    if (max_header_bytes > ST_MAX_HEADER_BYTES) max_header_bytes = ST_MAX_HEADER_BYTES;
    if (size < 8)
        return tool_fail("%s: not a safetensors file (%zu bytes; truncated?)", name, size);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--) header_len = header_len << 8 | buffer[i];
    if (header_len > max_header_bytes)
        return tool_fail("%s: header length %llu is implausible (above the limit of %zu "
                         "bytes; not a safetensors file?)",
                         name, (unsigned long long)header_len, max_header_bytes);
    if (header_len > size - 8)
        return tool_fail("%s: truncated: the header needs %llu bytes, the file has %zu", name,
                         (unsigned long long)header_len, size - 8);
    if (header_len < 2 || buffer[8] != '{')
        return tool_fail("%s: the header is not a JSON object (not a safetensors file?)", name);
    json_error_t err;
    json_t *root =
        json_loadb((const char *)buffer + 8, (size_t)header_len, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return tool_fail("%s: invalid JSON header at byte %d: %s", name, err.position, err.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return tool_fail("%s: the header is not a JSON object", name);
    }
    st_file f = {.buffer = buffer, .size = size};
    size_t data_start = 8 + (size_t)header_len;
    int status = parse_header(name, root, size - data_start, &f);
    json_decref(root);
    if (status == 0) f.path = strdup(name);
    if (status != 0 || !f.path) {
        free_parsed(&f);
        return status != 0 ? -1 : tool_fail("%s: out of memory", name);
    }
    for (size_t i = 0; i < f.count; i++)
        f.tensors[i].data = buffer + data_start + (size_t)(uintptr_t)f.tensors[i].data;
    *out = f;
    return 0;
}

int st_read(const char *path, st_file *out) { return st_read_max(path, ST_MAX_HEADER_BYTES, out); }

int st_read_max(const char *path, size_t max_header_bytes, st_file *out) {
    uint8_t *buf;
    size_t size;
    TOOL_TRY(tool_read_regular(path, INT64_MAX, &buf, &size));
    int status = st_parse_max(buf, size, path, max_header_bytes, out);
    if (status != 0) free(buf);
    return status;
}

void st_close(st_file *f) {
    if (!f) return;
    free_parsed(f);
    free(f->buffer);
    memset(f, 0, sizeof *f);
}

const st_tensor *st_find(const st_file *f, const char *name) {
    size_t lo = 0, hi = f->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_tensor *t = f->by_name[mid];
        int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const st_tensor *st_expect(const st_file *f, const char *name, st_dtype dtype, int ndim,
                           const int64_t *shape) {
    const st_tensor *t = st_find(f, name);
    if (!t) {
        tool_fail("%s: tensor '%s' is missing", f->path, name);
        return NULL;
    }
    if (t->dtype != dtype) {
        tool_fail("%s: tensor '%s' has dtype %s, expected %s", f->path, name,
                  st_dtype_name(t->dtype), st_dtype_name(dtype));
        return NULL;
    }
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char got[160], want[160];
        format_shape(got, sizeof got, t->ndim, t->shape);
        format_shape(want, sizeof want, ndim, shape);
        tool_fail("%s: tensor '%s' has shape %s, expected %s", f->path, name, got, want);
        return NULL;
    }
    return t;
}

const char *st_meta(const st_file *f, const char *key) {
    for (size_t i = 0; i < f->meta_count; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
    return NULL;
}
