/* The CPU binary GEMM frame: packing into micro-panels, cache blocking, threads and the
 * epilogue (popcount back-transform and scale), written once for every micro-kernel. */
#include <string.h>

#include "../../core/formats.h"
#include "../../core/internal.h"
#include "../dispatch.h"

static int big_enough_for_threads(int64_t m, int64_t n, int64_t k) {
    return (double)m * (double)n * (double)k > 4.0e6;
}

static void run_rows(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k, const uint8_t *a,
                     int64_t lda, const uint8_t *b, int64_t ldb, float scale, float *out) {
#pragma omp parallel for num_threads(bie_threads()) \
    schedule(static) if (big_enough_for_threads(m, n, k))
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *bj = b + j * ldb;
        for (int64_t i = 0; i < m; i++)
            out[i * n + j] = bie_finish_dot(k, kern->rows(a + i * lda, bj, k), scale);
    }
}

/* Steps of a panel for k bits in a kernel's layout. */
static int64_t panel_steps(const bie_tile_kernel *t, int64_t k) {
    int64_t nbytes = (k + 7) >> 3;
    if (t->layout == BIE_PANEL_NIBBLE32) return 2 * ((nbytes + 31) / 32);
    return (nbytes + t->step_bytes - 1) / t->step_bytes;
}

/* Copy bytes [off, off + len) of a row into buf, zero past the row's valid bits. */
static void fetch_chunk(const uint8_t *row, int64_t k, int64_t off, int len, uint8_t *buf) {
    int64_t nbytes = (k + 7) >> 3;
    int64_t avail = nbytes - off;
    if (row == NULL || avail <= 0) {
        memset(buf, 0, (size_t)len);
        return;
    }
    int take = avail < len ? (int)avail : len;
    memcpy(buf, row + off, (size_t)take);
    memset(buf + take, 0, (size_t)(len - take));
    if (off + take == nbytes) buf[take - 1] &= bie_tail_mask(k);
}

/* Pack rows [row0, row0 + rows_per_panel) of a packed matrix into one micro-panel. */
static void pack_panel(const bie_tile_kernel *t, int rows_per_panel, const uint8_t *src, int64_t ld,
                       int64_t row0, int64_t nrows, int64_t k, int64_t steps, uint8_t *dst) {
    int sb = t->step_bytes;
    uint8_t buf[64];
    if (t->layout == BIE_PANEL_NIBBLE32) {
        for (int64_t c = 0; c < steps / 2; c++)
            for (int r = 0; r < rows_per_panel; r++) {
                const uint8_t *row = row0 + r < nrows ? src + (row0 + r) * ld : NULL;
                fetch_chunk(row, k, c * 32, 32, buf);
                uint8_t *lo = dst + (2 * c * rows_per_panel + r) * 32;
                uint8_t *hi = dst + ((2 * c + 1) * rows_per_panel + r) * 32;
                for (int x = 0; x < 32; x++) {
                    lo[x] = buf[x] & 15;
                    hi[x] = buf[x] >> 4;
                }
            }
        return;
    }
    const int64_t nbytes = (k + 7) >> 3;
    for (int r = 0; r < rows_per_panel; r++) {
        const uint8_t *row = row0 + r < nrows ? src + (row0 + r) * ld : NULL;
        int64_t s = 0;
        if (row) /* whole chunks before the last byte: plain copies */
            for (; (s + 1) * sb < nbytes; s++)
                memcpy(dst + (s * rows_per_panel + r) * sb, row + s * sb, (size_t)sb);
        for (; s < steps; s++) fetch_chunk(row, k, s * sb, sb, dst + (s * rows_per_panel + r) * sb);
    }
}

static void pack_all(const bie_tile_kernel *t, int per_panel, const uint8_t *src, int64_t ld,
                     int64_t nrows, int64_t k, int64_t steps, uint8_t *dst, int64_t panel_bytes) {
    int64_t npanels = (nrows + per_panel - 1) / per_panel;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (nrows * k > 65536)
    for (int64_t p = 0; p < npanels; p++)
        pack_panel(t, per_panel, src, ld, p * per_panel, nrows, k, steps, dst + p * panel_bytes);
}

/* Bytes of one micro-panel of `per_panel` rows and the number of k steps. */
static int64_t panel_bytes_of(const bie_tile_kernel *t, int per_panel, int64_t steps) {
    return steps * per_panel * t->step_bytes;
}

/* Every tile of out from packed A and B panels: blocking, threads, edge tiles. */
static void compute_tiles(const bie_tile_kernel *t, int64_t m, int64_t n, int64_t k, int64_t steps,
                          const uint8_t *ap, const uint8_t *bp, float scale, float *out) {
    const int mr = t->mr, nr = t->nr;
    const int64_t a_panels = (m + mr - 1) / mr, b_panels = (n + nr - 1) / nr;
    const int64_t a_panel_bytes = panel_bytes_of(t, mr, steps),
                  b_panel_bytes = panel_bytes_of(t, nr, steps);
    /* Blocks: a B block of about 16 KiB stays in L1 while the A panels of an A block (about
     * 256 KiB, in L2) stream past it one at a time; each A panel is then reused from L1
     * across the whole B block. */
    int64_t b_per_block = (16 * 1024) / b_panel_bytes;
    b_per_block = b_per_block < 1 ? 1 : b_per_block > 64 ? 64 : b_per_block;
    int64_t a_per_block = (256 * 1024) / a_panel_bytes;
    a_per_block = a_per_block < 1 ? 1 : a_per_block;
    const int64_t ablocks = (a_panels + a_per_block - 1) / a_per_block;
    const int64_t bblocks = (b_panels + b_per_block - 1) / b_per_block;
#pragma omp parallel for num_threads(bie_threads()) schedule(dynamic) \
    collapse(2) if (big_enough_for_threads(m, n, k))
    for (int64_t jb = 0; jb < bblocks; jb++)
        for (int64_t ib = 0; ib < ablocks; ib++) {
            float edge[256]; /* partial tiles at the matrix edges go through here */
            int64_t jp_end = (jb + 1) * b_per_block < b_panels ? (jb + 1) * b_per_block : b_panels;
            int64_t ip_end = (ib + 1) * a_per_block < a_panels ? (ib + 1) * a_per_block : a_panels;
            for (int64_t ip = ib * a_per_block; ip < ip_end; ip++)
                for (int64_t jp = jb * b_per_block; jp < jp_end; jp++) {
                    int64_t i0 = ip * mr, j0 = jp * nr;
                    int rows = m - i0 < mr ? (int)(m - i0) : mr;
                    int cols = n - j0 < nr ? (int)(n - j0) : nr;
                    const uint8_t *apan = ap + ip * a_panel_bytes, *bpan = bp + jp * b_panel_bytes;
                    if (rows == mr && cols == nr) {
                        t->fn(steps, apan, bpan, k, scale, out + i0 * n + j0, n);
                        continue;
                    }
                    t->fn(steps, apan, bpan, k, scale, edge, nr);
                    for (int r = 0; r < rows; r++)
                        for (int c = 0; c < cols; c++)
                            out[(i0 + r) * n + j0 + c] = edge[r * nr + c];
                }
        }
}

/* Packed panels of `rows` rows of a matrix, allocated. */
static bie_status pack_side(const bie_tile_kernel *t, int per_panel, const uint8_t *src, int64_t ld,
                            int64_t rows, int64_t k, uint8_t **out) {
    const int64_t steps = panel_steps(t, k), panels = (rows + per_panel - 1) / per_panel;
    int64_t bytes;
    if (!bie_mul_ok(panels, panel_bytes_of(t, per_panel, steps), &bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "gemm: packed panels too large");
    uint8_t *p = bie_alloc_aligned((size_t)bytes);
    if (p == NULL)
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "gemm: %lld bytes of panels", (long long)bytes);
    pack_all(t, per_panel, src, ld, rows, k, steps, p, panel_bytes_of(t, per_panel, steps));
    *out = p;
    return BIE_OK;
}

bie_status bie_cpu_pack_b(const bie_cpu_kernel *kern, int64_t n, int64_t k, const uint8_t *b,
                          int64_t ldb, bie_packed_b *out) {
    uint8_t *p = NULL;
    if (kern->tile) BIE_TRY(pack_side(kern->tile, kern->tile->nr, b, ldb, n, k, &p));
    bie_cpu_packed_b_free(out);
    out->kern = kern;
    out->n = n;
    out->k = k;
    out->panels = p;
    return BIE_OK;
}

void bie_cpu_packed_b_free(bie_packed_b *p) {
    bie_free_aligned(p->panels);
    memset(p, 0, sizeof *p);
}

bool bie_cpu_packed_b_fits(const bie_packed_b *p, const bie_cpu_kernel *kern, int64_t n,
                           int64_t k) {
    return p->panels && p->kern == kern && p->n == n && p->k == k;
}

bie_status bie_cpu_bgemm_packed(const bie_cpu_kernel *kern, int64_t m, const uint8_t *a,
                                int64_t lda, const bie_packed_b *b, float scale, float *out) {
    const bie_tile_kernel *t = kern->tile;
    uint8_t *ap = NULL;
    BIE_TRY(pack_side(t, t->mr, a, lda, m, b->k, &ap));
    compute_tiles(t, m, b->n, b->k, panel_steps(t, b->k), ap, b->panels, scale, out);
    bie_free_aligned(ap);
    return BIE_OK;
}

static bie_status run_tiled(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k,
                            const uint8_t *a, int64_t lda, const uint8_t *b, int64_t ldb,
                            float scale, float *out) {
    const bie_tile_kernel *t = kern->tile;
    uint8_t *ap = NULL, *bp = NULL;
    bie_status st = pack_side(t, t->mr, a, lda, m, k, &ap);
    if (st == BIE_OK) st = pack_side(t, t->nr, b, ldb, n, k, &bp);
    if (st == BIE_OK) compute_tiles(t, m, n, k, panel_steps(t, k), ap, bp, scale, out);
    bie_free_aligned(ap);
    bie_free_aligned(bp);
    return st;
}

bie_status bie_cpu_bgemm(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k,
                         const uint8_t *a, int64_t lda, const uint8_t *b, int64_t ldb, float scale,
                         float *out) {
    if (kern->rows) {
        run_rows(kern, m, n, k, a, lda, b, ldb, scale, out);
        return BIE_OK;
    }
    return run_tiled(kern, m, n, k, a, lda, b, ldb, scale, out);
}

bie_status bie_cpu_kernel_for_call(bie_op op, int kernel_id, int64_t m, const char *who,
                                   const bie_cpu_kernel **out) {
    const bie_cpu_kernel *kern =
        kernel_id < 0 ? bie_cpu_default_kernel_for(op, m) : bie_cpu_kernel_by_id(kernel_id);
    if (kern == NULL)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no CPU kernel with id %d", who, kernel_id);
    if (kern->op != op)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: kernel %s computes a different operation",
                        who, kern->name);
    if (!bie_cpu_kernel_available(kern))
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s: kernel %s needs an ISA this CPU lacks or "
                        "BIE_CPU_KERNELS excludes (active set: %s)",
                        who, kern->name, bie_cpu_kernel_set());
    *out = kern;
    return BIE_OK;
}

/* Public entry (see bie.h). */
bie_status bie_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const void *a,
                           int64_t a_row_bytes, const void *b, int64_t b_row_bytes, float scale,
                           float *out) {
    BIE_CHECK_NULL(a);
    BIE_CHECK_NULL(b);
    BIE_CHECK_NULL(out);
    if (m < 1 || n < 1 || k < 1)
        return bie_fail(BIE_ERR_SHAPE,
                        "bie_binary_gemm: m, n, k must be >= 1 (got %lld, %lld, %lld)",
                        (long long)m, (long long)n, (long long)k);
    if (k > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "bie_binary_gemm: k = %lld exceeds 2^31 - 1",
                        (long long)k);
    int64_t need = (k + 7) / 8, mn;
    if (a_row_bytes < need || b_row_bytes < need)
        return bie_fail(BIE_ERR_SHAPE,
                        "bie_binary_gemm: row strides must be >= ceil(k / 8) = %lld bytes",
                        (long long)need);
    if (!bie_mul_ok(m, n, &mn) || !bie_mul_ok(m, a_row_bytes, &need) ||
        !bie_mul_ok(n, b_row_bytes, &need))
        return bie_fail(BIE_ERR_OVERFLOW, "bie_binary_gemm: sizes overflow");
    if (!(scale == scale) || scale - scale != 0.0f)
        return bie_fail(BIE_ERR_NOT_FINITE, "bie_binary_gemm: scale is not finite");
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_BINARY_GEMM, kernel_id, m, "bie_binary_gemm", &kern));
    return bie_cpu_bgemm(kern, m, n, k, a, a_row_bytes, b, b_row_bytes, scale, out);
}

bie_status bie_q4_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const int8_t *a, int64_t lda,
                       const int8_t *b, int64_t ldb, float scale, float *out) {
    BIE_CHECK_NULL(a);
    BIE_CHECK_NULL(b);
    BIE_CHECK_NULL(out);
    if (m < 1 || n < 1 || k < 1)
        return bie_fail(BIE_ERR_SHAPE, "bie_q4_gemm: m, n, k must be >= 1");
    if (k > (1 << 24))
        return bie_fail(BIE_ERR_OVERFLOW, "bie_q4_gemm: k = %lld exceeds 2^24", (long long)k);
    if (lda < k || ldb < k) return bie_fail(BIE_ERR_SHAPE, "bie_q4_gemm: row strides must be >= k");
    int64_t mn;
    if (!bie_mul_ok(m, n, &mn) || !bie_mul_ok(m, lda, &mn) || !bie_mul_ok(n, ldb, &mn))
        return bie_fail(BIE_ERR_OVERFLOW, "bie_q4_gemm: sizes overflow");
    if (!(scale - scale == 0.0f))
        return bie_fail(BIE_ERR_NOT_FINITE, "bie_q4_gemm: scale is not finite");
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, kernel_id, m, "bie_q4_gemm", &kern));
    /* The frame moves bytes: an int8 row of k codes is a k * 8-bit row. */
    return bie_cpu_bgemm(kern, m, n, k * 8, (const uint8_t *)a, lda, (const uint8_t *)b, ldb, scale,
                         out);
}
