#include "augment.h"

#include <string.h>

#include "errors.h"

int augment_parse(const char *mode, int64_t max_shift, augment_config *out) {
    augment_config c = {0, false};
    if (!mode) mode = "none";
    bool shift = strcmp(mode, "shift") == 0 || strcmp(mode, "shift-flip") == 0;
    c.flip = strcmp(mode, "flip") == 0 || strcmp(mode, "shift-flip") == 0;
    if (!shift && !c.flip && strcmp(mode, "none") != 0)
        return tool_fail("unknown augmentation '%s' (expected %s)", mode, AUGMENT_CHOICES);
    if (shift) {
        if (max_shift < 1 || max_shift > AUGMENT_MAX_SHIFT)
            return tool_fail("augmentation shift %lld is out of range [1, %d]",
                             (long long)max_shift, AUGMENT_MAX_SHIFT);
        c.max_shift = (int)max_shift;
    }
    *out = c;
    return 0;
}

bool augment_active(const augment_config *config) {
    return config && (config->max_shift > 0 || config->flip);
}

void augment_batch(const augment_config *config, float *x, int64_t batch, tool_rng *rng) {
    if (!augment_active(config)) return;
    const int side = FMNIST_SIDE, span = 2 * config->max_shift + 1;
    float background;
    const uint8_t black = 0;
    fmnist_normalize(&black, 1, &background);
    float src[FMNIST_PIXELS];
    for (int64_t b = 0; b < batch; b++) {
        /* Always three draws per image whatever the mode, in a fixed order. */
        int dy = (int)tool_rng_below(rng, (uint64_t)span) - config->max_shift;
        int dx = (int)tool_rng_below(rng, (uint64_t)span) - config->max_shift;
        bool mirror = config->flip && (tool_rng_next(rng) >> 63);
        if (dy == 0 && dx == 0 && !mirror) continue;
        float *img = x + b * FMNIST_PIXELS;
        memcpy(src, img, sizeof src);
        for (int r = 0; r < side; r++) {
            int sr = r - dy;
            for (int c = 0; c < side; c++) {
                int sc = (mirror ? side - 1 - c : c) - dx;
                bool inside = sr >= 0 && sr < side && sc >= 0 && sc < side;
                img[r * side + c] = inside ? src[sr * side + sc] : background;
            }
        }
    }
}
