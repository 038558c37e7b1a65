/* Hostile input files must become clear errors within bounded time and memory: a FIFO
 * without a writer, /dev/zero and a directory given as a model or as images, gzip bombs
 * (a header claiming huge counts, a small header before a huge stream), a model
 * architecture with very many layers or too much metadata, and a file declaring a huge
 * layer without its tensors. Each case only asserts the error; none may hang or allocate
 * what the file does not hold. */
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "../test_util.h"
#include "errors.h"
#include "idx.h"
#include "model_io.h"
#include "safetensors.h"

static char dir[] = "/tmp/bie_test_hostile_XXXXXX";

static void expect_error(int rc, const char *what, const char *expect) {
    CHECK(rc == -1);
    bool found = rc == -1 && strstr(tool_error(), expect) != NULL;
    CHECK(found);
    if (!found)
        fprintf(stderr, "  %s: rc %d, message '%s' lacks '%s'\n", what, rc, tool_error(), expect);
}

/* Both readers refuse `path` with a message containing `expect`. */
static void expect_refused(const char *path, const char *expect) {
    loaded_model m;
    idx_array a;
    st_file f;
    expect_error(model_load(path, &m), path, expect);
    expect_error(idx_read_u8(path, 3, &a), path, expect);
    expect_error(st_read(path, &f), path, expect);
}

static void test_not_regular_files(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/fifo", dir);
    CHECK(mkfifo(path, 0600) == 0);
    expect_refused(path, "not a regular file (a FIFO)");
    unlink(path);
    expect_refused("/dev/zero", "not a regular file (a character device)");
    snprintf(path, sizeof path, "%s/folder", dir);
    CHECK(mkdir(path, 0700) == 0);
    expect_refused(path, "is a directory");
    rmdir(path);
}

/* An IDX header for [n, 28, 28] followed by `zeros` zero bytes, gzip-compressed. */
static void write_bomb(const char *path, uint32_t n, int64_t zeros) {
    uint8_t head[16] = {0,
                        0,
                        0x08,
                        3,
                        (uint8_t)(n >> 24),
                        (uint8_t)(n >> 16),
                        (uint8_t)(n >> 8),
                        (uint8_t)n,
                        0,
                        0,
                        0,
                        28,
                        0,
                        0,
                        0,
                        28};
    gzFile f = gzopen(path, "wb9");
    CHECK(f != NULL);
    if (!f) return;
    CHECK(gzwrite(f, head, sizeof head) == (int)sizeof head);
    enum { CHUNK = 1 << 20 };
    uint8_t *block = calloc(CHUNK, 1);
    for (int64_t done = 0; block && done < zeros; done += CHUNK) {
        unsigned n_bytes = (unsigned)(zeros - done < CHUNK ? zeros - done : CHUNK);
        CHECK(gzwrite(f, block, n_bytes) == (int)n_bytes);
    }
    free(block);
    CHECK(gzclose(f) == Z_OK);
}

static void test_gzip_bombs(void) {
    char path[256];
    idx_array a;
    snprintf(path, sizeof path, "%s/bomb-idx3-ubyte.gz", dir);
    /* 2^32 - 1 images claimed: refused from the header alone. */
    write_bomb(path, 0xffffffffu, 1 << 20);
    expect_error(idx_read_u8(path, 3, &a), "2^32 images", "too large");
    /* 1,000,000 images (784 MB, under the limit) claimed by a file of a few KB: more than its
     * stream can hold, refused before decompressing. */
    write_bomb(path, 1000000, 4 << 20);
    expect_error(idx_read_u8(path, 3, &a), "a million images", "more than a");
    /* 10 images claimed, 64 MB of zeros behind them: reading stops after the promised bytes. */
    write_bomb(path, 10, 64 << 20);
    expect_error(idx_read_u8(path, 3, &a), "trailing stream", "unexpected bytes after");
    /* The same stream cut short of the promise: truncated. */
    write_bomb(path, 100, 50 * 784);
    expect_error(idx_read_u8(path, 3, &a), "short stream", "truncated: 39200 of 78400");
    unlink(path);
}

/* A model file holding `tensors` (may be empty) and the metadata a model file needs, with
 * this architecture; `pad` bytes of an extra metadata note make the header larger. */
/* Tensor i has shape shapes[i * ndim .. (i + 1) * ndim). */
static void write_model(const char *path, const char *architecture, bool packed, size_t pad,
                        int n_tensors, const char *const *names, const st_dtype *dtypes, int ndim,
                        const int64_t *shapes, const void *const *data) {
    st_writer *w;
    CHECK(st_writer_create(&w) == 0);
    for (int i = 0; i < n_tensors; i++)
        CHECK(st_writer_add(w, names[i], dtypes[i], ndim, shapes + i * ndim, data[i]) == 0);
    char *note = tu_alloc(pad + 1);
    memset(note, 'x', pad);
    note[pad] = 0;
    CHECK(st_writer_meta(w, "format", MODEL_FORMAT) == 0 &&
          st_writer_meta(w, "format_version", MODEL_FORMAT_VERSION) == 0 &&
          st_writer_meta(w, "architecture", architecture) == 0 &&
          st_writer_meta(w, "input_shape", "[1, 28, 28]") == 0 &&
          st_writer_meta(w, "classes", "[\"a\", \"b\"]") == 0 &&
          st_writer_meta(w, "packed", packed ? "true" : "false") == 0 &&
          st_writer_meta(w, "note", note) == 0);
    CHECK(st_writer_save(w, path) == 0);
    st_writer_free(w);
    free(note);
}

static void test_model_limits(void) {
    char path[256];
    loaded_model m;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    /* Very many layers: a short architecture text, refused by the layer count. */
    enum { LAYERS = 5000 };
    const char *relu = "{\"type\":\"relu\"},";
    char *arch = tu_alloc(LAYERS * strlen(relu) + 2);
    char *p = arch;
    *p++ = '[';
    for (int i = 0; i < LAYERS; i++, p += strlen(relu)) memcpy(p, relu, strlen(relu));
    p[-1] = ']';
    *p = 0;
    write_model(path, arch, false, 0, 0, NULL, NULL, 0, NULL, NULL);
    expect_error(model_load(path, &m), "5000 layers", "5000 layers (at most 1024)");
    free(arch);
    /* An architecture text above its limit (spaces are valid JSON). */
    size_t big = MODEL_MAX_ARCHITECTURE_BYTES + 10;
    arch = tu_alloc(big + 1);
    memset(arch, ' ', big);
    memcpy(arch, "[{\"type\":\"relu\"}", 16);
    arch[big - 1] = ']';
    arch[big] = 0;
    write_model(path, arch, false, 0, 0, NULL, NULL, 0, NULL, NULL);
    expect_error(model_load(path, &m), "1 MiB architecture", "bytes (at most");
    free(arch);
    /* A header above the model files' limit. */
    write_model(path, "[{\"type\":\"relu\"}]", false, MODEL_MAX_HEADER_BYTES, 0, NULL, NULL, 0,
                NULL, NULL);
    expect_error(model_load(path, &m), "17 MiB header", "implausible");
    unlink(path);
}

static void test_layers_without_tensors(void) {
    char path[256];
    loaded_model m;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    /* 784 x 300,000 (940 MB of float weights) declared, no tensors: refused before building. */
    const char *huge = "[{\"type\":\"flatten\"},{\"type\":\"linear\",\"in\":784,\"out\":300000,"
                       "\"bias\":true}]";
    write_model(path, huge, false, 0, 0, NULL, NULL, 0, NULL, NULL);
    expect_error(model_load(path, &m), "784 x 300000, no tensors", "tensor '1.weight' is missing");
    /* The weight present but far smaller than declared. */
    static float small[4];
    const char *names[] = {"1.weight"};
    const st_dtype dtypes[] = {ST_F32};
    const int64_t shapes[][2] = {{2, 2}};
    const void *const data[] = {small};
    write_model(path, huge, false, 0, 1, names, dtypes, 2, &shapes[0][0], data);
    expect_error(model_load(path, &m), "784 x 300000, 4 weights",
                 "has 4 elements, architecture layer 1 (linear) needs 300000 x 784");
    /* A packed binary layer of 2^31 x 2^31 weights with a tiny qweight. */
    const char *packed = "[{\"type\":\"flatten\"},{\"type\":\"binary_linear\",\"in\":2147483648,"
                         "\"out\":2147483648,\"bits_binary_word\":8,\"symmetric\":true}]";
    const char *qnames[] = {"1.qweight"};
    const st_dtype qdtypes[] = {ST_U8};
    write_model(path, packed, true, 0, 1, qnames, qdtypes, 2, &shapes[0][0], data);
    expect_error(model_load(path, &m), "packed 2^31 x 2^31", "'1.qweight' is too small");
    /* A 3x3 conv of 36 bytes padded by 5,000: 100 million activations for one 28x28 image. */
    const char *padded = "[{\"type\":\"conv2d\",\"in\":1,\"out\":1,\"kernel_size\":3,"
                         "\"stride\":1,\"padding\":5000,\"dilation\":1}]";
    static float k9[9];
    const char *cnames[] = {"0.weight"};
    const int64_t cshape[4] = {1, 1, 3, 3};
    const void *const cdata[] = {k9};
    write_model(path, padded, false, 0, 1, cnames, dtypes, 4, cshape, cdata);
    expect_error(model_load(path, &m), "conv padded by 5000", "activations take");
    unlink(path);
}

int main(void) {
    if (!mkdtemp(dir)) return 2;
    test_not_regular_files();
    test_gzip_bombs();
    test_model_limits();
    test_layers_without_tensors();
    rmdir(dir);
    return tu_finish();
}
