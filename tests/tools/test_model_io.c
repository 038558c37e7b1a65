/* Model files: save -> load gives bit-identical outputs (trained and packed models, both
 * presets and first/last kinds), packing keeps the outputs, and files with a wrong dtype,
 * shape, missing or extra tensor, or bad metadata are rejected with a clear message.
 * Needs no data set: inputs are random. */
#include <unistd.h>

#include "../test_util.h"
#include "errors.h"
#include "model_io.h"
#include "safetensors.h"

enum { BATCH = 5 };
static char dir[] = "/tmp/bie_test_model_XXXXXX";

/* Eval-mode logits of the model on x [BATCH, 1, 28, 28] into out [BATCH, 10]. */
static int logits(bie_model *m, float *x, float *out) {
    bie_tensor tx = tu_view(x, BIE_F32, 4, BATCH, 1, 28, 28), y;
    if (bie_model_set_training(m, false) != BIE_OK || bie_model_forward(m, &tx, &y) != BIE_OK) {
        fprintf(stderr, "forward: %s\n", bie_last_error());
        return -1;
    }
    memcpy(out, y.data, BATCH * 10 * sizeof(float));
    return 0;
}

/* A few training steps on random data so every parameter and statistic moves. */
static void train_a_little(bie_model *m, float *x) {
    bie_optimizer *opt;
    CHECK_OK(bie_optimizer_create(&opt, m, NULL));
    int32_t labels[BATCH];
    float grad[BATCH * 10];
    for (int i = 0; i < BATCH; i++) labels[i] = (int32_t)(tu_next() % 10);
    for (int step = 0; step < 3; step++) {
        bie_tensor tx = tu_view(x, BIE_F32, 4, BATCH, 1, 28, 28), y;
        bie_tensor tl = tu_view(labels, BIE_I32, 1, BATCH, 0, 0, 0);
        bie_tensor tg = tu_view(grad, BIE_F32, 2, BATCH, 10, 0, 0);
        float loss;
        CHECK_OK(bie_model_set_training(m, true));
        CHECK_OK(bie_model_forward(m, &tx, &y));
        CHECK_OK(bie_softmax_cross_entropy(&y, &tl, &loss, &tg));
        CHECK_OK(bie_model_backward(m, &tg, NULL));
        CHECK_OK(bie_optimizer_step(opt, NULL));
    }
    bie_optimizer_free(opt);
}

static void check_load_equal(const char *path, const float *x, const float *expect, bool packed) {
    loaded_model lm;
    int rc = model_load(path, &lm);
    CHECK(rc == 0);
    if (rc != 0) {
        fprintf(stderr, "load %s: %s\n", path, tool_error());
        return;
    }
    float out[BATCH * 10];
    tu_poison(out, BATCH * 10);
    CHECK(lm.packed == packed && lm.classes == 10 && lm.input_ndim == 3);
    CHECK(logits(lm.model, (float *)x, out) == 0);
    CHECK(tu_same_bits(out, expect, BATCH * 10));
    loaded_model_free(&lm);
}

static void test_round_trip(const char *preset, const char *first_last, int64_t width) {
    preset_config pc = {preset, first_last, width, 0};
    bie_model *m;
    CHECK(preset_build(&pc, &m) == 0);
    CHECK_OK(bie_model_reset_parameters(m, tu_next()));
    CHECK_OK(bie_model_prepare_params(m));
    float *x = tu_alloc(BATCH * 784 * sizeof(float));
    tu_fill(x, BATCH * 784, -1.5f, 2.5f);
    train_a_little(m, x);
    float ref[BATCH * 10], packed_out[BATCH * 10];
    CHECK(logits(m, x, ref) == 0);
    char path[256], packed_path[256];
    snprintf(path, sizeof path, "%s/%s_%s.safetensors", dir, preset, first_last);
    snprintf(packed_path, sizeof packed_path, "%s/%s_%s_packed.safetensors", dir, preset,
             first_last);
    const model_note notes[] = {{"preset", preset}, {"packed", "bogus: fixed keys win"}};
    CHECK(model_save(m, path, notes, 2) == 0);
    check_load_equal(path, x, ref, false);

    /* packing keeps the eval-mode outputs bit for bit, and so does its file */
    int64_t stored, as_float;
    CHECK_OK(bie_model_pack(m));
    tu_poison(packed_out, BATCH * 10);
    CHECK(logits(m, x, packed_out) == 0);
    CHECK(tu_same_bits(packed_out, ref, BATCH * 10));
    CHECK(model_binary_weight_bytes(m, &stored, &as_float) == 0);
    CHECK(stored > 0 && as_float >= 25 * stored);
    CHECK(model_save(m, packed_path, NULL, 0) == 0);
    check_load_equal(packed_path, x, ref, true);
    bie_model_free(m);
    free(x);
}

/* Rewrite `src` with one change, then expect model_load to fail mentioning `expect`. */
typedef enum change {
    DROP_TENSOR,
    EXTRA_TENSOR,
    WRONG_DTYPE,
    WRONG_SHAPE,
    BAD_ARCH,
    BAD_FORMAT,
    NAN_SCALE,
    ARCH_TEXT /* the architecture becomes arch_text */
} change;

static const char *arch_text;

static void expect_bad(const char *src, change what, const char *expect) {
    st_file f;
    if (st_read(src, &f) != 0) {
        CHECK(0);
        return;
    }
    char path[256];
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    st_writer *w;
    CHECK(st_writer_create(&w) == 0);
    static float extra[3] = {1, 2, 3}, nan_scale[1];
    nan_scale[0] = NAN;
    bool changed = false;
    for (size_t i = 0; i < f.count; i++) {
        const st_tensor *t = &f.tensors[i];
        int64_t shape[ST_MAX_DIMS];
        memcpy(shape, t->shape, sizeof shape);
        st_dtype dtype = t->dtype;
        if (!changed && what == DROP_TENSOR && strstr(t->name, "bias_a")) {
            changed = true;
            continue;
        }
        if (!changed && what == WRONG_DTYPE && t->dtype == ST_F32 && t->nbytes % 8 == 0 &&
            strstr(t->name, "running_var")) {
            dtype = ST_I32;
            changed = true;
        }
        if (!changed && what == WRONG_SHAPE && t->ndim == 2 && t->shape[0] % 2 == 0) {
            shape[0] /= 2;
            shape[1] *= 2;
            changed = true;
        }
        if (!changed && what == NAN_SCALE && strstr(t->name, "scale_a")) {
            CHECK(st_writer_add(w, t->name, ST_F32, 1, shape, nan_scale) == 0);
            changed = true;
            continue;
        }
        CHECK(st_writer_add(w, t->name, dtype, t->ndim, shape, t->data) == 0);
    }
    if (what == EXTRA_TENSOR) {
        int64_t n = 3;
        CHECK(st_writer_add(w, "99.weight", ST_F32, 1, &n, extra) == 0);
    }
    for (size_t i = 0; i < f.meta_count; i++) {
        const char *value = f.meta_values[i];
        if (what == BAD_ARCH && strcmp(f.meta_keys[i], "architecture") == 0)
            value = "[{\"type\":\"binary_linear\",\"in\":\"many\"}]";
        if (what == ARCH_TEXT && strcmp(f.meta_keys[i], "architecture") == 0) value = arch_text;
        if (what == BAD_FORMAT && strcmp(f.meta_keys[i], "format") == 0) value = "other";
        CHECK(st_writer_meta(w, f.meta_keys[i], value) == 0);
    }
    CHECK(st_writer_save(w, path) == 0);
    st_writer_free(w);
    st_close(&f);
    loaded_model lm;
    int rc = model_load(path, &lm);
    CHECK(rc == -1);
    if (rc == 0) {
        loaded_model_free(&lm);
        fprintf(stderr, "  change %d was accepted\n", (int)what);
    } else if (!strstr(tool_error(), expect)) {
        CHECK(0);
        fprintf(stderr, "  change %d: message '%s' lacks '%s'\n", (int)what, tool_error(), expect);
    }
    unlink(path);
}

int main(void) {
    if (!mkdtemp(dir)) return 2;
    bie_set_num_threads(2);
    tu_seed(11);
    test_round_trip("mlp", "float", 40);
    test_round_trip("mlp", "q4", 33);
    test_round_trip("cnn", "float", 4);
    test_round_trip("cnn", "q4", 3);
    test_round_trip("resnet", "float", 4);
    test_round_trip("resnet", "q4", 3);

    char path[256];
    snprintf(path, sizeof path, "%s/cnn_float.safetensors", dir);
    expect_bad(path, DROP_TENSOR, "is missing");
    expect_bad(path, EXTRA_TENSOR, "unexpected tensor '99.weight'");
    expect_bad(path, WRONG_DTYPE, "dtype I32, expected F32");
    expect_bad(path, WRONG_SHAPE, "has shape");
    expect_bad(path, BAD_ARCH, "'in' must be an integer");
    expect_bad(path, BAD_FORMAT, "not a bie model file");
    expect_bad(path, NAN_SCALE, "scale_a");

    /* graphs: an input that is a later node or the node itself, a mismatched add */
    snprintf(path, sizeof path, "%s/resnet_float.safetensors", dir);
    arch_text = "[{\"type\":\"relu\",\"inputs\":[1]},{\"type\":\"relu\"}]";
    expect_bad(path, ARCH_TEXT, "not an earlier node");
    arch_text = "[{\"type\":\"relu\",\"inputs\":[0]}]";
    expect_bad(path, ARCH_TEXT, "not an earlier node");
    arch_text = "[{\"type\":\"relu\",\"inputs\":[-1,-1]}]";
    expect_bad(path, ARCH_TEXT, "takes exactly 1 inputs");
    arch_text = "[{\"type\":\"add\",\"inputs\":\"all\"}]";
    expect_bad(path, ARCH_TEXT, "'inputs' must be an array");
    arch_text = "[{\"type\":\"conv2d\",\"in\":1,\"out\":4,\"kernel_size\":3,\"stride\":2,"
                "\"padding\":1,\"dilation\":1},{\"type\":\"add\",\"inputs\":[0,-1]}]";
    expect_bad(path, ARCH_TEXT, "an add needs equal shapes");

    const char *names[] = {"mlp_float", "mlp_q4",       "cnn_float",
                           "cnn_q4",    "resnet_float", "resnet_q4"};
    for (int i = 0; i < 6; i++) {
        snprintf(path, sizeof path, "%s/%s.safetensors", dir, names[i]);
        unlink(path);
        snprintf(path, sizeof path, "%s/%s_packed.safetensors", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
    return tu_finish();
}
