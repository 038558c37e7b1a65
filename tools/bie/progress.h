/* A progress display on stderr for one epoch of work: on a terminal a bar redrawn in place
 * (at most ~10 times a second) with samples/s, elapsed time, ETA and the running loss;
 * elsewhere (a pipe, a log file) a plain line at each quarter of the epoch. */
#ifndef BIE_TOOL_PROGRESS_H
#define BIE_TOOL_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef enum progress_mode {
    PROGRESS_AUTO = 0, /* bar on a terminal, plain lines otherwise */
    PROGRESS_BAR,
    PROGRESS_PLAIN,
    PROGRESS_NONE
} progress_mode;

typedef struct progress {
    FILE *out;
    progress_mode mode; /* resolved: BAR, PLAIN or NONE */
    char label[32];
    int64_t total_steps, total_samples;
    int64_t done_steps, done_samples;
    double start_s, last_draw_s;
    int next_quarter; /* plain mode: next quarter to report */
    double last_loss;
} progress;

/* Monotonic seconds. */
double progress_now(void);

/* Start an epoch of `total_steps` steps covering `total_samples` samples. */
void progress_start(progress *p, progress_mode mode, FILE *out, const char *label,
                    int64_t total_steps, int64_t total_samples);
/* One more step of `samples` samples done; `loss` is the running mean loss. */
void progress_step(progress *p, int64_t samples, double loss);
/* End the display (the bar's line is finished with a newline). */
void progress_finish(progress *p);

/* "1:05" or "1:02:03". */
void progress_format_time(double seconds, char *buf, size_t cap);

#endif
