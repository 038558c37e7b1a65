/* The weight of a binary layer, shared by binary linear and binary conv2d: a [rows, cols]
 * matrix (cols = fan-in: in_features, or in_c * k * k in [c, i, j] order) that is float
 * after reset_parameters, int8 after prepare_params, and may be packed into qweight (words
 * of word_bits) or dropped for inference (SPEC §2). Every function validates and allocates
 * before it changes anything. */
#ifndef BIE_BINARY_WEIGHT_H
#define BIE_BINARY_WEIGHT_H

#include "../core/formats.h"
#include "../core/internal.h"

typedef struct bie_binary_weight {
    int64_t rows, cols;
    int word_bits;
    float *f32;       /* training weight before prepare_params, or NULL */
    int8_t *i8;       /* training weight after prepare_params, or NULL */
    uint8_t *qweight; /* [rows, bie_packed_row_bytes(cols, word_bits)] or NULL */
    float scale_w;
} bie_binary_weight;

/* Zero-initialised weight of the given shape, word size 8, scale_w 1, no data yet. */
void bie_bw_init(bie_binary_weight *w, int64_t rows, int64_t cols);
void bie_bw_free(bie_binary_weight *w);
bool bie_bw_has_training_weight(const bie_binary_weight *w);

/* Kaiming-uniform (a = sqrt(5)): uniform in ±1/sqrt(cols), seeded; drops int8 and qweight. */
bie_status bie_bw_reset(bie_binary_weight *w, uint64_t seed);
/* prepare_params: int8 weight and scale_w from the float weight (no-op when already int8). */
bie_status bie_bw_prepare(bie_binary_weight *w, const char *who);
/* set_weight_data: copy, check finiteness, prepare (data must have rows * cols floats). */
bie_status bie_bw_set_data(bie_binary_weight *w, const float *data, const char *who);
/* generate_quantized_weight. */
bie_status bie_bw_generate_qweight(bie_binary_weight *w, bool qweight_only, const char *who);
/* set_quantized_weight_data: q must already be validated [rows, words] of the word dtype. */
bie_status bie_bw_set_qweight(bie_binary_weight *w, const void *q, const char *who);
bie_status bie_bw_set_word_bits(bie_binary_weight *w, int bits, const char *who);
/* Pack sign(training weight) into rows of row_bytes (>= ceil(cols / 8)) bytes. */
bie_status bie_bw_pack(const bie_binary_weight *w, int64_t row_bytes, uint8_t **out,
                       const char *who);
/* The error for a weight freed by qweight_only. */
bie_status bie_bw_no_weight(const char *who);
/* U8 / U32 / U64 for word sizes 8 / 32 / 64. */
bie_dtype bie_bw_word_dtype(int word_bits);

/* Shared by the layers' set_activation: scale_a as stored, or its initialisation
 * factor * mean|x| (binary: 2 symmetric, 4 otherwise; 4-bit: 2 / 11.269); an error if that
 * is not positive. */
bie_status bie_activation_scale(float current, const float *x, int64_t n, double factor,
                                const char *who, float *scale);
/* The gradients a layer's last backward produced (every layer's grad() reads them). */
typedef struct bie_layer_grads {
    bool present;
    float *w;     /* float gradient of the weight */
    int8_t *w_i8; /* its int8 quantization (binary layers with int8 weights) or NULL */
    float *bias_a;
    float scale_a;
} bie_layer_grads;
void bie_grads_free(bie_layer_grads *g);
/* Replace the gradients by these (the set takes ownership of the buffers). */
void bie_grads_install(bie_layer_grads *g, float *w, int8_t *w_i8, float *bias_a, float scale_a);
/* grad(): WEIGHT (int8 when there is one, else float), WEIGHT_FLOAT_GRAD, BIAS_A, SCALE_A. */
bie_status bie_grads_view(bie_layer_grads *g, bie_param which, int wndim, const int64_t *wshape,
                          const int64_t *bias_len, bie_tensor *v, const char *who);

/* A layer's bias_a: n zeros (NULL when out of memory). */
float *bie_layer_bias_alloc(int64_t n);
/* The layers' set_scale_a check: finite and >= 0 (0 = initialise from the next input). */
bie_status bie_check_scale_a(float scale_a, const char *who);

/* Per-tensor narrow-range int8 quantization (SPEC §1). */
void bie_quantize_i8(const float *x, int64_t n, int8_t *q);

/* Validates a CPU tensor of `dtype` whose last extent is `last` and whose leading extents
 * equal those of `like` (or, when like is NULL, any leading extents). */
bie_status bie_check_rows_tensor(const bie_tensor *t, const char *what, bie_dtype dtype,
                                 int64_t last, const bie_tensor *like, const char *who);

/* The device and dtype a binary layer may be created with: CPU float32, or CUDA (in a build
 * with the backend) float32 / bfloat16 / float16. */
bie_status bie_layer_check_device(bie_device device, bie_dtype dtype, const char *who);

#endif
