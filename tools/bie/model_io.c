/* Model files: architecture metadata, save and load (see model_io.h). */
#include "model_io.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dataset.h"
#include "errors.h"
#include "safetensors.h"

/* ------------------------------------------------------- architecture as JSON */

static void set_conv(json_t *o, const bie_layer_info *l) {
    json_object_set_new(o, "kernel_size", json_integer(l->kernel_size));
    json_object_set_new(o, "stride", json_integer(l->stride));
    json_object_set_new(o, "padding", json_integer(l->padding));
    json_object_set_new(o, "dilation", json_integer(l->dilation));
}

/* One layer; "inputs" only where the node does not read the node before it. */
static json_t *layer_to_json(const bie_layer_info *l, int index, int n_inputs, const int *inputs) {
    json_t *o = json_pack("{s:s}", "type", bie_layer_type_name(l->type));
    if (!o) return NULL;
    if (n_inputs != 1 || inputs[0] != index - 1) {
        json_t *arr = json_array();
        for (int j = 0; arr && j < n_inputs; j++)
            json_array_append_new(arr, json_integer(inputs[j]));
        json_object_set_new(o, "inputs", arr);
    }
    switch (l->type) {
    case BIE_LAYER_LINEAR:
    case BIE_LAYER_CONV2D:
        json_object_set_new(o, "in", json_integer(l->in));
        json_object_set_new(o, "out", json_integer(l->out));
        json_object_set_new(o, "bias", json_boolean(l->bias));
        if (l->type == BIE_LAYER_CONV2D) set_conv(o, l);
        break;
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        json_object_set_new(o, "in", json_integer(l->in));
        json_object_set_new(o, "eps", json_real(l->eps));
        json_object_set_new(o, "momentum", json_real(l->momentum));
        break;
    case BIE_LAYER_PRELU:
    case BIE_LAYER_RPRELU: json_object_set_new(o, "in", json_integer(l->in)); break;
    case BIE_LAYER_MAXPOOL2D:
    case BIE_LAYER_AVGPOOL2D:
        json_object_set_new(o, "kernel_size", json_integer(l->kernel_size));
        json_object_set_new(o, "stride", json_integer(l->stride));
        break;
    case BIE_LAYER_RELU:
    case BIE_LAYER_FLATTEN:
    case BIE_LAYER_GLOBAL_AVGPOOL:
    case BIE_LAYER_ADD:
    case BIE_LAYER_CONCAT: break;
    case BIE_LAYER_BINARY_LINEAR:
    case BIE_LAYER_BINARY_CONV2D:
    case BIE_LAYER_Q4_LINEAR:
    case BIE_LAYER_Q4_CONV2D:
        json_object_set_new(o, "in", json_integer(l->in));
        json_object_set_new(o, "out", json_integer(l->out));
        if (l->type == BIE_LAYER_BINARY_CONV2D || l->type == BIE_LAYER_Q4_CONV2D) set_conv(o, l);
        if (l->type == BIE_LAYER_BINARY_LINEAR || l->type == BIE_LAYER_BINARY_CONV2D) {
            json_object_set_new(o, "symmetric", json_boolean(l->symmetric));
            json_object_set_new(o, "bits_binary_word", json_integer(l->bits_binary_word));
        }
        break;
    }
    return o;
}

static char *architecture_json(const bie_model *model) {
    json_t *arr = json_array();
    for (int i = 0; arr && i < bie_model_layer_count(model); i++) {
        bie_layer_info info;
        json_t *o;
        int n_inputs, inputs[BIE_MODEL_MAX_INPUTS];
        if (bie_model_layer_info(model, i, &info) != BIE_OK ||
            bie_model_node_inputs(model, i, &n_inputs, inputs) != BIE_OK ||
            !(o = layer_to_json(&info, i, n_inputs, inputs)) ||
            json_array_append_new(arr, o) != 0) {
            json_decref(arr);
            return NULL;
        }
    }
    char *text = arr ? json_dumps(arr, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(arr);
    return text;
}

/* Read an integer field (absent: 0) that must fit an int. */
static int get_int(const char *path, int index, json_t *o, const char *key, int64_t max,
                   int64_t *value) {
    json_t *v = json_object_get(o, key);
    *value = 0;
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > max)
        return tool_fail("%s: architecture layer %d: '%s' must be an integer in [0, %lld]", path,
                         index, key, (long long)max);
    *value = json_integer_value(v);
    return 0;
}

static int get_bool(const char *path, int index, json_t *o, const char *key, bool *value) {
    json_t *v = json_object_get(o, key);
    *value = false;
    if (!v) return 0;
    if (!json_is_boolean(v))
        return tool_fail("%s: architecture layer %d: '%s' must be true or false", path, index, key);
    *value = json_is_true(v);
    return 0;
}

static int get_real(const char *path, int index, json_t *o, const char *key, float *value) {
    json_t *v = json_object_get(o, key);
    *value = 0;
    if (!v) return 0;
    if (!json_is_number(v))
        return tool_fail("%s: architecture layer %d: '%s' must be a number", path, index, key);
    *value = (float)json_number_value(v);
    return 0;
}

/* "inputs": absent (the node before), or 1..BIE_MODEL_MAX_INPUTS integers; whether they
 * name earlier nodes is bie_model_add_node's check. */
static int get_inputs(const char *path, int index, json_t *o, int *n_inputs, int *inputs) {
    json_t *v = json_object_get(o, "inputs");
    *n_inputs = 1;
    inputs[0] = index - 1;
    if (!v) return 0;
    size_t n = json_is_array(v) ? json_array_size(v) : 0;
    if (n < 1 || n > BIE_MODEL_MAX_INPUTS)
        return tool_fail("%s: architecture layer %d: 'inputs' must be an array of 1..%d node "
                         "indices",
                         path, index, BIE_MODEL_MAX_INPUTS);
    for (size_t j = 0; j < n; j++) {
        json_t *e = json_array_get(v, j);
        if (!json_is_integer(e) || json_integer_value(e) < -1 ||
            json_integer_value(e) >= MODEL_MAX_LAYERS)
            return tool_fail("%s: architecture layer %d: input %zu must be a node index (-1 = "
                             "the model's input)",
                             path, index, j);
        inputs[j] = (int)json_integer_value(e);
    }
    *n_inputs = (int)n;
    return 0;
}

static int layer_from_json(const char *path, int index, json_t *o, bie_layer_info *l, int *n_inputs,
                           int *inputs) {
    memset(l, 0, sizeof *l);
    json_t *type = json_object_get(o, "type");
    if (!json_is_object(o) || !json_is_string(type))
        return tool_fail("%s: architecture layer %d: needs a string 'type'", path, index);
    TOOL_TRY(get_inputs(path, index, o, n_inputs, inputs));
    if (bie_layer_type_from_name(json_string_value(type), &l->type) != BIE_OK)
        return tool_fail("%s: architecture layer %d: unknown layer type '%s'", path, index,
                         json_string_value(type));
    int64_t in, out, k, s, p, d, bits;
    const int64_t big = INT64_C(1) << 31;
    TOOL_TRY(get_int(path, index, o, "in", big, &in));
    TOOL_TRY(get_int(path, index, o, "out", big, &out));
    TOOL_TRY(get_int(path, index, o, "kernel_size", 1 << 16, &k));
    TOOL_TRY(get_int(path, index, o, "stride", 1 << 16, &s));
    TOOL_TRY(get_int(path, index, o, "padding", 1 << 16, &p));
    TOOL_TRY(get_int(path, index, o, "dilation", 1 << 16, &d));
    TOOL_TRY(get_int(path, index, o, "bits_binary_word", 64, &bits));
    TOOL_TRY(get_bool(path, index, o, "bias", &l->bias));
    TOOL_TRY(get_bool(path, index, o, "symmetric", &l->symmetric));
    TOOL_TRY(get_real(path, index, o, "eps", &l->eps));
    TOOL_TRY(get_real(path, index, o, "momentum", &l->momentum));
    l->in = in;
    l->out = out;
    l->kernel_size = (int)k;
    l->stride = (int)s;
    l->padding = (int)p;
    l->dilation = (int)d;
    l->bits_binary_word = (int)bits;
    return 0;
}

static bool is_lowbit(bie_layer_type type) {
    return type == BIE_LAYER_BINARY_LINEAR || type == BIE_LAYER_BINARY_CONV2D ||
           type == BIE_LAYER_Q4_LINEAR || type == BIE_LAYER_Q4_CONV2D;
}

/* Before layer `index` is built (which allocates and initialises its weights), its weight
 * tensor must be in the file with the size the architecture implies, so what the layer
 * allocates stays proportional to the file's real content. (The exact dtypes and shapes of
 * every tensor are checked when they are installed.) */
static int check_layer_weight(const st_file *f, bool packed, int index, const bie_layer_info *l) {
    int64_t rows = l->out, fan = l->in;
    switch (l->type) {
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
    case BIE_LAYER_PRELU:
    case BIE_LAYER_RPRELU: rows = 1; break;
    case BIE_LAYER_LINEAR:
    case BIE_LAYER_BINARY_LINEAR:
    case BIE_LAYER_Q4_LINEAR: break;
    case BIE_LAYER_CONV2D:
    case BIE_LAYER_BINARY_CONV2D:
    case BIE_LAYER_Q4_CONV2D:
        if (__builtin_mul_overflow(fan, (int64_t)l->kernel_size * l->kernel_size, &fan))
            return tool_fail("%s: architecture layer %d is too large", f->path, index);
        break;
    default: return 0; /* no parameters */
    }
    bool qweight = packed && is_lowbit(l->type);
    char name[48];
    snprintf(name, sizeof name, "%d.%s", index, qweight ? "qweight" : "weight");
    const st_tensor *t = st_find(f, name);
    if (!t) return tool_fail("%s: tensor '%s' is missing", f->path, name);
    int64_t numel = 1, need;
    for (int d = 0; d < t->ndim; d++) numel *= t->shape[d]; /* <= the file's data bytes */
    if (qweight) {
        /* [out, row]: a row holds fan_in weights of 1 (binary) or 4 (4-bit) bits. */
        int64_t bits = l->type == BIE_LAYER_Q4_LINEAR || l->type == BIE_LAYER_Q4_CONV2D ? 4 : 1;
        int64_t row_bits = t->ndim == 2 ? t->shape[1] * (int64_t)st_dtype_size(t->dtype) * 8 : 0;
        if (t->ndim == 2 && t->shape[0] == rows && !__builtin_mul_overflow(fan, bits, &need) &&
            row_bits >= need)
            return 0;
        return tool_fail("%s: tensor '%s' is too small for architecture layer %d (%lld x %lld "
                         "weights of %lld bits)",
                         f->path, name, index, (long long)rows, (long long)fan, (long long)bits);
    }
    if (__builtin_mul_overflow(rows, fan, &need) || numel != need)
        return tool_fail("%s: tensor '%s' has %lld elements, architecture layer %d (%s) needs "
                         "%lld x %lld",
                         f->path, name, (long long)numel, index, bie_layer_type_name(l->type),
                         (long long)rows, (long long)fan);
    return 0;
}

static int model_from_architecture(const st_file *f, bool packed, const char *text,
                                   const loaded_model *shape, bie_model **out) {
    const char *path = f->path;
    size_t text_len = strlen(text);
    if (text_len > MODEL_MAX_ARCHITECTURE_BYTES)
        return tool_fail("%s: metadata 'architecture' is %zu bytes (at most %u)", path, text_len,
                         MODEL_MAX_ARCHITECTURE_BYTES);
    json_error_t err;
    json_t *arr = json_loadb(text, text_len, JSON_REJECT_DUPLICATES, &err);
    if (!json_is_array(arr) || json_array_size(arr) == 0) {
        json_decref(arr);
        return tool_fail("%s: metadata 'architecture' is not a non-empty JSON array%s%s", path,
                         arr ? "" : ": ", arr ? "" : err.text);
    }
    if (json_array_size(arr) > MODEL_MAX_LAYERS) {
        size_t n = json_array_size(arr);
        json_decref(arr);
        return tool_fail("%s: metadata 'architecture' has %zu layers (at most %d)", path, n,
                         MODEL_MAX_LAYERS);
    }
    bie_model *m;
    if (bie_model_create(&m) != BIE_OK) {
        json_decref(arr);
        return tool_fail_status(BIE_ERR_OUT_OF_MEMORY, "bie_model_create");
    }
    /* With the input shape declared, every node's shapes are checked as it is added. */
    int status = 0;
    if (bie_model_set_input_shape(m, shape->input_ndim, shape->input_shape) != BIE_OK)
        status = tool_fail("%s: metadata 'input_shape': %s", path, bie_last_error());
    for (size_t i = 0; status == 0 && i < json_array_size(arr); i++) {
        bie_layer_info info;
        int n_inputs = 0, inputs[BIE_MODEL_MAX_INPUTS];
        status = layer_from_json(path, (int)i, json_array_get(arr, i), &info, &n_inputs, inputs);
        if (status == 0) status = check_layer_weight(f, packed, (int)i, &info);
        if (status == 0 && bie_model_add_node(m, &info, n_inputs, inputs) != BIE_OK)
            status = tool_fail("%s: architecture layer %zu: %s", path, i, bie_last_error());
    }
    json_decref(arr);
    if (status != 0) {
        bie_model_free(m);
        return -1;
    }
    *out = m;
    return 0;
}

/* ------------------------------------------------------------------- saving */

/* Metadata entries this module writes itself (everything else is an informational note). */
static bool is_fixed_key(const char *key) {
    static const char *const fixed[] = {"format",      "format_version", "architecture",
                                        "input_shape", "classes",        "packed"};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        if (strcmp(key, fixed[i]) == 0) return true;
    return false;
}

static char *classes_json(void) {
    json_t *arr = json_array();
    for (int c = 0; arr && c < FMNIST_CLASSES; c++)
        json_array_append_new(arr, json_string(fmnist_class_name(c)));
    char *text = arr ? json_dumps(arr, JSON_COMPACT) : NULL;
    json_decref(arr);
    return text;
}

int model_save(bie_model *model, const char *path, const model_note *notes, size_t note_count) {
    st_writer *w;
    TOOL_TRY(st_writer_create(&w));
    char *arch = architecture_json(model), *classes = classes_json();
    int status = arch && classes ? 0 : tool_fail("cannot describe the model's architecture");
    int count = bie_model_param_count(model);
    for (int i = 0; status == 0 && i < count; i++) {
        bie_model_param p;
        if (bie_model_param_get(model, i, &p) != BIE_OK)
            status = tool_fail_status(BIE_ERR_INTERNAL, "bie_model_param_get");
        else
            status = st_writer_add_bie(w, p.name, &p.value);
    }
    const model_note fixed[] = {
        {"format", MODEL_FORMAT}, {"format_version", MODEL_FORMAT_VERSION},
        {"architecture", arch},   {"input_shape", "[1, 28, 28]"},
        {"classes", classes},     {"packed", bie_model_packed(model) ? "true" : "false"},
    };
    for (size_t i = 0; status == 0 && i < sizeof fixed / sizeof fixed[0]; i++)
        status = st_writer_meta(w, fixed[i].key, fixed[i].value);
    for (size_t i = 0; status == 0 && i < note_count; i++)
        if (!is_fixed_key(notes[i].key)) status = st_writer_meta(w, notes[i].key, notes[i].value);
    if (status == 0) status = st_writer_save(w, path);
    free(arch);
    free(classes);
    st_writer_free(w);
    return status;
}

/* ------------------------------------------------------------------ loading */

static int check_format(const st_file *f) {
    const char *format = st_meta(f, "format"), *version = st_meta(f, "format_version");
    if (!format || strcmp(format, MODEL_FORMAT) != 0)
        return tool_fail("%s: not a bie model file (metadata 'format' is %s%s%s, expected "
                         "\"" MODEL_FORMAT "\")",
                         f->path, format ? "\"" : "missing", format ? format : "",
                         format ? "\"" : "");
    if (!version || strcmp(version, MODEL_FORMAT_VERSION) != 0)
        return tool_fail(
            "%s: unsupported model format version %s (this bie reads version " MODEL_FORMAT_VERSION
            ")",
            f->path, version ? version : "(missing)");
    return 0;
}

static int parse_input_shape(const st_file *f, loaded_model *out) {
    const char *text = st_meta(f, "input_shape");
    json_t *arr = text ? json_loads(text, 0, NULL) : NULL;
    int ok = json_is_array(arr) && json_array_size(arr) >= 1 && json_array_size(arr) <= 3;
    for (size_t i = 0; ok && i < json_array_size(arr); i++) {
        json_t *v = json_array_get(arr, i);
        ok = json_is_integer(v) && json_integer_value(v) >= 1 && json_integer_value(v) <= 65536;
        if (ok) out->input_shape[i] = json_integer_value(v);
    }
    if (ok) out->input_ndim = (int)json_array_size(arr);
    json_decref(arr);
    if (!ok) return tool_fail("%s: metadata 'input_shape' is missing or not [C, H, W]", f->path);
    return 0;
}

/* Copy a file tensor into the named parameter (through an aligned buffer: tensors in a
 * file need not be aligned for their element type). */
static int install_param(bie_model *m, const st_file *f, const bie_model_param *p) {
    const st_tensor *t = st_find(f, p->name);
    if (!t) return tool_fail("%s: tensor '%s' is missing", f->path, p->name);
    int want = st_dtype_from_bie(p->value.dtype);
    /* A binary weight may be stored as its int8 training form or as float. */
    bool float_binary = p->kind == BIE_PARAM_KIND_BINARY && t->dtype == ST_F32;
    st_dtype dtype = float_binary ? ST_F32 : (st_dtype)want;
    if (!st_expect(f, p->name, dtype, p->value.ndim, p->value.shape)) return -1;
    void *copy = malloc(t->nbytes ? t->nbytes : 1);
    if (!copy) return tool_fail("out of memory");
    memcpy(copy, t->data, t->nbytes);
    bie_tensor src;
    bie_status s = bie_tensor_view(&src, copy, float_binary ? BIE_F32 : p->value.dtype,
                                   p->value.ndim, p->value.shape);
    if (s == BIE_OK) s = bie_model_set_param(m, p->name, &src);
    free(copy);
    if (s != BIE_OK) return tool_fail("%s: tensor '%s': %s", f->path, p->name, bie_last_error());
    return 0;
}

static int install_params(bie_model *m, const st_file *f) {
    int count = bie_model_param_count(m);
    for (int i = 0; i < count; i++) {
        bie_model_param p;
        TOOL_TRY_BIE(bie_model_param_get(m, i, &p));
        TOOL_TRY(install_param(m, f, &p));
    }
    if ((size_t)count != f->count) {
        /* Name the first tensor the model does not have. */
        for (size_t i = 0; i < f->count; i++) {
            bie_model_param p;
            if (bie_model_param_find(m, f->tensors[i].name, &p) != BIE_OK)
                return tool_fail("%s: unexpected tensor '%s' (not a parameter of the model the "
                                 "architecture describes)",
                                 f->path, f->tensors[i].name);
        }
    }
    return 0;
}

static int copy_notes(const st_file *f, loaded_model *out) {
    out->notes = calloc(f->meta_count ? f->meta_count : 1, sizeof *out->notes);
    if (!out->notes) return tool_fail("out of memory");
    for (size_t i = 0; i < f->meta_count; i++) {
        if (is_fixed_key(f->meta_keys[i])) continue;
        model_note *n = &out->notes[out->note_count++];
        n->key = strdup(f->meta_keys[i]);
        n->value = strdup(f->meta_values[i]);
        if (!n->key || !n->value) return tool_fail("out of memory");
    }
    return 0;
}

static int load_from_file(const st_file *f, loaded_model *out) {
    TOOL_TRY(check_format(f));
    const char *packed = st_meta(f, "packed"), *arch = st_meta(f, "architecture");
    if (!arch) return tool_fail("%s: metadata 'architecture' is missing", f->path);
    if (!packed || (strcmp(packed, "true") != 0 && strcmp(packed, "false") != 0))
        return tool_fail("%s: metadata 'packed' must be \"true\" or \"false\"", f->path);
    TOOL_TRY(parse_input_shape(f, out));
    out->packed = strcmp(packed, "true") == 0;
    TOOL_TRY(model_from_architecture(f, out->packed, arch, out, &out->model));
    bie_model *m = out->model;
    /* Bring the model into the file's state, then overwrite every tensor from the file. */
    int status = 0;
    if (bie_model_prepare_params(m) != BIE_OK || (out->packed && bie_model_pack(m) != BIE_OK) ||
        bie_model_set_training(m, false) != BIE_OK)
        status = tool_fail("%s: cannot set up the model: %s", f->path, bie_last_error());
    if (status == 0) status = install_params(m, f);
    int64_t shape[4] = {1, out->input_shape[0], out->input_shape[1], out->input_shape[2]};
    int out_ndim;
    int64_t out_shape[BIE_MAX_DIMS];
    if (status == 0 &&
        bie_model_output_shape(m, out->input_ndim + 1, shape, &out_ndim, out_shape) != BIE_OK)
        status = tool_fail("%s: the architecture does not accept its input_shape: %s", f->path,
                           bie_last_error());
    int64_t floats = 0;
    if (status == 0 &&
        bie_model_activation_floats(m, out->input_ndim + 1, shape, &floats) != BIE_OK)
        status = tool_fail("%s: %s", f->path, bie_last_error());
    if (status == 0 && floats > MODEL_MAX_ACTIVATION_FLOATS)
        status = tool_fail("%s: the architecture's activations take %lld floats per example (at "
                           "most %lld)",
                           f->path, (long long)floats, (long long)MODEL_MAX_ACTIVATION_FLOATS);
    if (status == 0 && (out_ndim != 2 || out_shape[1] < 2))
        status = tool_fail("%s: the model does not produce class scores [N, classes]", f->path);
    if (status == 0) out->classes = (int)out_shape[1];
    const char *preset = st_meta(f, "preset");
    if (status == 0 && !(out->preset = strdup(preset ? preset : "")))
        status = tool_fail("out of memory");
    if (status == 0) status = copy_notes(f, out);
    if (status != 0) loaded_model_free(out);
    return status;
}

static int load_parsed(st_file *f, loaded_model *out) {
    loaded_model m = {0};
    int status = load_from_file(f, &m);
    st_close(f);
    if (status == 0) *out = m;
    return status;
}

int model_load(const char *path, loaded_model *out) {
    st_file f;
    TOOL_TRY(st_read_max(path, MODEL_MAX_HEADER_BYTES, &f));
    return load_parsed(&f, out);
}

int model_load_memory(const uint8_t *bytes, size_t size, const char *name, loaded_model *out) {
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return tool_fail("%s: out of memory", name);
    if (size) memcpy(copy, bytes, size);
    st_file f;
    if (st_parse_max(copy, size, name, MODEL_MAX_HEADER_BYTES, &f) != 0) {
        free(copy);
        return -1;
    }
    return load_parsed(&f, out);
}

void loaded_model_free(loaded_model *m) {
    if (!m) return;
    bie_model_free(m->model);
    free(m->preset);
    for (size_t i = 0; i < m->note_count; i++) {
        free((char *)m->notes[i].key);
        free((char *)m->notes[i].value);
    }
    free(m->notes);
    memset(m, 0, sizeof *m);
}

int model_binary_weight_bytes(bie_model *model, int64_t *stored, int64_t *as_float32) {
    *stored = 0;
    *as_float32 = 0;
    for (int i = 0; i < bie_model_layer_count(model); i++) {
        bie_layer_info info;
        TOOL_TRY_BIE(bie_model_layer_info(model, i, &info));
        if (info.type != BIE_LAYER_BINARY_LINEAR && info.type != BIE_LAYER_BINARY_CONV2D) continue;
        char name[32];
        bie_model_param p;
        snprintf(name, sizeof name, "%d.%s", i, bie_model_packed(model) ? "qweight" : "weight");
        TOOL_TRY_BIE(bie_model_param_find(model, name, &p));
        int64_t n = bie_tensor_numel(&p.value);
        *stored += n * (int64_t)bie_dtype_size(p.value.dtype);
        int64_t k2 =
            info.type == BIE_LAYER_BINARY_CONV2D ? (int64_t)info.kernel_size * info.kernel_size : 1;
        *as_float32 += info.out * info.in * k2 * 4;
    }
    return 0;
}
