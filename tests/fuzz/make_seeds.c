/* Writes the fuzz targets' seed corpora with the project's own writers: safetensors files
 * (st_writer), model files (model_save: small models of every layer type, trained form and
 * packed) and IDX files (plain and gzip-compressed, one and three dimensions).
 * Usage: make_seeds DIR  (creates DIR/safetensors, DIR/model, DIR/idx). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "errors.h"
#include "model_io.h"
#include "safetensors.h"

static const char *root;

static int fail(const char *what) {
    fprintf(stderr, "make_seeds: %s: %s\n", what, tool_error());
    return -1;
}

static void path_of(char *buf, size_t cap, const char *sub, const char *name) {
    snprintf(buf, cap, "%s/%s/%s", root, sub, name);
}

static int seed_safetensors(void) {
    static float f32[6] = {1, -2, 3.5f, 0, -0.25f, 8};
    static int8_t i8[4] = {-1, 1, 1, -1};
    static uint64_t u64[2] = {1, 0xffffffffffffffffull};
    static uint16_t bf16[3] = {0x3f80, 0xbf80, 0};
    int64_t s23[2] = {2, 3}, s4[1] = {4}, s2[1] = {2}, s3[1] = {3}, s0[2] = {0, 5};
    char path[4096];
    st_writer *w;
    if (st_writer_create(&w) != 0) return fail("st_writer_create");
    int rc = st_writer_add(w, "a.weight", ST_F32, 2, s23, f32) ||
             st_writer_add(w, "b", ST_I8, 1, s4, i8) || st_writer_add(w, "c", ST_U64, 1, s2, u64) ||
             st_writer_add(w, "d", ST_BF16, 1, s3, bf16) ||
             st_writer_add(w, "empty", ST_F32, 2, s0, f32) ||
             st_writer_add(w, "scalar", ST_F32, 0, NULL, f32) ||
             st_writer_meta(w, "format", "test") || st_writer_meta(w, "note", "x");
    path_of(path, sizeof path, "safetensors", "tensors.safetensors");
    if (rc == 0) rc = st_writer_save(w, path);
    st_writer_free(w);
    if (rc != 0) return fail("safetensors seed");
    if (st_writer_create(&w) != 0) return fail("st_writer_create");
    path_of(path, sizeof path, "safetensors", "empty.safetensors");
    rc = st_writer_save(w, path);
    st_writer_free(w);
    return rc ? fail("empty safetensors seed") : 0;
}

static bie_status add_low_bit(bie_model *m, bie_layer_type type, int64_t in, int64_t out, int k,
                              int padding, int word_bits) {
    bie_layer_info i;
    memset(&i, 0, sizeof i);
    i.type = type;
    i.in = in;
    i.out = out;
    i.symmetric = word_bits == 8;
    i.bits_binary_word = word_bits;
    if (k) {
        i.kernel_size = k;
        i.stride = 1;
        i.padding = padding;
        i.dilation = 1;
    }
    return bie_model_add_layer(m, &i);
}

/* A small MLP: every dense layer kind. */
static bie_status build_dense(bie_model *m) {
    bie_status s = bie_model_add_flatten(m);
    if (!s) s = add_low_bit(m, BIE_LAYER_Q4_LINEAR, 784, 4, 0, 0, 8);
    if (!s) s = bie_model_add_batchnorm1d(m, 4);
    if (!s) s = add_low_bit(m, BIE_LAYER_BINARY_LINEAR, 4, 6, 0, 0, 32);
    if (!s) s = bie_model_add_prelu(m, 6);
    if (!s) s = add_low_bit(m, BIE_LAYER_BINARY_LINEAR, 6, 3, 0, 0, 64);
    if (!s) s = bie_model_add_relu(m);
    if (!s) s = bie_model_add_prelu(m, 1);
    if (!s) s = bie_model_add_linear(m, 3, 10, true);
    return s;
}

/* A small CNN: every conv layer kind, max-pool, batch norm 2d. */
static bie_status build_conv(bie_model *m) {
    bie_status s = add_low_bit(m, BIE_LAYER_Q4_CONV2D, 1, 2, 3, 0, 8);
    if (!s) s = bie_model_add_maxpool2d(m, 2, 2);
    if (!s) s = bie_model_add_batchnorm2d(m, 2);
    if (!s) s = add_low_bit(m, BIE_LAYER_BINARY_CONV2D, 2, 2, 3, 1, 8);
    if (!s) s = bie_model_add_maxpool2d(m, 2, 2);
    if (!s) s = bie_model_add_flatten(m);
    if (!s) s = bie_model_add_linear(m, 2 * 6 * 6, 10, false);
    return s;
}

/* A small graph: every graph node type (float conv, RPReLU, binary conv with a residual add,
 * average pool + 1x1 conv shortcut, concat, global average pool) with explicit inputs. */
static bie_status build_graph(bie_model *m) {
    const int64_t sample[3] = {1, 28, 28};
    bie_status s = bie_model_set_input_shape(m, 3, sample);
    if (!s) s = bie_model_add_conv2d(m, 1, 4, 3, 2, 1, true);           /* 0: 14 x 14 */
    if (!s) s = bie_model_add_rprelu(m, 4);                             /* 1 */
    if (!s) s = add_low_bit(m, BIE_LAYER_BINARY_CONV2D, 4, 4, 3, 1, 8); /* 2 */
    bie_layer_info add = {.type = BIE_LAYER_ADD}, cat = {.type = BIE_LAYER_CONCAT};
    const int sum[2] = {2, 1};
    if (!s) s = bie_model_add_node(m, &add, 2, sum);           /* 3 */
    if (!s) s = bie_model_add_avgpool2d(m, 2, 2);              /* 4: 7 x 7 */
    if (!s) s = bie_model_add_conv2d(m, 4, 4, 1, 1, 0, false); /* 5 */
    if (!s) s = bie_model_add_avgpool2d(m, 2, 0);              /* 6: of 5, read by nobody */
    const int pooled[2] = {4, 5};
    if (!s) s = bie_model_add_node(m, &cat, 2, pooled); /* 7: 8 channels, 7 x 7 */
    if (!s) s = bie_model_add_global_avgpool(m);        /* 8 */
    if (!s) s = bie_model_add_linear(m, 8, 10, true);   /* 9 */
    return s;
}

static int seed_model(const char *name, bie_status (*build)(bie_model *), bool packed) {
    bie_model *m;
    char path[4096];
    if (bie_model_create(&m) != BIE_OK) return fail("bie_model_create");
    bie_status s = build(m);
    if (!s) s = bie_model_prepare_params(m);
    if (!s && packed) s = bie_model_pack(m);
    int rc = s == BIE_OK ? 0 : tool_fail_status(s, name);
    const model_note notes[] = {{"preset", name}, {"epochs", "1"}};
    path_of(path, sizeof path, "model", name);
    if (rc == 0) rc = model_save(m, path, notes, 2);
    /* The same model in the safetensors corpus: real headers to mutate. */
    path_of(path, sizeof path, "safetensors", name);
    if (rc == 0) rc = model_save(m, path, notes, 2);
    bie_model_free(m);
    return rc ? fail(name) : 0;
}

static int write_idx(const char *name, int ndim, const int64_t *dims, bool gz) {
    int64_t count = 1;
    uint8_t head[4 + 4 * 4] = {0, 0, 0x08, (uint8_t)ndim};
    for (int d = 0; d < ndim; d++) {
        count *= dims[d];
        for (int b = 0; b < 4; b++) head[4 + 4 * d + b] = (uint8_t)(dims[d] >> (24 - 8 * b));
    }
    uint8_t *data = malloc((size_t)count);
    if (!data) return -1;
    for (int64_t i = 0; i < count; i++) data[i] = (uint8_t)(i * 37 % 251 % (ndim == 1 ? 10 : 256));
    char path[4096];
    path_of(path, sizeof path, "idx", name);
    int rc = -1;
    if (gz) {
        gzFile f = gzopen(path, "wb9");
        if (f && gzwrite(f, head, 4 + 4 * (unsigned)ndim) > 0 &&
            gzwrite(f, data, (unsigned)count) > 0)
            rc = 0;
        if (f && gzclose(f) != Z_OK) rc = -1;
    } else {
        FILE *f = fopen(path, "wb");
        if (f && fwrite(head, 1, 4 + 4 * (size_t)ndim, f) == 4 + 4 * (size_t)ndim &&
            fwrite(data, 1, (size_t)count, f) == (size_t)count)
            rc = 0;
        if (f && fclose(f) != 0) rc = -1;
    }
    free(data);
    if (rc) fprintf(stderr, "make_seeds: cannot write %s\n", path);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: make_seeds DIR\n");
        return 2;
    }
    root = argv[1];
    char path[4096];
    const char *subs[] = {"", "/safetensors", "/model", "/idx"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s%s", root, subs[i]);
        mkdir(path, 0755);
    }
    const int64_t images[3] = {2, 28, 28}, small[3] = {2, 3, 2}, labels[1] = {7};
    int rc = seed_safetensors() || seed_model("dense.safetensors", build_dense, false) ||
             seed_model("dense-packed.safetensors", build_dense, true) ||
             seed_model("conv.safetensors", build_conv, false) ||
             seed_model("conv-packed.safetensors", build_conv, true) ||
             seed_model("graph.safetensors", build_graph, false) ||
             seed_model("graph-packed.safetensors", build_graph, true) ||
             write_idx("images-idx3-ubyte", 3, images, false) ||
             write_idx("images-idx3-ubyte.gz", 3, images, true) ||
             write_idx("small-idx3-ubyte", 3, small, false) ||
             write_idx("small-idx3-ubyte.gz", 3, small, true) ||
             write_idx("labels-idx1-ubyte", 1, labels, false) ||
             write_idx("labels-idx1-ubyte.gz", 1, labels, true);
    return rc ? 1 : 0;
}
