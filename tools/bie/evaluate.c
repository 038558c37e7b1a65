/* What the subcommands share: failure reports, device and thread setup, evaluation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bie_cuda.h"
#include "commands.h"
#include "errors.h"

int report_failure(const char *command) {
    fprintf(stderr, "bie %s: error: %s\n", command, tool_error());
    return 1;
}

int setup_device(const char *device, int64_t threads, bie_device *out) {
    *out = bie_cpu();
    if (strcmp(device, "cuda") == 0) {
        if (!bie_cuda_built())
            return tool_fail("--device cuda: this build of bie has no CUDA backend (nvcc was not "
                             "found when it was configured); use --device cpu");
        if (bie_cuda_device_count() < 1)
            return tool_fail("--device cuda: no CUDA device is visible (driver or GPU missing); "
                             "use --device cpu");
        out->type = BIE_DEVICE_CUDA;
        out->index = 0;
    } else if (strcmp(device, "cpu") != 0) {
        return tool_fail("--device must be cpu or cuda, got '%s'", device);
    }
    /* The CPU threads still load data and, on CUDA, compute the loss. */
    TOOL_TRY_BIE(bie_set_num_threads((int)threads));
    return 0;
}

int model_to_device(bie_model *model, bie_device device) {
    TOOL_TRY_BIE(bie_model_to_device(model, device));
    return 0;
}

int forward_on_host(bie_model *model, const bie_tensor *x, float *host, bie_tensor *out) {
    bie_tensor y;
    TOOL_TRY_BIE(bie_model_forward(model, x, &y));
    if (y.device.type == BIE_DEVICE_CPU) {
        *out = y;
        return 0;
    }
    TOOL_TRY_BIE(bie_tensor_view(out, host, BIE_F32, y.ndim, y.shape));
    TOOL_TRY_BIE(bie_tensor_copy(out, &y));
    return 0;
}

int evaluate_model(bie_model *model, const fmnist_set *set, int64_t batch, double *accuracy,
                   double *loss, int32_t *predictions) {
    if (set->count < 1) return tool_fail("no examples to evaluate");
    if (batch > set->count) batch = set->count;
    float *x = malloc((size_t)batch * FMNIST_PIXELS * sizeof(float));
    int32_t *labels = malloc((size_t)batch * sizeof(int32_t));
    int32_t *pred = malloc((size_t)batch * sizeof(int32_t));
    float *host_logits = malloc((size_t)batch * FMNIST_CLASSES * sizeof(float));
    int status = x && labels && pred && host_logits ? 0 : tool_fail("out of memory");
    if (status == 0 && bie_model_set_training(model, false) != BIE_OK)
        status = tool_fail_status(BIE_ERR_STATE, "bie_model_set_training");
    int64_t correct = 0;
    double loss_sum = 0;
    for (int64_t first = 0; status == 0 && first < set->count; first += batch) {
        int64_t n = set->count - first < batch ? set->count - first : batch;
        fmnist_gather(set, NULL, first, n, x, labels);
        int64_t xs[4] = {n, 1, FMNIST_SIDE, FMNIST_SIDE}, ls[1] = {n};
        bie_tensor tx, tl, tp, logits;
        int64_t batch_correct = 0;
        float batch_loss = 0;
        bie_status s = bie_tensor_view(&tx, x, BIE_F32, 4, xs);
        if (s == BIE_OK) s = bie_tensor_view(&tl, labels, BIE_I32, 1, ls);
        if (s == BIE_OK) s = bie_tensor_view(&tp, pred, BIE_I32, 1, ls);
        if (s == BIE_OK && forward_on_host(model, &tx, host_logits, &logits) != 0) {
            status = -1;
            break;
        }
        if (s == BIE_OK) s = bie_softmax_cross_entropy(&logits, &tl, &batch_loss, NULL);
        if (s == BIE_OK) s = bie_count_correct(&logits, &tl, &batch_correct);
        if (s == BIE_OK && predictions) s = bie_argmax(&logits, &tp);
        if (s != BIE_OK) {
            status = tool_fail("evaluation: %s", bie_last_error());
            break;
        }
        if (predictions) memcpy(predictions + first, pred, (size_t)n * sizeof(int32_t));
        correct += batch_correct;
        loss_sum += (double)batch_loss * (double)n;
    }
    free(x);
    free(labels);
    free(pred);
    free(host_logits);
    if (status != 0) return -1;
    *accuracy = (double)correct / (double)set->count;
    *loss = loss_sum / (double)set->count;
    return 0;
}
