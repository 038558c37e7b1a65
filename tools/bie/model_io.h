/* Models of the `bie` command: the presets, the architecture description kept in a model
 * file's metadata, and saving / loading models as safetensors files.
 *
 * A model file holds every parameter and buffer of a bie_model under its stable name
 * ("0.weight", "3.bias_a", "5.running_var", ...; binary weights as I8, packed weights as
 * U8/U32/U64) and, in "__metadata__":
 *   "format"        "bie-model"      "format_version"  "1"
 *   "architecture"  JSON array, one object per layer (type and hyper-parameters)
 *   "input_shape"   JSON array of the per-example input extents, e.g. [1, 28, 28]
 *   "classes"       JSON array of class names
 *   "packed"        "true" for an inference model from `bie export`, else "false"
 * plus informational entries (preset, training settings, accuracy) that loading ignores. */
#ifndef BIE_TOOL_MODEL_IO_H
#define BIE_TOOL_MODEL_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bie_train.h"

#define MODEL_FORMAT "bie-model"
#define MODEL_FORMAT_VERSION "1"

/* Limits on what a model file may declare, far above the presets (the CNN has 20 layers,
 * its file a header of about 4 KB): they bound the time and memory of loading a hostile
 * file before anything is built. */
#define MODEL_MAX_LAYERS 1024
#define MODEL_MAX_ARCHITECTURE_BYTES (1u << 20) /* metadata 'architecture', as text */
#define MODEL_MAX_HEADER_BYTES (16u << 20)      /* the safetensors JSON header */
/* Floats of all activations of one example (padding and strides can make them grow far
 * beyond the file's size; the resnet preset at width 64 needs about 1.3 million). */
#define MODEL_MAX_ACTIVATION_FLOATS (INT64_C(1) << 26)

typedef struct preset_config {
    const char *name;       /* "mlp", "cnn" or "resnet" */
    const char *first_last; /* "float" or "q4": kind of the first and last layers */
    int64_t width; /* mlp: hidden units; cnn, resnet: channels of the first conv (0: default) */
    int64_t depth; /* resnet: binary units per stage (0: default); others: 0 */
} preset_config;

/* Default width of a preset (mlp: hidden units, cnn / resnet: first conv's channels). */
int64_t preset_default_width(const char *name);
/* Default depth (resnet: units per stage; other presets 0). */
int64_t preset_default_depth(const char *name);

/* Build a preset for 1x28x28 inputs and 10 classes. Errors: unknown preset or first_last,
 * width out of range, library errors. */
int preset_build(const preset_config *config, bie_model **out);

/* Informational metadata entries (key, value) stored with a model. */
typedef struct model_note {
    const char *key;
    const char *value;
} model_note;

/* Save every parameter and buffer of `model` (packed or not) with its architecture.
 * notes[0..note_count) are added to the metadata. Errors: cannot write, library errors. */
int model_save(bie_model *model, const char *path, const model_note *notes, size_t note_count);

/* A loaded model and what the file says about it. */
typedef struct loaded_model {
    bie_model *model; /* in evaluation mode */
    bool packed;
    int64_t input_shape[3]; /* C, H, W */
    int input_ndim;
    int classes;
    char *preset;      /* "" if the file does not say; owned */
    model_note *notes; /* the informational metadata entries (strings owned) */
    size_t note_count;
} loaded_model;

/* Load a model file: validate the file (safetensors.h), rebuild the architecture, check
 * that the file holds exactly the model's tensors with the expected dtypes and shapes, and
 * install them. Errors (-1, tool_error): all of those, naming the file and the tensor; not
 * a regular file; a header, architecture or layer count above the limits above. Each
 * layer's weight tensor is checked (present, with the element count the architecture
 * implies) before the layer is built, so a file declaring huge layers without their data
 * is refused before anything large is allocated. */
int model_load(const char *path, loaded_model *out);
/* model_load on a file image in memory (copied); `name` is used in messages. */
int model_load_memory(const uint8_t *bytes, size_t size, const char *name, loaded_model *out);
void loaded_model_free(loaded_model *m);

/* Bytes of the weights of the model's binary layers as stored now (I8 or packed words), and
 * what the same weights take as float32. */
int model_binary_weight_bytes(bie_model *model, int64_t *stored, int64_t *as_float32);

#endif
