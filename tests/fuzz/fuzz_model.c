/* libFuzzer target: the model loader (model_load_memory: the safetensors reader, the
 * architecture metadata, building the layers and installing the tensors) on arbitrary
 * bytes. Loading must fail cleanly or give a model whose description can be read back. */
#include <stdlib.h>

#include "model_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loaded_model m;
    if (model_load_memory(data, size, "fuzz", &m) != 0) return 0;
    int64_t stored, as_float;
    if (model_binary_weight_bytes(m.model, &stored, &as_float) != 0) abort();
    for (int i = 0; i < bie_model_param_count(m.model); i++) {
        bie_model_param p;
        if (bie_model_param_get(m.model, i, &p) != BIE_OK) abort();
    }
    loaded_model_free(&m);
    return 0;
}
