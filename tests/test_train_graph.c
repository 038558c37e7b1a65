/* Models that are graphs: residual adds, concat, tensors that feed several nodes, a node
 * nobody reads; every gradient against central differences; the graph's float layers
 * (conv2d, RPReLU, average pools); bad graphs refused with the model unchanged; a binary
 * residual network whose packed form predicts bit for bit what it does in eval mode; and
 * rebuilding a graph from its description. */
/* A small step: deep graphs with batch norm and PReLU kinks bend more within a step of 1e-2
 * than the tolerance allows. */
#define TTU_H 2e-3f
#include "train/train_test_util.h"

static bie_layer_info info_of(bie_layer_type type, int64_t in, int64_t out) {
    return ttu_info(type, in, out, 0, 0, 0, 1);
}

static bie_layer_info conv_info(bie_layer_type type, int64_t in, int64_t out, int k, int s, int p,
                                bool bias) {
    bie_layer_info i = ttu_info(type, in, out, k, s, p, 1);
    i.bias = bias;
    return i;
}

/* Append a node; returns its index. */
static int node(bie_model *m, bie_layer_info info, int n, int a, int b) {
    const int in[2] = {a, b};
    CHECK_OK(bie_model_add_node(m, &info, n, in));
    return bie_model_layer_count(m) - 1;
}
static int node1(bie_model *m, bie_layer_info info, int a) { return node(m, info, 1, a, 0); }

/* Set every float parameter from `value` or uniformly in [lo, hi]. */
static void set_float_params(bie_model *m, const char *suffix, float lo, float hi) {
    for (int p = 0; p < bie_model_param_count(m); p++) {
        bie_model_param prm;
        CHECK_OK(bie_model_param_get(m, p, &prm));
        const size_t ls = strlen(prm.name), lx = strlen(suffix);
        if (prm.kind == BIE_PARAM_KIND_FLOAT && ls >= lx && strcmp(prm.name + ls - lx, suffix) == 0)
            tu_fill(prm.value.data, bie_tensor_numel(&prm.value), lo, hi);
    }
}

/* A float residual graph with every new node type:
 *  0 conv 3->4 (3x3, bias) | 1 BN | 2 RPReLU | 3 conv 4->4 (of 2) | 4 add(3, 2)
 *  5 avgpool 2 (of 4) | 6 conv 4->6 1x1 (of 5) | 7 conv 4->6 3x3 stride 2 (of 4) | 8 add(6, 7)
 *  9 concat(8, 6) | 10 PReLU 12 | 11 global avgpool | 12 linear 12->5
 * Node 2 feeds 3 and 4, node 4 feeds 5 and 7, node 6 feeds 8 and 9: their gradients are
 * sums. With `dead`, node 13 (a conv of the input) is read by nobody and node 14 = add(12,
 * 12) is the output (an input used twice). */
static bie_model *float_graph(bool dead) {
    bie_model *m;
    CHECK_OK(bie_model_create(&m));
    node1(m, conv_info(BIE_LAYER_CONV2D, 3, 4, 3, 1, 1, true), BIE_MODEL_INPUT);
    node1(m, info_of(BIE_LAYER_BATCHNORM2D, 4, 0), 0);
    node1(m, info_of(BIE_LAYER_RPRELU, 4, 0), 1);
    node1(m, conv_info(BIE_LAYER_CONV2D, 4, 4, 3, 1, 1, false), 2);
    node(m, info_of(BIE_LAYER_ADD, 0, 0), 2, 3, 2);
    bie_layer_info pool = info_of(BIE_LAYER_AVGPOOL2D, 0, 0);
    pool.kernel_size = 2;
    node1(m, pool, 4);
    node1(m, conv_info(BIE_LAYER_CONV2D, 4, 6, 1, 1, 0, true), 5);
    node1(m, conv_info(BIE_LAYER_CONV2D, 4, 6, 3, 2, 1, false), 4);
    node(m, info_of(BIE_LAYER_ADD, 0, 0), 2, 6, 7);
    node(m, info_of(BIE_LAYER_CONCAT, 0, 0), 2, 8, 6);
    node1(m, info_of(BIE_LAYER_PRELU, 12, 0), 9);
    node1(m, info_of(BIE_LAYER_GLOBAL_AVGPOOL, 0, 0), 10);
    node1(m, info_of(BIE_LAYER_LINEAR, 12, 5), 11);
    if (dead) {
        node1(m, conv_info(BIE_LAYER_CONV2D, 3, 2, 3, 1, 1, true), BIE_MODEL_INPUT);
        node(m, info_of(BIE_LAYER_ADD, 0, 0), 2, 12, 12);
    }
    return m;
}

static void test_float_graph_gradients(bool dead) {
    bie_model *m = float_graph(dead);
    CHECK_OK(bie_model_reset_parameters(m, 11));
    /* RPReLU and PReLU slopes of 1: no kink for central differences to step over (a step
     * that moves an activation across a kink of another slope changes the difference by
     * O(1), whatever the step). Their slopes' and shifts' gradients are still checked; the
     * kernels' branches are checked against direct formulas in test_train_graph_kernels. */
    set_float_params(m, "2.weight", 1.0f, 1.0f);
    set_float_params(m, "10.weight", 1.0f, 1.0f);
    set_float_params(m, "shift_in", -0.3f, 0.3f);
    set_float_params(m, "shift_out", -0.3f, 0.3f);
    const int64_t shape[4] = {2, 3, 6, 8};
    int on;
    int64_t os[BIE_MAX_DIMS];
    CHECK_OK(bie_model_output_shape(m, 4, shape, &on, os));
    CHECK(on == 2 && os[0] == 2 && os[1] == 5);
    const int64_t n = ttu_numel(4, shape);
    float *x = tu_alloc((size_t)n * 4);
    tu_fill(x, n, -1.5f, 1.5f);
    ttu_grad_check(m, x, 4, shape, dead ? "graph with a dead node" : "float residual graph");
    if (dead) { /* the dead conv's gradients are exactly zero */
        bie_model_param w;
        CHECK_OK(bie_model_param_find(m, "13.weight", &w));
        CHECK(w.grad.data != NULL);
        int nonzero = 0;
        for (int64_t i = 0; w.grad.data && i < bie_tensor_numel(&w.grad); i++)
            nonzero += ((const float *)w.grad.data)[i] != 0.0f;
        CHECK(nonzero == 0);
    }
    free(x);
    bie_model_free(m);
}

/* The graph's description (layer info + node inputs) rebuilds the same model, and the
 * parameter copy gives identical outputs. */
static bie_model *rebuild(bie_model *m) {
    bie_model *r;
    CHECK_OK(bie_model_create(&r));
    for (int i = 0; i < bie_model_layer_count(m); i++) {
        bie_layer_info info;
        int n, in[BIE_MODEL_MAX_INPUTS];
        CHECK_OK(bie_model_layer_info(m, i, &info));
        CHECK_OK(bie_model_node_inputs(m, i, &n, in));
        CHECK_OK(bie_model_add_node(r, &info, n, in));
    }
    CHECK_OK(bie_model_prepare_params(r));
    for (int p = 0; p < bie_model_param_count(m); p++) {
        bie_model_param prm;
        CHECK_OK(bie_model_param_get(m, p, &prm));
        CHECK_OK(bie_model_set_param(r, prm.name, &prm.value));
    }
    return r;
}

/* A binary residual network in the style of Bi-Real / ReActNet: float stem, binary 3x3
 * convs each with a real-valued shortcut, RPReLU, an average-pool + 1x1 float conv
 * down-sampling shortcut, global pool, float head. Trains a few steps; the packed model
 * predicts exactly what the eval-mode model does; a rebuilt copy agrees. */
static void test_binary_residual(void) {
    bie_model *m;
    CHECK_OK(bie_model_create(&m));
    const int64_t sample[3] = {1, 12, 12};
    CHECK_OK(bie_model_set_input_shape(m, 3, sample));
    int h = node1(m, conv_info(BIE_LAYER_CONV2D, 1, 8, 3, 1, 1, false), BIE_MODEL_INPUT);
    h = node1(m, info_of(BIE_LAYER_BATCHNORM2D, 8, 0), h);
    h = node1(m, info_of(BIE_LAYER_RPRELU, 8, 0), h);
    for (int block = 0; block < 2; block++) {
        const int64_t c = block == 0 ? 8 : 16;
        int b = node1(m,
                      conv_info(BIE_LAYER_BINARY_CONV2D, block == 0 ? 8 : 8, c, 3,
                                block == 0 ? 1 : 2, 1, false),
                      h);
        b = node1(m, info_of(BIE_LAYER_BATCHNORM2D, c, 0), b);
        int sc = h;
        if (block == 1) {
            bie_layer_info pool = info_of(BIE_LAYER_AVGPOOL2D, 0, 0);
            pool.kernel_size = 2;
            sc = node1(m, pool, h);
            sc = node1(m, conv_info(BIE_LAYER_CONV2D, 8, 16, 1, 1, 0, false), sc);
            sc = node1(m, info_of(BIE_LAYER_BATCHNORM2D, 16, 0), sc);
        }
        h = node(m, info_of(BIE_LAYER_ADD, 0, 0), 2, b, sc);
        h = node1(m, info_of(BIE_LAYER_RPRELU, c, 0), h);
    }
    h = node1(m, info_of(BIE_LAYER_GLOBAL_AVGPOOL, 0, 0), h);
    node1(m, info_of(BIE_LAYER_LINEAR, 16, 10), h);
    CHECK_OK(bie_model_reset_parameters(m, 5));
    CHECK_OK(bie_model_prepare_params(m));

    const int64_t shape[4] = {6, 1, 12, 12};
    const int64_t n = ttu_numel(4, shape);
    float *x = tu_alloc((size_t)n * 4), *g = tu_alloc(6 * 10 * 4);
    int32_t labels[6];
    for (int i = 0; i < 6; i++) labels[i] = i % 10;
    const int64_t lshape[1] = {6};
    bie_tensor tl;
    CHECK_OK(bie_tensor_view(&tl, labels, BIE_I32, 1, lshape));
    bie_optimizer *opt;
    bie_optimizer_options o = bie_optimizer_defaults();
    o.binary_lr = 0.05f;
    CHECK_OK(bie_optimizer_create(&opt, m, &o));
    float first = 0, last = 0;
    tu_fill(x, n, -1, 1);
    bie_tensor tx = ttu_view(x, 4, shape);
    for (int step = 0; step < 30; step++) { /* the same batch: the loss must fall */
        bie_tensor y;
        CHECK_OK(bie_model_forward(m, &tx, &y));
        bie_tensor tg = ttu_view(g, 2, y.shape);
        float loss;
        CHECK_OK(bie_softmax_cross_entropy(&y, &tl, &loss, &tg));
        CHECK_OK(bie_model_backward(m, &tg, NULL));
        CHECK_OK(bie_optimizer_step(opt, NULL));
        if (step == 0) first = loss;
        last = loss;
    }
    CHECK(last < first);
    bie_optimizer_free(opt);

    /* eval, then a rebuilt copy, then packed: identical logits */
    CHECK_OK(bie_model_set_training(m, false));
    tu_fill(x, n, -1, 1);
    bie_tensor y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    float *want = tu_alloc(60 * 4);
    memcpy(want, y.data, 60 * 4);
    bie_model *r = rebuild(m);
    CHECK_OK(bie_model_set_training(r, false));
    CHECK_OK(bie_model_forward(r, &tx, &y));
    CHECK(memcmp(want, y.data, 60 * 4) == 0);
    CHECK_OK(bie_model_pack(m));
    CHECK_OK(bie_model_forward(m, &tx, &y));
    CHECK(memcmp(want, y.data, 60 * 4) == 0);
    /* a wrong sample shape is refused against the declared one */
    const int64_t other[4] = {6, 1, 10, 12};
    bie_tensor tw = ttu_view(x, 4, other);
    CHECK(bie_model_forward(m, &tw, &y) == BIE_ERR_SHAPE);
    bie_model_free(r);
    bie_model_free(m);
    free(want);
    free(x);
    free(g);
}

static void test_bad_graphs(void) {
    bie_model *m;
    CHECK_OK(bie_model_create(&m));
    node1(m, conv_info(BIE_LAYER_CONV2D, 3, 4, 3, 1, 1, true), BIE_MODEL_INPUT);
    node1(m, info_of(BIE_LAYER_RELU, 0, 0), 0);
    const int count = bie_model_layer_count(m);
    bie_layer_info relu = info_of(BIE_LAYER_RELU, 0, 0), add = info_of(BIE_LAYER_ADD, 0, 0);
    int in[3] = {2, 0, 1};
    /* an unknown node, a node itself (a cycle), below the input */
    CHECK(bie_model_add_node(m, &relu, 1, in) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(strstr(bie_last_error(), "not an earlier node") != NULL);
    in[0] = -2;
    CHECK(bie_model_add_node(m, &relu, 1, in) == BIE_ERR_INVALID_ARGUMENT);
    /* arity */
    in[0] = 1;
    CHECK(bie_model_add_node(m, &add, 1, in) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_node(m, &relu, 2, in) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_node(m, &add, BIE_MODEL_MAX_INPUTS + 1, in) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_model_add_node(m, &relu, 1, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(bie_model_add_layer(m, &add) == BIE_ERR_INVALID_ARGUMENT); /* a chain node: 1 input */
    CHECK(bie_model_layer_count(m) == count);

    /* without a declared input shape an add of mismatched shapes is refused when data flows */
    in[0] = 1;
    in[1] = BIE_MODEL_INPUT; /* [N, 4, H, W] + [N, 3, H, W] */
    CHECK_OK(bie_model_add_node(m, &add, 2, in));
    const int64_t shape[4] = {2, 3, 5, 5};
    int on;
    int64_t os[BIE_MAX_DIMS];
    CHECK(bie_model_output_shape(m, 4, shape, &on, os) == BIE_ERR_SHAPE);
    CHECK(strstr(bie_last_error(), "layer 2 (add)") != NULL);
    float x[150];
    tu_fill(x, 150, -1, 1);
    bie_tensor tx = ttu_view(x, 4, shape), y;
    CHECK(bie_model_forward(m, &tx, &y) == BIE_ERR_SHAPE);
    /* declaring the input shape now is refused (the add does not fit), model unchanged */
    const int64_t sample[3] = {3, 5, 5};
    CHECK(bie_model_set_input_shape(m, 3, sample) == BIE_ERR_SHAPE);
    int nd = -1;
    int64_t got[BIE_MAX_DIMS];
    CHECK_OK(bie_model_input_shape(m, &nd, got));
    CHECK(nd == 0);
    bie_model_free(m);

    /* with a declared input shape, a mismatched add or concat is refused when it is added */
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(bie_model_set_input_shape(m, 3, sample));
    CHECK_OK(bie_model_input_shape(m, &nd, got));
    CHECK(nd == 3 && got[0] == 3 && got[1] == 5 && got[2] == 5);
    node1(m, conv_info(BIE_LAYER_CONV2D, 3, 4, 3, 2, 1, true), BIE_MODEL_INPUT); /* 3 x 3 */
    node1(m, conv_info(BIE_LAYER_CONV2D, 3, 4, 3, 1, 1, true), BIE_MODEL_INPUT); /* 5 x 5 */
    in[0] = 0;
    in[1] = 1;
    CHECK(bie_model_add_node(m, &add, 2, in) == BIE_ERR_SHAPE);
    CHECK(strstr(bie_last_error(), "an add needs equal shapes") != NULL);
    bie_layer_info cat = info_of(BIE_LAYER_CONCAT, 0, 0);
    CHECK(bie_model_add_node(m, &cat, 2, in) == BIE_ERR_SHAPE);
    bie_layer_info lin = info_of(BIE_LAYER_LINEAR, 7, 2); /* a chain node of the wrong size */
    CHECK(bie_model_add_layer(m, &lin) == BIE_ERR_SHAPE);
    CHECK(bie_model_layer_count(m) == 2);
    in[0] = 1;
    in[1] = BIE_MODEL_INPUT; /* channels 4 + 3 at 5 x 5: a valid concat */
    CHECK_OK(bie_model_add_node(m, &cat, 2, in));
    CHECK_OK(bie_model_output_shape(m, 4, shape, &on, os));
    CHECK(on == 4 && os[1] == 7 && os[2] == 5);
    CHECK(bie_model_set_input_shape(m, BIE_MAX_DIMS, sample) == BIE_ERR_SHAPE);
    CHECK(bie_model_add_node(NULL, &cat, 2, in) == BIE_ERR_NULL_POINTER);
    CHECK(bie_model_node_inputs(m, 5, &nd, in) == BIE_ERR_INVALID_ARGUMENT);
    bie_model_free(m);
}

/* A chain's nodes each read the node before; the first reads the input. */
static void test_chain_inputs(void) {
    bie_model *m;
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(bie_model_add_flatten(m));
    CHECK_OK(bie_model_add_linear(m, 12, 3, true));
    CHECK_OK(bie_model_add_rprelu(m, 3));
    int n, in[BIE_MODEL_MAX_INPUTS];
    for (int i = 0; i < 3; i++) {
        CHECK_OK(bie_model_node_inputs(m, i, &n, in));
        CHECK(n == 1 && in[0] == i - 1);
    }
    bie_model_free(m);
}

int main(void) {
    tu_seed(20261125);
    test_float_graph_gradients(true);
    test_float_graph_gradients(false);
    test_float_graph_gradients(false);
    test_binary_residual();
    test_bad_graphs();
    test_chain_inputs();
    return tu_finish();
}
