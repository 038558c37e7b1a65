/* The device state every layer on CUDA shares (binary and 4-bit, linear and conv2d): the
 * weight in device memory, bias_a, the device scalars the kernels read (scale_a, scale_w, and
 * the forward's copies of both for the backward) and the last backward's gradients. Tensors
 * users pass or receive are device tensors; the views and checks below give them the CPU
 * layers' shapes and errors.
 *
 * What the weight is made of depends on the layer (binary_weight_cuda.h: float, int8 and
 * packed signs; q4_weight_cuda.h: float and nibble rows); life-cycle calls that are rare
 * and not on the hot path stage it to the host, reuse the CPU weight code and upload the
 * result. Each successful upload bumps `version`, so that layers can rebuild caches derived
 * from the weight (its codes in a GEMM layout). */
#ifndef BIE_CUDA_LAYER_H
#define BIE_CUDA_LAYER_H

#include "binary_weight.h"

enum { BIE_CBW_SCALE_A = 0, BIE_CBW_SCALE_W = 1, BIE_CBW_SAVED_SCALES = 2 };

typedef struct bie_cuda_bw {
    int device;
    int64_t rows, cols, bias_len;
    int64_t ld; /* the kind's GEMM-layout row bytes (set by its init) */
    const char *module;
    float *w_f32;   /* float training weight, or NULL */
    int8_t *w_i8;   /* int8 training weight (binary layers after prepare_params), or NULL */
    void *qweight;  /* the user format of the quantized weight [rows, ...], or NULL */
    float *bias_a;  /* [bias_len] */
    float *scalars; /* scale_a, scale_w, saved scale_a, saved scale_w */
    /* scale_a is non-zero: set through bie_cbw_set_scale_a or measured. False after a
     * writable view of scale_a was handed out (the value on the device then decides). */
    bool scale_a_known;
    unsigned version; /* bumped by every successful upload */
    /* Gradients of the last backward. g_w_target: where that backward wrote the weight's
     * gradient (bie_layer_set_weight_grad_target: caller memory of dtype g_w_target_dtype,
     * in place of g_w_i8 for an int8 weight, else of g_w), or NULL. */
    bool has_grads;
    float *g_w, *g_bias, *g_scale;
    int8_t *g_w_i8;
    void *g_w_target;
    bie_dtype g_w_target_dtype;
    /* The running backward's weight gradients (bie_cbw_reserve_grads): float and int8 (NULL
     * for a float weight), and the target it was given. */
    float *out_w;
    int8_t *out_w_i8;
    void *out_target;
} bie_cuda_bw;

/* Status of a CUDA runtime call, with `module` in the message. */
bie_status bie_cbw_cuda_ok(int cuda_error, const char *module, const char *what);
bie_status bie_cbw_alloc(void **p, size_t bytes, const char *module, const char *what);
void bie_cbw_free_ptr(void *p);
/* Free device memory and clear the pointer. */
#define BIE_DEV_FREE(p)      \
    do {                     \
        bie_cbw_free_ptr(p); \
        (p) = NULL;          \
    } while (0)
/* Copy (any direction) and wait, on the calling thread's stream. */
bie_status bie_cbw_copy_sync(void *dst, const void *src, size_t bytes, const char *module,
                             const char *what);
/* A new device buffer filled from host memory (*dst NULL when src is NULL). */
bie_status bie_cbw_upload(const bie_cuda_bw *d, void **dst, const void *src, size_t bytes,
                          const char *what);
/* n elements of a device tensor of float `dtype` (f32/bf16/f16) as host float32. */
bie_status bie_cbw_to_host_f32(const bie_cuda_bw *d, bie_dtype dtype, const void *src, size_t n,
                               float *dst);

/* A layer's device state of `size` bytes (a struct that starts with a bie_cuda_bw), zeroed,
 * installed as l->backend with its bie_cuda_bw created for the layer's weight and bias_a.
 * On error nothing is left installed. */
struct bie_layer;
bie_status bie_cuda_layer_state(struct bie_layer *l, size_t size, const char *module);
/* Free the state's bie_cuda_bw and the state itself (NULL is fine). */
void bie_cuda_layer_state_free(struct bie_layer *l);

/* On device `device`: bias_a zeros, scale_a 0, scale_w 1, no weight yet. */
bie_status bie_cbw_create(bie_cuda_bw *d, int device, int64_t rows, int64_t cols, int64_t bias_len,
                          const char *module);
void bie_cbw_free(bie_cuda_bw *d);

/* Parameter views: WEIGHT (the int8 weight when there is one, else the float one;
 * wndim/wshape), BIAS_A, SCALE_A, SCALE_W. QWEIGHT is the layer's (its format differs). */
bie_status bie_cbw_param_common(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape,
                                bie_tensor *v);
/* Gradient views of the last backward. */
bie_status bie_cbw_grad(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape,
                        bie_tensor *v);
/* Room for a backward's gradients (int8 weight gradient only for an int8 weight) and its
 * weight-gradient destinations out_w / out_w_i8: `target` (the layer's wgrad_target, caller
 * memory of the weight's gradient dtype, or NULL) in place of the layer's own buffer. */
bie_status bie_cbw_reserve_grads(bie_cuda_bw *d, void *target);
/* After a successful backward: its gradients are the layer's (views go to the target it was
 * given, if any). */
void bie_cbw_grads_done(bie_cuda_bw *d);

bie_status bie_cbw_set_scale_a(bie_cuda_bw *d, float scale_a);
/* scale_a = factor * mean|x| over n elements of x (device, dtype) when still 0. */
/* Whether scale_a is set: the flag, or, when it is not, the value on the device (read back,
 * which waits for the stream), which then sets the flag. */
bie_status bie_cbw_scale_a_known(bie_cuda_bw *d, bool *known);
/* The value on the device (waits for the stream); sets the flag from it. */
bie_status bie_cbw_read_scale_a(bie_cuda_bw *d, float *scale_a);
bie_status bie_cbw_ensure_scale_a(bie_cuda_bw *d, bie_dtype dtype, const void *x, int64_t n,
                                  double factor, const char *who);
/* The saved scales = {scale_a, scale_w}, on the stream (no wait). */
bie_status bie_cbw_save_scales(bie_cuda_bw *d);

/* A device tensor on CUDA device `device` of `dtype` whose last extent is `last` and whose
 * leading extents equal those of `like` (any when like is NULL). */
bie_status bie_cbw_check_tensor(int device, const bie_tensor *t, const char *what, bie_dtype dtype,
                                int64_t last, const bie_tensor *like, const char *who);
/* t is a tensor on CUDA device `device`; *host is t viewed as a host tensor, for the CPU
 * layers' shape and dtype checks (it must not be dereferenced). */
bie_status bie_cbw_on_device(int device, const bie_tensor *t, const char *what, const char *who,
                             bie_tensor *host);
/* A 4-dimensional device tensor of `dtype` and `shape`, checked as the CPU checks a host one. */
bie_status bie_cbw_check_shape4(int device, const bie_tensor *t, bie_dtype dtype,
                                const int64_t *shape, const char *what, const char *who);
/* Every change of the weight through the host invalidates what the forward saved. */
static inline bie_status bie_cbw_weight_changed(bool *has_saved, bie_status st) {
    if (st == BIE_OK) *has_saved = false;
    return st;
}
/* A view of device memory on device `device`. */
bie_status bie_cbw_view(int device, bie_tensor *v, void *data, bie_dtype dt, int ndim,
                        const int64_t *shape);

#endif
