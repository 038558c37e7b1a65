/* Per-epoch training metrics: a CSV file and an SVG chart of the training curve.
 *
 * The CSV holds only values that a seed and thread count determine (no wall times), so two
 * runs with the same settings write identical files. */
#ifndef BIE_TOOL_METRICS_H
#define BIE_TOOL_METRICS_H

#include <stddef.h>

typedef struct epoch_metrics {
    int epoch;         /* 1-based */
    double train_loss; /* mean cross-entropy over the epoch's batches */
    double train_acc;  /* fraction of training examples classified right while training */
    double test_acc;   /* eval-mode accuracy on the test set after the epoch */
    double lr;         /* float learning rate at the epoch's last step */
} epoch_metrics;

/* Write the CSV (header line + one line per epoch). Errors: cannot write the file. */
int metrics_write_csv(const char *path, const epoch_metrics *rows, size_t count);

/* Write an SVG chart: training loss (left panel) and train/test accuracy in % (right
 * panel) against the epoch, with axes, ticks, labels and a legend. Errors: no rows,
 * cannot write the file. */
int metrics_write_svg(const char *path, const epoch_metrics *rows, size_t count, const char *title);

#endif
