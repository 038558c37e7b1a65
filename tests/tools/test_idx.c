/* IDX reader (plain and gzip), corrupt and truncated files, the Fashion-MNIST loader's
 * messages, and the seeded shuffle. */
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "../test_util.h"
#include "dataset.h"
#include "errors.h"
#include "idx.h"

static char dir[] = "/tmp/bie_test_idx_XXXXXX";

/* An IDX image of unsigned bytes with random contents. */
static uint8_t *make_idx(int ndim, const int64_t *dims, size_t *size) {
    size_t count = 1;
    for (int d = 0; d < ndim; d++) count *= (size_t)dims[d];
    *size = 4 + 4 * (size_t)ndim + count;
    uint8_t *buf = tu_alloc(*size);
    buf[0] = 0;
    buf[1] = 0;
    buf[2] = 0x08;
    buf[3] = (uint8_t)ndim;
    for (int d = 0; d < ndim; d++)
        for (int b = 0; b < 4; b++) buf[4 + 4 * d + b] = (uint8_t)(dims[d] >> (24 - 8 * b));
    tu_fill_bytes(buf + 4 + 4 * ndim, (int64_t)count);
    return buf;
}

static void write_plain(const char *path, const uint8_t *buf, size_t size) {
    FILE *f = fopen(path, "wb");
    fwrite(buf, 1, size, f);
    fclose(f);
}

static void write_gz(const char *path, const uint8_t *buf, size_t size) {
    gzFile f = gzopen(path, "wb");
    gzwrite(f, buf, (unsigned)size);
    gzclose(f);
}

static uint8_t *slurp(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = tu_alloc(*size);
    CHECK(fread(buf, 1, *size, f) == *size);
    fclose(f);
    return buf;
}

static void test_round_trips(void) {
    char path[256];
    for (int trial = 0; trial < 6; trial++) {
        int64_t dims[3] = {1 + (int64_t)(tu_next() % 9), 1 + (int64_t)(tu_next() % 31),
                           1 + (int64_t)(tu_next() % 31)};
        int ndim = 1 + trial % 3;
        size_t size;
        uint8_t *img = make_idx(ndim, dims, &size);
        for (int gz = 0; gz < 2; gz++) {
            snprintf(path, sizeof path, "%s/a%d.idx%s", dir, trial, gz ? ".gz" : "");
            (gz ? write_gz : write_plain)(path, img, size);
            idx_array a;
            CHECK(idx_read_u8(path, ndim, &a) == 0);
            CHECK(a.ndim == ndim);
            size_t count = 1;
            for (int d = 0; d < ndim; d++) {
                CHECK(a.dims[d] == dims[d]);
                count *= (size_t)dims[d];
            }
            CHECK(memcmp(a.data, img + 4 + 4 * ndim, count) == 0);
            idx_free(&a);
            CHECK(idx_read_u8(path, ndim + 1, &a) == -1 && strstr(tool_error(), "dimensions"));
        }
        free(img);
    }
}

static void test_corrupt(void) {
    char path[256];
    int64_t dims[3] = {7, 28, 28};
    size_t size;
    uint8_t *img = make_idx(3, dims, &size);
    idx_array a;
    /* truncated data, trailing data, bad magic, bad type: in memory */
    CHECK(idx_parse_u8(img, (int64_t)size - 1, 3, "m", &a) == -1 &&
          strstr(tool_error(), "truncated"));
    CHECK(idx_parse_u8(img, 10, 3, "m", &a) == -1 && strstr(tool_error(), "truncated"));
    uint8_t *longer = tu_alloc(size + 3);
    memcpy(longer, img, size);
    CHECK(idx_parse_u8(longer, (int64_t)size + 3, 3, "m", &a) == -1 &&
          strstr(tool_error(), "unexpected bytes"));
    free(longer);
    img[0] = 1;
    CHECK(idx_parse_u8(img, (int64_t)size, 3, "m", &a) == -1 && strstr(tool_error(), "magic"));
    img[0] = 0;
    img[2] = 0x0d; /* float */
    CHECK(idx_parse_u8(img, (int64_t)size, 3, "m", &a) == -1 && strstr(tool_error(), "type"));
    img[2] = 0x08;

    /* a gzip file cut short, and one with flipped bytes inside the compressed stream */
    snprintf(path, sizeof path, "%s/c.idx.gz", dir);
    write_gz(path, img, size);
    size_t gsize;
    uint8_t *gz = slurp(path, &gsize);
    for (size_t cut = 12; cut < gsize; cut += gsize / 7) {
        write_plain(path, gz, cut);
        CHECK(idx_read_u8(path, 3, &a) == -1);
        CHECK(strstr(tool_error(), "truncated") != NULL || strstr(tool_error(), "corrupt") != NULL);
    }
    gz[gsize / 2] ^= 0x5a;
    gz[gsize / 2 + 1] ^= 0xa5;
    write_plain(path, gz, gsize);
    CHECK(idx_read_u8(path, 3, &a) == -1);
    free(gz);
    free(img);
    unlink(path);
    CHECK(idx_read_u8("/nonexistent/x.idx", 3, &a) == -1 && strstr(tool_error(), "cannot open"));
}

static void test_loader_messages(void) {
    fmnist_set set;
    char empty[300];
    snprintf(empty, sizeof empty, "%s/empty", dir);
    mkdir(empty, 0700);
    CHECK(fmnist_load(empty, FMNIST_TRAIN, 0, &set) == -1);
    CHECK(strstr(tool_error(), "apt-get install dataset-fashion-mnist") != NULL);
    /* images that are not 28x28 */
    char path[400];
    int64_t dims[3] = {3, 27, 28};
    size_t size;
    uint8_t *img = make_idx(3, dims, &size);
    snprintf(path, sizeof path, "%s/t10k-images-idx3-ubyte", empty);
    write_plain(path, img, size);
    free(img);
    CHECK(fmnist_load(empty, FMNIST_TEST, 0, &set) == -1 && strstr(tool_error(), "28x28"));
    /* labels out of range and label count mismatch */
    dims[1] = 28;
    img = make_idx(3, dims, &size);
    write_plain(path, img, size);
    free(img);
    uint8_t labels[12] = {0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 9};
    snprintf(path, sizeof path, "%s/t10k-labels-idx1-ubyte", empty);
    write_plain(path, labels, 11);
    CHECK(fmnist_load(empty, FMNIST_TEST, 0, &set) == 0 && set.count == 3);
    if (set.count == 3) CHECK(set.labels[2] == 9 && isfinite(set.images[3 * 784 - 1]));
    fmnist_free(&set);
    CHECK(fmnist_load(empty, FMNIST_TEST, 2, &set) == 0 && set.count == 2);
    fmnist_free(&set);
    labels[10] = 10;
    write_plain(path, labels, 11);
    CHECK(fmnist_load(empty, FMNIST_TEST, 0, &set) == -1 && strstr(tool_error(), "expected 0..9"));
    labels[10] = 9;
    labels[7] = 4;
    write_plain(path, labels, 12);
    CHECK(fmnist_load(empty, FMNIST_TEST, 0, &set) == -1 && strstr(tool_error(), "labels for"));
    unlink(path);
    snprintf(path, sizeof path, "%s/t10k-images-idx3-ubyte", empty);
    unlink(path);
    rmdir(empty);
}

static void test_shuffle(void) {
    enum { N = 1001 };
    int64_t a[N], b[N];
    tool_rng r1 = {42}, r2 = {42}, r3 = {43};
    fmnist_shuffle(a, N, &r1);
    fmnist_shuffle(b, N, &r2);
    CHECK(memcmp(a, b, sizeof a) == 0); /* same seed, same order */
    fmnist_shuffle(b, N, &r3);
    CHECK(memcmp(a, b, sizeof a) != 0);
    int seen[N] = {0}, moved = 0;
    for (int i = 0; i < N; i++) {
        seen[a[i]]++;
        moved += a[i] != i;
    }
    int perm = 1;
    for (int i = 0; i < N; i++) perm &= seen[i] == 1;
    CHECK(perm);
    CHECK(moved > N / 2);
    for (uint64_t bound = 1; bound < 50; bound += 7) CHECK(tool_rng_below(&r1, bound) < bound);
}

int main(void) {
    if (!mkdtemp(dir)) return 2;
    tu_seed(7);
    test_round_trips();
    test_corrupt();
    test_loader_messages();
    test_shuffle();
    char path[256];
    for (int i = 0; i < 6; i++) {
        snprintf(path, sizeof path, "%s/a%d.idx", dir, i);
        unlink(path);
        snprintf(path, sizeof path, "%s/a%d.idx.gz", dir, i);
        unlink(path);
    }
    rmdir(dir);
    return tu_finish();
}
