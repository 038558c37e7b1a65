/* The model as a graph: nodes and their inputs, the declared input shape, and the shape of
 * every node's output (checked when a node is added, when the input shape is declared and
 * before data flows). */
#include <stdio.h>
#include <string.h>

#include "train_internal.h"

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        if (!bie_mul_ok(n, shape[d], &n)) return -1;
    return n;
}

static bie_status shape_error(int index, const bie_layer_info *c, const char *what) {
    return bie_fail(BIE_ERR_SHAPE, "model: layer %d (%s): %s", index, bie_layer_type_name(c->type),
                    what);
}

/* "[2, 3, 4]" into buf. */
static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t at = 0;
    at += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && at < cap; d++)
        at += (size_t)snprintf(buf + at, cap - at, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (at < cap) snprintf(buf + at, cap - at, "]");
    return buf;
}

/* floor((size + 2p - d(k - 1) - 1) / s) + 1, or 0 when the dilated kernel does not fit. */
static int64_t conv_extent(int64_t size, const bie_layer_info *c) {
    const int64_t span = (int64_t)c->dilation * (c->kernel_size - 1) + 1;
    if (size + 2 * (int64_t)c->padding < span) return 0;
    return (size + 2 * (int64_t)c->padding - span) / c->stride + 1;
}

/* Output shape of a node of kind c (number `index`, for messages) with n inputs. */
static bie_status node_out_shape(const bie_layer_info *c, int index, int n, const int *ndims,
                                 const int64_t (*shapes)[BIE_MAX_DIMS], int *out_ndim,
                                 int64_t *out) {
    char msg[400], a[96], b[96];
    const int ndim = ndims[0];
    const int64_t *shape = shapes[0];
    *out_ndim = ndim;
    memcpy(out, shape, (size_t)ndim * sizeof *out);
    const bie_layer_type_traits *t = bie_layer_type_traits_of(c->type);
    if (t == NULL) return shape_error(index, c, "unknown layer type");
    if (t->conv) {
        if (ndim != 4 || shape[1] != c->in) {
            snprintf(msg, sizeof msg, "expects NCHW input with %lld channels, got %s",
                     (long long)c->in, shape_str(a, sizeof a, ndim, shape));
            return shape_error(index, c, msg);
        }
        out[1] = c->out;
        out[2] = conv_extent(shape[2], c);
        out[3] = conv_extent(shape[3], c);
        if (out[2] < 1 || out[3] < 1) {
            snprintf(msg, sizeof msg, "input %lld x %lld is smaller than the dilated kernel",
                     (long long)shape[2], (long long)shape[3]);
            return shape_error(index, c, msg);
        }
        return BIE_OK;
    }
    if (c->type == BIE_LAYER_LINEAR || t->low_bit) {
        if (shape[ndim - 1] != c->in) {
            snprintf(msg, sizeof msg,
                     "the input's last extent is %lld, expected in_features = %lld",
                     (long long)shape[ndim - 1], (long long)c->in);
            return shape_error(index, c, msg);
        }
        out[ndim - 1] = c->out;
        return BIE_OK;
    }
    switch (c->type) {
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D: {
        const int want = c->type == BIE_LAYER_BATCHNORM1D ? 2 : 4;
        if (ndim != want || shape[1] != c->in) {
            snprintf(msg, sizeof msg, "expects input [N, %lld%s], got %s", (long long)c->in,
                     want == 4 ? ", H, W" : "", shape_str(a, sizeof a, ndim, shape));
            return shape_error(index, c, msg);
        }
        return BIE_OK;
    }
    case BIE_LAYER_RELU: return BIE_OK;
    case BIE_LAYER_PRELU:
    case BIE_LAYER_RPRELU:
        if ((c->in > 1 || c->type == BIE_LAYER_RPRELU) && (ndim < 2 || shape[1] != c->in)) {
            snprintf(msg, sizeof msg, "has %lld channels: the input's dim 1 must have that size",
                     (long long)c->in);
            return shape_error(index, c, msg);
        }
        return BIE_OK;
    case BIE_LAYER_MAXPOOL2D:
    case BIE_LAYER_AVGPOOL2D:
        if (ndim != 4 || shape[2] < c->kernel_size || shape[3] < c->kernel_size) {
            snprintf(msg, sizeof msg, "expects NCHW input of at least %d x %d", c->kernel_size,
                     c->kernel_size);
            return shape_error(index, c, msg);
        }
        out[2] = (shape[2] - c->kernel_size) / c->stride + 1;
        out[3] = (shape[3] - c->kernel_size) / c->stride + 1;
        return BIE_OK;
    case BIE_LAYER_GLOBAL_AVGPOOL:
        if (ndim != 4) return shape_error(index, c, "expects NCHW input");
        *out_ndim = 2;
        return BIE_OK;
    case BIE_LAYER_FLATTEN:
        if (ndim < 2) return shape_error(index, c, "expects an input of rank >= 2");
        *out_ndim = 2;
        out[1] = numel_of(ndim - 1, shape + 1);
        return BIE_OK;
    case BIE_LAYER_ADD:
    case BIE_LAYER_CONCAT: {
        const bool cat = c->type == BIE_LAYER_CONCAT;
        if (cat && ndim < 2) return shape_error(index, c, "expects inputs of rank >= 2");
        for (int j = 1; j < n; j++) {
            bool same = ndims[j] == ndim;
            for (int d = 0; same && d < ndim; d++)
                same = shapes[j][d] == shape[d] || (cat && d == 1);
            if (!same) {
                snprintf(msg, sizeof msg, "input %d has shape %s and input 0 %s: %s", j,
                         shape_str(a, sizeof a, ndims[j], shapes[j]),
                         shape_str(b, sizeof b, ndim, shape),
                         cat ? "a concat needs equal shapes except in dim 1"
                             : "an add needs equal shapes");
                return shape_error(index, c, msg);
            }
            if (cat) out[1] += shapes[j][1];
        }
        return BIE_OK;
    }
    default: break;
    }
    return shape_error(index, c, "unknown layer type");
}

/* The shapes of node `index`'s inputs, from the rows of a shape plan. */
static void gather(const bie_train_layer *l, const int *ndims,
                   const int64_t (*shapes)[BIE_MAX_DIMS], int *in_nd,
                   int64_t (*in_sh)[BIE_MAX_DIMS]) {
    for (int j = 0; j < l->n_inputs; j++) {
        in_nd[j] = ndims[l->inputs[j] + 1];
        memcpy(in_sh[j], shapes[l->inputs[j] + 1], sizeof in_sh[j]);
    }
}

bie_status bie_model_layer_out_shape(const bie_model *m, int index, const int *ndims,
                                     const int64_t (*shapes)[BIE_MAX_DIMS], int *out_ndim,
                                     int64_t *out_shape) {
    const bie_train_layer *l = &m->layers[index];
    return node_out_shape(&l->info, index, l->n_inputs, ndims, shapes, out_ndim, out_shape);
}

bie_status bie_model_plan_shapes(const bie_model *m, int in_ndim, const int64_t *in_shape,
                                 int *ndims, int64_t (*shapes)[BIE_MAX_DIMS], const char *who) {
    if (in_ndim < 1 || in_ndim > BIE_MAX_DIMS)
        return bie_fail(BIE_ERR_SHAPE, "%s: input rank %d outside 1..%d", who, in_ndim,
                        BIE_MAX_DIMS);
    for (int d = 0; d < in_ndim; d++)
        if (in_shape[d] < 1) return bie_fail(BIE_ERR_SHAPE, "%s: input extents must be >= 1", who);
    const int64_t n_in = numel_of(in_ndim, in_shape);
    if (n_in < 0 || n_in > (int64_t)1 << 40)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large", who);
    if (m->sample_ndim > 0) {
        bool ok = in_ndim == m->sample_ndim + 1;
        for (int d = 0; ok && d < m->sample_ndim; d++) ok = in_shape[d + 1] == m->sample_shape[d];
        if (!ok) {
            char a[96], b[96];
            return bie_fail(BIE_ERR_SHAPE,
                            "%s: input %s does not match the model's input shape "
                            "[N, %s]",
                            who, shape_str(a, sizeof a, in_ndim, in_shape),
                            shape_str(b, sizeof b, m->sample_ndim, m->sample_shape) + 1);
        }
    }
    ndims[0] = in_ndim;
    memset(shapes[0], 0, sizeof shapes[0]);
    memcpy(shapes[0], in_shape, (size_t)in_ndim * sizeof *in_shape);
    for (int i = 0; i < m->count; i++) {
        int in_nd[BIE_MODEL_MAX_INPUTS];
        int64_t in_sh[BIE_MODEL_MAX_INPUTS][BIE_MAX_DIMS];
        gather(&m->layers[i], ndims, (const int64_t(*)[BIE_MAX_DIMS])shapes, in_nd, in_sh);
        memset(shapes[i + 1], 0, sizeof shapes[i + 1]);
        BIE_TRY(bie_model_layer_out_shape(m, i, in_nd, (const int64_t(*)[BIE_MAX_DIMS])in_sh,
                                          &ndims[i + 1], shapes[i + 1]));
        const int64_t n = numel_of(ndims[i + 1], shapes[i + 1]);
        if (n < 0 || n > (int64_t)1 << 40)
            return bie_fail(BIE_ERR_OVERFLOW, "%s: layer %d's output is too large", who, i);
    }
    return BIE_OK;
}

/* A shape plan's rows on the heap: (count + 2) rows, room for one node more. */
typedef struct plan {
    int *ndims;
    int64_t (*shapes)[BIE_MAX_DIMS];
} plan;

static bie_status plan_alloc(const bie_model *m, plan *p, const char *who) {
    p->ndims = malloc((size_t)(m->count + 2) * sizeof *p->ndims);
    p->shapes = malloc((size_t)(m->count + 2) * sizeof *p->shapes);
    if (p->ndims && p->shapes) return BIE_OK;
    free(p->ndims);
    free(p->shapes);
    return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: shape plan", who);
}

static void plan_free(plan *p) {
    free(p->ndims);
    free(p->shapes);
}

/* The plan of a batch of 2 samples of the declared input shape. */
static bie_status plan_declared(const bie_model *m, plan *p, const char *who) {
    int64_t in[BIE_MAX_DIMS] = {2};
    memcpy(in + 1, m->sample_shape, (size_t)m->sample_ndim * sizeof *in);
    return bie_model_plan_shapes(m, m->sample_ndim + 1, in, p->ndims, p->shapes, who);
}

bie_status bie_model_output_shape(const bie_model *m, int in_ndim, const int64_t *in_shape,
                                  int *out_ndim, int64_t *out_shape) {
    static const char *who = "model_output_shape";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(in_shape);
    BIE_CHECK_NULL(out_ndim);
    BIE_CHECK_NULL(out_shape);
    if (m->count == 0) return bie_fail(BIE_ERR_STATE, "%s: the model has no layers", who);
    plan p;
    BIE_TRY(plan_alloc(m, &p, who));
    bie_status st = bie_model_plan_shapes(m, in_ndim, in_shape, p.ndims, p.shapes, who);
    if (st == BIE_OK) {
        *out_ndim = p.ndims[m->count];
        memcpy(out_shape, p.shapes[m->count], (size_t)*out_ndim * sizeof *out_shape);
    }
    plan_free(&p);
    return st;
}

bie_status bie_model_activation_floats(const bie_model *m, int in_ndim, const int64_t *in_shape,
                                       int64_t *floats) {
    static const char *who = "model_activation_floats";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(in_shape);
    BIE_CHECK_NULL(floats);
    if (m->count == 0) return bie_fail(BIE_ERR_STATE, "%s: the model has no layers", who);
    plan p;
    BIE_TRY(plan_alloc(m, &p, who));
    bie_status st = bie_model_plan_shapes(m, in_ndim, in_shape, p.ndims, p.shapes, who);
    int64_t total = 0; /* each row <= 2^40 and at most 2^30 rows: no overflow */
    for (int i = 1; st == BIE_OK && i <= m->count; i++) total += numel_of(p.ndims[i], p.shapes[i]);
    if (st == BIE_OK) *floats = total;
    plan_free(&p);
    return st;
}

bie_status bie_model_check_inputs(const bie_model *m, bie_layer_type type, int n_inputs,
                                  const int *inputs, const char *who) {
    const bool multi = type == BIE_LAYER_ADD || type == BIE_LAYER_CONCAT;
    if (multi ? n_inputs < 2 || n_inputs > BIE_MODEL_MAX_INPUTS : n_inputs != 1)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: a %s node takes %s inputs, got %d", who,
                        bie_layer_type_name(type), multi ? "2..8" : "exactly 1", n_inputs);
    if (inputs == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: inputs is NULL", who);
    for (int j = 0; j < n_inputs; j++)
        if (inputs[j] < BIE_MODEL_INPUT || inputs[j] >= m->count)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                            "%s: input %d of node %d is %d, which is not an earlier node "
                            "(-1 = the model's input, 0..%d = the nodes so far: nodes come in "
                            "topological order, so an unknown node or a cycle is refused)",
                            who, j, m->count, inputs[j], m->count - 1);
    return BIE_OK;
}

bie_status bie_model_add_node(bie_model *m, const bie_layer_info *info, int n_inputs,
                              const int *inputs) {
    static const char *who = "model_add_node";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(info);
    if (m->packed)
        return bie_fail(BIE_ERR_STATE, "%s: a packed (inference-only) model can't grow", who);
    bie_layer_info c;
    BIE_TRY(bie_model_canonical_info(info, &c, who));
    BIE_TRY(bie_model_check_inputs(m, c.type, n_inputs, inputs, who));
    if (m->sample_ndim > 0) { /* the new node must accept what it would see */
        plan p;
        BIE_TRY(plan_alloc(m, &p, who));
        bie_status st = plan_declared(m, &p, who);
        if (st == BIE_OK) {
            bie_train_layer node = {0};
            node.n_inputs = n_inputs;
            memcpy(node.inputs, inputs, (size_t)n_inputs * sizeof *inputs);
            int in_nd[BIE_MODEL_MAX_INPUTS], nd;
            int64_t in_sh[BIE_MODEL_MAX_INPUTS][BIE_MAX_DIMS], out[BIE_MAX_DIMS];
            gather(&node, p.ndims, (const int64_t(*)[BIE_MAX_DIMS])p.shapes, in_nd, in_sh);
            st = node_out_shape(&c, m->count, n_inputs, in_nd,
                                (const int64_t(*)[BIE_MAX_DIMS])in_sh, &nd, out);
        }
        plan_free(&p);
        BIE_TRY(st);
    }
    return bie_model_append(m, &c, n_inputs, inputs, who);
}

bie_status bie_model_node_inputs(const bie_model *m, int index, int *n_inputs, int *inputs) {
    static const char *who = "model_node_inputs";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(n_inputs);
    BIE_CHECK_NULL(inputs);
    if (index < 0 || index >= m->count)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: index %d outside [0, %d)", who, index,
                        m->count);
    const bie_train_layer *l = &m->layers[index];
    *n_inputs = l->n_inputs;
    memcpy(inputs, l->inputs, (size_t)l->n_inputs * sizeof *inputs);
    return BIE_OK;
}

bie_status bie_model_set_input_shape(bie_model *m, int ndim, const int64_t *shape) {
    static const char *who = "model_set_input_shape";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    if (ndim < 0 || ndim > BIE_MAX_DIMS - 1)
        return bie_fail(BIE_ERR_SHAPE, "%s: ndim %d outside 0..%d", who, ndim, BIE_MAX_DIMS - 1);
    if (ndim > 0) BIE_CHECK_NULL(shape);
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 1 || shape[d] > (int64_t)1 << 40)
            return bie_fail(BIE_ERR_SHAPE, "%s: extent %d is %lld", who, d, (long long)shape[d]);
    const int old_nd = m->sample_ndim;
    int64_t old[BIE_MAX_DIMS];
    memcpy(old, m->sample_shape, sizeof old);
    m->sample_ndim = ndim;
    memset(m->sample_shape, 0, sizeof m->sample_shape);
    if (ndim > 0) memcpy(m->sample_shape, shape, (size_t)ndim * sizeof *shape);
    bie_status st = BIE_OK;
    if (ndim > 0) {
        plan p;
        st = plan_alloc(m, &p, who);
        if (st == BIE_OK) {
            st = plan_declared(m, &p, who);
            plan_free(&p);
        }
    }
    if (st != BIE_OK) { /* unchanged on error */
        m->sample_ndim = old_nd;
        memcpy(m->sample_shape, old, sizeof old);
    }
    return st;
}

bie_status bie_model_input_shape(const bie_model *m, int *ndim, int64_t *shape) {
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "model_input_shape: model is NULL");
    BIE_CHECK_NULL(ndim);
    BIE_CHECK_NULL(shape);
    *ndim = m->sample_ndim;
    memcpy(shape, m->sample_shape, (size_t)m->sample_ndim * sizeof *shape);
    return BIE_OK;
}
