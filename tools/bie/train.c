/* `bie train`: train a preset on Fashion-MNIST, report per-epoch metrics, write the model,
 * a metrics CSV and a training-curve SVG. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "augment.h"
#include "bie_cuda.h"
#include "commands.h"
#include "errors.h"
#include "metrics.h"
#include "model_io.h"
#include "options.h"
#include "progress.h"

#define DEFAULT_SEED 1
#define DEFAULT_THREADS 0 /* all cores */

typedef struct train_options {
    const char *preset, *first_last, *schedule, *device, *data_dir, *out_dir, *progress;
    const char *augment, *backward;
    int64_t width, depth, epochs, batch, seed, threads, train_limit, test_limit, eval_batch;
    int64_t augment_shift;
    double lr, binary_lr, binary_beta1, binary_beta2, weight_decay;
    bool help;
} train_options;

/* Per-preset defaults for the options left at -1. The cnn defaults are the README's default
 * run: tuned to finish within 10 minutes on 2 cores (about 470 images/s there). */
static void preset_defaults(train_options *o) {
    bool mlp = strcmp(o->preset, "mlp") == 0;
    if (o->epochs < 0) o->epochs = mlp ? 10 : 4;
    if (o->batch < 0) o->batch = 64;
    if (o->lr < 0) o->lr = 2e-3;
    /* The sign-flip state starts at v = -sign(w) delta, delta up to 1e-3 (SPEC §5): with a
     * binary lr of 0.1 a weight whose gradient keeps one sign overcomes that start within
     * tens of steps (1e-4 took about 18,000, more than a default run has). */
    if (o->binary_lr < 0) o->binary_lr = 0.1;
    if (o->width < 0) o->width = preset_default_width(o->preset);
    if (o->depth < 0) o->depth = preset_default_depth(o->preset);
}

static void print_usage(FILE *out, const opt_spec *specs) {
    fprintf(out,
            "usage: bie train [options]\n\n"
            "Train a binary network on Fashion-MNIST (Debian package dataset-fashion-mnist).\n"
            "Presets: cnn (default): a 4-bit first conv, two binary convs and a binary dense\n"
            "layer, float (or --first-last q4: 4-bit) classifier; mlp: a float (or 4-bit) first\n"
            "layer, two binary hidden layers, a float (or 4-bit) classifier; resnet: a binary\n"
            "ResNet in the style of Bi-Real / ReActNet (float stem, binary 3x3 convs each with\n"
            "a real-valued shortcut, RPReLU, average-pool + 1x1 conv down-sampling, global\n"
            "average pool, float classifier), --depth units per stage at 28, 14 and 7 pixels.\n"
            "Writes DIR/model.safetensors, DIR/metrics.csv and DIR/training_curve.svg.\n"
            "Options left at -1 take the preset's default.\n\n");
    opt_print_help(out, specs);
}

static int make_dirs(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return tool_fail("output directory name too long");
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char saved = *p;
            *p = 0;
            if (mkdir(buf, 0777) != 0 && errno != EEXIST)
                return tool_fail("cannot create directory %s: %s", buf, strerror(errno));
            *p = saved;
            if (!saved) break;
        }
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return tool_fail("%s is not a directory", path);
    return 0;
}

/* Learning-rate multiplier at `step` of `total`: cosine decay from 1 towards 0 (never 0),
 * or 1. */
static double schedule_factor(const char *schedule, int64_t step, int64_t total) {
    if (strcmp(schedule, "cosine") != 0) return 1.0;
    return 0.5 * (1.0 + cos(M_PI * (double)step / (double)total));
}

static int64_t trainable_count(bie_model *m) {
    int64_t total = 0;
    for (int i = 0; i < bie_model_param_count(m); i++) {
        bie_model_param p;
        if (bie_model_param_get(m, i, &p) == BIE_OK && p.kind != BIE_PARAM_KIND_BUFFER)
            total += bie_tensor_numel(&p.value);
    }
    return total;
}

/* Adam moves a float parameter by up to about lr per step whatever its gradient's size, so
 * an activation scale (a few tenths) can be driven through zero within an epoch: the 4-bit
 * layer's codes then collapse, the binary layers' straight-through window closes, and a
 * negative scale is not even a valid model. Each scale_a is therefore kept at or above a
 * fraction of the value the first batch gave it (a projection after each step). */
#define SCALE_A_FLOOR_FRACTION 0.5f
enum { MAX_SCALES = 256 };
/* Steps between reads of the loss totals from a GPU (for the progress line). */
enum { SUMS_READ_EVERY = 50 };

typedef struct trainer {
    const train_options *opt;
    bie_model *model;
    bie_optimizer *optimizer;
    fmnist_set train, test;
    int64_t *order;
    float *x, *grad;
    int32_t *labels;
    tool_rng rng;
    augment_config augment;
    tool_rng augment_rng; /* a stream of its own: augmentation leaves the shuffling as it was */
    int64_t steps_per_epoch, total_steps;
    char model_path[4096], csv_path[4096], svg_path[4096];
    /* Each scale_a's floor: a copy of it after the first step (on its device), with the index
     * of its parameter. */
    bie_tensor floors[MAX_SCALES];
    int floor_param[MAX_SCALES], floor_count;
    bool floors_set;
    /* The loss's gradient and the epoch's totals (loss, correct, non-finite rows) on the
     * model's device: a GPU step queues its work and never waits for the device. */
    bie_tensor dgrad, sums;
    bie_device where; /* from --device */
} trainer;

static bool is_scale_a(const char *name) {
    size_t len = strlen(name);
    return len > 8 && strcmp(name + len - 8, ".scale_a") == 0;
}

/* An uninitialised tensor of this dtype and shape on device `where`. */
static int alloc_on(bie_tensor *out, bie_dtype dtype, int ndim, const int64_t *shape,
                    bie_device where) {
    if (where.type == BIE_DEVICE_CUDA)
        TOOL_TRY_BIE(bie_cuda_tensor_alloc(out, dtype, ndim, shape, where.index));
    else
        TOOL_TRY_BIE(bie_tensor_alloc(out, dtype, ndim, shape));
    return 0;
}

/* After the first step, keep a copy of every scale_a; after each later one, clamp every
 * scale_a to SCALE_A_FLOOR_FRACTION of its copy. On the model's device, without waiting. */
static int keep_scales_positive(trainer *t) {
    if (t->floors_set) {
        for (int k = 0; k < t->floor_count; k++) {
            bie_model_param p;
            TOOL_TRY_BIE(bie_model_param_get(t->model, t->floor_param[k], &p));
            TOOL_TRY_BIE(bie_clamp_min_scaled(&p.value, &t->floors[k], SCALE_A_FLOOR_FRACTION));
        }
        return 0;
    }
    int count = bie_model_param_count(t->model);
    for (int i = 0; i < count && t->floor_count < MAX_SCALES; i++) {
        bie_model_param p;
        TOOL_TRY_BIE(bie_model_param_get(t->model, i, &p));
        if (!is_scale_a(p.name) || p.value.dtype != BIE_F32) continue;
        bie_tensor *f = &t->floors[t->floor_count];
        TOOL_TRY(alloc_on(f, BIE_F32, p.value.ndim, p.value.shape, p.value.device));
        t->floor_param[t->floor_count++] = i;
        TOOL_TRY_BIE(bie_tensor_copy(f, &p.value));
    }
    t->floors_set = true;
    return 0;
}

/* The epoch's totals so far: loss sum, correct rows, non-finite rows (a host read of a
 * device's totals waits for it). */
static int read_sums(trainer *t, double out[3]) {
    bie_tensor host;
    int64_t three = 3;
    TOOL_TRY_BIE(bie_tensor_view(&host, out, BIE_F64, 1, &three));
    TOOL_TRY_BIE(bie_tensor_copy(&host, &t->sums));
    if (out[2] > 0)
        return tool_fail("training diverged: %.0f rows of logits were not finite", out[2]);
    return 0;
}

/* One optimizer step on examples order[first .. first + batch). */
static int train_step(trainer *t, int64_t first, int64_t step) {
    const train_options *o = t->opt;
    double f = schedule_factor(o->schedule, step, t->total_steps);
    TOOL_TRY_BIE(bie_optimizer_set_lr(t->optimizer, (float)(o->lr * f), (float)(o->binary_lr * f)));
    fmnist_gather(&t->train, t->order, first, o->batch, t->x, t->labels);
    augment_batch(&t->augment, t->x, o->batch, &t->augment_rng);
    int64_t xs[4] = {o->batch, 1, FMNIST_SIDE, FMNIST_SIDE}, ls[1] = {o->batch};
    bie_tensor tx, tl, logits;
    TOOL_TRY_BIE(bie_tensor_view(&tx, t->x, BIE_F32, 4, xs));
    TOOL_TRY_BIE(bie_tensor_view(&tl, t->labels, BIE_I32, 1, ls));
    TOOL_TRY_BIE(bie_model_forward(t->model, &tx, &logits));
    TOOL_TRY_BIE(bie_softmax_cross_entropy_accumulate(&logits, &tl, &t->dgrad, &t->sums));
    TOOL_TRY_BIE(bie_model_backward(t->model, &t->dgrad, NULL));
    TOOL_TRY_BIE(bie_optimizer_step(t->optimizer, NULL));
    return keep_scales_positive(t);
}

static int train_epoch(trainer *t, int epoch, epoch_metrics *row, double *seconds) {
    const train_options *o = t->opt;
    fmnist_shuffle(t->order, t->train.count, &t->rng);
    TOOL_TRY_BIE(bie_model_set_training(t->model, true));
    char label[32];
    snprintf(label, sizeof label, "epoch %d/%lld", epoch, (long long)o->epochs);
    progress bar;
    progress_mode mode = strcmp(o->progress, "bar") == 0     ? PROGRESS_BAR
                         : strcmp(o->progress, "plain") == 0 ? PROGRESS_PLAIN
                         : strcmp(o->progress, "none") == 0  ? PROGRESS_NONE
                                                             : PROGRESS_AUTO;
    progress_start(&bar, mode, stderr, label, t->steps_per_epoch, t->steps_per_epoch * o->batch);
    double sums[3] = {0, 0, 0}, shown = 0;
    int64_t three = 3;
    bie_tensor zeros;
    TOOL_TRY_BIE(bie_tensor_view(&zeros, sums, BIE_F64, 1, &three));
    TOOL_TRY_BIE(bie_tensor_copy(&t->sums, &zeros));
    const bool on_host = t->sums.device.type == BIE_DEVICE_CPU;
    for (int64_t s = 0; s < t->steps_per_epoch; s++) {
        int64_t step = (int64_t)(epoch - 1) * t->steps_per_epoch + s;
        int rc = train_step(t, s * o->batch, step);
        /* A device's totals are read now and then (each read waits for it). */
        if (rc == 0 && (on_host || (s + 1) % SUMS_READ_EVERY == 0 || s + 1 == t->steps_per_epoch)) {
            rc = read_sums(t, sums);
            shown = sums[0] / (double)((s + 1) * o->batch);
        }
        if (rc != 0) {
            progress_finish(&bar);
            return -1;
        }
        progress_step(&bar, o->batch, shown);
    }
    progress_finish(&bar);
    *seconds = progress_now() - bar.start_s;
    row->epoch = epoch;
    row->train_loss = sums[0] / (double)(t->steps_per_epoch * o->batch);
    row->train_acc = sums[1] / (double)(t->steps_per_epoch * o->batch);
    row->lr = o->lr *
              schedule_factor(o->schedule, (int64_t)epoch * t->steps_per_epoch - 1, t->total_steps);
    double test_loss;
    TOOL_TRY(evaluate_model(t->model, &t->test, o->eval_batch, &row->test_acc, &test_loss, NULL));
    return 0;
}

/* "none", "shift 2", "flip", "shift 2 + flip": for the header line and the model file. */
static void describe_augment(const augment_config *a, char *buf, size_t cap) {
    if (a->max_shift > 0)
        snprintf(buf, cap, "shift %d%s", a->max_shift, a->flip ? " + flip" : "");
    else
        snprintf(buf, cap, "%s", a->flip ? "flip" : "none");
}

static int save_model(trainer *t, double test_acc) {
    const train_options *o = t->opt;
    char width[32], epochs[32], batch[32], lr[32], blr[32], seed[32], threads[32], acc[32];
    char wd[32], augment[48], depth[32];
    snprintf(width, sizeof width, "%lld", (long long)o->width);
    snprintf(depth, sizeof depth, "%lld", (long long)o->depth);
    snprintf(epochs, sizeof epochs, "%lld", (long long)o->epochs);
    snprintf(batch, sizeof batch, "%lld", (long long)o->batch);
    snprintf(lr, sizeof lr, "%g", o->lr);
    snprintf(blr, sizeof blr, "%g", o->binary_lr);
    snprintf(seed, sizeof seed, "%lld", (long long)o->seed);
    snprintf(threads, sizeof threads, "%d", bie_get_num_threads());
    snprintf(acc, sizeof acc, "%.4f", test_acc);
    snprintf(wd, sizeof wd, "%g", o->weight_decay);
    describe_augment(&t->augment, augment, sizeof augment);
    const model_note notes[] = {
        {"preset", o->preset},  {"first_last", o->first_last},
        {"width", width},       {"epochs", epochs},
        {"batch_size", batch},  {"lr", lr},
        {"binary_lr", blr},     {"schedule", o->schedule},
        {"seed", seed},         {"threads", threads},
        {"weight_decay", wd},   {"augment", augment},
        {"test_accuracy", acc}, {"depth", depth},
    };
    return model_save(t->model, t->model_path, notes, sizeof notes / sizeof notes[0]);
}

static int run_epochs(trainer *t, epoch_metrics *rows) {
    const train_options *o = t->opt;
    double total_s = 0;
    char title[160];
    snprintf(title, sizeof title, "bie train: %s preset (first/last %s), seed %lld", o->preset,
             o->first_last, (long long)o->seed);
    for (int e = 1; e <= o->epochs; e++) {
        double seconds = 0;
        TOOL_TRY(train_epoch(t, e, &rows[e - 1], &seconds));
        total_s += seconds;
        printf("epoch %d/%lld: train loss %.4f, train acc %.2f%%, test acc %.2f%%, lr %.3g, "
               "%.1f s (%.0f samples/s)\n",
               e, (long long)o->epochs, rows[e - 1].train_loss, 100 * rows[e - 1].train_acc,
               100 * rows[e - 1].test_acc, rows[e - 1].lr, seconds,
               (double)(t->steps_per_epoch * o->batch) / seconds);
        fflush(stdout);
        /* Written after every epoch, so an interrupted run still leaves its curve. */
        TOOL_TRY(metrics_write_csv(t->csv_path, rows, (size_t)e));
        TOOL_TRY(metrics_write_svg(t->svg_path, rows, (size_t)e, title));
    }
    char elapsed[32];
    progress_format_time(total_s, elapsed, sizeof elapsed);
    TOOL_TRY(model_to_device(t->model, bie_cpu())); /* model files are written from the host */
    TOOL_TRY(save_model(t, rows[o->epochs - 1].test_acc));
    printf("done: test accuracy %.2f%% after %lld epochs, training time %s (m:ss)\n",
           100 * rows[o->epochs - 1].test_acc, (long long)o->epochs, elapsed);
    printf("wrote %s, %s, %s\n", t->model_path, t->csv_path, t->svg_path);
    printf("next: bie export %s   (packs the binary layers for inference)\n", t->model_path);
    return 0;
}

static int setup_trainer(trainer *t) {
    const train_options *o = t->opt;
    const char *dir = fmnist_data_dir(o->data_dir);
    TOOL_TRY(fmnist_load(dir, FMNIST_TRAIN, o->train_limit, &t->train));
    TOOL_TRY(fmnist_load(dir, FMNIST_TEST, o->test_limit, &t->test));
    if (t->train.count < o->batch)
        return tool_fail("--batch-size %lld is larger than the %lld training examples",
                         (long long)o->batch, (long long)t->train.count);
    /* The last partial batch is dropped: every step sees a full batch (batch norm). */
    t->steps_per_epoch = t->train.count / o->batch;
    t->total_steps = t->steps_per_epoch * o->epochs;
    preset_config pc = {o->preset, o->first_last, o->width, o->depth};
    TOOL_TRY(preset_build(&pc, &t->model));
    TOOL_TRY_BIE(bie_model_reset_parameters(t->model, (uint64_t)o->seed));
    TOOL_TRY_BIE(bie_model_prepare_params(t->model));
    /* Built and initialised on the host (the same numbers on any device), then moved. */
    TOOL_TRY(model_to_device(t->model, t->where));
    if (strcmp(o->backward, "fp8") == 0)
        TOOL_TRY_BIE(bie_model_set_backward_mode(t->model, BIE_BACKWARD_FP8));
    bie_optimizer_options oo = bie_optimizer_defaults();
    oo.adam.lr = (float)o->lr;
    oo.adam.weight_decay = (float)o->weight_decay;
    oo.adam.decoupled = true;
    oo.binary_lr = (float)o->binary_lr;
    oo.binary_beta1 = (float)o->binary_beta1;
    oo.binary_beta2 = (float)o->binary_beta2;
    oo.seed = (uint64_t)o->seed;
    TOOL_TRY_BIE(bie_optimizer_create(&t->optimizer, t->model, &oo));
    t->order = malloc((size_t)t->train.count * sizeof(int64_t));
    t->x = malloc((size_t)o->batch * FMNIST_PIXELS * sizeof(float));
    t->grad = malloc((size_t)o->batch * FMNIST_CLASSES * sizeof(float));
    t->labels = malloc((size_t)o->batch * sizeof(int32_t));
    if (!t->order || !t->x || !t->grad || !t->labels) return tool_fail("out of memory");
    int64_t gs[2] = {o->batch, FMNIST_CLASSES}, three = 3;
    if (t->where.type == BIE_DEVICE_CUDA)
        TOOL_TRY(alloc_on(&t->dgrad, BIE_F32, 2, gs, t->where));
    else
        TOOL_TRY_BIE(bie_tensor_view(&t->dgrad, t->grad, BIE_F32, 2, gs));
    TOOL_TRY(alloc_on(&t->sums, BIE_F64, 1, &three, t->where));
    t->rng.state = (uint64_t)o->seed * 0x2545f4914f6cdd1dull + 1;
    t->augment_rng.state = ((uint64_t)o->seed ^ 0xa0761d6478bd642full) * 0xe7037ed1a0b428dbull;
    TOOL_TRY(make_dirs(o->out_dir));
    snprintf(t->model_path, sizeof t->model_path, "%s/model.safetensors", o->out_dir);
    snprintf(t->csv_path, sizeof t->csv_path, "%s/metrics.csv", o->out_dir);
    snprintf(t->svg_path, sizeof t->svg_path, "%s/training_curve.svg", o->out_dir);
    printf("bie train: %s preset, first/last layers %s, width %lld%s%.0lld, %lld trainable "
           "parameters\n",
           o->preset, o->first_last, (long long)o->width, o->depth > 0 ? ", depth " : "",
           (long long)o->depth, (long long)trainable_count(t->model));
    printf("data: %lld training / %lld test images from %s\n", (long long)t->train.count,
           (long long)t->test.count, dir);
    char where[64];
    if (t->where.type == BIE_DEVICE_CUDA)
        snprintf(where, sizeof where, "CUDA device %d", t->where.index);
    else
        snprintf(where, sizeof where, "%d threads, kernels %s", bie_get_num_threads(),
                 bie_cpu_kernel_set());
    printf("epochs %lld, batch %lld (%lld steps/epoch), lr %g, binary lr %g, %s schedule, "
           "weight decay %g, seed %lld, %s%s\n",
           (long long)o->epochs, (long long)o->batch, (long long)t->steps_per_epoch, o->lr,
           o->binary_lr, o->schedule, o->weight_decay, (long long)o->seed, where,
           strcmp(o->backward, "fp8") == 0 ? ", fp8 backward" : "");
    if (augment_active(&t->augment)) { /* the default run's output stays as documented */
        char augment[48];
        describe_augment(&t->augment, augment, sizeof augment);
        printf("augmentation of the training images: %s\n", augment);
    }
    fflush(stdout);
    return 0;
}

static void free_trainer(trainer *t) {
    bie_optimizer_free(t->optimizer);
    bie_model_free(t->model);
    fmnist_free(&t->train);
    fmnist_free(&t->test);
    free(t->order);
    free(t->x);
    free(t->grad);
    free(t->labels);
    bie_tensor_free(&t->dgrad);
    bie_tensor_free(&t->sums);
    for (int k = 0; k < t->floor_count; k++) bie_tensor_free(&t->floors[k]);
}

int cmd_train(int argc, char **argv) {
    train_options o = {.preset = "cnn",
                       .first_last = "float",
                       .schedule = "cosine",
                       .device = "cpu",
                       .backward = "exact",
                       .out_dir = NULL,
                       .progress = "auto",
                       .width = -1,
                       .depth = -1,
                       .epochs = -1,
                       .batch = -1,
                       .seed = DEFAULT_SEED,
                       .threads = DEFAULT_THREADS,
                       .eval_batch = 1000,
                       .lr = -1,
                       .binary_lr = -1,
                       .binary_beta1 = 0.99,
                       .binary_beta2 = 0.9999,
                       .weight_decay = 0,
                       .augment = "none",
                       .augment_shift = 2};
    const opt_spec specs[] = {
        {"model", OPT_STRING, &o.preset, 0, 0, "mlp|cnn|resnet", NULL, "model preset"},
        {"first-last", OPT_STRING, &o.first_last, 0, 0, "float|q4", NULL,
         "first and last layers: float or 4-bit (cnn: the first conv is 4-bit either way)"},
        {"width", OPT_INT, &o.width, -1, 16384, NULL, "N",
         "mlp: hidden units (1024); cnn: channels of the first conv (32); resnet: channels of "
         "the first stage (64)"},
        {"depth", OPT_INT, &o.depth, -1, 16, NULL, "N", "resnet: binary units per stage (2)"},
        {"epochs", OPT_INT, &o.epochs, -1, 10000, NULL, "N", "passes over the training set"},
        {"batch-size", OPT_INT, &o.batch, -1, 65536, NULL, "N", "examples per step (>= 2)"},
        {"lr", OPT_DOUBLE, &o.lr, -1, 10, NULL, "LR", "AdamW learning rate of float parameters"},
        {"binary-lr", OPT_DOUBLE, &o.binary_lr, -1, 10, NULL, "LR",
         "sign-flip optimizer's learning rate for binary weights"},
        {"binary-beta1", OPT_DOUBLE, &o.binary_beta1, 0, 0.999999, NULL, "B",
         "sign-flip optimizer: decay of the gradient's moving average"},
        {"binary-beta2", OPT_DOUBLE, &o.binary_beta2, 0, 0.999999, NULL, "B",
         "sign-flip optimizer: decay of the flip vote's moving average"},
        {"weight-decay", OPT_DOUBLE, &o.weight_decay, 0, 1, NULL, "WD", "AdamW weight decay"},
        {"augment", OPT_STRING, &o.augment, 0, 0, AUGMENT_CHOICES, NULL,
         "random changes of each training image: shift by up to --augment-shift pixels, "
         "mirror left-right"},
        {"augment-shift", OPT_INT, &o.augment_shift, 1, AUGMENT_MAX_SHIFT, NULL, "N",
         "largest shift of --augment shift (pixels, each axis)"},
        {"schedule", OPT_STRING, &o.schedule, 0, 0, "cosine|constant", NULL,
         "learning-rate schedule over all steps"},
        {"seed", OPT_INT, &o.seed, 0, 9e15, NULL, "N",
         "seed of initialisation and shuffling (same seed + threads: same run, bit for bit)"},
        {"threads", OPT_INT, &o.threads, 0, 1024, NULL, "N", "CPU threads (0: all cores)"},
        {"device", OPT_STRING, &o.device, 0, 0, "cpu|cuda", NULL, "where the layers run"},
        {"backward", OPT_STRING, &o.backward, 0, 0, "exact|fp8", NULL,
         "binary linear layers' backward products (fp8: CUDA with FP8 tensor cores, opt-in)"},
        {"data", OPT_STRING, &o.data_dir, 0, 0, NULL, "DIR",
         "Fashion-MNIST IDX files (default $BIE_DATA_DIR or " FMNIST_DEFAULT_DIR ")"},
        {"train-limit", OPT_INT, &o.train_limit, 0, 1e9, NULL, "N",
         "use only the first N training images (0: all)"},
        {"test-limit", OPT_INT, &o.test_limit, 0, 1e9, NULL, "N",
         "use only the first N test images (0: all)"},
        {"eval-batch-size", OPT_INT, &o.eval_batch, 1, 65536, NULL, "N", "batch for evaluation"},
        {"out", OPT_STRING, &o.out_dir, 0, 0, NULL, "DIR",
         "output directory (default runs/<model>)"},
        {"progress", OPT_STRING, &o.progress, 0, 0, "auto|bar|plain|none", NULL,
         "progress display on stderr (auto: a bar on a terminal)"},
        {"help", OPT_FLAG, &o.help, 0, 0, NULL, NULL, "show this help"},
        {NULL, 0, NULL, 0, 0, NULL, NULL, NULL},
    };
    if (opt_parse("train", specs, argc, argv, NULL, 0, NULL) != 0) {
        fprintf(stderr, "%s\n", tool_error());
        return EXIT_USAGE;
    }
    if (o.help) {
        print_usage(stdout, specs);
        return 0;
    }
    if (o.depth != -1 && strcmp(o.preset, "resnet") != 0) {
        fprintf(stderr, "bie train: --depth applies to the resnet preset only\n");
        return EXIT_USAGE;
    }
    if (o.depth == 0) {
        fprintf(stderr, "bie train: --depth must be at least 1\n");
        return EXIT_USAGE;
    }
    preset_defaults(&o);
    if (o.batch < 2) {
        fprintf(stderr, "bie train: --batch-size must be at least 2 (batch norm)\n");
        return EXIT_USAGE;
    }
    if (o.epochs < 1 || o.lr <= 0 || o.binary_lr <= 0) {
        fprintf(stderr, "bie train: --epochs, --lr and --binary-lr must be positive\n");
        return EXIT_USAGE;
    }
    char default_out[64];
    if (!o.out_dir) {
        snprintf(default_out, sizeof default_out, "runs/%s", o.preset);
        o.out_dir = default_out;
    }
    trainer t = {.opt = &o};
    if (augment_parse(o.augment, o.augment_shift, &t.augment) != 0) {
        fprintf(stderr, "bie train: %s\n", tool_error());
        return EXIT_USAGE;
    }
    if (setup_device(o.device, o.threads, &t.where) != 0) return report_failure("train");
    epoch_metrics *rows = calloc((size_t)o.epochs, sizeof *rows);
    int status = rows ? setup_trainer(&t) : tool_fail("out of memory");
    if (status == 0) status = run_epochs(&t, rows);
    free_trainer(&t);
    free(rows);
    return status == 0 ? 0 : report_failure("train");
}
