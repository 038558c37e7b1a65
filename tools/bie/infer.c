/* `bie eval` and `bie predict`: run a model file (trained or packed) on images. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "errors.h"
#include "idx.h"
#include "model_io.h"
#include "options.h"
#include "progress.h"

typedef struct infer_options {
    const char *device, *data_dir, *images;
    int64_t threads, limit, batch, first, count;
    bool help, logits;
    bie_device where; /* from --device */
} infer_options;

static int check_model_input(const loaded_model *m, const char *path) {
    if (m->input_ndim != 3 || m->input_shape[0] != 1 || m->input_shape[1] != FMNIST_SIDE ||
        m->input_shape[2] != FMNIST_SIDE)
        return tool_fail("%s: the model takes inputs of another shape than 1x28x28 images", path);
    if (m->classes != FMNIST_CLASSES)
        return tool_fail("%s: the model has %d classes, Fashion-MNIST 10", path, m->classes);
    return 0;
}

static int run_eval(const char *path, const infer_options *o) {
    loaded_model m;
    TOOL_TRY(model_load(path, &m));
    fmnist_set test = {0};
    int status = check_model_input(&m, path);
    if (status == 0) status = model_to_device(m.model, o->where);
    if (status == 0) status = fmnist_load(o->data_dir, FMNIST_TEST, o->limit, &test);
    int32_t *pred = status == 0 ? malloc((size_t)test.count * sizeof(int32_t)) : NULL;
    if (status == 0 && !pred) status = tool_fail("out of memory");
    double acc = 0, loss = 0, start = progress_now();
    if (status == 0) status = evaluate_model(m.model, &test, o->batch, &acc, &loss, pred);
    if (status == 0) {
        double seconds = progress_now() - start;
        printf("model: %s (%s%s%s)\n", path, m.packed ? "packed inference model" : "trained model",
               *m.preset ? ", preset " : "", m.preset);
        char where[32];
        if (o->where.type == BIE_DEVICE_CUDA)
            snprintf(where, sizeof where, "CUDA device %d", o->where.index);
        else
            snprintf(where, sizeof where, "%d threads", bie_get_num_threads());
        printf("test accuracy %.2f%% (%lld images), loss %.4f, %.2f s (%.0f images/s, %s)\n",
               100 * acc, (long long)test.count, loss, seconds, (double)test.count / seconds,
               where);
        int64_t total[FMNIST_CLASSES] = {0}, right[FMNIST_CLASSES] = {0};
        for (int64_t i = 0; i < test.count; i++) {
            total[test.labels[i]]++;
            right[test.labels[i]] += pred[i] == test.labels[i];
        }
        printf("per class:");
        for (int c = 0; c < FMNIST_CLASSES; c++)
            if (total[c])
                printf(" %s %.1f%%%s", fmnist_class_name(c),
                       100.0 * (double)right[c] / (double)total[c],
                       c + 1 < FMNIST_CLASSES ? "," : "");
        printf("\n");
    }
    free(pred);
    fmnist_free(&test);
    loaded_model_free(&m);
    return status;
}

/* Images to predict: an IDX file given with --images, or test images first..first+count. */
static int load_inputs(const infer_options *o, fmnist_set *set, bool *has_labels) {
    if (!o->images) {
        fmnist_set test;
        TOOL_TRY(fmnist_load(o->data_dir, FMNIST_TEST, 0, &test));
        if (o->first >= test.count) {
            fmnist_free(&test);
            return tool_fail("--first %lld: the test set has %lld images", (long long)o->first,
                             (long long)test.count);
        }
        int64_t n = o->count < test.count - o->first ? o->count : test.count - o->first;
        memmove(test.images, test.images + o->first * FMNIST_PIXELS,
                (size_t)n * FMNIST_PIXELS * sizeof(float));
        memmove(test.labels, test.labels + o->first, (size_t)n);
        test.count = n;
        *set = test;
        *has_labels = true;
        return 0;
    }
    idx_array a;
    TOOL_TRY(idx_read_u8(o->images, 3, &a));
    if (a.dims[1] != FMNIST_SIDE || a.dims[2] != FMNIST_SIDE) {
        idx_free(&a);
        return tool_fail("%s: images are %lldx%lld, the model takes 28x28", o->images,
                         (long long)a.dims[1], (long long)a.dims[2]);
    }
    set->count = a.dims[0];
    set->images = malloc((size_t)set->count * FMNIST_PIXELS * sizeof(float));
    set->labels = calloc((size_t)set->count, 1);
    if (!set->images || !set->labels) {
        idx_free(&a);
        fmnist_free(set);
        return tool_fail("out of memory");
    }
    fmnist_normalize(a.data, set->count * FMNIST_PIXELS, set->images);
    idx_free(&a);
    *has_labels = false;
    return 0;
}

/* Softmax probability of the predicted class. */
static double top_probability(const float *logits, int classes, int top) {
    double sum = 0;
    for (int c = 0; c < classes; c++) sum += exp((double)logits[c] - (double)logits[top]);
    return 1.0 / sum;
}

/* One line per image: its class, probability and label, or with --logits its scores. */
static int predict_batch(bie_model *model, const fmnist_set *set, int64_t first, int64_t n,
                         bool has_labels, const char *source, int64_t offset, float *host,
                         bool logits) {
    int64_t xs[4] = {n, 1, FMNIST_SIDE, FMNIST_SIDE};
    bie_tensor tx, scores;
    TOOL_TRY_BIE(bie_tensor_view(&tx, set->images + first * FMNIST_PIXELS, BIE_F32, 4, xs));
    TOOL_TRY(forward_on_host(model, &tx, host, &scores));
    const float *l = scores.data;
    for (int64_t i = 0; i < n; i++) {
        if (logits) { /* %.9g: each float32 score exactly */
            printf("%s[%lld]:", source, (long long)(offset + first + i));
            for (int c = 0; c < FMNIST_CLASSES; c++) printf(" %.9g", l[i * FMNIST_CLASSES + c]);
            printf("\n");
            continue;
        }
        int top = 0;
        for (int c = 1; c < FMNIST_CLASSES; c++)
            if (l[i * FMNIST_CLASSES + c] > l[i * FMNIST_CLASSES + top]) top = c;
        printf("%s[%lld]: %-11s %5.1f%%", source, (long long)(offset + first + i),
               fmnist_class_name(top),
               100 * top_probability(l + i * FMNIST_CLASSES, FMNIST_CLASSES, top));
        if (has_labels)
            printf("  (label %s%s)", fmnist_class_name(set->labels[first + i]),
                   set->labels[first + i] == top ? "" : ", wrong");
        printf("\n");
    }
    return 0;
}

static int run_predict(const char *path, const infer_options *o) {
    loaded_model m;
    TOOL_TRY(model_load(path, &m));
    fmnist_set set = {0};
    bool has_labels = false;
    int status = check_model_input(&m, path);
    if (status == 0) status = model_to_device(m.model, o->where);
    if (status == 0) status = load_inputs(o, &set, &has_labels);
    const char *source = o->images ? o->images : "test";
    int64_t offset = o->images ? 0 : o->first;
    float *host = status == 0 ? malloc((size_t)o->batch * FMNIST_CLASSES * sizeof(float)) : NULL;
    if (status == 0 && host == NULL) status = tool_fail("out of memory");
    for (int64_t first = 0; status == 0 && first < set.count; first += o->batch) {
        int64_t n = set.count - first < o->batch ? set.count - first : o->batch;
        status =
            predict_batch(m.model, &set, first, n, has_labels, source, offset, host, o->logits);
    }
    free(host);
    fmnist_free(&set);
    loaded_model_free(&m);
    return status;
}

static int run_infer(const char *command, int argc, char **argv, bool predict) {
    infer_options o = {.device = "cpu", .batch = predict ? 256 : 1000, .count = 10};
    const opt_spec eval_specs[] = {
        {"data", OPT_STRING, &o.data_dir, 0, 0, NULL, "DIR",
         "Fashion-MNIST IDX files (default $BIE_DATA_DIR or " FMNIST_DEFAULT_DIR ")"},
        {"limit", OPT_INT, &o.limit, 0, 1e9, NULL, "N",
         "evaluate the first N test images (0: all)"},
        {"batch-size", OPT_INT, &o.batch, 1, 65536, NULL, "N", "images per forward pass"},
        {"threads", OPT_INT, &o.threads, 0, 1024, NULL, "N", "CPU threads (0: all cores)"},
        {"device", OPT_STRING, &o.device, 0, 0, "cpu|cuda", NULL, "where the layers run"},
        {"help", OPT_FLAG, &o.help, 0, 0, NULL, NULL, "show this help"},
        {NULL, 0, NULL, 0, 0, NULL, NULL, NULL},
    };
    const opt_spec predict_specs[] = {
        {"images", OPT_STRING, &o.images, 0, 0, NULL, "FILE",
         "IDX file of 28x28 grey images (unsigned bytes, .gz or plain) instead of test images"},
        {"first", OPT_INT, &o.first, 0, 1e9, NULL, "N", "first test image to classify"},
        {"count", OPT_INT, &o.count, 1, 1e9, NULL, "N", "number of test images to classify"},
        {"logits", OPT_FLAG, &o.logits, 0, 0, NULL, NULL,
         "print each image's 10 class scores (logits) instead of its class"},
        eval_specs[0],
        eval_specs[2],
        eval_specs[3],
        eval_specs[4],
        eval_specs[5],
        {NULL, 0, NULL, 0, 0, NULL, NULL, NULL},
    };
    const opt_spec *specs = predict ? predict_specs : eval_specs;
    const char *pos[1];
    int npos = 0;
    if (opt_parse(command, specs, argc, argv, pos, 1, &npos) != 0) {
        fprintf(stderr, "%s\n", tool_error());
        return EXIT_USAGE;
    }
    if (o.help) {
        if (predict)
            printf("usage: bie predict MODEL [options]\n\nClassify images with a model file "
                   "(trained or packed): by default the first 10\nFashion-MNIST test images; "
                   "prints the class, its probability and the label\n(with --logits: "
                   "\"test[I]: S0 S1 ... S9\", the model's raw scores).\n\n");
        else
            printf("usage: bie eval MODEL [options]\n\nTest-set accuracy and loss of a model "
                   "file (trained or packed), per class too.\n\n");
        opt_print_help(stdout, specs);
        return 0;
    }
    if (npos < 1) {
        fprintf(stderr, "bie %s: missing MODEL; usage: bie %s MODEL [options]\n", command, command);
        return EXIT_USAGE;
    }
    if (setup_device(o.device, o.threads, &o.where) != 0) return report_failure(command);
    int status = predict ? run_predict(pos[0], &o) : run_eval(pos[0], &o);
    return status == 0 ? 0 : report_failure(command);
}

int cmd_eval(int argc, char **argv) { return run_infer("eval", argc, argv, false); }
int cmd_predict(int argc, char **argv) { return run_infer("predict", argc, argv, true); }
