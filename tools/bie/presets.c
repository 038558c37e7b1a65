/* The model presets of `bie train` (see model_io.h). Hidden layers are binary; the first and
 * last layers are float or 4-bit, as in the original library's examples, because they see
 * the raw pixels and produce the class scores, where one bit per value costs the most
 * accuracy. A binary layer binarises its own input (sign of x + bias_a), so no activation
 * function is needed in front of it; batch norm before each binary layer centres what the
 * sign sees. */
#include <string.h>

#include "dataset.h"
#include "errors.h"
#include "model_io.h"

enum { MLP_DEFAULT_WIDTH = 1024, CNN_DEFAULT_WIDTH = 32, CNN_DENSE_UNITS = 256 };

int64_t preset_default_width(const char *name) {
    return name && strcmp(name, "mlp") == 0 ? MLP_DEFAULT_WIDTH : CNN_DEFAULT_WIDTH;
}

/* A low-bit layer: binary ones symmetric with 8-bit words; conv2d 3x3, stride 1, padding 1
 * (the size is kept). */
static bie_status add_low_bit(bie_model *m, bie_layer_type type, int64_t in, int64_t out) {
    bie_layer_info i;
    memset(&i, 0, sizeof i);
    i.type = type;
    i.in = in;
    i.out = out;
    i.symmetric = true;
    i.bits_binary_word = 8;
    if (type == BIE_LAYER_BINARY_CONV2D || type == BIE_LAYER_Q4_CONV2D) {
        i.kernel_size = 3;
        i.stride = 1;
        i.padding = 1;
        i.dilation = 1;
    }
    return bie_model_add_layer(m, &i);
}

static bie_status add_first_or_last_linear(bie_model *m, bool q4, int64_t in, int64_t out) {
    return q4 ? add_low_bit(m, BIE_LAYER_Q4_LINEAR, in, out)
              : bie_model_add_linear(m, in, out, true);
}

/* flatten | first 784->H | BN | binary H->H | BN | binary H->H | BN | PReLU | last H->10 */
static int build_mlp(bie_model *m, bool q4, int64_t h) {
    TOOL_TRY_BIE(bie_model_add_flatten(m));
    TOOL_TRY_BIE(add_first_or_last_linear(m, q4, FMNIST_PIXELS, h));
    TOOL_TRY_BIE(bie_model_add_batchnorm1d(m, h));
    for (int i = 0; i < 2; i++) {
        TOOL_TRY_BIE(add_low_bit(m, BIE_LAYER_BINARY_LINEAR, h, h));
        TOOL_TRY_BIE(bie_model_add_batchnorm1d(m, h));
    }
    TOOL_TRY_BIE(bie_model_add_prelu(m, h));
    TOOL_TRY_BIE(add_first_or_last_linear(m, q4, h, FMNIST_CLASSES));
    return 0;
}

/* 4-bit conv 1->C (28x28) | pool (14x14) | BN | binary conv C->2C | pool (7x7) | BN |
 * binary conv 2C->4C | BN | flatten | binary linear 4C*49->256 | BN | PReLU | last 256->10.
 * Pooling right after the first conv keeps the binary convs at 14x14 and 7x7, where their
 * backward passes (float GEMMs and im2col) cost a quarter of what they would at 28x28.
 * The first layer is a 4-bit conv in both variants: the library has no float conv2d. */
static int build_cnn(bie_model *m, bool q4, int64_t c) {
    TOOL_TRY_BIE(add_low_bit(m, BIE_LAYER_Q4_CONV2D, 1, c));
    TOOL_TRY_BIE(bie_model_add_maxpool2d(m, 2, 2));
    TOOL_TRY_BIE(bie_model_add_batchnorm2d(m, c));
    TOOL_TRY_BIE(add_low_bit(m, BIE_LAYER_BINARY_CONV2D, c, 2 * c));
    TOOL_TRY_BIE(bie_model_add_maxpool2d(m, 2, 2));
    TOOL_TRY_BIE(bie_model_add_batchnorm2d(m, 2 * c));
    TOOL_TRY_BIE(add_low_bit(m, BIE_LAYER_BINARY_CONV2D, 2 * c, 4 * c));
    TOOL_TRY_BIE(bie_model_add_batchnorm2d(m, 4 * c));
    TOOL_TRY_BIE(bie_model_add_flatten(m));
    TOOL_TRY_BIE(add_low_bit(m, BIE_LAYER_BINARY_LINEAR, 4 * c * 7 * 7, CNN_DENSE_UNITS));
    TOOL_TRY_BIE(bie_model_add_batchnorm1d(m, CNN_DENSE_UNITS));
    TOOL_TRY_BIE(bie_model_add_prelu(m, CNN_DENSE_UNITS));
    TOOL_TRY_BIE(add_first_or_last_linear(m, q4, CNN_DENSE_UNITS, FMNIST_CLASSES));
    return 0;
}

int preset_build(const preset_config *config, bie_model **out) {
    bool is_mlp = strcmp(config->name, "mlp") == 0;
    if (!is_mlp && strcmp(config->name, "cnn") != 0)
        return tool_fail("unknown model preset '%s' (expected mlp or cnn)", config->name);
    bool q4 = strcmp(config->first_last, "q4") == 0;
    if (!q4 && strcmp(config->first_last, "float") != 0)
        return tool_fail("unknown first/last layer kind '%s' (expected float or q4)",
                         config->first_last);
    int64_t width = config->width > 0 ? config->width : preset_default_width(config->name);
    if (width > (is_mlp ? 16384 : 512))
        return tool_fail("width %lld is too large for the %s preset", (long long)width,
                         config->name);
    bie_model *m;
    TOOL_TRY_BIE(bie_model_create(&m));
    if ((is_mlp ? build_mlp(m, q4, width) : build_cnn(m, q4, width)) != 0) {
        bie_model_free(m);
        return -1;
    }
    *out = m;
    return 0;
}
