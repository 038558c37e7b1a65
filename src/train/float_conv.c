/* Float conv2d of the graph (NCHW): im2col of one image into the caller's work buffer, then
 * one OpenBLAS sgemm per image. The backward runs the same im2col, accumulates dw over the
 * images in order with sgemm, and scatters W^T dy back with col2im, one thread per input
 * channel. bie's own sums run in a fixed order; OpenBLAS may block an sgemm differently for
 * another thread count, so results are reproducible for a given thread count (as the float
 * linear layer's). */
#include <cblas.h>
#include <string.h>

#include "train_internal.h"

/* Rows of the column matrix (c k k) and its columns (oh ow). */
static int64_t conv_rows(const bie_conv_geom *g) { return g->c * g->k * g->k; }
static int64_t conv_cols(const bie_conv_geom *g) { return g->oh * g->ow; }

/* A 1x1 kernel with stride 1 and no padding reads the image as it is: the column matrix of
 * image i is x_i itself. */
static bool conv_is_pointwise(const bie_conv_geom *g) {
    return g->k == 1 && g->s == 1 && g->p == 0 && g->oh == g->h && g->ow == g->w;
}

/* Outputs along one axis that read an input inside [0, extent) for kernel tap offset
 * `off` (= tap * d - p): those with index in [*lo, *hi). */
static void conv_valid_range(int64_t off, int64_t s, int64_t extent, int64_t out, int64_t *lo,
                             int64_t *hi) {
    int64_t a = off >= 0 ? 0 : (-off + s - 1) / s;
    int64_t b = off >= extent ? 0 : (extent - off - 1) / s + 1;
    if (a > out) a = out;
    if (b > out) b = out;
    if (b < a) b = a;
    *lo = a;
    *hi = b;
}

/* col[(ci k + ky) k + kx, oy ow + ox] = x[ci, oy s - p + ky d, ox s - p + kx d], 0 outside.
 * Rows are independent: any split over threads writes the same values. */
static void im2col(const bie_conv_geom *g, const float *x, float *col) {
    const int64_t k = g->k, rows = conv_rows(g), cols = conv_cols(g);
    const int64_t h = g->h, w = g->w, ow = g->ow, oh = g->oh, s = g->s;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (rows * cols > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t ci = r / (k * k), ky = r / k % k, kx = r % k;
        const int64_t offy = ky * g->d - g->p, offx = kx * g->d - g->p;
        const float *xp = x + ci * h * w;
        float *row = col + r * cols;
        int64_t y0, y1, x0, x1;
        conv_valid_range(offy, s, h, oh, &y0, &y1);
        conv_valid_range(offx, s, w, ow, &x0, &x1);
        for (int64_t oy = 0; oy < oh; oy++) {
            float *dst = row + oy * ow;
            if (oy < y0 || oy >= y1) {
                memset(dst, 0, (size_t)ow * sizeof(float));
                continue;
            }
            const float *src = xp + (oy * s + offy) * w + offx;
            for (int64_t ox = 0; ox < x0; ox++) dst[ox] = 0.0f;
            if (s == 1) {
                if (x1 > x0) memcpy(dst + x0, src + x0, (size_t)(x1 - x0) * sizeof(float));
            } else {
                for (int64_t ox = x0; ox < x1; ox++) dst[ox] = src[ox * s];
            }
            for (int64_t ox = x1; ox < ow; ox++) dst[ox] = 0.0f;
        }
    }
}

/* The adjoint of im2col: dx[ci, iy, ix] = sum of the column entries that read it. One thread
 * per input channel; each channel's taps and positions are added in a fixed order. */
static void col2im(const bie_conv_geom *g, const float *col, float *dx) {
    const int64_t k = g->k, cols = conv_cols(g);
    const int64_t h = g->h, w = g->w, ow = g->ow, oh = g->oh, s = g->s;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (conv_rows(g) * cols > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t ci = 0; ci < g->c; ci++) {
        float *dxp = dx + ci * h * w;
        memset(dxp, 0, (size_t)(h * w) * sizeof(float));
        for (int64_t ky = 0; ky < k; ky++)
            for (int64_t kx = 0; kx < k; kx++) {
                const int64_t offy = ky * g->d - g->p, offx = kx * g->d - g->p;
                const float *row = col + ((ci * k + ky) * k + kx) * cols;
                int64_t y0, y1, x0, x1;
                conv_valid_range(offy, s, h, oh, &y0, &y1);
                conv_valid_range(offx, s, w, ow, &x0, &x1);
                for (int64_t oy = y0; oy < y1; oy++) {
                    float *dst = dxp + (oy * s + offy) * w + offx;
                    const float *src = row + oy * ow;
                    if (s == 1) { /* the same adds, in a loop the compiler vectorises */
                        for (int64_t ox = x0; ox < x1; ox++) dst[ox] += src[ox];
                    } else {
                        for (int64_t ox = x0; ox < x1; ox++) dst[ox * s] += src[ox];
                    }
                }
            }
    }
}

/* The column matrix of one image and W^T dy of one image (backward). */
int64_t bie_conv2d_work_floats(const bie_conv_geom *g) { return 2 * conv_rows(g) * conv_cols(g); }

void bie_conv2d_forward(const bie_conv_geom *g, const float *x, const float *w, const float *b,
                        float *y, float *work) {
    const int64_t rows = conv_rows(g), cols = conv_cols(g), o = g->o;
    const int64_t x_image = g->c * g->h * g->w, y_image = o * cols;
    if (g->n == 0 || y_image == 0) return;
    const bool pointwise = conv_is_pointwise(g);
    for (int64_t i = 0; i < g->n; i++) {
        const float *xi = x + i * x_image;
        float *yi = y + i * y_image;
        const float *col = xi;
        if (!pointwise) {
            im2col(g, xi, work);
            col = work;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)o, (int)cols, (int)rows, 1.0f,
                    w, (int)rows, col, (int)cols, 0.0f, yi, (int)cols);
        if (b == NULL) continue;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (y_image > BIE_TRAIN_PARALLEL_MIN)
        for (int64_t oc = 0; oc < o; oc++) {
            const float bias = b[oc];
            float *yr = yi + oc * cols;
            for (int64_t j = 0; j < cols; j++) yr[j] += bias;
        }
    }
}

void bie_conv2d_backward(const bie_conv_geom *g, const float *x, const float *dy, const float *w,
                         float *dx, float *dw, float *db, float *work) {
    const int64_t rows = conv_rows(g), cols = conv_cols(g), o = g->o;
    const int64_t x_image = g->c * g->h * g->w, y_image = o * cols;
    if (g->n == 0 || cols == 0) { /* no output: every gradient is zero */
        memset(dw, 0, (size_t)(o * rows) * sizeof(float));
        if (db) memset(db, 0, (size_t)o * sizeof(float));
        if (dx) memset(dx, 0, (size_t)(g->n * x_image) * sizeof(float));
        return;
    }
    const bool pointwise = conv_is_pointwise(g);
    float *col_buf = work, *dcol_buf = work + rows * cols;
    for (int64_t i = 0; i < g->n; i++) {
        const float *xi = x + i * x_image, *dyi = dy + i * y_image;
        const float *col = xi;
        if (!pointwise) {
            im2col(g, xi, col_buf);
            col = col_buf;
        }
        /* dw (+)= dy_i col_i^T: the images add in order, the first overwrites */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)o, (int)rows, (int)cols, 1.0f,
                    dyi, (int)cols, col, (int)cols, i == 0 ? 0.0f : 1.0f, dw, (int)rows);
        if (dx == NULL) continue;
        float *dxi = dx + i * x_image;
        float *dcol = pointwise ? dxi : dcol_buf;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)rows, (int)cols, (int)o, 1.0f, w,
                    (int)rows, dyi, (int)cols, 0.0f, dcol, (int)cols);
        if (!pointwise) col2im(g, dcol, dxi);
    }
    if (db == NULL) return;
        /* Bias gradient: one thread per output channel, images then positions in order. */
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (g->n * y_image > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t oc = 0; oc < o; oc++) {
        double s = 0;
        for (int64_t i = 0; i < g->n; i++) {
            const float *dr = dy + i * y_image + oc * cols;
            for (int64_t j = 0; j < cols; j++) s += dr[j];
        }
        db[oc] = (float)s;
    }
}
