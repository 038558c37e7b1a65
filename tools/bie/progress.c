#include "progress.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

enum { BAR_WIDTH = 24 };
#define REDRAW_INTERVAL_S 0.1

double progress_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void progress_format_time(double seconds, char *buf, size_t cap) {
    if (!(seconds >= 0) || seconds > 1e7) {
        snprintf(buf, cap, "--:--");
        return;
    }
    long s = (long)(seconds + 0.5);
    if (s >= 3600)
        snprintf(buf, cap, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else
        snprintf(buf, cap, "%ld:%02ld", s / 60, s % 60);
}

void progress_start(progress *p, progress_mode mode, FILE *out, const char *label,
                    int64_t total_steps, int64_t total_samples) {
    memset(p, 0, sizeof *p);
    p->out = out;
    if (mode == PROGRESS_AUTO) mode = isatty(fileno(out)) ? PROGRESS_BAR : PROGRESS_PLAIN;
    p->mode = mode;
    snprintf(p->label, sizeof p->label, "%s", label);
    p->total_steps = total_steps > 0 ? total_steps : 1;
    p->total_samples = total_samples;
    p->start_s = progress_now();
    p->next_quarter = 1;
}

static void draw(progress *p, double loss, bool final) {
    double elapsed = progress_now() - p->start_s;
    double rate = elapsed > 0 ? (double)p->done_samples / elapsed : 0;
    double remaining = p->done_steps > 0 ? elapsed * (double)(p->total_steps - p->done_steps) /
                                               (double)p->done_steps
                                         : -1;
    char el[32], eta[32];
    progress_format_time(elapsed, el, sizeof el);
    progress_format_time(remaining, eta, sizeof eta);
    int filled = (int)(BAR_WIDTH * p->done_steps / p->total_steps);
    if (p->mode == PROGRESS_BAR) {
        char bar[BAR_WIDTH + 1];
        for (int i = 0; i < BAR_WIDTH; i++) bar[i] = i < filled ? '#' : '.';
        bar[BAR_WIDTH] = 0;
        fprintf(
            p->out,
            "\r%s [%s] %3d%% %lld/%lld | %6.0f samples/s | %s elapsed, ETA %s | loss %.4f\033[K",
            p->label, bar, (int)(100 * p->done_steps / p->total_steps), (long long)p->done_steps,
            (long long)p->total_steps, rate, el, eta, loss);
        if (final) fputc('\n', p->out);
    } else {
        fprintf(p->out, "%s %3d%% %lld/%lld steps, %.0f samples/s, %s elapsed, ETA %s, loss %.4f\n",
                p->label, (int)(100 * p->done_steps / p->total_steps), (long long)p->done_steps,
                (long long)p->total_steps, rate, el, eta, loss);
    }
    fflush(p->out);
}

void progress_step(progress *p, int64_t samples, double loss) {
    p->done_steps++;
    p->done_samples += samples;
    p->last_loss = loss;
    if (p->mode == PROGRESS_NONE) return;
    double now = progress_now();
    if (p->mode == PROGRESS_BAR) {
        if (now - p->last_draw_s >= REDRAW_INTERVAL_S || p->done_steps == p->total_steps) {
            p->last_draw_s = now;
            draw(p, loss, false);
        }
        return;
    }
    if (p->done_steps * 4 >= p->next_quarter * p->total_steps) {
        while (p->done_steps * 4 >= p->next_quarter * p->total_steps) p->next_quarter++;
        draw(p, loss, false);
    }
}

void progress_finish(progress *p) {
    if (p->mode == PROGRESS_BAR) draw(p, p->last_loss, true);
}
