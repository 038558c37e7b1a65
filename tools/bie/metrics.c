#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "errors.h"

int metrics_write_csv(const char *path, const epoch_metrics *rows, size_t count) {
    FILE *f = fopen(path, "w");
    if (!f) return tool_fail("cannot create %s: %s", path, strerror(errno));
    fprintf(f, "epoch,train_loss,train_accuracy,test_accuracy,learning_rate\n");
    for (size_t i = 0; i < count; i++)
        fprintf(f, "%d,%.6f,%.6f,%.6f,%.6g\n", rows[i].epoch, rows[i].train_loss, rows[i].train_acc,
                rows[i].test_acc, rows[i].lr);
    int failed = ferror(f);
    if (fclose(f) != 0 || failed) return tool_fail("cannot write %s: %s", path, strerror(errno));
    return 0;
}

/* ------------------------------------------------------------------ SVG chart */

enum {
    PANEL_W = 460,
    PANEL_H = 340,
    MARGIN_L = 64,
    MARGIN_R = 16,
    MARGIN_T = 40,
    MARGIN_B = 52,
    TITLE_H = 36
};

typedef struct axis {
    double lo, hi, step; /* data range covered and tick spacing */
} axis;

/* A tick step of 1, 2 or 5 times a power of ten giving about `ticks` intervals. */
static double nice_step(double span, int ticks) {
    double raw = span / ticks, mag = pow(10.0, floor(log10(raw))), r = raw / mag;
    return (r <= 1 ? 1 : r <= 2 ? 2 : r <= 5 ? 5 : 10) * mag;
}

static axis make_axis(double lo, double hi, int ticks) {
    if (!(hi > lo)) { /* one value (or none): open a small window around it */
        double pad = fabs(lo) > 0 ? fabs(lo) * 0.1 : 1.0;
        lo -= pad;
        hi += pad;
    }
    axis a;
    a.step = nice_step(hi - lo, ticks);
    a.lo = floor(lo / a.step) * a.step;
    a.hi = ceil(hi / a.step) * a.step;
    return a;
}

typedef struct panel {
    double x0, y0; /* top-left corner of the plot area in the SVG */
    double w, h;
    axis ax, ay;
} panel;

static double px(const panel *p, double x) {
    return p->x0 + (x - p->ax.lo) / (p->ax.hi - p->ax.lo) * p->w;
}
static double py(const panel *p, double y) {
    return p->y0 + p->h - (y - p->ay.lo) / (p->ay.hi - p->ay.lo) * p->h;
}

static void draw_axes(FILE *f, const panel *p, const char *xlabel, const char *ylabel,
                      const char *title) {
    fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='white' stroke='#444'/>\n",
            p->x0, p->y0, p->w, p->h);
    for (double y = p->ay.lo; y <= p->ay.hi + p->ay.step * 1e-6; y += p->ay.step) {
        double yy = py(p, y);
        fprintf(f, "<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='#ddd'/>\n", p->x0, yy,
                p->x0 + p->w, yy);
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='end' font-size='12'>%g</text>\n",
                p->x0 - 6, yy + 4, fabs(y) < p->ay.step * 1e-6 ? 0.0 : y);
    }
    for (double x = p->ax.lo; x <= p->ax.hi + p->ax.step * 1e-6; x += p->ax.step) {
        double xx = px(p, x);
        fprintf(f, "<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='#444'/>\n", xx,
                p->y0 + p->h, xx, p->y0 + p->h + 5);
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='12'>%g</text>\n", xx,
                p->y0 + p->h + 19, x);
    }
    fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='13'>%s</text>\n",
            p->x0 + p->w / 2, p->y0 + p->h + 40, xlabel);
    fprintf(f,
            "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='13' "
            "transform='rotate(-90 %.1f %.1f)'>%s</text>\n",
            p->x0 - 46, p->y0 + p->h / 2, p->x0 - 46, p->y0 + p->h / 2, ylabel);
    fprintf(f,
            "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='14' "
            "font-weight='bold'>%s</text>\n",
            p->x0 + p->w / 2, p->y0 - 12, title);
}

typedef double (*metric_getter)(const epoch_metrics *row);
static double get_loss(const epoch_metrics *row) { return row->train_loss; }
static double get_train_pct(const epoch_metrics *row) { return 100 * row->train_acc; }
static double get_test_pct(const epoch_metrics *row) { return 100 * row->test_acc; }

/* One series as a polyline with a dot per epoch. */
static void draw_series(FILE *f, const panel *p, const epoch_metrics *rows, size_t count,
                        metric_getter get, const char *color) {
    fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='2' points='", color);
    for (size_t i = 0; i < count; i++) {
        double v = get(&rows[i]);
        fprintf(f, "%s%.1f,%.1f", i ? " " : "", px(p, rows[i].epoch), py(p, v));
    }
    fprintf(f, "'/>\n");
    for (size_t i = 0; i < count; i++) {
        double v = get(&rows[i]);
        fprintf(f, "<circle cx='%.1f' cy='%.1f' r='3' fill='%s'/>\n", px(p, rows[i].epoch),
                py(p, v), color);
    }
}

static void legend_entry(FILE *f, double x, double y, const char *color, const char *label) {
    fprintf(f, "<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='%s' stroke-width='2'/>\n", x,
            y, x + 20, y, color);
    fprintf(f, "<text x='%.1f' y='%.1f' font-size='12'>%s</text>\n", x + 26, y + 4, label);
}

/* Write `s` with XML's special characters escaped. */
static void write_escaped(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '\'': fputs("&apos;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

int metrics_write_svg(const char *path, const epoch_metrics *rows, size_t count,
                      const char *title) {
    if (count == 0) return tool_fail("no epochs to plot");
    double loss_max = 0, acc_min = 1, acc_max = 0;
    for (size_t i = 0; i < count; i++) {
        loss_max = fmax(loss_max, rows[i].train_loss);
        acc_min = fmin(acc_min, fmin(rows[i].train_acc, rows[i].test_acc));
        acc_max = fmax(acc_max, fmax(rows[i].train_acc, rows[i].test_acc));
    }
    axis ax = make_axis(1, (double)rows[count - 1].epoch, count < 10 ? (int)count : 10);
    if (count < 10) ax.step = 1;
    if (ax.lo < 1) ax.lo = count > 1 ? 1 : 0;
    panel loss = {MARGIN_L,
                  TITLE_H + MARGIN_T,
                  PANEL_W - MARGIN_L - MARGIN_R,
                  PANEL_H - MARGIN_T - MARGIN_B,
                  ax,
                  make_axis(0, loss_max, 5)};
    panel acc = loss;
    acc.x0 += PANEL_W;
    acc.ay = make_axis(acc_min * 100, fmin(acc_max * 100, 100), 5);
    if (acc.ay.hi > 100) acc.ay.hi = 100;

    FILE *f = fopen(path, "w");
    if (!f) return tool_fail("cannot create %s: %s", path, strerror(errno));
    fprintf(f,
            "<?xml version='1.0' encoding='UTF-8'?>\n"
            "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' "
            "font-family='sans-serif'>\n<rect width='100%%' height='100%%' fill='#fafafa'/>\n",
            2 * PANEL_W, PANEL_H + TITLE_H);
    fprintf(f, "<text x='%d' y='24' text-anchor='middle' font-size='16'>", PANEL_W);
    write_escaped(f, title);
    fprintf(f, "</text>\n");
    draw_axes(f, &loss, "epoch", "cross-entropy", "Training loss");
    draw_series(f, &loss, rows, count, get_loss, "#d62728");
    draw_axes(f, &acc, "epoch", "accuracy (%)", "Accuracy");
    draw_series(f, &acc, rows, count, get_train_pct, "#1f77b4");
    draw_series(f, &acc, rows, count, get_test_pct, "#2ca02c");
    legend_entry(f, acc.x0 + acc.w - 110, acc.y0 + acc.h - 36, "#1f77b4", "train");
    legend_entry(f, acc.x0 + acc.w - 110, acc.y0 + acc.h - 16, "#2ca02c", "test");
    fprintf(f, "</svg>\n");
    int failed = ferror(f);
    if (fclose(f) != 0 || failed) return tool_fail("cannot write %s: %s", path, strerror(errno));
    return 0;
}
