/* safetensors reader and writer: round trips of random tensors of many dtypes and shapes,
 * and every kind of corrupt file rejected with a message (never a crash). */
#include <unistd.h>

#include "../test_util.h"
#include "errors.h"
#include "safetensors.h"

static char dir[] = "/tmp/bie_test_st_XXXXXX";

static uint8_t *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = tu_alloc((size_t)n);
    *size = fread(buf, 1, (size_t)n, f);
    fclose(f);
    return buf;
}

/* Build a file image: 8-byte length, header text, data bytes. */
static uint8_t *make_image(const char *header, size_t data_len, size_t *size) {
    size_t h = strlen(header);
    *size = 8 + h + data_len;
    uint8_t *buf = tu_alloc(*size);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, header, h);
    tu_fill_bytes(buf + 8 + h, (int64_t)data_len);
    return buf;
}

/* A hand-made header must be rejected and the message must mention `expect`. */
static void expect_rejected(const char *header, size_t data_len, const char *expect) {
    size_t size;
    uint8_t *buf = make_image(header, data_len, &size);
    st_file f;
    int rc = st_parse(buf, size, "case", &f);
    CHECK(rc == -1);
    if (rc == 0) {
        st_close(&f);
        return;
    }
    CHECK(strstr(tool_error(), expect) != NULL);
    if (!strstr(tool_error(), expect))
        fprintf(stderr, "  header %s: message '%s' lacks '%s'\n", header, tool_error(), expect);
    free(buf);
}

static void test_round_trip(uint64_t seed) {
    tu_seed(seed);
    char path[256];
    snprintf(path, sizeof path, "%s/round.safetensors", dir);
    enum { N = 6 };
    const st_dtype dtypes[N] = {ST_F32, ST_I8, ST_U8, ST_U64, ST_I32, ST_U32};
    int64_t shapes[N][3];
    int ndims[N];
    void *data[N];
    size_t bytes[N];
    st_writer *w;
    CHECK(st_writer_create(&w) == 0);
    for (int i = 0; i < N; i++) {
        ndims[i] = 1 + (int)(tu_next() % 3);
        int64_t numel = 1;
        for (int d = 0; d < ndims[i]; d++) {
            shapes[i][d] = 1 + (int64_t)(tu_next() % 13); /* odd sizes, extent 1 included */
            numel *= shapes[i][d];
        }
        bytes[i] = (size_t)numel * st_dtype_size(dtypes[i]);
        data[i] = tu_alloc(bytes[i]);
        tu_fill_bytes(data[i], (int64_t)bytes[i]);
        char name[32];
        snprintf(name, sizeof name, "layer.%d.t", i);
        CHECK(st_writer_add(w, name, dtypes[i], ndims[i], shapes[i], data[i]) == 0);
    }
    CHECK(st_writer_meta(w, "architecture", "[{\"type\":\"flatten\"}]") == 0);
    CHECK(st_writer_meta(w, "note", "quotes \" and \\ and \xc3\xa9") == 0);
    CHECK(st_writer_add(w, "layer.0.t", ST_F32, 1, shapes[0], data[0]) == -1); /* duplicate */
    CHECK(st_writer_add(w, "__metadata__", ST_F32, 1, shapes[0], data[0]) == -1);
    CHECK(st_writer_save(w, path) == 0);
    st_writer_free(w);

    st_file f;
    CHECK(st_read(path, &f) == 0);
    CHECK(f.count == N);
    for (int i = 0; i < N; i++) {
        char name[32];
        snprintf(name, sizeof name, "layer.%d.t", i);
        const st_tensor *t = st_expect(&f, name, dtypes[i], ndims[i], shapes[i]);
        CHECK(t != NULL);
        if (t) CHECK(t->nbytes == bytes[i] && memcmp(t->data, data[i], bytes[i]) == 0);
        /* Larger elements are laid out first, so each tensor is aligned to its size. */
        if (t) CHECK((size_t)((const uint8_t *)t->data - f.buffer) % st_dtype_size(dtypes[i]) == 0);
        free(data[i]);
    }
    CHECK(st_meta(&f, "note") && strcmp(st_meta(&f, "note"), "quotes \" and \\ and \xc3\xa9") == 0);
    CHECK(st_meta(&f, "missing") == NULL);
    CHECK(st_find(&f, "nope") == NULL);
    /* wrong dtype / shape are reported by st_expect */
    CHECK(st_expect(&f, "layer.0.t", ST_I8, ndims[0], shapes[0]) == NULL);
    CHECK(strstr(tool_error(), "dtype") != NULL);
    int64_t wrong[3] = {shapes[0][0] + 1, shapes[0][1], shapes[0][2]};
    CHECK(st_expect(&f, "layer.0.t", ST_F32, ndims[0], wrong) == NULL);
    CHECK(strstr(tool_error(), "shape") != NULL);

    /* Every truncation of the file is rejected. */
    size_t size = 0;
    uint8_t *whole = read_file(path, &size);
    CHECK(whole != NULL && size == f.size);
    for (size_t cut = 0; whole && cut < size; cut += 1 + cut / 16) {
        uint8_t *part = tu_alloc(cut);
        memcpy(part, whole, cut);
        st_file g;
        int rc = st_parse(part, cut, "cut", &g);
        CHECK(rc == -1);
        if (rc == 0) st_close(&g);
        free(part);
    }
    free(whole);
    st_close(&f);
    unlink(path);
}

int main(void) {
    if (!mkdtemp(dir)) return 2;
    for (uint64_t seed = 1; seed <= 5; seed++) test_round_trip(seed);

    /* a valid image first, to show the helper accepts good input */
    size_t size;
    uint8_t *ok = make_image("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                             "\"__metadata__\":{\"k\":\"v\"}}",
                             8, &size);
    st_file f;
    CHECK(st_parse(ok, size, "ok", &f) == 0);
    CHECK(f.count == 1 && strcmp(st_meta(&f, "k"), "v") == 0);
    st_close(&f);

    /* one broken rule each */
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
                    "needs 12 bytes");
    expect_rejected("{\"a\":{\"dtype\":\"X9\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                    "unknown dtype");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8,
                    "past the end");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
                    "shape entries");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8,
                    "begin <= end");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}",
                    8, "overlaps");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
                    "unused bytes");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
                    "after the last");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8,
                    "invalid JSON");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                    8, "invalid JSON");
    expect_rejected("{\"__metadata__\":{\"k\":5}}", 0, "not a string");
    expect_rejected("{\"a\":[1,2]}", 0, "not a JSON object");
    expect_rejected("[1,2]", 0, "not a JSON object");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
                    "unknown field");
    expect_rejected(
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}", 8,
        "too large");
    expect_rejected("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
                    "[begin, end]");
    expect_rejected("{\"\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                    "empty name");

    /* header length beyond the file, and implausibly large */
    uint8_t small[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    CHECK(st_parse(small, sizeof small, "len", &f) == -1 && strstr(tool_error(), "truncated"));
    uint8_t huge[16] = {0, 0, 0, 0, 0, 0, 0, 1, '{', '}'};
    CHECK(st_parse(huge, sizeof huge, "huge", &f) == -1 && strstr(tool_error(), "implausible"));
    CHECK(st_read("/nonexistent/model.safetensors", &f) == -1 &&
          strstr(tool_error(), "cannot open"));
    rmdir(dir);
    return tu_finish();
}
