/* The layer object: the state every layer kind shares on every device (struct bie_layer),
 * what differs by kind (bie_kind_def) and what differs by kind and device (bie_layer_ops).
 * The life cycle above them is written once, in layer.c; a kind is a row of the kind table
 * (kinds.c) and one ops table per device in its own files. */
#ifndef BIE_LAYER_H
#define BIE_LAYER_H

#include "../core/formats.h"
#include "../core/internal.h"
#include "../core/workspace.h"
#include "binary_weight.h"
#include "q4_weight.h"

typedef struct bie_layer_ops bie_layer_ops;

/* The names the life cycle's error messages give (KIND_operation), fixed per kind so that no
 * call formats them. */
typedef struct bie_kind_names {
    const char *prepare_params, *set_weight_data, *generate_quantized_weight;
    const char *set_quantized_weight_data, *check_forward, *set_activation;
} bie_kind_names;

/* What differs by kind (binary / 4-bit x linear / conv2d). */
typedef struct bie_kind_def {
    bie_layer_kind id;
    const char *name;         /* "binary_linear", ... (also the prefix of error messages) */
    bie_op op;                /* the GEMM its kernels run */
    bool conv;                /* NCHW input, weight [out_c, in_c, k, k] */
    bool binary;              /* weight format: bie_binary_weight (else bie_q4_weight) */
    bool packed_input;        /* the forward also takes pre-packed sign rows (binary linear) */
    double scale_a_factor[2]; /* scale_a = factor * mean|x| at first use: [asymmetric, symmetric] */
    bie_kind_names who;
} bie_kind_def;

const bie_kind_def *bie_kind_get(bie_layer_kind id);

/* The state of a layer, common to every kind and device. */
struct bie_layer {
    const bie_kind_def *kind;
    const bie_layer_ops *ops;             /* the kind's operations on the layer's device */
    int64_t in, out;                      /* features (linear) or channels (conv) */
    int64_t fan_in;                       /* weight columns: in, or in k k in [c, i, j] order */
    int64_t k, stride, padding, dilation; /* conv kinds (1, 1, 0, 1 for linear kinds) */
    bie_device device;
    bie_dtype dtype;
    bool symmetric; /* binary kinds (SPEC §2) */
    bool training;
    int kernel_id;      /* -1: default per shape */
    int backward_mode;  /* bie_backward_mode */
    bool channels_last; /* conv activations NHWC in memory (bie_layer_set_channels_last) */

    bie_binary_weight w; /* binary kinds: [out, fan_in] (on CUDA: host staging only) */
    bie_q4_weight qw;    /* 4-bit kinds: [out, fan_in] (on CUDA: host staging only) */
    float *bias_a;       /* [in] */
    float scale_a;

    /* Saved by a training forward for the backward (the CPU's buffers; on CUDA the device
     * keeps its own and only has_saved is used). Linear kinds record the input's shape
     * (saved_m rows), conv kinds its geometry. Binary kinds keep sign(x') and the clip mask
     * as bits and the weight's sign bits (saved_wrb bytes per row for conv); 4-bit kinds the
     * codes of x' as nibbles, the clip bits, the rounding residual and the weight's codes. */
    bool has_saved;
    int64_t saved_m;
    int saved_ndim;
    int64_t saved_shape[BIE_MAX_DIMS];
    bie_conv_geom saved_geom;
    uint8_t *saved_signs, *saved_mask, *saved_wbits;
    int64_t saved_wrb;
    uint8_t *saved_codes;
    int8_t *saved_resid, *saved_wcodes;
    float saved_scale_a, saved_scale_w;

    bie_layer_grads grads; /* of the last backward (CPU) */
    /* bie_layer_set_weight_grad_target: where the next backward writes the weight's gradient
     * (caller memory on the layer's device, of dtype wgrad_target_dtype), or NULL. */
    void *wgrad_target;
    bie_dtype wgrad_target_dtype;
    bie_workspace ws; /* the forward's scratch memory, grown and reused */
    void *backend;    /* device-private state (NULL on the CPU) */
};

/* The weight's operations on one device, shared by the kinds of one weight format. Each
 * validates and allocates before it changes anything; tensors passed are already checked
 * for device, dtype and shape. */
typedef struct bie_weight_ops {
    bie_status (*reset)(bie_layer *l, uint64_t seed);
    bie_status (*prepare)(bie_layer *l, const char *who);
    bie_status (*set_data)(bie_layer *l, const bie_tensor *w, const char *who);
    bie_status (*generate)(bie_layer *l, bool qweight_only, const char *who);
    bie_status (*set_qweight)(bie_layer *l, const bie_tensor *q, const char *who);
    bie_status (*set_word_bits)(bie_layer *l, int bits, const char *who); /* binary only */
    bool (*has_qweight)(const bie_layer *l);
    bool (*has_weight)(const bie_layer *l); /* a training weight (float or int8) */
    bool (*weight_is_float)(const bie_layer *l);
    /* Views: WEIGHT (wndim / wshape), QWEIGHT, BIAS_A, SCALE_A, SCALE_W. */
    bie_status (*param)(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                        bie_tensor *v);
    bie_status (*grad)(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                       bie_tensor *v);
    bie_status (*set_scale_a)(bie_layer *l, float scale_a);
    /* The value scale_a holds now (on a device: read back). */
    bie_status (*get_scale_a)(bie_layer *l, float *scale_a);
} bie_weight_ops;

/* What every kind shares on one device (start from these; a kind overrides nothing here). */
typedef struct bie_device_ops {
    /* t (not NULL) is on the layer's device; *host is t marked as a CPU tensor, for the
     * shape and dtype checks (not to be dereferenced on other devices). */
    bie_status (*on_device)(const bie_layer *l, const bie_tensor *t, const char *what,
                            const char *who, bie_tensor *host);
    /* set_activation on checked tensors: scale_a from x when 0, x_out = x + bias_a. */
    bie_status (*activate)(bie_layer *l, const bie_tensor *x, bie_tensor *x_out, const char *who);
    /* A kernel of the layer's op that this device can run for the layer (id >= 0). */
    bie_status (*check_kernel)(const bie_layer *l, int id, const char *who);
    /* The fastest kernel of the layer's op on x's GEMM shape, timed. */
    bie_status (*select_kernel)(bie_layer *l, const bie_tensor *x, int *id);
} bie_device_ops;

/* What differs by kind and device. */
struct bie_layer_ops {
    const bie_weight_ops *weight;
    const bie_device_ops *device;
    bie_status (*init)(bie_layer *l); /* device state (NULL: none) */
    void (*release)(bie_layer *l);    /* NULL: none */
    bie_status (*forward)(bie_layer *l, const bie_tensor *x, bie_tensor *out);
    /* The last training forward's output again from what it kept (NULL: not offered). */
    bie_status (*forward_again)(bie_layer *l, bie_tensor *out);
    bie_status (*backward)(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);
    /* The backward writes the weight's gradient into l->wgrad_target itself when one is set
     * (else bie_layer_backward copies it there afterwards). */
    bool wgrad_target_direct;
    /* Whether the layer can run a non-exact backward mode (NULL: EXACT only). */
    bie_status (*check_backward_mode)(const bie_layer *l, int mode, const char *who);
    bool channels_last; /* forward and backward take NHWC activations (conv kinds) */
};

/* The ops tables of each kind on each device. */
extern const bie_layer_ops bie_binary_linear_cpu_ops, bie_binary_conv2d_cpu_ops;
extern const bie_layer_ops bie_q4_linear_cpu_ops, bie_q4_conv2d_cpu_ops;
/* The device registry's table for a kind on a device type, or NULL when this build has no
 * such device. */
const bie_layer_ops *bie_layer_ops_for(bie_layer_kind kind, bie_device_type device);

/* The CPU's weight operations of each format, and what every kind shares on the CPU. */
extern const bie_weight_ops bie_binary_weight_cpu_ops, bie_q4_weight_cpu_ops;
extern const bie_device_ops bie_cpu_device_ops;

/* A tensor on the layer's device of `dtype` whose last extent is `last` and whose leading
 * extents equal those of `like` (any when NULL). */
bie_status bie_layer_check_rows(const bie_layer *l, const bie_tensor *t, const char *what,
                                bie_dtype dtype, int64_t last, const bie_tensor *like,
                                const char *who);

/* Free what a training forward saved (host buffers) and forget it. */
void bie_layer_drop_saved(bie_layer *l);
/* The weight's shape as users see it: [out, in] or [out_c, in_c, k, k]. */
int bie_layer_weight_shape(const bie_layer *l, int64_t *shape);
/* A data-less tensor of the last training forward's input shape (linear kinds), which
 * outputs and gradients of that forward are checked against. */
bie_tensor bie_layer_saved_like(const bie_layer *l);
/* Convolution geometry of an input x (NCHW) for this layer. */
bie_conv_geom bie_layer_conv_geom(const bie_layer *l, const bie_tensor *x);
/* scale_a the next forward uses: the stored one, or factor * mean|x| from host data. */
bie_status bie_layer_activation_scale(const bie_layer *l, const bie_tensor *x, float *scale);
double bie_layer_scale_a_factor(const bie_layer *l);

#endif
