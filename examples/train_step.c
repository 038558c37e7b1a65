/* One training step of a binary linear layer, then packed inference (README example). */
#include <stdio.h>
#include <stdlib.h>

#include "bie.h"

#define TRY(call)                                                        \
    do {                                                                 \
        if ((call) != BIE_OK) {                                          \
            fprintf(stderr, "%s failed: %s\n", #call, bie_last_error()); \
            return 1;                                                    \
        }                                                                \
    } while (0)

int main(void) {
    enum { BATCH = 4, IN = 100, OUT = 10 };
    static float x[BATCH * IN], y[BATCH * OUT], grad_y[BATCH * OUT], grad_x[BATCH * IN];
    for (int i = 0; i < BATCH * IN; i++) x[i] = (float)((i * 37) % 17) / 8.0f - 1.0f;
    int64_t xs[2] = {BATCH, IN}, ys[2] = {BATCH, OUT};
    bie_tensor tx, ty, tgy, tgx;
    TRY(bie_tensor_view(&tx, x, BIE_F32, 2, xs));
    TRY(bie_tensor_view(&ty, y, BIE_F32, 2, ys));
    TRY(bie_tensor_view(&tgy, grad_y, BIE_F32, 2, ys));
    TRY(bie_tensor_view(&tgx, grad_x, BIE_F32, 2, xs));

    bie_layer *layer;
    TRY(bie_binary_linear_create(&layer, IN, OUT, bie_cpu(), BIE_F32, true));
    TRY(bie_layer_reset_parameters(layer, 42));
    TRY(bie_layer_prepare_params(layer)); /* int8 weights + scale_w */

    /* training step: forward, loss gradient (here: d(sum y^2 / 2) = y), backward */
    TRY(bie_layer_forward(layer, &tx, &ty));
    for (int i = 0; i < BATCH * OUT; i++) grad_y[i] = y[i];
    TRY(bie_layer_backward(layer, &tgy, &tgx));
    bie_tensor w, gw, gscale;
    TRY(bie_layer_param(layer, BIE_PARAM_WEIGHT, &w)); /* int8 [OUT, IN] */
    TRY(bie_layer_grad(layer, BIE_PARAM_WEIGHT, &gw)); /* int8-quantized grad */
    TRY(bie_layer_grad(layer, BIE_PARAM_SCALE_A, &gscale));
    int flips = 0; /* a crude sign-flip update: flip where the gradient agrees with the sign */
    for (int i = 0; i < OUT * IN; i++) {
        int8_t *wi = (int8_t *)w.data + i, g = ((int8_t *)gw.data)[i];
        if ((g > 64 && *wi > 0) || (g < -64 && *wi < 0)) {
            *wi = (int8_t) - *wi;
            flips++;
        }
    }
    printf("training step: y[0] = %g, grad scale_a = %g, %d weights flipped\n", (double)y[0],
           (double)*(float *)gscale.data, flips);

    /* deployment: pack the weights (1 bit each), drop the int8 copy, run inference */
    TRY(bie_layer_generate_quantized_weight(layer, true));
    TRY(bie_layer_set_training(layer, false));
    TRY(bie_layer_forward(layer, &tx, &ty));
    printf("packed inference: y[0] = %g\n", (double)y[0]);
    bie_layer_free(layer);
    return 0;
}
