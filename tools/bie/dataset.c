#include "dataset.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "errors.h"
#include "idx.h"

/* Mean and standard deviation of the training images' pixels scaled to [0, 1]. */
#define FMNIST_MEAN 0.2860f
#define FMNIST_STD 0.3530f

static const char *const class_names[FMNIST_CLASSES] = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

const char *fmnist_class_name(int label) {
    return label >= 0 && label < FMNIST_CLASSES ? class_names[label] : "?";
}

const char *fmnist_data_dir(const char *dir) {
    if (dir && *dir) return dir;
    const char *env = getenv("BIE_DATA_DIR");
    return env && *env ? env : FMNIST_DEFAULT_DIR;
}

enum { PATH_CAP = 4096 };

/* The path of `<dir>/<base>.gz` or, failing that, `<dir>/<base>`. */
static int find_file(const char *dir, const char *base, char path[PATH_CAP]) {
    static const char *const suffixes[2] = {".gz", ""};
    for (int i = 0; i < 2; i++) {
        struct stat st;
        int n = snprintf(path, PATH_CAP, "%s/%s%s", dir, base, suffixes[i]);
        if (n < 0 || n >= PATH_CAP) return tool_fail("data directory name too long: %s", dir);
        if (stat(path, &st) == 0) return 0;
    }
    return tool_fail("Fashion-MNIST file %s[.gz] not found in %s. Install the data set with "
                     "`sudo apt-get install dataset-fashion-mnist` (or run scripts/setup-deps), "
                     "or point --data (or BIE_DATA_DIR) at a folder holding the IDX files",
                     base, dir);
}

static int read_split_files(const char *dir, const char *prefix, idx_array *images,
                            idx_array *labels) {
    char base[64], path[PATH_CAP];
    snprintf(base, sizeof base, "%s-images-idx3-ubyte", prefix);
    TOOL_TRY(find_file(dir, base, path));
    TOOL_TRY(idx_read_u8(path, 3, images));
    if (images->dims[1] != FMNIST_SIDE || images->dims[2] != FMNIST_SIDE) {
        tool_fail("%s: images are %lldx%lld, expected 28x28", path, (long long)images->dims[1],
                  (long long)images->dims[2]);
        idx_free(images);
        return -1;
    }
    snprintf(base, sizeof base, "%s-labels-idx1-ubyte", prefix);
    if (find_file(dir, base, path) != 0 || idx_read_u8(path, 1, labels) != 0) {
        idx_free(images);
        return -1;
    }
    int64_t bad = -1;
    for (int64_t i = 0; i < labels->dims[0] && bad < 0; i++)
        if (labels->data[i] >= FMNIST_CLASSES) bad = i;
    if (labels->dims[0] != images->dims[0] || bad >= 0) {
        if (bad >= 0)
            tool_fail("%s: label %lld is %d, expected 0..9", path, (long long)bad,
                      labels->data[bad]);
        else
            tool_fail("%s: %lld labels for %lld images", path, (long long)labels->dims[0],
                      (long long)images->dims[0]);
        idx_free(images);
        idx_free(labels);
        return -1;
    }
    return 0;
}

int fmnist_load(const char *dir, fmnist_split split, int64_t limit, fmnist_set *out) {
    idx_array images, labels;
    const char *prefix = split == FMNIST_TRAIN ? "train" : "t10k";
    TOOL_TRY(read_split_files(fmnist_data_dir(dir), prefix, &images, &labels));
    int64_t count = images.dims[0];
    if (limit > 0 && limit < count) count = limit;
    fmnist_set set = {.count = count};
    set.images = malloc((size_t)count * FMNIST_PIXELS * sizeof(float));
    set.labels = malloc((size_t)count);
    if (!set.images || !set.labels) {
        free(set.images);
        free(set.labels);
        idx_free(&images);
        idx_free(&labels);
        return tool_fail("out of memory loading Fashion-MNIST");
    }
    fmnist_normalize(images.data, count * FMNIST_PIXELS, set.images);
    memcpy(set.labels, labels.data, (size_t)count);
    idx_free(&images);
    idx_free(&labels);
    *out = set;
    return 0;
}

void fmnist_normalize(const uint8_t *pixels, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++)
        out[i] = ((float)pixels[i] / 255.0f - FMNIST_MEAN) / FMNIST_STD;
}

void fmnist_free(fmnist_set *set) {
    if (!set) return;
    free(set->images);
    free(set->labels);
    memset(set, 0, sizeof *set);
}

uint64_t tool_rng_next(tool_rng *rng) {
    uint64_t z = (rng->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t tool_rng_below(tool_rng *rng, uint64_t bound) {
    /* Reject the top partial range so every value is equally likely. */
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t r;
    do r = tool_rng_next(rng);
    while (r >= limit);
    return r % bound;
}

void fmnist_shuffle(int64_t *order, int64_t count, tool_rng *rng) {
    for (int64_t i = 0; i < count; i++) order[i] = i;
    for (int64_t i = count - 1; i > 0; i--) {
        int64_t j = (int64_t)tool_rng_below(rng, (uint64_t)i + 1);
        int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

void fmnist_gather(const fmnist_set *set, const int64_t *order, int64_t first, int64_t batch,
                   float *x, int32_t *labels) {
    for (int64_t b = 0; b < batch; b++) {
        int64_t src = order ? order[first + b] : first + b;
        memcpy(x + b * FMNIST_PIXELS, set->images + src * FMNIST_PIXELS,
               FMNIST_PIXELS * sizeof(float));
        labels[b] = set->labels[src];
    }
}
