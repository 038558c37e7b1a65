/* The subcommands of `bie` and what they share. Each cmd_* takes the arguments after the
 * subcommand's name and returns the process exit status: 0 success, 1 failure (message on
 * stderr), 2 bad usage. */
#ifndef BIE_TOOL_COMMANDS_H
#define BIE_TOOL_COMMANDS_H

#include <stdint.h>

#include "bie_train.h"
#include "dataset.h"

enum { EXIT_USAGE = 2 };

int cmd_train(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_predict(int argc, char **argv);

/* Print "bie <command>: error: <tool_error()>" to stderr; returns 1. */
int report_failure(const char *command);

/* Apply --threads (0: library default) and check --device ("cpu" or "cuda": CUDA device 0,
 * which must exist); *out receives the device. */
int setup_device(const char *device, int64_t threads, bie_device *out);

/* Move the model to `device` (nothing to do for the CPU). */
int model_to_device(bie_model *model, bie_device device);

/* bie_model_forward with the output on the host: *out views `host` (room for the output)
 * when the model returned device memory, else the model's own output. */
int forward_on_host(bie_model *model, const bie_tensor *x, float *host, bie_tensor *out);

/* Run the model (evaluation mode) over `set` in batches: accuracy in [0, 1], mean loss,
 * and each example's predicted class in predictions[0..count) (may be NULL).
 * The model is left in evaluation mode. */
int evaluate_model(bie_model *model, const fmnist_set *set, int64_t batch, double *accuracy,
                   double *loss, int32_t *predictions);

#endif
