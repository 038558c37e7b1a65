/* What the benchmarks read of a layer (bie_layer_describe, bie_layer_output_shape); C and C++.
 * A failing call ends the program: the benchmarks only ask about layers they made. */
#ifndef BIE_BENCH_LAYER_H
#define BIE_BENCH_LAYER_H

#include <stdio.h>
#include <stdlib.h>

#include "bie.h"

static inline bie_layer_desc bench_describe(const bie_layer *l) {
    bie_layer_desc d;
    if (bie_layer_describe(l, &d) != BIE_OK) {
        fprintf(stderr, "bie_layer_describe failed: %s\n", bie_last_error());
        exit(1);
    }
    return d;
}

/* The layer's selected GEMM kernel id (-1: the default per shape). */
static inline int bench_kernel_id(const bie_layer *l) { return bench_describe(l).kernel_id; }

/* Output extents of a conv layer for one h x w image (0 when the shape is refused). */
static inline bie_status bench_output_hw(const bie_layer *l, int64_t h, int64_t w, int64_t *oh,
                                         int64_t *ow) {
    const int64_t in_shape[4] = {1, bench_describe(l).in, h, w};
    int64_t out_shape[BIE_MAX_DIMS];
    int out_ndim = 0;
    const bie_status st = bie_layer_output_shape(l, 4, in_shape, &out_ndim, out_shape);
    *oh = st == BIE_OK ? out_shape[2] : 0;
    *ow = st == BIE_OK ? out_shape[3] : 0;
    return st;
}

#endif
