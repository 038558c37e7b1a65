/* libFuzzer target: the IDX reader on arbitrary bytes, in memory (idx_parse_u8) and as a
 * file (idx_read_u8, which reads plain and gzip-compressed files alike), with one and
 * three dimensions expected. The file is a memfd, reached through /proc/self/fd. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "idx.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int file_fd = -1;
static char file_path[64];

static void check(const idx_array *a) {
    int64_t count = 1;
    for (int d = 0; d < a->ndim; d++) count *= a->dims[d];
    unsigned sum = 0;
    for (int64_t i = 0; i < count; i++) sum += a->data[i]; /* every byte readable */
    (void)sum;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (file_fd < 0) {
        file_fd = memfd_create("bie-fuzz-idx", 0);
        if (file_fd < 0) abort();
        snprintf(file_path, sizeof file_path, "/proc/self/fd/%d", file_fd);
    }
    if (ftruncate(file_fd, 0) != 0) abort();
    if (size && pwrite(file_fd, data, size, 0) != (ssize_t)size) abort();
    static const int ranks[2] = {1, 3};
    for (int r = 0; r < 2; r++) {
        idx_array a;
        if (idx_parse_u8(data, (int64_t)size, ranks[r], "fuzz", &a) == 0) {
            check(&a);
            idx_free(&a);
        }
        if (idx_read_u8(file_path, ranks[r], &a) == 0) {
            check(&a);
            idx_free(&a);
        }
    }
    return 0;
}
