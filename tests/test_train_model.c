/* The sequential model with bie's low-bit layers: a small binary MLP and a small binary CNN
 * (4-bit first layer, binary conv, batch norm, PReLU, max-pool, flatten, binary linear,
 * float last layer): shapes, a few optimizer steps on a tiny synthetic problem reduce the
 * loss, runs reproduce bit for bit, evaluation equals packed inference exactly, parameters
 * have unique stable names and survive a save / rebuild / load round trip (float and
 * packed), and bad input is rejected without changing anything. */
#include "train/train_test_util.h"

typedef struct problem {
    int ndim;
    int64_t shape[4];
    int64_t classes;
    float *x;
    int32_t *labels;
} problem;

/* Class prototypes plus noise: learnable by any of the networks below. */
static problem make_problem(int ndim, const int64_t *shape, int64_t classes, uint64_t seed) {
    problem p;
    p.ndim = ndim;
    memcpy(p.shape, shape, sizeof p.shape);
    p.classes = classes;
    tu_seed(seed);
    const int64_t n = shape[0], per = ttu_numel(ndim, shape) / n;
    float *proto = tu_alloc((size_t)(classes * per) * 4);
    tu_fill(proto, classes * per, -1, 1);
    p.x = tu_alloc((size_t)(n * per) * 4);
    p.labels = tu_alloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) {
        p.labels[i] = (int32_t)(i % classes);
        for (int64_t j = 0; j < per; j++)
            p.x[i * per + j] = proto[p.labels[i] * per + j] + tu_uniform(-0.5f, 0.5f);
    }
    free(proto);
    return p;
}

static void free_problem(problem *p) {
    free(p->x);
    free(p->labels);
}

static void build_mlp(bie_model *m) {
    CHECK_OK(bie_model_add_flatten(m));
    CHECK_OK(ttu_add_q4_linear(m, 63, 32));
    CHECK_OK(bie_model_add_batchnorm1d(m, 32));
    CHECK_OK(ttu_add_binary_linear(m, 32, 24));
    CHECK_OK(bie_model_add_batchnorm1d(m, 24));
    CHECK_OK(ttu_add_binary_linear(m, 24, 16));
    CHECK_OK(bie_model_add_batchnorm1d(m, 16));
    CHECK_OK(bie_model_add_linear(m, 16, 4, true));
}

static void build_cnn(bie_model *m) {
    CHECK_OK(ttu_add_q4_conv2d(m, 3, 8, 3, 1, 1, 1));
    CHECK_OK(bie_model_add_batchnorm2d(m, 8));
    CHECK_OK(bie_model_add_prelu(m, 8));
    CHECK_OK(ttu_add_binary_conv2d(m, 8, 12, 3, 1, 1, 1));
    CHECK_OK(bie_model_add_batchnorm2d(m, 12));
    CHECK_OK(bie_model_add_maxpool2d(m, 2, 2));
    CHECK_OK(ttu_add_binary_conv2d(m, 12, 16, 3, 1, 0, 1));
    CHECK_OK(bie_model_add_batchnorm2d(m, 16));
    CHECK_OK(bie_model_add_maxpool2d(m, 2, 0));
    CHECK_OK(bie_model_add_flatten(m));
    CHECK_OK(ttu_add_binary_linear(m, 64, 32));
    CHECK_OK(bie_model_add_batchnorm1d(m, 32));
    /* ReLU only where no binary layer follows: all its outputs have sign +1 */
    CHECK_OK(bie_model_add_relu(m));
    CHECK_OK(ttu_add_q4_linear(m, 32, 5));
}

static bie_model *new_model(void (*build)(bie_model *), uint64_t seed) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    build(m);
    CHECK_OK(bie_model_reset_parameters(m, seed));
    CHECK_OK(bie_model_prepare_params(m));
    return m;
}

/* One training step; returns the loss before the step. */
static float train_step(bie_model *m, bie_optimizer *opt, const problem *p, int64_t *flips) {
    bie_tensor tx = ttu_view(p->x, p->ndim, p->shape), y, tl;
    int64_t ls[1] = {p->shape[0]};
    CHECK_OK(bie_tensor_view(&tl, p->labels, BIE_I32, 1, ls));
    CHECK_OK(bie_model_forward(m, &tx, &y));
    float *g = tu_alloc((size_t)bie_tensor_numel(&y) * 4);
    bie_tensor tg = ttu_view(g, y.ndim, y.shape);
    float loss = NAN;
    CHECK_OK(bie_softmax_cross_entropy(&y, &tl, &loss, &tg));
    CHECK_OK(bie_model_backward(m, &tg, NULL));
    CHECK_OK(bie_optimizer_step(opt, flips));
    free(g);
    return loss;
}

/* Trains `steps` steps; the losses go to `losses` (steps entries). */
static void train(bie_model *m, const problem *p, int steps, float *losses, int64_t *total_flips) {
    bie_optimizer_options o = bie_optimizer_defaults();
    CHECK(o.binary_lr == 1e-4f && o.binary_beta1 == 0.99f && o.binary_beta2 == 0.9999f &&
          o.seed == 0);
    /* v starts at -sign(w) * delta, delta up to 1e-3: with lr 1e-3 and beta2 0.9 a weight
     * whose gradient keeps one sign flips within 7 steps (the defaults take thousands) */
    o.binary_lr = 1e-3f;
    o.binary_beta2 = 0.9f;
    o.adam.lr = 1e-2f;
    bie_optimizer *opt = NULL;
    CHECK_OK(bie_optimizer_create(&opt, m, &o));
    *total_flips = 0;
    for (int s = 0; s < steps; s++) {
        int64_t f = 0;
        losses[s] = train_step(m, opt, p, &f);
        *total_flips += f;
    }
    CHECK(bie_optimizer_steps(opt) == steps);
    bie_optimizer_free(opt);
}

/* A copy of the model's eval output (caller frees). */
static float *eval_output(bie_model *m, const problem *p, int64_t *n) {
    bie_tensor tx = ttu_view(p->x, p->ndim, p->shape), y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    *n = bie_tensor_numel(&y);
    float *copy = tu_alloc((size_t)*n * 4);
    memcpy(copy, y.data, (size_t)*n * 4);
    return copy;
}

/* Names are unique, "<layer>.<name>", and kinds / gradients are consistent. */
static void check_params(bie_model *m, bool after_backward) {
    const int n = bie_model_param_count(m);
    CHECK(n > 0);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        bie_model_param p;
        CHECK_OK(bie_model_param_get(m, i, &p));
        char prefix[16];
        snprintf(prefix, sizeof prefix, "%d.", p.layer);
        bad += strncmp(p.name, prefix, strlen(prefix)) != 0;
        bad += p.value.data == NULL;
        for (int j = 0; j < i; j++) {
            bie_model_param q;
            CHECK_OK(bie_model_param_get(m, j, &q));
            bad += strcmp(p.name, q.name) == 0;
        }
        const bool trainable = p.kind == BIE_PARAM_KIND_FLOAT || p.kind == BIE_PARAM_KIND_BINARY;
        if (after_backward) bad += trainable != (p.grad.data != NULL);
        if (p.kind == BIE_PARAM_KIND_BINARY) {
            bad += p.value.dtype != BIE_I8;
            if (p.grad.data) bad += p.grad.dtype != BIE_I8 || !ttu_same_shape(&p.grad, &p.value);
        }
        bie_model_param found;
        CHECK_OK(bie_model_param_find(m, p.name, &found));
        bad += found.value.data != p.value.data;
    }
    CHECK(bad == 0);
}

static void test_network(void (*build)(bie_model *), const char *label, int ndim,
                         const int64_t *shape, int64_t classes) {
    problem p = make_problem(ndim, shape, classes, 5);
    bie_model *m = new_model(build, 11);
    int on;
    int64_t os[4];
    CHECK_OK(bie_model_output_shape(m, ndim, shape, &on, os));
    CHECK(on == 2 && os[0] == shape[0] && os[1] == classes);
    check_params(m, false);

    enum { STEPS = 30 };
    float losses[STEPS], again[STEPS];
    int64_t flips = 0, flips2 = 0;
    train(m, &p, STEPS, losses, &flips);
    check_params(m, true);
    const float first = losses[0],
                last = (losses[STEPS - 1] + losses[STEPS - 2] + losses[STEPS - 3]) / 3;
    printf("%s: loss %.4f -> %.4f, %lld sign flips\n", label, (double)first, (double)last,
           (long long)flips);
    CHECK(isfinite(first) && last < 0.7f * first);
    CHECK(flips > 0);

    /* the same seed reproduces the run bit for bit */
    bie_model *m2 = new_model(build, 11);
    train(m2, &p, STEPS, again, &flips2);
    CHECK(memcmp(losses, again, sizeof losses) == 0 && flips == flips2);
    int same = bie_model_param_count(m) == bie_model_param_count(m2);
    for (int i = 0; same && i < bie_model_param_count(m); i++) {
        bie_model_param a, b;
        CHECK_OK(bie_model_param_get(m, i, &a));
        CHECK_OK(bie_model_param_get(m2, i, &b));
        same = strcmp(a.name, b.name) == 0 &&
               memcmp(a.value.data, b.value.data,
                      (size_t)bie_tensor_numel(&a.value) * bie_dtype_size(a.value.dtype)) == 0;
    }
    CHECK(same);
    bie_model_free(m2);

    /* evaluation: running statistics, packed weights; twice the same */
    CHECK_OK(bie_model_set_training(m, false));
    CHECK(!bie_model_training(m));
    int64_t ny;
    float *y_eval = eval_output(m, &p, &ny), *y_eval2 = eval_output(m, &p, &ny);
    CHECK(tu_same_bits(y_eval, y_eval2, ny));

    /* save: every parameter of the trained model, and the architecture */
    const int np = bie_model_param_count(m);
    char(*names)[32] = tu_alloc((size_t)np * 32);
    bie_tensor *saved = tu_alloc((size_t)np * sizeof *saved);
    for (int i = 0; i < np; i++) {
        bie_model_param a;
        CHECK_OK(bie_model_param_get(m, i, &a));
        snprintf(names[i], 32, "%s", a.name);
        CHECK_OK(bie_tensor_alloc(&saved[i], a.value.dtype, a.value.ndim, a.value.shape));
        memcpy(saved[i].data, a.value.data,
               (size_t)bie_tensor_numel(&a.value) * bie_dtype_size(a.value.dtype));
    }
    /* rebuild from the description and load: the same evaluation output */
    bie_model *re = NULL;
    CHECK_OK(bie_model_create(&re));
    for (int i = 0; i < bie_model_layer_count(m); i++) {
        bie_layer_info info;
        bie_layer_type t;
        CHECK_OK(bie_model_layer_info(m, i, &info));
        CHECK_OK(bie_layer_type_from_name(bie_layer_type_name(info.type), &t));
        CHECK(t == info.type);
        CHECK_OK(bie_model_add_layer(re, &info));
    }
    CHECK(bie_model_param_count(re) == np);
    for (int i = 0; i < np; i++) CHECK_OK(bie_model_set_param(re, names[i], &saved[i]));
    CHECK_OK(bie_model_set_training(re, false));
    float *y_re = eval_output(re, &p, &ny);
    CHECK(tu_same_bits(y_eval, y_re, ny));

    /* pack: bit-identical to the evaluation forward; qweight replaces weight */
    CHECK_OK(bie_model_pack(m));
    CHECK(bie_model_packed(m));
    float *y_packed = eval_output(m, &p, &ny);
    CHECK(tu_same_bits(y_eval, y_packed, ny));
    int packed_n = 0;
    for (int i = 0; i < bie_model_param_count(m); i++) {
        bie_model_param a;
        CHECK_OK(bie_model_param_get(m, i, &a));
        packed_n += a.kind == BIE_PARAM_KIND_PACKED;
        CHECK(a.kind != BIE_PARAM_KIND_BINARY && a.grad.data == NULL);
    }
    int low_bit = 0;
    for (int i = 0; i < bie_model_layer_count(m); i++) {
        bie_layer_info info;
        CHECK_OK(bie_model_layer_info(m, i, &info));
        low_bit += info.type == BIE_LAYER_BINARY_LINEAR || info.type == BIE_LAYER_BINARY_CONV2D ||
                   info.type == BIE_LAYER_Q4_LINEAR || info.type == BIE_LAYER_Q4_CONV2D;
    }
    CHECK(packed_n == low_bit && low_bit >= 3);
    /* a packed model loads from packed parameters */
    CHECK_OK(bie_model_pack(re));
    CHECK(bie_model_reset_parameters(re, 1) == BIE_ERR_STATE);
    bie_model *fresh = NULL;
    CHECK_OK(bie_model_create(&fresh));
    for (int i = 0; i < bie_model_layer_count(m); i++) {
        bie_layer_info info;
        CHECK_OK(bie_model_layer_info(m, i, &info));
        CHECK_OK(bie_model_add_layer(fresh, &info));
    }
    CHECK_OK(bie_model_pack(fresh));
    for (int i = 0; i < bie_model_param_count(m); i++) {
        bie_model_param a;
        CHECK_OK(bie_model_param_get(m, i, &a));
        CHECK_OK(bie_model_set_param(fresh, a.name, &a.value));
    }
    float *y_fresh = eval_output(fresh, &p, &ny);
    CHECK(tu_same_bits(y_eval, y_fresh, ny));

    /* a packed model is inference-only */
    CHECK(bie_model_set_training(m, true) == BIE_ERR_STATE);
    CHECK(bie_model_add_relu(m) == BIE_ERR_STATE);
    CHECK(bie_model_reset_parameters(m, 1) == BIE_ERR_STATE);
    bie_optimizer *opt = NULL;
    CHECK(bie_optimizer_create(&opt, m, NULL) == BIE_ERR_STATE && opt == NULL);

    for (int i = 0; i < np; i++) bie_tensor_free(&saved[i]);
    free(saved);
    free(names);
    free(y_eval), free(y_eval2), free(y_re), free(y_packed), free(y_fresh);
    bie_model_free(fresh);
    bie_model_free(re);
    bie_model_free(m);
    free_problem(&p);
}

static void test_names(void) {
    bie_model *m = new_model(build_mlp, 3);
    static const struct {
        const char *name;
        bie_param_kind kind;
    } expect[] = {
        {"1.weight", BIE_PARAM_KIND_FLOAT},        {"1.bias_a", BIE_PARAM_KIND_FLOAT},
        {"1.scale_a", BIE_PARAM_KIND_FLOAT},       {"1.scale_w", BIE_PARAM_KIND_BUFFER},
        {"2.weight", BIE_PARAM_KIND_FLOAT},        {"2.bias", BIE_PARAM_KIND_FLOAT},
        {"2.running_mean", BIE_PARAM_KIND_BUFFER}, {"2.running_var", BIE_PARAM_KIND_BUFFER},
        {"3.weight", BIE_PARAM_KIND_BINARY},       {"3.bias_a", BIE_PARAM_KIND_FLOAT},
        {"3.scale_a", BIE_PARAM_KIND_FLOAT},       {"3.scale_w", BIE_PARAM_KIND_BUFFER},
        {"7.weight", BIE_PARAM_KIND_FLOAT},        {"7.bias", BIE_PARAM_KIND_FLOAT},
    };
    for (size_t i = 0; i < sizeof expect / sizeof expect[0]; i++) {
        bie_model_param p;
        CHECK_OK(bie_model_param_find(m, expect[i].name, &p));
        CHECK(p.kind == expect[i].kind);
    }
    bie_model_param p;
    CHECK_OK(bie_model_param_find(m, "3.weight", &p));
    CHECK(p.value.dtype == BIE_I8 && p.value.shape[0] == 24 && p.value.shape[1] == 32);
    CHECK(bie_model_param_find(m, "3.qweight", &p) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_param_find(m, "0.weight", &p) == BIE_ERR_INVALID_ARGUMENT);
    /* the list is the same after a reset (values change, names and order do not) */
    const int n = bie_model_param_count(m);
    char(*names)[32] = tu_alloc((size_t)n * 32);
    for (int i = 0; i < n; i++) {
        CHECK_OK(bie_model_param_get(m, i, &p));
        snprintf(names[i], 32, "%s", p.name);
    }
    CHECK_OK(bie_model_reset_parameters(m, 4));
    CHECK(bie_model_param_count(m) == n);
    int same = 1;
    for (int i = 0; i < n; i++) {
        CHECK_OK(bie_model_param_get(m, i, &p));
        same &= strcmp(names[i], p.name) == 0;
    }
    CHECK(same);
    /* layer descriptions */
    bie_layer_info info;
    CHECK_OK(bie_model_layer_info(m, 3, &info));
    CHECK(info.type == BIE_LAYER_BINARY_LINEAR && info.in == 32 && info.out == 24 &&
          info.symmetric && info.bits_binary_word == 8);
    CHECK(strcmp(bie_layer_type_name(info.type), "binary_linear") == 0);
    CHECK_OK(bie_model_layer_info(m, 2, &info));
    CHECK(info.type == BIE_LAYER_BATCHNORM1D && info.in == 32 && info.eps == 1e-5f &&
          info.momentum == 0.1f);
    CHECK(bie_model_layer_count(m) == 8 && bie_model_layer_count(NULL) == 0);
    CHECK(bie_model_layer_info(m, 8, &info) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_layer_type_name((bie_layer_type)99) == NULL);
    bie_layer_type t;
    CHECK(bie_layer_type_from_name("conv3d", &t) == BIE_ERR_INVALID_ARGUMENT);
    free(names);
    bie_model_free(m);

    bie_model *c = new_model(build_cnn, 3);
    CHECK_OK(bie_model_layer_info(c, 3, &info));
    CHECK(info.type == BIE_LAYER_BINARY_CONV2D && info.in == 8 && info.out == 12 &&
          info.kernel_size == 3 && info.stride == 1 && info.padding == 1 && info.dilation == 1);
    CHECK_OK(bie_model_layer_info(c, 8, &info));
    CHECK(info.type == BIE_LAYER_MAXPOOL2D && info.kernel_size == 2 && info.stride == 2);
    bie_layer *bc = NULL;
    bie_layer_desc desc;
    CHECK_OK(bie_model_layer(c, 3, &bc));
    CHECK_OK(bie_layer_describe(bc, &desc));
    CHECK(desc.kind == BIE_KIND_BINARY_CONV2D && desc.bits_binary_word == 8 && desc.symmetric &&
          desc.in == 8 && desc.out == 12 && desc.kernel_size == 3 && desc.padding == 1);
    bie_layer *qc = NULL;
    CHECK_OK(bie_model_layer(c, 0, &qc));
    CHECK_OK(bie_layer_describe(qc, &desc));
    CHECK(desc.kind == BIE_KIND_Q4_CONV2D && desc.bits_binary_word == 0 && desc.training);
    bie_layer *fl = NULL; /* batch norm, PReLU, max-pool: float layers have no bie_layer */
    CHECK(bie_model_layer(c, 1, &fl) == BIE_ERR_INVALID_ARGUMENT && fl == NULL);
    CHECK(bie_model_layer(c, 2, &fl) == BIE_ERR_INVALID_ARGUMENT && fl == NULL);
    CHECK(bie_model_layer(c, -1, &fl) == BIE_ERR_INVALID_ARGUMENT && fl == NULL);
    CHECK(bie_model_layer(c, bie_model_layer_count(c), &fl) == BIE_ERR_INVALID_ARGUMENT &&
          fl == NULL);
    CHECK(bie_model_layer(NULL, 3, &fl) == BIE_ERR_NULL_POINTER && fl == NULL);
    CHECK(bie_model_layer(c, 3, NULL) == BIE_ERR_NULL_POINTER);
    bie_model_free(c);

    /* bie_model_add_layer honours symmetric and the word size; a new layer follows the
     * model's mode */
    bie_model *w = NULL;
    CHECK_OK(bie_model_create(&w));
    CHECK_OK(bie_model_set_training(w, false));
    memset(&info, 0, sizeof info);
    info.type = BIE_LAYER_BINARY_CONV2D;
    info.in = 2;
    info.out = 3;
    info.kernel_size = 3;
    info.stride = 2;
    info.padding = 0;
    info.dilation = 2;
    info.bits_binary_word = 64;
    info.symmetric = false;
    CHECK_OK(bie_model_add_layer(w, &info));
    bie_layer *wl = NULL;
    CHECK_OK(bie_model_layer(w, 0, &wl));
    CHECK_OK(bie_layer_describe(wl, &desc));
    CHECK(desc.kind == BIE_KIND_BINARY_CONV2D && !desc.symmetric && desc.bits_binary_word == 64 &&
          !desc.training && desc.stride == 2 && desc.dilation == 2 && desc.fan_in == 18);
    CHECK_OK(bie_model_layer_info(w, 0, &info));
    CHECK(!info.symmetric && info.bits_binary_word == 64 && info.dilation == 2);
    bie_model_free(w);
}

static void test_bad_input(void) {
    bie_model_free(NULL);
    bie_optimizer_free(NULL);
    CHECK(bie_model_create(NULL) == BIE_ERR_NULL_POINTER);
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    float x[2 * 63], g[2 * 4];
    tu_fill(x, 2 * 63, -1, 1);
    int64_t xs[4] = {2, 1, 7, 9}, gs[2] = {2, 4};
    bie_tensor tx = ttu_view(x, 4, xs), tg = ttu_view(g, 2, gs), y;
    CHECK(bie_model_forward(m, &tx, &y) == BIE_ERR_STATE); /* empty */

    /* backward modes: FP8 needs a CUDA model; unknown modes; EXACT always */
    CHECK(bie_model_set_backward_mode(NULL, BIE_BACKWARD_EXACT) == BIE_ERR_NULL_POINTER);
    CHECK(bie_model_set_backward_mode(m, (bie_backward_mode)5) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_set_backward_mode(m, BIE_BACKWARD_FP8) == BIE_ERR_UNSUPPORTED);
    CHECK_OK(bie_model_set_backward_mode(m, BIE_BACKWARD_EXACT));

    /* bad hyper-parameters, the model unchanged */
    CHECK(bie_model_add_linear(m, 0, 3, true) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(ttu_add_binary_conv2d(m, 3, 4, 3, 0, 1, 1) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(ttu_add_q4_conv2d(m, 3, 4, 3, 1, -1, 1) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_maxpool2d(m, 0, 1) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_prelu(m, 0) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_batchnorm1d(m, -2) == BIE_ERR_INVALID_ARGUMENT);
    bie_layer_info info;
    memset(&info, 0, sizeof info);
    info.type = BIE_LAYER_BATCHNORM1D;
    info.in = 4;
    info.eps = 1e-5f;
    info.momentum = 2.0f;
    CHECK(bie_model_add_layer(m, &info) == BIE_ERR_INVALID_ARGUMENT);
    info.type = BIE_LAYER_BINARY_LINEAR;
    info.out = 3;
    info.bits_binary_word = 16;
    CHECK(bie_model_add_layer(m, &info) == BIE_ERR_INVALID_ARGUMENT);
    info.type = (bie_layer_type)42;
    CHECK(bie_model_add_layer(m, &info) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_layer(m, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(bie_model_add_relu(NULL) == BIE_ERR_NULL_POINTER);
    CHECK(bie_model_layer_count(m) == 0 && bie_model_param_count(m) == 0);

    build_mlp(m);
    /* training needs int8 binary weights */
    CHECK(bie_model_forward(m, &tx, &y) == BIE_ERR_STATE);
    CHECK(bie_model_backward(m, &tg, NULL) == BIE_ERR_STATE);
    bie_optimizer *opt = NULL;
    CHECK(bie_optimizer_create(&opt, m, NULL) == BIE_ERR_STATE);
    CHECK_OK(bie_model_prepare_params(m));
    bie_optimizer_options o = bie_optimizer_defaults();
    o.adam.beta1 = 1.0f;
    CHECK(bie_optimizer_create(&opt, m, &o) == BIE_ERR_INVALID_ARGUMENT && opt == NULL);
    CHECK_OK(bie_optimizer_create(&opt, m, NULL));
    CHECK(bie_optimizer_step(opt, NULL) == BIE_ERR_STATE); /* no backward yet */
    CHECK(bie_optimizer_set_lr(opt, 0.0f, 1e-4f) == BIE_ERR_INVALID_ARGUMENT);
    CHECK_OK(bie_optimizer_set_lr(opt, 1e-3f, 1e-4f));

    /* wrong input shapes name the layer; nothing changes */
    bie_model_param rm;
    CHECK_OK(bie_model_param_find(m, "2.running_mean", &rm));
    float rm_before[32];
    memcpy(rm_before, rm.value.data, sizeof rm_before);
    int64_t bad_xs[4] = {2, 1, 7, 8};
    bie_tensor bad_x = ttu_view(x, 4, bad_xs);
    CHECK(bie_model_forward(m, &bad_x, &y) == BIE_ERR_SHAPE);
    CHECK(strstr(bie_last_error(), "layer 1") != NULL);
    CHECK(bie_model_forward(m, NULL, &y) == BIE_ERR_NULL_POINTER);
    CHECK(bie_model_forward(m, &tx, NULL) == BIE_ERR_NULL_POINTER);
    bie_tensor x_i8 = tx;
    x_i8.dtype = BIE_I8;
    CHECK(bie_model_forward(m, &x_i8, &y) == BIE_ERR_DTYPE);
    /* training batch norm needs two values per channel */
    int64_t one_xs[4] = {1, 1, 7, 9};
    bie_tensor one_x = ttu_view(x, 4, one_xs);
    CHECK(bie_model_forward(m, &one_x, &y) == BIE_ERR_SHAPE);
    CHECK(memcmp(rm_before, rm.value.data, sizeof rm_before) == 0);

    /* an all-zero input cannot initialise scale_a: scale_a stays 0 everywhere */
    float zeros[2 * 63] = {0};
    bie_tensor tz = ttu_view(zeros, 4, xs);
    CHECK(bie_model_forward(m, &tz, &y) != BIE_OK);
    bie_model_param sa;
    CHECK_OK(bie_model_param_find(m, "1.scale_a", &sa));
    CHECK(*(float *)sa.value.data == 0.0f);
    CHECK(memcmp(rm_before, rm.value.data, sizeof rm_before) == 0);

    /* backward: shapes */
    CHECK_OK(bie_model_forward(m, &tx, &y));
    CHECK(y.shape[0] == 2 && y.shape[1] == 4);
    bie_tensor bad_g = ttu_view(g, 1, gs + 1);
    tu_fill(g, 8, -1, 1);
    CHECK(bie_model_backward(m, &bad_g, NULL) == BIE_ERR_SHAPE);
    float gx[2 * 63];
    int64_t gxs[2] = {2, 63};
    bie_tensor bad_gx = ttu_view(gx, 2, gxs);
    CHECK(bie_model_backward(m, &tg, &bad_gx) == BIE_ERR_SHAPE);
    bie_tensor tgx = ttu_view(gx, 4, xs);
    tu_poison(gx, 2 * 63);
    CHECK_OK(bie_model_backward(m, &tg, &tgx));
    int finite = 1;
    for (int i = 0; i < 2 * 63; i++) finite &= isfinite(gx[i]) != 0;
    CHECK(finite);
    CHECK_OK(bie_optimizer_step(opt, NULL));
    CHECK(bie_optimizer_step(opt, NULL) == BIE_ERR_STATE); /* one step per backward */

    /* set_param: unknown names, shapes, dtypes, non-finite values change nothing */
    bie_model_param w;
    CHECK_OK(bie_model_param_find(m, "7.weight", &w));
    float w_before[64], src[64];
    memcpy(w_before, w.value.data, sizeof w_before);
    tu_fill(src, 64, -1, 1);
    int64_t ws[2] = {4, 16}, ws_bad[2] = {16, 4};
    bie_tensor tsrc = ttu_view(src, 2, ws), tsrc_bad = ttu_view(src, 2, ws_bad);
    CHECK(bie_model_set_param(m, "7.wieght", &tsrc) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_set_param(m, "7.weight", &tsrc_bad) == BIE_ERR_SHAPE);
    CHECK(bie_model_set_param(m, "7.weight", NULL) == BIE_ERR_NULL_POINTER);
    src[5] = NAN;
    CHECK(bie_model_set_param(m, "7.weight", &tsrc) == BIE_ERR_NOT_FINITE);
    CHECK(memcmp(w_before, w.value.data, sizeof w_before) == 0);
    src[5] = 0.5f;
    CHECK_OK(bie_model_set_param(m, "7.weight", &tsrc));
    CHECK(memcmp(src, w.value.data, sizeof src) == 0);
    int8_t i8w[24 * 32];
    memset(i8w, -128, sizeof i8w);
    int64_t bs[2] = {24, 32};
    bie_tensor ti8 = tu_view(i8w, BIE_I8, 2, bs[0], bs[1], 0, 0);
    CHECK(bie_model_set_param(m, "3.weight", &ti8) == BIE_ERR_INVALID_ARGUMENT);
    float neg = -1.0f;
    int64_t one = 1;
    bie_tensor tneg;
    CHECK_OK(bie_tensor_view(&tneg, &neg, BIE_F32, 1, &one));
    CHECK(bie_model_set_param(m, "3.scale_w", &tneg) == BIE_ERR_NOT_FINITE);
    CHECK(bie_model_set_param(m, "3.scale_a", &tneg) != BIE_OK);
    float var_src[32];
    tu_fill(var_src, 32, 0.5f, 2.0f);
    var_src[31] = -0.25f;
    int64_t vs = 32;
    bie_tensor tvar;
    CHECK_OK(bie_tensor_view(&tvar, var_src, BIE_F32, 1, &vs));
    bie_model_param rv;
    CHECK_OK(bie_model_param_find(m, "2.running_var", &rv));
    float rv_before[32];
    memcpy(rv_before, rv.value.data, sizeof rv_before);
    CHECK(bie_model_set_param(m, "2.running_var", &tvar) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(memcmp(rv_before, rv.value.data, sizeof rv_before) == 0);

    /* structural changes invalidate the optimizer */
    CHECK_OK(bie_model_reset_parameters(m, 9));
    CHECK_OK(bie_model_prepare_params(m));
    CHECK_OK(bie_model_forward(m, &tx, &y));
    CHECK_OK(bie_model_backward(m, &tg, NULL));
    CHECK(bie_optimizer_step(opt, NULL) == BIE_ERR_STATE);
    bie_optimizer_free(opt);
    /* switching to evaluation drops the saved activations */
    CHECK_OK(bie_model_set_training(m, false));
    CHECK(bie_model_backward(m, &tg, NULL) == BIE_ERR_STATE);
    bie_model_free(m);
}

int main(void) {
    int64_t mlp_shape[4] = {32, 1, 7, 9}, cnn_shape[4] = {20, 3, 13, 13};
    test_network(build_mlp, "binary MLP", 4, mlp_shape, 4);
    test_network(build_cnn, "binary CNN", 4, cnn_shape, 5);
    test_names();
    test_bad_input();
    return tu_finish();
}
