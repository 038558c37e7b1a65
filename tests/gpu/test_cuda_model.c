/* The model on CUDA (bie_model_to_device): every layer type moves to the GPU and
 * back with its parameters bit for bit; forwards and input gradients match the CPU model's
 * (float layers within rounding, so the binary layers after them see the same signs);
 * training on the GPU lowers the loss and reproduces bit for bit; a packed model moves and
 * predicts as on the CPU; host and device inputs and gradients give the same results; bad
 * calls are refused and change nothing. Reports itself skipped (77) without a GPU. */
#include "../train/train_test_util.h"
#include "gpu_util.h"

#include "bie_train.h"

static const bie_device kCuda = {BIE_DEVICE_CUDA, 0};

typedef struct problem {
    int64_t shape[4];
    int64_t classes;
    float *x;
    int32_t *labels;
} problem;

/* Class prototypes plus noise. */
static problem make_problem(const int64_t *shape, int64_t classes, uint64_t seed) {
    problem p;
    memcpy(p.shape, shape, sizeof p.shape);
    p.classes = classes;
    tu_seed(seed);
    const int64_t n = shape[0], per = ttu_numel(4, shape) / n;
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

/* Every layer type: 4-bit conv, batch norm 2d, PReLU, binary conv, max-pool (overlapping
 * windows too), flatten, binary linear, batch norm 1d, 4-bit linear, ReLU, float linear. */
static void build_all(bie_model *m) {
    CHECK_OK(ttu_add_q4_conv2d(m, 3, 8, 3, 1, 1, 1));
    CHECK_OK(bie_model_add_batchnorm2d(m, 8));
    CHECK_OK(bie_model_add_prelu(m, 8));
    CHECK_OK(ttu_add_binary_conv2d(m, 8, 12, 3, 1, 1, 1));
    CHECK_OK(bie_model_add_batchnorm2d(m, 12));
    CHECK_OK(bie_model_add_maxpool2d(m, 3, 2));
    CHECK_OK(ttu_add_binary_conv2d(m, 12, 16, 3, 1, 0, 1));
    CHECK_OK(bie_model_add_batchnorm2d(m, 16));
    CHECK_OK(bie_model_add_maxpool2d(m, 2, 0));
    CHECK_OK(bie_model_add_flatten(m));
    CHECK_OK(ttu_add_binary_linear(m, 16, 33));
    CHECK_OK(bie_model_add_batchnorm1d(m, 33));
    CHECK_OK(bie_model_add_prelu(m, 1));
    CHECK_OK(ttu_add_q4_linear(m, 33, 19));
    CHECK_OK(bie_model_add_relu(m));
    CHECK_OK(bie_model_add_linear(m, 19, 5, true));
}
static const int64_t kShape[4] = {6, 3, 11, 11}; /* 11 -> 11 -> pool 5 -> 3 -> pool 1 */

static bie_model *new_model(uint64_t seed, bie_device where) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    build_all(m);
    CHECK_OK(bie_model_reset_parameters(m, seed));
    CHECK_OK(bie_model_prepare_params(m));
    CHECK_OK(bie_model_to_device(m, where));
    return m;
}

/* Every parameter of a and b has the same name, dtype, shape and bits. */
static int same_params(bie_model *a, bie_model *b) {
    if (bie_model_param_count(a) != bie_model_param_count(b)) return 0;
    int same = 1;
    for (int i = 0; same && i < bie_model_param_count(a); i++) {
        bie_model_param pa, pb;
        CHECK_OK(bie_model_param_get(a, i, &pa));
        CHECK_OK(bie_model_param_get(b, i, &pb));
        const size_t bytes = (size_t)bie_tensor_numel(&pa.value) * bie_dtype_size(pa.value.dtype);
        void *ha = download_bytes(&pa.value), *hb = download_bytes(&pb.value);
        same = strcmp(pa.name, pb.name) == 0 && pa.value.dtype == pb.value.dtype &&
               ttu_same_shape(&pa.value, &pb.value) && memcmp(ha, hb, bytes) == 0;
        if (!same) fprintf(stderr, "parameter %s differs\n", pa.name);
        free(ha);
        free(hb);
    }
    return same;
}

/* Forward on the host input; a host copy of the output (caller frees). */
static float *forward_copy(bie_model *m, const problem *p, int64_t *n) {
    bie_tensor tx = ttu_view(p->x, 4, p->shape), y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    *n = bie_tensor_numel(&y);
    CHECK(y.device.type == bie_model_device(m).type);
    return download_bytes(&y);
}

/* Outputs of the CPU and the CUDA model: equal up to float rounding, i.e. within 1e-4 of
 * the largest magnitude for all but a few elements (a value that rounds to the other side of
 * zero before a binary layer changes what follows). */
static void check_close(const float *got, const float *want, int64_t n, const char *what) {
    double top = 0, worst = 0;
    for (int64_t i = 0; i < n; i++) top = fmax(top, fabs(want[i]));
    int64_t off = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) bad++;
        const double d = fabs((double)got[i] - want[i]);
        worst = fmax(worst, d);
        off += d > 1e-4 * top + 1e-6;
    }
    if (off || bad)
        printf("%s: %lld of %lld elements differ (worst %.3g of %.3g)\n", what, (long long)off,
               (long long)n, worst, top);
    CHECK(bad == 0);
    CHECK(off * 50 <= n);
}

/* The gradients of the named parameters: on CUDA in the GPU model, close to the CPU's. */
static void check_grads(bie_model *cpu, bie_model *gpu, const char *const *names, int count) {
    for (int k = 0; k < count; k++) {
        bie_model_param a, b;
        CHECK_OK(bie_model_param_find(cpu, names[k], &a));
        CHECK_OK(bie_model_param_find(gpu, names[k], &b));
        CHECK(a.grad.data != NULL && b.grad.data != NULL && b.grad.device.type == BIE_DEVICE_CUDA);
        if (a.grad.data && b.grad.data) {
            float *hb = download_bytes(&b.grad);
            check_close(hb, a.grad.data, bie_tensor_numel(&a.grad), names[k]);
            free(hb);
        }
    }
}

static void test_move_round_trip(void) {
    bie_model *cpu = new_model(3, bie_cpu());
    bie_model *gpu = new_model(3, kCuda);
    CHECK(bie_model_device(gpu).type == BIE_DEVICE_CUDA &&
          bie_model_device(cpu).type == BIE_DEVICE_CPU);
    for (int i = 0; i < bie_model_param_count(gpu); i++) {
        bie_model_param p;
        CHECK_OK(bie_model_param_get(gpu, i, &p));
        CHECK(p.value.device.type == BIE_DEVICE_CUDA);
    }
    CHECK(same_params(cpu, gpu));
    CHECK_OK(bie_model_to_device(gpu, kCuda)); /* already there: nothing changes */
    CHECK_OK(bie_model_to_device(gpu, bie_cpu()));
    CHECK(bie_model_device(gpu).type == BIE_DEVICE_CPU);
    CHECK(same_params(cpu, gpu));
    bie_model_free(cpu);
    bie_model_free(gpu);
}

/* Training forward, backward (grad_x on the host and on the device) and evaluation forward
 * of the same model on both devices. */
static void test_matches_cpu(void) {
    problem p = make_problem(kShape, 5, 21);
    bie_model *cpu = new_model(5, bie_cpu()), *gpu = new_model(5, kCuda);
    int64_t n;
    float *yc = forward_copy(cpu, &p, &n), *yg = forward_copy(gpu, &p, &n);
    check_close(yg, yc, n, "training forward");

    float *g = tu_alloc((size_t)n * 4);
    tu_fill(g, n, -1, 1);
    const int64_t nx = ttu_numel(4, p.shape);
    float *dx_cpu = tu_alloc((size_t)nx * 4), *dx_host = tu_alloc((size_t)nx * 4);
    tu_poison(dx_cpu, nx);
    tu_poison(dx_host, nx);
    bie_tensor tg = ttu_view(g, 2, (int64_t[]){p.shape[0], 5});
    bie_tensor dxc = ttu_view(dx_cpu, 4, p.shape), dxh = ttu_view(dx_host, 4, p.shape);
    CHECK_OK(bie_model_backward(cpu, &tg, &dxc));
    CHECK_OK(bie_model_backward(gpu, &tg, &dxh)); /* host grad_out and grad_x */
    check_close(dx_host, dx_cpu, nx, "input gradient");

    /* device grad_out and grad_x give the same bits as host ones */
    bie_tensor dg = upload_as(BIE_F32, g, p.shape[0], 5), ddx;
    dg.ndim = 2;
    CHECK_OK(bie_cuda_tensor_alloc(&ddx, BIE_F32, 4, p.shape, 0));
    CHECK_OK(bie_model_backward(gpu, &dg, &ddx));
    float *dx_dev = download_bytes(&ddx);
    CHECK(tu_same_bits(dx_dev, dx_host, nx));
    free(dx_dev);

    /* parameter gradients: a float layer's and a binary layer's weight */
    const char *names[] = {"15.weight", "1.weight", "11.bias"};
    check_grads(cpu, gpu, names, 3);

    /* evaluation: running statistics and packed weights */
    CHECK_OK(bie_model_set_training(cpu, false));
    CHECK_OK(bie_model_set_training(gpu, false));
    free(yc);
    free(yg);
    yc = forward_copy(cpu, &p, &n);
    yg = forward_copy(gpu, &p, &n);
    check_close(yg, yc, n, "evaluation forward");

    /* a device input gives the same output as the host one */
    bie_tensor dxin = upload_as(BIE_F32, p.x, p.shape[0], nx / p.shape[0]), y;
    dxin.ndim = 4;
    memcpy(dxin.shape, p.shape, sizeof p.shape);
    CHECK_OK(bie_model_forward(gpu, &dxin, &y));
    float *yd = download_bytes(&y);
    CHECK(tu_same_bits(yd, yg, n));
    free(yd);

    bie_tensor_free(&dg);
    bie_tensor_free(&ddx);
    bie_tensor_free(&dxin);
    free(yc);
    free(yg);
    free(g);
    free(dx_cpu);
    free(dx_host);
    bie_model_free(cpu);
    bie_model_free(gpu);
    free(p.x);
    free(p.labels);
}

/* A residual graph with every graph node type: float conv stem, BN, RPReLU, a binary conv
 * with a real-valued shortcut (add), an average-pool + 1x1 conv shortcut, concat, global
 * average pool, linear. CPU and CUDA agree (forward, input and parameter gradients, eval),
 * the CUDA model's packed form predicts bit for bit what it does in eval mode, and moving
 * keeps the parameters. */
static void add_node1(bie_model *m, bie_layer_type type, int64_t in, int64_t out, int k, int s,
                      int p, int input) {
    const bie_layer_info i = ttu_info(type, in, out, k, s, p, 1);
    CHECK_OK(bie_model_add_node(m, &i, 1, &input));
}
static void add_node2(bie_model *m, bie_layer_type type, int a, int b) {
    const bie_layer_info i = ttu_info(type, 0, 0, 0, 0, 0, 1);
    const int in[2] = {a, b};
    CHECK_OK(bie_model_add_node(m, &i, 2, in));
}

static bie_model *graph_model(uint64_t seed, bie_device where) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    add_node1(m, BIE_LAYER_CONV2D, 3, 8, 3, 1, 1, BIE_MODEL_INPUT); /* 0: 10 x 10 */
    add_node1(m, BIE_LAYER_BATCHNORM2D, 8, 0, 0, 0, 0, 0);          /* 1 */
    add_node1(m, BIE_LAYER_RPRELU, 8, 0, 0, 0, 0, 1);               /* 2 */
    add_node1(m, BIE_LAYER_BINARY_CONV2D, 8, 8, 3, 1, 1, 2);        /* 3 */
    add_node1(m, BIE_LAYER_BATCHNORM2D, 8, 0, 0, 0, 0, 3);          /* 4 */
    add_node2(m, BIE_LAYER_ADD, 4, 2);                              /* 5 */
    add_node1(m, BIE_LAYER_RPRELU, 8, 0, 0, 0, 0, 5);               /* 6 */
    add_node1(m, BIE_LAYER_BINARY_CONV2D, 8, 16, 3, 2, 1, 6);       /* 7: 5 x 5 */
    add_node1(m, BIE_LAYER_BATCHNORM2D, 16, 0, 0, 0, 0, 7);         /* 8 */
    add_node1(m, BIE_LAYER_AVGPOOL2D, 0, 0, 2, 2, 0, 6);            /* 9 */
    add_node1(m, BIE_LAYER_CONV2D, 8, 16, 1, 1, 0, 9);              /* 10 */
    add_node2(m, BIE_LAYER_ADD, 8, 10);                             /* 11 */
    add_node2(m, BIE_LAYER_CONCAT, 11, 10);                         /* 12: 32 channels */
    add_node1(m, BIE_LAYER_RPRELU, 32, 0, 0, 0, 0, 12);             /* 13 */
    add_node1(m, BIE_LAYER_GLOBAL_AVGPOOL, 0, 0, 0, 0, 0, 13);      /* 14 */
    add_node1(m, BIE_LAYER_LINEAR, 32, 5, 0, 0, 0, 14);             /* 15 */
    CHECK_OK(bie_model_reset_parameters(m, seed));
    CHECK_OK(bie_model_prepare_params(m));
    CHECK_OK(bie_model_to_device(m, where));
    return m;
}

static void test_graph_matches_cpu(void) {
    const int64_t shape[4] = {6, 3, 10, 10};
    problem p = make_problem(shape, 5, 33);
    bie_model *cpu = graph_model(9, bie_cpu()), *gpu = graph_model(9, kCuda);
    CHECK(same_params(cpu, gpu));
    int64_t n;
    float *yc = forward_copy(cpu, &p, &n), *yg = forward_copy(gpu, &p, &n);
    check_close(yg, yc, n, "graph: training forward");
    float *g = tu_alloc((size_t)n * 4);
    tu_fill(g, n, -1, 1);
    const int64_t nx = ttu_numel(4, p.shape);
    float *dxc = tu_alloc((size_t)nx * 4), *dxg = tu_alloc((size_t)nx * 4);
    tu_poison(dxc, nx);
    tu_poison(dxg, nx);
    bie_tensor tg = ttu_view(g, 2, (int64_t[]){p.shape[0], 5});
    bie_tensor tc = ttu_view(dxc, 4, p.shape), tgx = ttu_view(dxg, 4, p.shape);
    CHECK_OK(bie_model_backward(cpu, &tg, &tc));
    CHECK_OK(bie_model_backward(gpu, &tg, &tgx));
    check_close(dxg, dxc, nx, "graph: input gradient");
    const char *names[] = {"0.weight",  "2.shift_in", "2.weight", "13.shift_out",
                           "10.weight", "15.weight",  "3.bias_a"};
    check_grads(cpu, gpu, names, 7);
    CHECK_OK(bie_model_set_training(cpu, false));
    CHECK_OK(bie_model_set_training(gpu, false));
    free(yc);
    free(yg);
    yc = forward_copy(cpu, &p, &n);
    yg = forward_copy(gpu, &p, &n);
    check_close(yg, yc, n, "graph: evaluation forward");
    CHECK_OK(bie_model_pack(gpu));
    float *yp = forward_copy(gpu, &p, &n);
    CHECK(tu_same_bits(yp, yg, n));
    CHECK_OK(bie_model_to_device(gpu, bie_cpu())); /* a packed graph moves back */
    free(yp);
    yp = forward_copy(gpu, &p, &n);
    check_close(yp, yc, n, "graph: packed, moved back");
    free(yp);
    free(yc);
    free(yg);
    free(g);
    free(dxc);
    free(dxg);
    bie_model_free(cpu);
    bie_model_free(gpu);
    free(p.x);
    free(p.labels);
}

/* A scale_a written through the layer's parameter view (as the Python package and model
 * loaders do) is kept: a training forward of a rebuilt layer does not measure it again. */
static void test_scale_a_written_through_view(void) {
    for (int kind = 0; kind < 2; kind++) {
        bie_layer *l;
        if (kind == 0)
            CHECK_OK(bie_binary_linear_create(&l, 40, 8, kCuda, BIE_F32, true));
        else
            CHECK_OK(bie_q4_linear_create(&l, 40, 8, kCuda, BIE_F32));
        CHECK_OK(bie_layer_reset_parameters(l, 3));
        CHECK_OK(bie_layer_prepare_params(l));
        bie_tensor view, host;
        float want = 0.37f, got = 0.0f;
        const int64_t one[1] = {1};
        CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &view));
        CHECK_OK(bie_tensor_view(&host, &want, BIE_F32, view.ndim, view.ndim ? view.shape : one));
        CHECK_OK(bie_tensor_copy(&view, &host));
        float read = 0.0f; /* read without a view, from the device */
        CHECK_OK(bie_layer_get_scale_a(l, &read));
        CHECK(read == want);
        float x[5 * 40];
        tu_fill(x, 5 * 40, -3, 3); /* mean |x| = 1.5: a measurement would not give 0.37 */
        bie_tensor dx = upload_as(BIE_F32, x, 5, 40), y;
        CHECK_OK(bie_cuda_tensor_alloc(&y, BIE_F32, 2, (int64_t[]){5, 8}, 0));
        CHECK_OK(bie_layer_forward(l, &dx, &y));
        bie_tensor back;
        CHECK_OK(bie_tensor_view(&back, &got, BIE_F32, view.ndim, view.ndim ? view.shape : one));
        CHECK_OK(bie_tensor_copy(&back, &view));
        if (got != want) printf("kind %d: scale_a %g after the forward, set %g\n", kind, got, want);
        CHECK(got == want);
        bie_tensor_free(&dx);
        bie_tensor_free(&y);
        bie_layer_free(l);
    }
}

/* Adam can drive an activation scale through zero in a few large steps; as `bie train`
 * does, each scale_a is kept at or above half the value its first batch gave it, written
 * through its parameter view (device memory here). */
static void keep_scales(bie_model *m, float *floors, bool first) {
    for (int i = 0, k = 0; i < bie_model_param_count(m); i++) {
        bie_model_param q;
        CHECK_OK(bie_model_param_get(m, i, &q));
        if (strstr(q.name, ".scale_a") == NULL) continue;
        float v;
        bie_tensor h;
        CHECK_OK(bie_tensor_view(&h, &v, BIE_F32, q.value.ndim, q.value.shape));
        CHECK_OK(bie_tensor_copy(&h, &q.value));
        if (first) {
            floors[k] = 0.5f * v;
        } else if (v < floors[k]) {
            v = floors[k];
            CHECK_OK(bie_tensor_copy(&q.value, &h));
        }
        k++;
    }
}

/* `steps` optimizer steps; losses[s] is the loss before step s. */
static void train(bie_model *m, const problem *p, int steps, float *losses, int64_t *flips) {
    float floors[16];
    bie_optimizer_options o = bie_optimizer_defaults();
    o.adam.lr = 2e-2f;
    bie_optimizer *opt = NULL;
    CHECK_OK(bie_optimizer_create(&opt, m, &o));
    const int64_t n = p->shape[0] * p->classes;
    float *g = tu_alloc((size_t)n * 4);
    bie_tensor tl;
    CHECK_OK(bie_tensor_view(&tl, p->labels, BIE_I32, 1, p->shape));
    *flips = 0;
    for (int s = 0; s < steps; s++) {
        int64_t got;
        float *y = forward_copy(m, p, &got);
        bie_tensor ty = ttu_view(y, 2, (int64_t[]){p->shape[0], p->classes});
        bie_tensor tg = ttu_view(g, 2, (int64_t[]){p->shape[0], p->classes});
        losses[s] = NAN;
        CHECK_OK(bie_softmax_cross_entropy(&ty, &tl, &losses[s], &tg));
        CHECK_OK(bie_model_backward(m, &tg, NULL));
        int64_t f = 0;
        CHECK_OK(bie_optimizer_step(opt, &f));
        *flips += f;
        keep_scales(m, floors, s == 0);
        free(y);
    }
    free(g);
    bie_optimizer_free(opt);
}

/* The loop `bie train` runs on a GPU, which never waits for the device: the loss's gradient
 * and totals by bie_softmax_cross_entropy_accumulate into device tensors, each scale_a kept
 * at or above half of a device copy of its first-step value by bie_clamp_min_scaled.
 * losses[s] is the loss before step s (the totals are read after each step here, to check). */
static void train_on_device(bie_model *m, const problem *p, int steps, float *losses) {
    bie_optimizer_options o = bie_optimizer_defaults();
    o.adam.lr = 2e-2f;
    bie_optimizer *opt = NULL;
    CHECK_OK(bie_optimizer_create(&opt, m, &o));
    bie_tensor tl, dg, ds, hs, floors[16];
    int floor_param[16], nfloors = 0;
    const int64_t gs[2] = {p->shape[0], p->classes}, three = 3;
    double sums[3] = {0, 0, 0}, before = 0;
    CHECK_OK(bie_tensor_view(&tl, p->labels, BIE_I32, 1, p->shape));
    CHECK_OK(bie_cuda_tensor_alloc(&dg, BIE_F32, 2, gs, 0));
    CHECK_OK(bie_cuda_tensor_alloc(&ds, BIE_F64, 1, &three, 0));
    CHECK_OK(bie_tensor_view(&hs, sums, BIE_F64, 1, &three));
    CHECK_OK(bie_tensor_copy(&ds, &hs));
    bie_tensor tx = ttu_view(p->x, 4, p->shape);
    for (int s = 0; s < steps; s++) {
        bie_tensor y;
        CHECK_OK(bie_model_forward(m, &tx, &y));
        CHECK_OK(bie_softmax_cross_entropy_accumulate(&y, &tl, &dg, &ds));
        CHECK_OK(bie_model_backward(m, &dg, NULL));
        CHECK_OK(bie_optimizer_step(opt, NULL));
        for (int i = 0, k = 0; i < bie_model_param_count(m); i++) {
            bie_model_param q;
            CHECK_OK(bie_model_param_get(m, i, &q));
            if (strstr(q.name, ".scale_a") == NULL || k >= 16) continue;
            if (s == 0) {
                CHECK_OK(
                    bie_cuda_tensor_alloc(&floors[k], BIE_F32, q.value.ndim, q.value.shape, 0));
                CHECK_OK(bie_tensor_copy(&floors[k], &q.value));
                floor_param[k] = i, nfloors = k + 1;
            } else {
                CHECK(floor_param[k] == i);
                CHECK_OK(bie_clamp_min_scaled(&q.value, &floors[k], 0.5f));
            }
            k++;
        }
        CHECK_OK(bie_tensor_copy(&hs, &ds));
        CHECK(sums[2] == 0);
        losses[s] = (float)((sums[0] - before) / (double)p->shape[0]);
        before = sums[0];
    }
    /* every scale_a at or above half its snapshot */
    for (int k = 0; k < nfloors; k++) {
        bie_model_param q;
        CHECK_OK(bie_model_param_get(m, floor_param[k], &q));
        float v, f;
        bie_tensor hv, hf;
        CHECK_OK(bie_tensor_view(&hv, &v, BIE_F32, q.value.ndim, q.value.shape));
        CHECK_OK(bie_tensor_view(&hf, &f, BIE_F32, q.value.ndim, q.value.shape));
        CHECK_OK(bie_tensor_copy(&hv, &q.value));
        CHECK_OK(bie_tensor_copy(&hf, &floors[k]));
        CHECK(v >= 0.5f * f && f > 0);
        bie_tensor_free(&floors[k]);
    }
    CHECK(nfloors > 0);
    bie_tensor_free(&dg), bie_tensor_free(&ds);
    bie_optimizer_free(opt);
}

static void test_training(void) {
    const int64_t shape[4] = {20, 3, 11, 11};
    problem p = make_problem(shape, 5, 8);
    enum { STEPS = 40 }; /* on the CPU this run goes from 1.63 to 0.46 */
    float losses[STEPS], again[STEPS];
    int64_t flips = 0, flips2 = 0;
    bie_model *m = new_model(9, kCuda), *m2 = new_model(9, kCuda);
    train(m, &p, STEPS, losses, &flips);
    train(m2, &p, STEPS, again, &flips2);
    const float first = losses[0],
                last = (losses[STEPS - 1] + losses[STEPS - 2] + losses[STEPS - 3]) / 3;
    printf("training on CUDA: loss %.4f -> %.4f, %lld sign flips\n", (double)first, (double)last,
           (long long)flips);
    CHECK(isfinite(first) && last < 0.7f * first);
    CHECK(flips > 0);
    /* the same seed reproduces the run bit for bit */
    CHECK(memcmp(losses, again, sizeof losses) == 0 && flips == flips2);
    CHECK(same_params(m, m2));

    /* the loop with the loss and the scale floors on the device: the same first loss, the
     * same descent, and bit for bit reproducible */
    bie_model *d1 = new_model(9, kCuda), *d2 = new_model(9, kCuda);
    float dl[STEPS], dl2[STEPS];
    train_on_device(d1, &p, STEPS, dl);
    train_on_device(d2, &p, STEPS, dl2);
    const float dlast = (dl[STEPS - 1] + dl[STEPS - 2] + dl[STEPS - 3]) / 3;
    printf("training on CUDA, loss on the device: loss %.4f -> %.4f\n", (double)dl[0],
           (double)dlast);
    CHECK(fabsf(dl[0] - first) <= 1e-5f * first);
    CHECK(dlast < 0.7f * dl[0]);
    CHECK(memcmp(dl, dl2, sizeof dl) == 0);
    CHECK(same_params(d1, d2));
    bie_model_free(d1);
    bie_model_free(d2);

    /* a trained model moves back to the CPU and evaluates there as on the GPU */
    CHECK_OK(bie_model_set_training(m, false));
    int64_t n;
    float *yg = forward_copy(m, &p, &n);
    CHECK_OK(bie_model_to_device(m, bie_cpu()));
    CHECK(same_params(m, m2)); /* m2 is still on the GPU */
    float *yc = forward_copy(m, &p, &n);
    check_close(yg, yc, n, "trained model, evaluation");

    /* packed on the CPU, then moved: the same predictions */
    CHECK_OK(bie_model_pack(m));
    free(yc);
    yc = forward_copy(m, &p, &n);
    CHECK_OK(bie_model_to_device(m, kCuda));
    CHECK(bie_model_packed(m));
    free(yg);
    yg = forward_copy(m, &p, &n);
    check_close(yg, yc, n, "packed model");
    free(yc);
    free(yg);
    bie_model_free(m);
    bie_model_free(m2);
    free(p.x);
    free(p.labels);
}

/* The opt-in FP8 backward of the binary linear layers (shapes of multiples of 16, so that it
 * runs): a model trains with it; it stays set across moves to the CPU (exact there) and back. */
static void test_fp8_backward(void) {
    const int64_t shape[4] = {32, 3, 11, 11};
    problem p = make_problem(shape, 5, 12);
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(bie_model_add_flatten(m));
    CHECK_OK(bie_model_add_linear(m, 363, 64, true));
    CHECK_OK(bie_model_add_batchnorm1d(m, 64));
    CHECK_OK(ttu_add_binary_linear(m, 64, 64));
    CHECK_OK(bie_model_add_batchnorm1d(m, 64));
    CHECK_OK(bie_model_add_prelu(m, 1));
    CHECK_OK(ttu_add_binary_linear(m, 64, 32));
    CHECK_OK(bie_model_add_batchnorm1d(m, 32));
    CHECK_OK(bie_model_add_linear(m, 32, 5, true));
    CHECK_OK(bie_model_reset_parameters(m, 13));
    CHECK_OK(bie_model_prepare_params(m));
    CHECK(bie_model_set_backward_mode(m, BIE_BACKWARD_FP8) == BIE_ERR_UNSUPPORTED); /* CPU */
    CHECK_OK(bie_model_to_device(m, kCuda));
    if (bie_model_set_backward_mode(m, BIE_BACKWARD_FP8) != BIE_OK) {
        printf("fp8 backward: not on this device (%s)\n", bie_last_error());
    } else {
        enum { STEPS = 40 };
        float losses[STEPS];
        int64_t flips = 0;
        train(m, &p, STEPS, losses, &flips);
        const float first = losses[0],
                    last = (losses[STEPS - 1] + losses[STEPS - 2] + losses[STEPS - 3]) / 3;
        printf("training on CUDA, fp8 backward: loss %.4f -> %.4f, %lld sign flips\n",
               (double)first, (double)last, (long long)flips);
        CHECK(isfinite(first) && last < 0.7f * first && flips > 0);
        CHECK_OK(bie_model_to_device(m, bie_cpu())); /* the exact backward there */
        CHECK_OK(bie_model_to_device(m, kCuda));     /* FP8 again */
        train(m, &p, 3, losses, &flips);
        CHECK(isfinite(losses[2]));
    }
    bie_model_free(m);
    free(p.x);
    free(p.labels);
}

static void test_bad_input(void) {
    problem p = make_problem(kShape, 5, 4);
    bie_model *m = new_model(2, bie_cpu());
    bie_optimizer *opt = NULL;
    CHECK_OK(bie_optimizer_create(&opt, m, NULL));
    CHECK(bie_model_to_device(m, (bie_device){BIE_DEVICE_CUDA, 1}) == BIE_ERR_DEVICE);
    CHECK(bie_model_device(m).type == BIE_DEVICE_CPU);
    CHECK(bie_model_to_device(NULL, kCuda) == BIE_ERR_NULL_POINTER);

    /* a device input for a CPU model is refused */
    const int64_t nx = ttu_numel(4, p.shape);
    bie_tensor dx = upload_as(BIE_F32, p.x, p.shape[0], nx / p.shape[0]), y;
    dx.ndim = 4;
    memcpy(dx.shape, p.shape, sizeof p.shape);
    CHECK(bie_model_forward(m, &dx, &y) == BIE_ERR_DEVICE);

    /* an optimizer made before a move refuses to step */
    CHECK_OK(bie_model_to_device(m, kCuda));
    CHECK_OK(bie_model_forward(m, &dx, &y));
    float *g = tu_alloc((size_t)bie_tensor_numel(&y) * 4);
    tu_fill(g, bie_tensor_numel(&y), -1, 1);
    bie_tensor tg = ttu_view(g, y.ndim, y.shape);
    CHECK_OK(bie_model_backward(m, &tg, NULL));
    CHECK(bie_optimizer_step(opt, NULL) == BIE_ERR_STATE);
    bie_optimizer_free(opt);

    /* set_param from host and device sources, with the CPU's checks */
    bie_model_param w;
    CHECK_OK(bie_model_param_find(m, "15.weight", &w));
    const int64_t nw = bie_tensor_numel(&w.value);
    float *hw = tu_alloc((size_t)nw * 4), *back;
    tu_fill(hw, nw, -1, 1);
    bie_tensor src = ttu_view(hw, 2, w.value.shape);
    CHECK_OK(bie_model_set_param(m, "15.weight", &src));
    back = download_bytes(&w.value);
    CHECK(tu_same_bits(back, hw, nw));
    free(back);
    hw[3] = NAN;
    bie_tensor dsrc = upload_as(BIE_F32, hw, w.value.shape[0], w.value.shape[1]);
    CHECK(bie_model_set_param(m, "15.weight", &dsrc) == BIE_ERR_NOT_FINITE);
    back = download_bytes(&w.value);
    CHECK(!isnan(back[3]));
    free(back);
    /* an int8 binary weight loaded from the device */
    bie_model_param bw;
    CHECK_OK(bie_model_param_find(m, "3.weight", &bw));
    CHECK(bw.value.dtype == BIE_I8 && bw.value.device.type == BIE_DEVICE_CUDA);
    int8_t *q = download_bytes(&bw.value);
    for (int64_t i = 0; i < bie_tensor_numel(&bw.value); i++) q[i] = (int8_t)(i % 2 ? -3 : 5);
    bie_tensor qs;
    CHECK_OK(bie_tensor_view(&qs, q, BIE_I8, bw.value.ndim, bw.value.shape));
    CHECK_OK(bie_model_set_param(m, "3.weight", &qs));
    int8_t *q2 = download_bytes(&bw.value);
    CHECK(memcmp(q, q2, (size_t)bie_tensor_numel(&bw.value)) == 0);
    free(q);
    free(q2);

    bie_tensor_free(&dsrc);
    bie_tensor_free(&dx);
    free(hw);
    free(g);
    bie_model_free(m);
    free(p.x);
    free(p.labels);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv; /* --small: the cases are small already */
    if (gpu_missing()) return TU_SKIP;
    test_move_round_trip();
    test_graph_matches_cpu();
    test_scale_a_written_through_view();
    test_matches_cpu();
    test_training();
    test_fp8_backward();
    test_bad_input();
    return tu_finish();
}
