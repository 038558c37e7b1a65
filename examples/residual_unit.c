/* A binary residual unit in the style of Bi-Real / ReActNet built as a graph (the README's
 * graph example), trained for a few steps on random data, then packed: the packed model must
 * predict bit for bit what the model does in evaluation mode. */
#include <stdio.h>
#include <string.h>

#include "bie_train.h"

#define TRY(call)                                                        \
    do {                                                                 \
        if ((call) != BIE_OK) {                                          \
            fprintf(stderr, "%s failed: %s\n", #call, bie_last_error()); \
            return 1;                                                    \
        }                                                                \
    } while (0)

enum { N = 8, C = 64, S = 14, CLASSES = 10 };

int main(void) {
    static float x[N * C * S * S], grad[N * CLASSES], eval_out[N * CLASSES];
    int32_t labels[N];
    for (int i = 0; i < N * C * S * S; i++) x[i] = (float)((i * 7919) % 2003) / 1001.0f - 1.0f;
    for (int i = 0; i < N; i++) labels[i] = i % CLASSES;
    bie_model *m;
    TRY(bie_model_create(&m));

    /* --- the README's example */
    const int64_t sample[3] = {64, 14, 14};
    TRY(bie_model_set_input_shape(m, 3, sample)); /* every node is shape-checked as added */
    int h = BIE_MODEL_INPUT;                      /* the unit reads the model's input */
    bie_layer_info conv = {.type = BIE_LAYER_BINARY_CONV2D,
                           .in = 64,
                           .out = 64,
                           .kernel_size = 3,
                           .stride = 1,
                           .padding = 1,
                           .dilation = 1,
                           .symmetric = true,
                           .bits_binary_word = 8};
    TRY(bie_model_add_node(m, &conv, 1, &h)); /* binary 3x3 conv of h */
    TRY(bie_model_add_batchnorm2d(m, 64));    /* reads the conv */
    bie_layer_info add = {.type = BIE_LAYER_ADD};
    int in[2] = {bie_model_layer_count(m) - 1, h};
    TRY(bie_model_add_node(m, &add, 2, in)); /* BN(conv(h)) + h */
    TRY(bie_model_add_rprelu(m, 64));
    /* --- */

    TRY(bie_model_add_global_avgpool(m));
    TRY(bie_model_add_linear(m, C, CLASSES, true));
    TRY(bie_model_reset_parameters(m, 7));
    TRY(bie_model_prepare_params(m));
    bie_optimizer *opt;
    TRY(bie_optimizer_create(&opt, m, NULL));
    const int64_t xs[4] = {N, C, S, S}, ls[1] = {N}, gs[2] = {N, CLASSES};
    bie_tensor tx, tl, tg, y;
    TRY(bie_tensor_view(&tx, x, BIE_F32, 4, xs));
    TRY(bie_tensor_view(&tl, labels, BIE_I32, 1, ls));
    TRY(bie_tensor_view(&tg, grad, BIE_F32, 2, gs));
    float loss = 0;
    for (int step = 0; step < 5; step++) {
        TRY(bie_model_forward(m, &tx, &y));
        TRY(bie_softmax_cross_entropy(&y, &tl, &loss, &tg));
        TRY(bie_model_backward(m, &tg, NULL));
        TRY(bie_optimizer_step(opt, NULL));
    }
    bie_optimizer_free(opt);
    TRY(bie_model_set_training(m, false));
    TRY(bie_model_forward(m, &tx, &y));
    memcpy(eval_out, y.data, sizeof eval_out);
    TRY(bie_model_pack(m));
    TRY(bie_model_forward(m, &tx, &y));
    const int same = memcmp(eval_out, y.data, sizeof eval_out) == 0;
    printf("residual unit: loss %.4f after 5 steps, packed model %s\n", (double)loss,
           same ? "predicts as in eval mode" : "DIFFERS");
    bie_model_free(m);
    return same ? 0 : 1;
}
