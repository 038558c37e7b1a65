/*
 * bie_train — training a low-bit network with bie: float layers, a model (a chain or a graph
 * of layers) that holds them together with bie's binary and 4-bit layers, a loss, and
 * optimizers.
 *
 * API status: stable
 *
 * Ordered from simple to advanced:
 *   1. loss and accuracy on logits
 *   2. optimizer steps on plain tensors (sign-flip for int8 binary weights, Adam / AdamW)
 *   3. the model (a chain or a graph of layers): building, life cycle, forward / backward
 *   4. architecture description (to save a model and rebuild it)
 *   5. parameter enumeration (for optimizers, model files, inspection)
 *   6. the optimizer object over a model's parameters
 *
 * The rules of bie.h hold here: every function returns a bie_status unless documented
 * otherwise; on error bie_last_error() says why and outputs and state are left exactly as
 * they were; nothing aborts. All tensors are float32 CPU tensors unless said otherwise.
 * Results are deterministic: the same seed, inputs and thread count reproduce a run bit
 * for bit.
 */
#ifndef BIE_TRAIN_H
#define BIE_TRAIN_H

#include "bie.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ 1. loss, accuracy */

/* Softmax cross-entropy averaged over the batch (PyTorch's cross_entropy with mean
 * reduction): loss = mean_i (logsumexp(logits[i, :]) - logits[i, labels[i]]).
 * logits: [N, C] F32 (N >= 1, C >= 1); labels: [N] I32 with values in [0, C).
 * grad_logits (may be NULL): [N, C] F32, receives d loss / d logits
 * = (softmax(logits[i]) - onehot(labels[i])) / N. It may alias logits.
 * Errors: NULL logits/labels/loss, shapes, dtypes, label out of range, non-finite logits. */
BIE_API bie_status bie_softmax_cross_entropy(const bie_tensor *logits, const bie_tensor *labels,
                                             float *loss, bie_tensor *grad_logits);

/* The loss above for a training loop that does not wait for its device: on the logits'
 * device (CPU or CUDA), the gradient into grad_logits (required; [N, C] F32 on that device;
 * may alias logits) and the batch's totals added to sums, an F64 [3] tensor on that device:
 *   sums[0] += the summed loss of the rows, sums[1] += the rows whose argmax (the first on
 *   ties) is the label, sums[2] += the rows holding a non-finite logit or, for labels on the
 *   device, a label outside [0, C); such a row adds nothing to sums[0] and sums[1], and its
 *   gradient row is zero.
 * labels: [N] I32 on the CPU (checked at once) or on the logits' device. On a GPU the call only
 * queues work on bie's stream: read sums (bie_tensor_copy) when the numbers are wanted, e.g.
 * once per epoch, and check sums[2] then. The gradient equals bie_softmax_cross_entropy's
 * (within float rounding of the double sums; bit for bit on the CPU).
 * Errors: NULL, shapes, dtypes, devices, CPU labels out of range. */
BIE_API bie_status bie_softmax_cross_entropy_accumulate(const bie_tensor *logits,
                                                        const bie_tensor *labels,
                                                        bie_tensor *grad_logits, bie_tensor *sums);

/* Index of the largest logit of each row (the first one on ties): logits [N, C] F32,
 * predictions [N] I32. Errors: NULL, shapes, dtypes. */
BIE_API bie_status bie_argmax(const bie_tensor *logits, bie_tensor *predictions);

/* Number of rows whose argmax equals the label: logits [N, C] F32, labels [N] I32.
 * Errors: as bie_argmax; labels out of [0, C). */
BIE_API bie_status bie_count_correct(const bie_tensor *logits, const bie_tensor *labels,
                                     int64_t *correct);

/* ------------------------------------------------- 2. optimizer steps on tensors */

/* x = max(x, factor * floor) element by element (a NaN in x stays), on x's device (CPU or
 * CUDA; floor F32 of x's shape on the same device; x F32), without waiting for the device:
 * a projection after an optimizer step, e.g. keeping an activation scale at or above half
 * of a snapshot of it (floor: a device copy of the scale, factor 0.5), with no host round
 * trip. Errors: NULL, devices, dtypes, shapes, factor not finite. */
BIE_API bie_status bie_clamp_min_scaled(bie_tensor *x, const bie_tensor *floor, float factor);

/* Sign-flip step for an int8 binary weight (SPEC §5), element by element:
 *   m = lerp(m, g, 1 - beta1);  v = lerp(v, sgn0(m) * lr, 1 - beta2);  u = -sign(v);
 *   where u != sign(w): w = -w
 * where sgn0(0) = 0 (the momentum's sign only) and sign(0) = +1 everywhere else; a zero
 * weight becomes -1 when it flips. Start the state with bie_signflip_init (m = 0,
 * v = -sign(w) * delta): then u starts equal to sign(w), and a weight whose gradient has
 * been 0 since the start never flips (for beta2 >= 0.5: v keeps its sign as it decays).
 * weight: I8, any shape; grad: same shape, I8 (the layers' int8-quantized gradient, used as
 * integers) or F32; m, v: same shape F32 optimizer state, updated.
 * flipped (may be NULL) receives the number of weights that changed sign.
 * The tensors may all be CPU tensors or all on one CUDA device (CUDA builds; asynchronous
 * on the current stream, except that a non-NULL flipped waits for the count).
 * Errors: NULL, shapes, dtypes, lr not finite or <= 0, betas outside [0, 1), tensors on
 * different devices or on a device this build cannot use. */
BIE_API bie_status bie_signflip_step(bie_tensor *weight, const bie_tensor *grad, bie_tensor *m,
                                     bie_tensor *v, float lr, float beta1, float beta2,
                                     int64_t *flipped);

/* The sign-flip state at the start (SPEC §5): m = 0 and v = -sign(w) * delta (sign(0) = +1),
 * delta uniform in (0, 1e-3], one per element in order, from a splitmix64 generator seeded
 * with `seed` (the same seed gives the same state on any device). weight: I8; m, v: F32 of
 * its shape, all CPU tensors or all on one CUDA device (CUDA builds; waits for the copies).
 * Errors: NULL, shapes, dtypes, devices (as bie_signflip_step), out of memory. */
BIE_API bie_status bie_signflip_init(const bie_tensor *weight, bie_tensor *m, bie_tensor *v,
                                     uint64_t seed);

typedef struct bie_adam_options {
    float lr;           /* default 1e-3 */
    float beta1, beta2; /* default 0.9, 0.999 */
    float eps;          /* default 1e-8 */
    float weight_decay; /* default 0 */
    bool decoupled;     /* false: Adam (decay added to the gradient); true: AdamW */
} bie_adam_options;

/* Adam's defaults (lr 1e-3, betas 0.9 / 0.999, eps 1e-8, no weight decay, Adam). */
BIE_API bie_adam_options bie_adam_defaults(void);

/* One Adam / AdamW step with bias correction (PyTorch's formulas), element by element:
 *   Adam:  g += weight_decay * p;                 AdamW: p -= lr * weight_decay * p;
 *   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
 *   p -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps).
 * param, grad, m, v: F32 of one shape (m, v zeros at the start). step: 1 for the first.
 * The tensors may all be CPU tensors or all on one CUDA device (CUDA builds; asynchronous on
 * the current stream).
 * Errors: NULL, shapes, dtypes, step < 1, lr / eps not finite and > 0, betas outside [0, 1),
 * weight_decay negative or not finite, tensors on different devices or on a device this
 * build cannot use. */
BIE_API bie_status bie_adam_step(bie_tensor *param, const bie_tensor *grad, bie_tensor *m,
                                 bie_tensor *v, int64_t step, const bie_adam_options *options);

/* ------------------------------------------------------------- 3. the model */

/* Opaque handle: a network of float layers and bie's binary / 4-bit layers, which the model
 * creates and owns: a chain (like torch.nn.Sequential) or a graph (see "graphs" below).
 * Layers are numbered from 0 in the order they were added. The model owns the intermediate
 * activations. */
typedef struct bie_model bie_model;

/* An empty model in training mode. Errors: NULL out. */
BIE_API bie_status bie_model_create(bie_model **out);
/* Release the model, its layers and buffers; NULL is fine. Optimizers created over the
 * model must be freed first. */
BIE_API void bie_model_free(bie_model *model);

/* Builders: each appends one layer, initialised deterministically from a seed derived from
 * (0, layer index) (see bie_model_reset_parameters). Shapes are checked when data flows
 * (bie_model_output_shape, bie_model_forward), not between layers here.
 * Errors (all): NULL model, sizes < 1 or too large, bad hyper-parameters, a model that was
 * packed (bie_model_pack) can't grow. */

/* Float linear: x [..., in] -> [..., out]; weight [out, in], bias [out] (if `bias`);
 * PyTorch's init: weight and bias uniform in ±1/sqrt(in). */
BIE_API bie_status bie_model_add_linear(bie_model *model, int64_t in_features, int64_t out_features,
                                        bool bias);
/* Batch norm over [N, C] (BatchNorm1d): learnable weight (gamma, ones) and bias (beta,
 * zeros), running_mean (zeros) and running_var (ones) updated in training with momentum
 * 0.1 (running = 0.9 running + 0.1 batch, the variance unbiased), eps 1e-5. Training
 * normalises with the batch statistics (biased variance; N >= 2), eval with the running
 * ones. */
BIE_API bie_status bie_model_add_batchnorm1d(bie_model *model, int64_t num_features);
/* Batch norm over [N, C, H, W] (BatchNorm2d): statistics per channel over N, H, W. */
BIE_API bie_status bie_model_add_batchnorm2d(bie_model *model, int64_t num_channels);
/* ReLU, any shape. Its outputs all have sign +1, so a binary layer right after it sees a
 * constant input: put ReLU where a float or 4-bit layer follows (PReLU keeps signs). */
BIE_API bie_status bie_model_add_relu(bie_model *model);
/* PReLU: y = x if x >= 0 else a * x, with one learnable slope (num_parameters = 1) or one
 * per channel (dim 1 of the input: [N, C] or [N, C, H, W]); slopes start at 0.25. */
BIE_API bie_status bie_model_add_prelu(bie_model *model, int64_t num_parameters);
/* 2-D max-pooling of NCHW input, square window `kernel_size`, `stride` (0 = kernel_size),
 * no padding, floor output size (H - k) / s + 1. The gradient goes to the first maximum of
 * each window (in row-major window order). */
BIE_API bie_status bie_model_add_maxpool2d(bie_model *model, int kernel_size, int stride);
/* [N, d1, ...] -> [N, d1 * ...]. */
BIE_API bie_status bie_model_add_flatten(bie_model *model);
/* Float conv2d (torch.nn.Conv2d, groups 1): NCHW [N, in, H, W] -> [N, out, OH, OW], square
 * kernel, stride, zero padding; weight [out, in, k, k] and bias [out] (if `bias`) uniform in
 * ±1/sqrt(in k k) (PyTorch's init). CPU: im2col + OpenBLAS; CUDA: im2col + cuBLAS. */
BIE_API bie_status bie_model_add_conv2d(bie_model *model, int64_t in_channels, int64_t out_channels,
                                        int kernel_size, int stride, int padding, bool bias);
/* 2-D average pooling of NCHW input: square window, stride (0 = kernel_size), no padding,
 * floor output size; each output is the mean of its k x k window. */
BIE_API bie_status bie_model_add_avgpool2d(bie_model *model, int kernel_size, int stride);
/* Global average pooling: [N, C, H, W] -> [N, C] (AdaptiveAvgPool2d(1) + flatten). */
BIE_API bie_status bie_model_add_global_avgpool(bie_model *model);
/* RPReLU over dim 1 ([N, C] or [N, C, H, W]), one value per channel for each of its three
 * parameters: t = x + shift_in; y = (t >= 0 ? t : weight * t) + shift_out. Parameters
 * "shift_in" (zeros), "weight" (slopes, 0.25), "shift_out" (zeros). */
BIE_API bie_status bie_model_add_rprelu(bie_model *model, int64_t channels);
/* bie's low-bit layers (bie.h) are added with bie_model_add_layer (types BIE_LAYER_BINARY_*,
 * BIE_LAYER_Q4_*); the model owns them. Nodes with several inputs (residual add, concat) are
 * added with bie_model_add_node (section 4). */

/* Re-initialise every layer: layer i from a generator seeded with a value derived from
 * (seed, i), so one layer's values do not depend on the others. Float layers as their
 * builders say; low-bit layers get reset_parameters (float weight again, as before
 * bie_model_prepare_params), bias_a zeros and scale_a 0 (set by the next training forward);
 * batch-norm statistics are reset. Errors: NULL, a packed model. */
BIE_API bie_status bie_model_reset_parameters(bie_model *model, uint64_t seed);

/* prepare_params on every low-bit layer (binary: int8 weights and scale_w for the
 * sign-flip optimizer; 4-bit: scale_w). Needed before training; idempotent.
 * Errors: NULL, a packed model. */
BIE_API bie_status bie_model_prepare_params(bie_model *model);

/* Move the model to `device` (module.to(device)): every layer, parameter and buffer is
 * rebuilt there and the old storage freed. A new model is on the CPU. On CUDA (device 0)
 * every layer runs on the GPU: forward takes its input from the host or the device and
 * returns a view of device memory; backward takes grad_out from either and writes grad_x
 * (which may be on either); parameter views (bie_model_param_get) are device tensors, and
 * bie_model_set_param loads from either. Optimizers made before a move refuse to step
 * (the parameters changed): make a new one. Errors: device not available (no CUDA
 * backend, no GPU, an index other than 0); the model is unchanged on error. Packed models
 * move too. */
BIE_API bie_status bie_model_to_device(bie_model *model, bie_device device);
/* The model's device (the CPU for NULL). */
BIE_API bie_device bie_model_device(const bie_model *model);
/* The backward mode of every binary linear layer (bie_layer_set_backward_mode; other layers
 * keep the exact backward). The model keeps the mode and applies it again after
 * bie_model_to_device; on a device without FP8 tensor cores (the CPU) its layers run the
 * exact backward until the model is moved back. Setting FP8 fails (BIE_ERR_UNSUPPORTED) on
 * such a device. */
BIE_API bie_status bie_model_set_backward_mode(bie_model *model, bie_backward_mode mode);

/* Floats of every node's output for an input of `in_ndim` extents `in_shape` (what a forward
 * keeps in activation buffers; a training forward and backward need about as much again),
 * e.g. to bound what a model from an untrusted file may cost. Errors: as
 * bie_model_output_shape. */
BIE_API bie_status bie_model_activation_floats(const bie_model *model, int in_ndim,
                                               const int64_t *in_shape, int64_t *floats);

/* Training (true, the default) or evaluation mode for every layer (module.train() /
 * .eval()): batch norm switches statistics, low-bit layers their forward path.
 * Errors: NULL; training = true on a packed model. */
BIE_API bie_status bie_model_set_training(bie_model *model, bool training);
BIE_API bool bie_model_training(const bie_model *model);

/* Pack for inference: generate_quantized_weight(qweight_only = true) on every binary and
 * 4-bit layer (the float / int8 weights are freed, "N.qweight" parameters appear, "N.weight"
 * ones of those layers disappear) and switch to evaluation mode. The model is then
 * inference-only: its evaluation forward gives bit-identical outputs to the unpacked
 * model's. Idempotent. Errors: NULL, a low-bit layer without weight data. */
BIE_API bie_status bie_model_pack(bie_model *model);
BIE_API bool bie_model_packed(const bie_model *model);

/* Shape of the output for an input of `in_ndim` extents `in_shape` (NCHW or [N, features]),
 * checking that every node accepts what its inputs give. out_shape has room for
 * BIE_MAX_DIMS extents. Errors: NULL, an empty model, a node that does not accept its input
 * shapes (the message names the node), an input whose sample shape is not the declared one
 * (bie_model_set_input_shape). */
BIE_API bie_status bie_model_output_shape(const bie_model *model, int in_ndim,
                                          const int64_t *in_shape, int *out_ndim,
                                          int64_t *out_shape);

/* Forward over a batch. x: F32 CPU, shape accepted by the first layer (N >= 1; training
 * batch norm needs N >= 2 values per channel). *out receives a view of the model's output
 * buffer (owns_data false), valid until the next forward, pack, or free. In training mode
 * the model keeps what backward needs and updates batch-norm running statistics; low-bit
 * layers initialise scale_a from the first batch. Errors: NULL, an empty model, shapes
 * (naming the layer), dtype, a model in training mode without prepared int8 weights
 * (bie_model_prepare_params), out of memory. */
BIE_API bie_status bie_model_forward(bie_model *model, const bie_tensor *x, bie_tensor *out);

/* Backward from grad_out (shaped like the last forward's output) through every node; where
 * a tensor feeds several nodes their gradients are summed, and a node whose output nobody
 * reads gets a zero gradient. Overwrites (does not accumulate) every parameter's gradient,
 * seen through
 * bie_model_param_get(). grad_x (may be NULL: not computed) receives d loss / d x, shaped
 * like the last input. Errors: NULL, no training forward since the last structural change,
 * mode switch or failed forward (BIE_ERR_STATE), shapes, dtypes. */
BIE_API bie_status bie_model_backward(bie_model *model, const bie_tensor *grad_out,
                                      bie_tensor *grad_x);

/* ------------------------------------------------- 4. architecture description */

typedef enum bie_layer_type {
    BIE_LAYER_LINEAR = 0,
    BIE_LAYER_BATCHNORM1D = 1,
    BIE_LAYER_BATCHNORM2D = 2,
    BIE_LAYER_RELU = 3,
    BIE_LAYER_PRELU = 4,
    BIE_LAYER_MAXPOOL2D = 5,
    BIE_LAYER_FLATTEN = 6,
    BIE_LAYER_BINARY_LINEAR = 7,
    BIE_LAYER_BINARY_CONV2D = 8,
    BIE_LAYER_Q4_LINEAR = 9,
    BIE_LAYER_Q4_CONV2D = 10,
    BIE_LAYER_CONV2D = 11,         /* float conv2d */
    BIE_LAYER_AVGPOOL2D = 12,      /* average pool */
    BIE_LAYER_GLOBAL_AVGPOOL = 13, /* [N, C, H, W] -> [N, C] */
    BIE_LAYER_ADD = 14,            /* sum of its inputs (residual add) */
    BIE_LAYER_CONCAT = 15,         /* channel concat of its inputs */
    BIE_LAYER_RPRELU = 16          /* shift, PReLU, shift (ReActNet's RPReLU) */
} bie_layer_type;

/* Stable lower-case name of a type, for files: "linear", "batchnorm1d", "batchnorm2d",
 * "relu", "prelu", "maxpool2d", "flatten", "binary_linear", "binary_conv2d", "q4_linear",
 * "q4_conv2d", "conv2d", "avgpool2d", "global_avgpool", "add", "concat", "rprelu"; NULL for
 * an unknown type. */
BIE_API const char *bie_layer_type_name(bie_layer_type type);
/* Inverse of bie_layer_type_name. Errors: NULL, unknown name. */
BIE_API bie_status bie_layer_type_from_name(const char *name, bie_layer_type *type);

/* Everything needed to rebuild a layer (fields that do not apply to a type are 0 / false). */
typedef struct bie_layer_info {
    bie_layer_type type;
    int64_t in;  /* in_features (linear kinds), in_channels (conv kinds), num_features
                    (batch norm), num_parameters (PReLU), channels (RPReLU) */
    int64_t out; /* out_features / out_channels */
    int kernel_size, stride, padding, dilation; /* conv kinds; pools: kernel_size, stride */
    bool bias;                                  /* linear, conv2d: has a bias */
    bool symmetric;                             /* binary kinds (SPEC §2) */
    int bits_binary_word;                       /* binary kinds: 8, 32 or 64 */
    float eps, momentum;                        /* batch norm: 1e-5, 0.1 */
} bie_layer_info;

BIE_API int bie_model_layer_count(const bie_model *model); /* 0 for NULL */
/* Describe layer `index`. Errors: NULL, index out of range. */
BIE_API bie_status bie_model_layer_info(const bie_model *model, int index, bie_layer_info *info);
/* Append a layer described by info (what bie_model_layer_info gave), honouring every field
 * (e.g. symmetric, bits_binary_word, eps, momentum). Errors: as the builders; eps not
 * finite and > 0, momentum outside [0, 1], bits_binary_word not 8 / 32 / 64. */
BIE_API bie_status bie_model_add_layer(bie_model *model, const bie_layer_info *info);

/* ---- graphs. The model is a graph of nodes (the layers) in topological order: node i
 * reads the outputs of earlier nodes, or the model's input (BIE_MODEL_INPUT); the model's
 * output is the last node's. Every builder above appends a node that reads the node before
 * it (the input for the first node), so a sequential model is a chain. A node's index is its
 * name: parameters are "<index>.<name>". Backward sums the gradients of a tensor that feeds
 * several nodes; a node whose output nobody reads gets a zero gradient. */
#define BIE_MODEL_INPUT (-1)
#define BIE_MODEL_MAX_INPUTS 8

/* Append a node of any type (what bie_model_add_layer takes) reading `inputs` (n_inputs
 * entries, each BIE_MODEL_INPUT or the index of an earlier node; a node may appear twice).
 * BIE_LAYER_ADD takes 2..BIE_MODEL_MAX_INPUTS inputs of one shape; BIE_LAYER_CONCAT
 * 2..BIE_MODEL_MAX_INPUTS inputs equal except in dim 1; every other type exactly 1. When the
 * model has an input shape (bie_model_set_input_shape), the new node's shapes are checked
 * here; otherwise when data flows. Errors: as bie_model_add_layer; n_inputs wrong for the
 * type; an input that is not an earlier node (unknown node, or a cycle); shapes that do not
 * fit (BIE_ERR_SHAPE, naming the node and its inputs). */
BIE_API bie_status bie_model_add_node(bie_model *model, const bie_layer_info *info, int n_inputs,
                                      const int *inputs);
/* The inputs of node `index`: *n_inputs entries written to inputs (room for
 * BIE_MODEL_MAX_INPUTS). Errors: NULL, index out of range. */
BIE_API bie_status bie_model_node_inputs(const bie_model *model, int index, int *n_inputs,
                                         int *inputs);
/* Declare the shape of one sample of the model's input (the extents after N: {C, H, W} or
 * {features}; ndim 0 clears it). Every node is checked against it now and every later one
 * when it is added; forward still takes any batch size and refuses other sample shapes.
 * Errors: NULL, ndim outside 0..BIE_MAX_DIMS - 1, extents < 1, a node that does not accept
 * the shapes it would see (the model is unchanged). */
BIE_API bie_status bie_model_set_input_shape(bie_model *model, int ndim, const int64_t *shape);
/* The declared sample shape (*ndim 0 when none). Errors: NULL. */
BIE_API bie_status bie_model_input_shape(const bie_model *model, int *ndim, int64_t *shape);

/* The low-bit layer object at `index` (bie.h's bie_layer_* calls), for what the model does
 * not wrap (kernel selection, word size, ...). The model keeps ownership; don't free it, and
 * keep it in the state the model expects (don't pack or reset it directly). Errors: NULL,
 * index out of range, a float layer. */
BIE_API bie_status bie_model_layer(bie_model *model, int index, bie_layer **layer);

/* --------------------------------------------------- 5. parameter enumeration */

typedef enum bie_param_kind {
    BIE_PARAM_KIND_FLOAT = 0,  /* trainable float: Adam / AdamW (weights, biases, bias_a,
                                  scale_a, batch-norm weight and bias, PReLU slopes) */
    BIE_PARAM_KIND_BINARY = 1, /* a binary layer's weight: I8 after prepare_params, trained
                                  by sign flips (F32 before prepare_params) */
    BIE_PARAM_KIND_BUFFER = 2, /* state that is saved but not trained: running_mean,
                                  running_var, scale_w */
    BIE_PARAM_KIND_PACKED = 3  /* a packed inference weight (qweight) */
} bie_param_kind;

/* One parameter or buffer of the model. */
typedef struct bie_model_param {
    const char *name; /* "<layer index>.<name>", e.g. "3.weight", "3.bias_a", "3.scale_a",
                         "3.scale_w", "3.qweight", "1.weight", "1.bias", "1.running_mean",
                         "1.running_var" (PyTorch's names; batch norm's gamma / beta are
                         "weight" / "bias", PReLU's slopes "weight"). Valid until the
                         parameter set changes (add, reset, prepare, pack) or free. */
    int layer;        /* layer index */
    bie_param_kind kind;
    bie_tensor value; /* view of the live data (writable; after writing low-bit weights
                         directly, call bie_model_set_training so that an evaluation
                         forward packs them again — bie_model_set_param and optimizer
                         steps do that themselves) */
    bie_tensor grad;  /* view of the gradient of the last backward, ndim 0 / data NULL when
                         there is none (buffers, packed weights, before the first backward).
                         Binary weights: I8, the int8-quantized gradient (SPEC §2). */
} bie_model_param;

/* Number of parameters and buffers in the model's current state (0 for NULL). Their
 * order is stable: by layer, then in a fixed order per layer type (weight, qweight, bias,
 * bias_a, scale_a, scale_w, running_mean, running_var). Which ones exist depends on the
 * state: low-bit layers have "weight" until packed and "qweight" once packed. */
BIE_API int bie_model_param_count(const bie_model *model);
/* Parameter `index` (0..count-1). Errors: NULL, index out of range. */
BIE_API bie_status bie_model_param_get(bie_model *model, int index, bie_model_param *param);
/* The parameter with this name. Errors: NULL, unknown name (BIE_ERR_INVALID_ARGUMENT). */
BIE_API bie_status bie_model_param_find(bie_model *model, const char *name, bie_model_param *param);

/* Copy src into the named parameter, e.g. when loading a model file. src must have the
 * parameter's shape; its dtype must be the parameter's, except for a binary layer's
 * "weight": an I8 src into a layer still holding F32 first runs prepare_params, and an F32
 * src into an I8 weight runs set_weight_data (i.e. prepare_params on src). "qweight" goes
 * through set_quantized_weight_data (U8 / U32 / U64 matching the layer's word size; the
 * name exists once the model is packed); "scale_a" through set_scale_a. Values must be
 * finite. Errors: NULL, unknown name, shape, dtype, non-finite values. */
BIE_API bie_status bie_model_set_param(bie_model *model, const char *name, const bie_tensor *src);

/* -------------------------------------------------- 6. optimizer over a model */

typedef struct bie_optimizer_options {
    /* sign-flip for BIE_PARAM_KIND_BINARY (SPEC §5) */
    float binary_lr;                  /* default 1e-4 */
    float binary_beta1, binary_beta2; /* default 0.99, 0.9999 */
    /* Adam / AdamW for BIE_PARAM_KIND_FLOAT */
    bie_adam_options adam; /* default bie_adam_defaults() */
    /* seed of the sign-flip state's initial v (bie_signflip_init); each binary weight's
     * generator is seeded with a mix of it and the parameter's index. Default 0. */
    uint64_t seed;
} bie_optimizer_options;

BIE_API bie_optimizer_options bie_optimizer_defaults(void);

/* Opaque handle: optimizer state (m, v per parameter, step counter) over one model. */
typedef struct bie_optimizer bie_optimizer;

/* An optimizer over the model's current trainable parameters (create it after
 * bie_model_prepare_params). options NULL = defaults. Binary weights start their sign-flip
 * state as bie_signflip_init does, from options->seed; float ones start at m = v = 0.
 * Errors: NULL, options out of range (as bie_signflip_step / bie_adam_step), a packed
 * model, binary weights not yet int8, out of memory. */
BIE_API bie_status bie_optimizer_create(bie_optimizer **out, bie_model *model,
                                        const bie_optimizer_options *options);
BIE_API void bie_optimizer_free(bie_optimizer *optimizer); /* NULL is fine */

/* One step over every trainable parameter with the gradients of the last backward:
 * sign-flip on binary weights, Adam(W) on float ones; then the step counter grows by one.
 * flipped (may be NULL) receives the number of binary weights that changed sign.
 * Errors: NULL, no backward since the last step (BIE_ERR_STATE), the model's parameters
 * changed since create (reset, pack, added layers: BIE_ERR_STATE). */
BIE_API bie_status bie_optimizer_step(bie_optimizer *optimizer, int64_t *flipped);

/* Learning rates for the next steps (schedules). Errors: NULL, not finite or <= 0. */
BIE_API bie_status bie_optimizer_set_lr(bie_optimizer *optimizer, float float_lr, float binary_lr);
/* Steps taken so far (0 for NULL). */
BIE_API int64_t bie_optimizer_steps(const bie_optimizer *optimizer);

#ifdef __cplusplus
}
#endif
#endif /* BIE_TRAIN_H */
