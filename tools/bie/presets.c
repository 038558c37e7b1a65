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

enum {
    MLP_DEFAULT_WIDTH = 1024,
    CNN_DEFAULT_WIDTH = 32,
    CNN_DENSE_UNITS = 256,
    RESNET_DEFAULT_WIDTH = 64,
    RESNET_DEFAULT_DEPTH = 2,
    RESNET_MAX_DEPTH = 16
};

int64_t preset_default_width(const char *name) {
    if (name && strcmp(name, "mlp") == 0) return MLP_DEFAULT_WIDTH;
    return name && strcmp(name, "resnet") == 0 ? RESNET_DEFAULT_WIDTH : CNN_DEFAULT_WIDTH;
}

int64_t preset_default_depth(const char *name) {
    return name && strcmp(name, "resnet") == 0 ? RESNET_DEFAULT_DEPTH : 0;
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

/* The node a graph builder appended last. */
static int last(const bie_model *m) { return bie_model_layer_count(m) - 1; }

static bie_status add_node1(bie_model *m, const bie_layer_info *info, int input) {
    return bie_model_add_node(m, info, 1, &input);
}

/* One Bi-Real / ReActNet unit on node h (c_in channels): a binary 3x3 conv (its input
 * binarised at learnable per-channel thresholds, bias_a) and batch norm, plus a real-valued
 * shortcut: h itself, or, where the unit halves the size and doubles the channels, average
 * pool 2 + float 1x1 conv + batch norm; their sum goes through RPReLU. */
static int resnet_unit(bie_model *m, int h, int64_t c_in, int64_t c_out, bool down) {
    bie_layer_info conv;
    memset(&conv, 0, sizeof conv);
    conv.type = BIE_LAYER_BINARY_CONV2D;
    conv.in = c_in;
    conv.out = c_out;
    conv.kernel_size = 3;
    conv.stride = down ? 2 : 1;
    conv.padding = 1;
    conv.dilation = 1;
    conv.symmetric = true;
    conv.bits_binary_word = 8;
    TOOL_TRY_BIE(add_node1(m, &conv, h));
    TOOL_TRY_BIE(bie_model_add_batchnorm2d(m, c_out));
    int branch = last(m), shortcut = h;
    if (down) {
        bie_layer_info pool;
        memset(&pool, 0, sizeof pool);
        pool.type = BIE_LAYER_AVGPOOL2D;
        pool.kernel_size = 2;
        pool.stride = 2;
        TOOL_TRY_BIE(add_node1(m, &pool, h));
        TOOL_TRY_BIE(bie_model_add_conv2d(m, c_in, c_out, 1, 1, 0, false));
        TOOL_TRY_BIE(bie_model_add_batchnorm2d(m, c_out));
        shortcut = last(m);
    }
    bie_layer_info add;
    memset(&add, 0, sizeof add);
    add.type = BIE_LAYER_ADD;
    const int inputs[2] = {branch, shortcut};
    TOOL_TRY_BIE(bie_model_add_node(m, &add, 2, inputs));
    TOOL_TRY_BIE(bie_model_add_rprelu(m, c_out));
    return 0;
}

/* Float stem conv 1->C 3x3 | BN | RPReLU, then three stages of `depth` units at 28x28 (C),
 * 14x14 (2C), 7x7 (4C), the first unit of stages 2 and 3 down-sampling; global average pool
 * | float linear 4C->10 (4-bit with --first-last q4). */
static int build_resnet(bie_model *m, bool q4, int64_t c, int64_t depth) {
    const int64_t sample[3] = {1, FMNIST_SIDE, FMNIST_SIDE};
    TOOL_TRY_BIE(bie_model_set_input_shape(m, 3, sample));
    TOOL_TRY_BIE(bie_model_add_conv2d(m, 1, c, 3, 1, 1, false));
    TOOL_TRY_BIE(bie_model_add_batchnorm2d(m, c));
    TOOL_TRY_BIE(bie_model_add_rprelu(m, c));
    int64_t ch = c;
    for (int stage = 0; stage < 3; stage++)
        for (int64_t u = 0; u < depth; u++) {
            const bool down = stage > 0 && u == 0;
            TOOL_TRY(resnet_unit(m, last(m), ch, down ? 2 * ch : ch, down));
            if (down) ch *= 2;
        }
    TOOL_TRY_BIE(bie_model_add_global_avgpool(m));
    TOOL_TRY_BIE(add_first_or_last_linear(m, q4, ch, FMNIST_CLASSES));
    return 0;
}

int preset_build(const preset_config *config, bie_model **out) {
    bool is_mlp = strcmp(config->name, "mlp") == 0;
    bool is_resnet = strcmp(config->name, "resnet") == 0;
    if (!is_mlp && !is_resnet && strcmp(config->name, "cnn") != 0)
        return tool_fail("unknown model preset '%s' (expected mlp, cnn or resnet)", config->name);
    bool q4 = strcmp(config->first_last, "q4") == 0;
    if (!q4 && strcmp(config->first_last, "float") != 0)
        return tool_fail("unknown first/last layer kind '%s' (expected float or q4)",
                         config->first_last);
    int64_t width = config->width > 0 ? config->width : preset_default_width(config->name);
    if (width > (is_mlp ? 16384 : 512))
        return tool_fail("width %lld is too large for the %s preset", (long long)width,
                         config->name);
    int64_t depth = config->depth > 0 ? config->depth : preset_default_depth(config->name);
    if (is_resnet && depth > RESNET_MAX_DEPTH)
        return tool_fail("depth %lld is too large for the resnet preset (at most %d)",
                         (long long)depth, RESNET_MAX_DEPTH);
    if (!is_resnet && config->depth > 0)
        return tool_fail("--depth applies to the resnet preset only");
    bie_model *m;
    TOOL_TRY_BIE(bie_model_create(&m));
    int built = is_mlp      ? build_mlp(m, q4, width)
                : is_resnet ? build_resnet(m, q4, width, depth)
                            : build_cnn(m, q4, width);
    if (built != 0) {
        bie_model_free(m);
        return -1;
    }
    *out = m;
    return 0;
}
