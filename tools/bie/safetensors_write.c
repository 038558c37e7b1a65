/* Writing safetensors files (see safetensors.h). */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "safetensors.h"

typedef struct pending_tensor {
    char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
    size_t nbytes;
    size_t order; /* insertion order, to keep the sort stable */
} pending_tensor;

struct st_writer {
    pending_tensor *tensors;
    size_t count, cap;
    json_t *metadata;
};

int st_writer_create(st_writer **out) {
    st_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->metadata = json_object())) {
        free(w);
        return tool_fail("out of memory");
    }
    *out = w;
    return 0;
}

void st_writer_free(st_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->count; i++) free(w->tensors[i].name);
    free(w->tensors);
    json_decref(w->metadata);
    free(w);
}

int st_writer_add(st_writer *w, const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                  const void *data) {
    if (!name || !*name || strcmp(name, "__metadata__") == 0)
        return tool_fail("safetensors: invalid tensor name '%s'", name ? name : "(null)");
    if ((unsigned)dtype >= ST_DTYPE_COUNT) return tool_fail("safetensors: '%s': bad dtype", name);
    if (ndim < 0 || ndim > ST_MAX_DIMS)
        return tool_fail("safetensors: '%s': %d dimensions", name, ndim);
    for (size_t i = 0; i < w->count; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return tool_fail("safetensors: tensor '%s' added twice", name);
    int64_t bytes = (int64_t)st_dtype_size(dtype);
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0 || __builtin_mul_overflow(bytes, shape[d], &bytes))
            return tool_fail("safetensors: '%s': bad or too large shape", name);
    if (bytes > 0 && !data) return tool_fail("safetensors: '%s': no data", name);
    if (w->count == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 16;
        pending_tensor *grown = realloc(w->tensors, cap * sizeof *grown);
        if (!grown) return tool_fail("out of memory");
        w->tensors = grown;
        w->cap = cap;
    }
    pending_tensor t = {.name = strdup(name),
                        .dtype = dtype,
                        .ndim = ndim,
                        .data = data,
                        .nbytes = (size_t)bytes,
                        .order = w->count};
    if (!t.name) return tool_fail("out of memory");
    for (int d = 0; d < ndim; d++) t.shape[d] = shape[d];
    w->tensors[w->count++] = t;
    return 0;
}

int st_writer_add_bie(st_writer *w, const char *name, const bie_tensor *t) {
    int dtype = st_dtype_from_bie(t->dtype);
    if (dtype < 0)
        return tool_fail("safetensors: '%s': dtype %s has no safetensors name", name,
                         bie_dtype_name(t->dtype));
    if (t->device.type != BIE_DEVICE_CPU)
        return tool_fail("safetensors: '%s': tensor is not in CPU memory", name);
    return st_writer_add(w, name, (st_dtype)dtype, t->ndim, t->shape, t->data);
}

int st_writer_meta(st_writer *w, const char *key, const char *value) {
    json_t *s = json_string(value);
    if (!s) return tool_fail("safetensors: metadata '%s' is not valid UTF-8", key);
    if (json_object_set_new(w->metadata, key, s) != 0)
        return tool_fail("safetensors: cannot set metadata '%s'", key);
    return 0;
}

/* Larger elements first (then insertion order), so every tensor starts at an offset that is
 * a multiple of its element size, as the reference writer arranges. */
static int compare_for_layout(const void *a, const void *b) {
    const pending_tensor *x = a, *y = b;
    size_t sx = st_dtype_size(x->dtype), sy = st_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

static char *build_header(st_writer *w, size_t *len) {
    json_t *root = json_object();
    if (!root) return NULL;
    if (json_object_size(w->metadata) > 0) json_object_set(root, "__metadata__", w->metadata);
    size_t offset = 0;
    for (size_t i = 0; i < w->count; i++) {
        const pending_tensor *t = &w->tensors[i];
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_t *entry =
            json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_dtype_name(t->dtype), "shape", shape,
                      "data_offsets", (json_int_t)offset, (json_int_t)(offset + t->nbytes));
        if (!entry || json_object_set_new(root, t->name, entry) != 0) {
            json_decref(root);
            return NULL;
        }
        offset += t->nbytes;
    }
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!text) return NULL;
    /* Pad with spaces so the data starts 8-byte aligned. */
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    char *out = realloc(text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + n, ' ', padded - n);
    out[padded] = 0;
    *len = padded;
    return out;
}

int st_writer_save(st_writer *w, const char *path) {
    if (w->count) qsort(w->tensors, w->count, sizeof *w->tensors, compare_for_layout);
    size_t header_len;
    char *header = build_header(w, &header_len);
    if (!header) return tool_fail("safetensors: cannot build the header for %s", path);
    size_t tmp_len = strlen(path) + 16;
    char *tmp = malloc(tmp_len);
    if (!tmp) {
        free(header);
        return tool_fail("out of memory");
    }
    snprintf(tmp, tmp_len, "%s.partial", path);
    FILE *fp = fopen(tmp, "wb");
    int status = fp ? 0 : tool_fail("cannot create %s: %s", tmp, strerror(errno));
    if (status == 0) {
        uint8_t len_le[8];
        for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
        int ok = fwrite(len_le, 1, 8, fp) == 8 && fwrite(header, 1, header_len, fp) == header_len;
        for (size_t i = 0; ok && i < w->count; i++)
            ok = w->tensors[i].nbytes == 0 ||
                 fwrite(w->tensors[i].data, 1, w->tensors[i].nbytes, fp) == w->tensors[i].nbytes;
        if (fclose(fp) != 0) ok = 0;
        if (!ok) status = tool_fail("cannot write %s: %s", tmp, strerror(errno));
    }
    if (status == 0 && rename(tmp, path) != 0)
        status = tool_fail("cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (status != 0 && fp) remove(tmp);
    free(tmp);
    free(header);
    return status;
}
