/* Fashion-MNIST: loading the IDX files of Debian's dataset-fashion-mnist package and
 * drawing shuffled mini-batches from a seed.
 *
 * Images become float32 [n, 1, 28, 28], normalized to (pixel / 255 - mean) / std with the
 * training set's statistics, so every model sees inputs of unit scale. */
#ifndef BIE_TOOL_DATASET_H
#define BIE_TOOL_DATASET_H

#include <stdint.h>

/* Where Debian's package installs the files. */
#define FMNIST_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"
#define FMNIST_CLASSES 10
#define FMNIST_SIDE 28
#define FMNIST_PIXELS (FMNIST_SIDE * FMNIST_SIDE)

typedef enum fmnist_split { FMNIST_TRAIN = 0, FMNIST_TEST = 1 } fmnist_split;

typedef struct fmnist_set {
    float *images;   /* [count, 1, 28, 28] normalized */
    uint8_t *labels; /* [count], 0..9 */
    int64_t count;
} fmnist_set;

/* The data directory: `dir` if not NULL, else $BIE_DATA_DIR, else FMNIST_DEFAULT_DIR. */
const char *fmnist_data_dir(const char *dir);

/* Load one split from `dir` (the files <prefix>-images-idx3-ubyte[.gz] and
 * <prefix>-labels-idx1-ubyte[.gz], prefix "train" or "t10k"), keeping the first `limit`
 * examples (limit <= 0: all). Errors (-1, tool_error): missing files (the message says how
 * to install them), corrupt or truncated files, 28x28 images expected, label count or
 * values that do not match. */
int fmnist_load(const char *dir, fmnist_split split, int64_t limit, fmnist_set *out);
void fmnist_free(fmnist_set *set);

/* Normalize `count` pixels (0..255) the way the loader does. */
void fmnist_normalize(const uint8_t *pixels, int64_t count, float *out);

/* Class names, index 0..9. */
const char *fmnist_class_name(int label);

/* A seedable generator (splitmix64): the tool's only source of randomness, so a seed
 * reproduces a run. */
typedef struct tool_rng {
    uint64_t state;
} tool_rng;
uint64_t tool_rng_next(tool_rng *rng);
/* Uniform integer in [0, bound) without modulo bias; bound >= 1. */
uint64_t tool_rng_below(tool_rng *rng, uint64_t bound);

/* Fill order[0..count) with a permutation of 0..count-1 drawn from rng (Fisher-Yates). */
void fmnist_shuffle(int64_t *order, int64_t count, tool_rng *rng);

/* Copy examples order[first .. first + batch) into x [batch, 1, 28, 28] and labels. */
void fmnist_gather(const fmnist_set *set, const int64_t *order, int64_t first, int64_t batch,
                   float *x, int32_t *labels);

#endif
