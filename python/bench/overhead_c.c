/* The C side of the per-call overhead benchmark (python/bench/overhead.py): the same layer
 * calls the Python package makes, made directly through the C API, timed per call.
 * Usage: overhead_c KIND M IN OUT ITERATIONS, KIND = eval | train; prints seconds per call. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bie.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int check(bie_status st, const char *what) {
    if (st == BIE_OK) return 0;
    fprintf(stderr, "overhead_c: %s: %s\n", what, bie_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: overhead_c eval|train M IN OUT ITERATIONS\n");
        return 2;
    }
    const int train = argv[1][0] == 't';
    const int64_t m = atoll(argv[2]), in = atoll(argv[3]), out = atoll(argv[4]);
    const long iterations = atol(argv[5]);
    float *x = malloc((size_t)(m * in) * sizeof(float));
    float *y = malloc((size_t)(m * out) * sizeof(float));
    float *gy = malloc((size_t)(m * out) * sizeof(float));
    float *gx = malloc((size_t)(m * in) * sizeof(float));
    if (!x || !y || !gy || !gx) return 1;
    for (int64_t i = 0; i < m * in; i++) x[i] = (float)((i * 7919) % 13) - 6.0f;
    for (int64_t i = 0; i < m * out; i++) gy[i] = (float)((i * 104729) % 11) - 5.0f;
    const int64_t xs[2] = {m, in}, ys[2] = {m, out};
    bie_tensor tx, ty, tgy, tgx;
    bie_layer *layer;
    if (check(bie_tensor_view(&tx, x, BIE_F32, 2, xs), "view") ||
        check(bie_tensor_view(&ty, y, BIE_F32, 2, ys), "view") ||
        check(bie_tensor_view(&tgy, gy, BIE_F32, 2, ys), "view") ||
        check(bie_tensor_view(&tgx, gx, BIE_F32, 2, xs), "view") ||
        check(bie_binary_linear_create(&layer, in, out, bie_cpu(), BIE_F32, true), "create") ||
        check(bie_layer_prepare_params(layer), "prepare") ||
        check(bie_layer_set_training(layer, train), "mode"))
        return 1;
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) { /* best of 5 runs of `iterations` calls */
        double t0 = now();
        for (long i = 0; i < iterations; i++) {
            if (check(bie_layer_forward(layer, &tx, &ty), "forward")) return 1;
            if (train && check(bie_layer_backward(layer, &tgy, &tgx), "backward")) return 1;
        }
        double per_call = (now() - t0) / (double)iterations;
        best = per_call < best ? per_call : best;
    }
    printf("%.9f\n", best);
    bie_layer_free(layer);
    free(x);
    free(y);
    free(gy);
    free(gx);
    return 0;
}
