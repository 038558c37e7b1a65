/* Data augmentation of `bie train`: each augmented image is one of the allowed shifts /
 * mirrors of its own source image (so it still matches its label), offsets cover the whole
 * range and nothing else, images do change, the seed reproduces the result, and bad
 * configurations are rejected. */
#include "../test_util.h"
#include "augment.h"
#include "dataset.h"
#include "errors.h"

enum { SIDE = FMNIST_SIDE, PIX = FMNIST_PIXELS };

static float background(void) {
    const uint8_t zero = 0;
    float v;
    fmnist_normalize(&zero, 1, &v);
    return v;
}

/* Reference: mirror first (into a copy), then translate by (dy, dx) with background fill. */
static void reference(const float *src, int dy, int dx, bool mirror, float *out) {
    float tmp[PIX];
    for (int r = 0; r < SIDE; r++)
        for (int c = 0; c < SIDE; c++)
            tmp[r * SIDE + c] = src[r * SIDE + (mirror ? SIDE - 1 - c : c)];
    const float bg = background();
    for (int i = 0; i < PIX; i++) out[i] = bg;
    for (int r = 0; r < SIDE; r++)
        for (int c = 0; c < SIDE; c++) {
            int tr = r + dy, tc = c + dx;
            if (tr >= 0 && tr < SIDE && tc >= 0 && tc < SIDE)
                out[tr * SIDE + tc] = tmp[r * SIDE + c];
        }
}

/* A synthetic set of random images (random bytes, normalized like the real data). */
static fmnist_set make_set(int64_t count) {
    fmnist_set s = {.count = count};
    s.images = malloc((size_t)count * PIX * sizeof(float));
    s.labels = malloc((size_t)count);
    uint8_t *bytes = malloc((size_t)count * PIX);
    for (int64_t i = 0; i < count * PIX; i++) bytes[i] = (uint8_t)(tu_next() % 256);
    fmnist_normalize(bytes, count * PIX, s.images);
    for (int64_t i = 0; i < count; i++) s.labels[i] = (uint8_t)(tu_next() % FMNIST_CLASSES);
    free(bytes);
    return s;
}

/* Augment `batch` shuffled examples and check each one against every allowed transform of
 * its source; counts[] records how often each (dy, dx, mirror) was seen. */
static void check_batch(const fmnist_set *set, const augment_config *cfg, int64_t batch,
                        uint64_t seed, int64_t *counts) {
    int64_t *order = malloc((size_t)set->count * sizeof(int64_t));
    float *x = malloc((size_t)batch * PIX * sizeof(float));
    int32_t *labels = malloc((size_t)batch * sizeof(int32_t));
    tool_rng shuffle = {seed}, rng = {seed * 7 + 3};
    fmnist_shuffle(order, set->count, &shuffle);
    for (int64_t i = 0; i < batch * PIX; i++) x[i] = NAN; /* poison: gather must overwrite */
    for (int64_t i = 0; i < batch; i++) labels[i] = -1;
    fmnist_gather(set, order, 0, batch, x, labels);
    augment_batch(cfg, x, batch, &rng);
    const int s = cfg->max_shift, span = 2 * s + 1;
    float want[PIX];
    for (int64_t b = 0; b < batch; b++) {
        const int64_t src = order[b];
        CHECK(labels[b] == set->labels[src]);
        int matches = 0;
        for (int m = 0; m <= (cfg->flip ? 1 : 0); m++)
            for (int dy = -s; dy <= s; dy++)
                for (int dx = -s; dx <= s; dx++) {
                    reference(set->images + src * PIX, dy, dx, m, want);
                    if (memcmp(want, x + b * PIX, sizeof want) == 0) {
                        matches++;
                        counts[(m * span + dy + s) * span + dx + s]++;
                    }
                }
        CHECK(matches == 1);
        if (matches != 1)
            fprintf(stderr, "  image %lld matched %d transforms\n", (long long)b, matches);
    }
    free(order);
    free(x);
    free(labels);
}

static void test_transforms(void) {
    fmnist_set set = make_set(600);
    const struct {
        const char *mode;
        int shift;
    } cases[] = {{"shift", 2}, {"shift-flip", 2}, {"flip", 2}, {"shift", 1}, {"shift-flip", 8}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        augment_config cfg;
        CHECK(augment_parse(cases[k].mode, cases[k].shift, &cfg) == 0);
        CHECK(augment_active(&cfg));
        const int span = 2 * cfg.max_shift + 1, kinds = span * span * (cfg.flip ? 2 : 1);
        int64_t *counts = calloc((size_t)kinds, sizeof(int64_t));
        const int64_t batches[] = {1, 7, 500};
        for (size_t j = 0; j < 3; j++)
            check_batch(&set, &cfg, batches[j], 11 + j + 100 * k, counts);
        /* 508 images over at most 2 * 17 * 17 = 578 kinds: with few kinds every one must
         * occur; with many, at least a wide spread. No identity-only run. */
        int seen = 0;
        int64_t total = 0, identity = counts[(cfg.max_shift) * span + cfg.max_shift];
        for (int i = 0; i < kinds; i++) {
            seen += counts[i] > 0;
            total += counts[i];
        }
        CHECK(total == 508);
        if (kinds <= 50)
            CHECK(seen == kinds);
        else
            CHECK(seen > 200);
        CHECK(identity < total / 2 + (kinds == 2 ? 40 : 0)); /* flip only: about half */
        if (cfg.flip) {                                      /* mirrored in about half the images */
            int64_t mirrored = 0;
            for (int i = kinds / 2; i < kinds; i++) mirrored += counts[i];
            CHECK(mirrored > 180 && mirrored < 330);
        }
        free(counts);
    }
    fmnist_free(&set);
}

/* Zero-fill at the borders: shifting a bright image leaves background rows / columns. */
static void test_background(void) {
    augment_config cfg;
    CHECK(augment_parse("shift", 2, &cfg) == 0);
    float x[PIX * 64];
    const uint8_t bright = 200;
    float v;
    fmnist_normalize(&bright, 1, &v);
    for (int i = 0; i < PIX * 64; i++) x[i] = v;
    tool_rng rng = {42};
    augment_batch(&cfg, x, 64, &rng);
    const float bg = background();
    int changed = 0;
    for (int b = 0; b < 64; b++) {
        int n_bg = 0, n_other = 0;
        for (int i = 0; i < PIX; i++) {
            n_bg += x[b * PIX + i] == bg;
            n_other += x[b * PIX + i] != bg && x[b * PIX + i] != v;
        }
        CHECK(n_other == 0);
        /* a shift by (dy, dx) leaves 28 * 28 - (28 - |dy|) * (28 - |dx|) background pixels */
        bool possible = false;
        for (int dy = 0; dy <= 2; dy++)
            for (int dx = 0; dx <= 2; dx++) possible |= n_bg == PIX - (SIDE - dy) * (SIDE - dx);
        CHECK(possible);
        changed += n_bg > 0;
    }
    CHECK(changed > 48); /* 24 of 25 offsets move the image */
}

static void test_reproducible(void) {
    fmnist_set set = make_set(50);
    augment_config cfg;
    CHECK(augment_parse("shift-flip", 2, &cfg) == 0);
    float *a = malloc(sizeof(float) * PIX * 50), *b = malloc(sizeof(float) * PIX * 50);
    int32_t la[50], lb[50];
    fmnist_gather(&set, NULL, 0, 50, a, la);
    fmnist_gather(&set, NULL, 0, 50, b, lb);
    tool_rng r1 = {1234}, r2 = {1234};
    augment_batch(&cfg, a, 50, &r1);
    augment_batch(&cfg, b, 50, &r2);
    CHECK(memcmp(a, b, sizeof(float) * PIX * 50) == 0);
    CHECK(r1.state == r2.state);
    /* A second batch from the same generators is again identical, and differs from the first. */
    float *c = malloc(sizeof(float) * PIX * 50);
    fmnist_gather(&set, NULL, 0, 50, b, lb);
    fmnist_gather(&set, NULL, 0, 50, c, lb);
    augment_batch(&cfg, b, 50, &r1);
    augment_batch(&cfg, c, 50, &r2);
    CHECK(memcmp(b, c, sizeof(float) * PIX * 50) == 0);
    CHECK(memcmp(a, b, sizeof(float) * PIX * 50) != 0);
    /* Another seed: other images. */
    tool_rng r3 = {1235};
    fmnist_gather(&set, NULL, 0, 50, c, lb);
    augment_batch(&cfg, c, 50, &r3);
    CHECK(memcmp(a, c, sizeof(float) * PIX * 50) != 0);
    /* "none" changes nothing and leaves the generator alone. */
    augment_config none;
    CHECK(augment_parse("none", 2, &none) == 0);
    CHECK(!augment_active(&none));
    tool_rng r4 = {99};
    fmnist_gather(&set, NULL, 0, 50, c, lb);
    augment_batch(&none, c, 50, &r4);
    CHECK(r4.state == 99);
    CHECK(memcmp(c, set.images, sizeof(float) * PIX * 50) == 0);
    free(a);
    free(b);
    free(c);
    fmnist_free(&set);
}

static void test_parse(void) {
    augment_config cfg = {5, true}, before = cfg;
    CHECK(augment_parse("rotate", 2, &cfg) == -1);
    CHECK(strstr(tool_error(), "unknown augmentation 'rotate'") != NULL);
    CHECK(augment_parse("", 2, &cfg) == -1);
    CHECK(augment_parse("shift", 0, &cfg) == -1);
    CHECK(strstr(tool_error(), "out of range") != NULL);
    CHECK(augment_parse("shift-flip", AUGMENT_MAX_SHIFT + 1, &cfg) == -1);
    CHECK(augment_parse("shift", -2, &cfg) == -1);
    CHECK(cfg.max_shift == before.max_shift && cfg.flip == before.flip); /* untouched */
    CHECK(augment_parse("flip", 0, &cfg) == 0 && cfg.flip && cfg.max_shift == 0);
    CHECK(augment_parse("shift", 3, &cfg) == 0 && !cfg.flip && cfg.max_shift == 3);
    CHECK(augment_parse(NULL, 2, &cfg) == 0 && !augment_active(&cfg));
}

int main(void) {
    tu_seed(2024);
    test_transforms();
    test_background();
    test_reproducible();
    test_parse();
    return tu_finish();
}
