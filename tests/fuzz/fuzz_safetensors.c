/* libFuzzer target: the safetensors reader (st_parse) on arbitrary bytes. A file it
 * accepts is then read through every accessor, touching every tensor byte, so a tensor
 * pointing outside the buffer is an AddressSanitizer report. */
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile unsigned sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    st_file f;
    if (st_parse(buf, size, "fuzz", &f) != 0) {
        free(buf);
        return 0;
    }
    unsigned sum = 0;
    for (size_t i = 0; i < f.count; i++) {
        const st_tensor *t = &f.tensors[i];
        if (st_find(&f, t->name) != t) abort();
        if (!st_expect(&f, t->name, t->dtype, t->ndim, t->shape)) abort();
        const uint8_t *p = t->data;
        for (size_t b = 0; b < t->nbytes; b++) sum += p[b];
    }
    for (size_t i = 0; i < f.meta_count; i++)
        if (st_meta(&f, f.meta_keys[i]) == NULL) abort();
    st_close(&f);
    sink = sum;
    return 0;
}
