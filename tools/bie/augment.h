/* Data augmentation for `bie train`: each training image of a batch is moved by a random
 * whole-pixel offset (the pixels that come in are background, the pixels pushed out are
 * lost) and/or mirrored left to right, drawn from the run's generator so that a seed
 * reproduces a run. Labels are untouched: a shifted or mirrored garment is the same class.
 * Test images are never augmented. */
#ifndef BIE_TOOL_AUGMENT_H
#define BIE_TOOL_AUGMENT_H

#include <stdbool.h>
#include <stdint.h>

#include "dataset.h"

/* What the --augment option's words mean; "none", "shift", "flip", "shift-flip". */
#define AUGMENT_CHOICES "none|shift|flip|shift-flip"
#define AUGMENT_MAX_SHIFT 8

typedef struct augment_config {
    int max_shift; /* 0: no translation; else offsets drawn uniformly in [-max, max] per axis */
    bool flip;     /* mirror left to right with probability 1/2 */
} augment_config;

/* The configuration for an --augment word and a maximal shift (used only when the word
 * includes "shift"; 1..AUGMENT_MAX_SHIFT). Errors (-1, tool_error): an unknown word, a shift
 * out of range. */
int augment_parse(const char *mode, int64_t max_shift, augment_config *out);

/* Whether the configuration changes anything. */
bool augment_active(const augment_config *config);

/* Augment x [batch, 1, 28, 28] (normalized images) in place. Each image draws its offsets
 * (dy, dx) and flip from rng, in image order, so the result depends only on the rng's state
 * and the batch. Output pixel (r, c) is input pixel (r - dy, c' - dx), where c' is c or, for
 * a mirrored image, 27 - c; pixels from outside the image are background (pixel value 0,
 * normalized). Does nothing when the configuration is inactive (rng untouched). */
void augment_batch(const augment_config *config, float *x, int64_t batch, tool_rng *rng);

#endif
