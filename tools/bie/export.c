/* `bie export`: pack a trained model's binary and 4-bit layers for inference. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "commands.h"
#include "errors.h"
#include "model_io.h"
#include "options.h"

static void default_output(const char *in, char *out, size_t cap) {
    size_t n = strlen(in);
    const char *ext = ".safetensors";
    size_t e = strlen(ext);
    if (n > e && strcmp(in + n - e, ext) == 0)
        snprintf(out, cap, "%.*s-packed%s", (int)(n - e), in, ext);
    else
        snprintf(out, cap, "%s-packed.safetensors", in);
}

static int64_t file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (int64_t)st.st_size : -1;
}

static int export_model(const char *in, const char *out) {
    loaded_model m;
    TOOL_TRY(model_load(in, &m));
    int status = 0;
    int64_t before = 0, float_bytes = 0, after = 0;
    if (m.packed) status = tool_fail("%s is already packed (an inference model)", in);
    if (status == 0) status = model_binary_weight_bytes(m.model, &before, &float_bytes);
    if (status == 0 && bie_model_pack(m.model) != BIE_OK)
        status = tool_fail("packing %s: %s", in, bie_last_error());
    if (status == 0) status = model_binary_weight_bytes(m.model, &after, &float_bytes);
    if (status == 0) status = model_save(m.model, out, m.notes, m.note_count);
    if (status == 0) {
        printf("packed %s -> %s\n", in, out);
        printf("binary layer weights: %lld bytes as float32, %lld as int8 (training), %lld "
               "packed: %.1fx smaller than float32\n",
               (long long)float_bytes, (long long)before, (long long)after,
               after > 0 ? (double)float_bytes / (double)after : 0.0);
        printf("file: %lld -> %lld bytes\n", (long long)file_size(in), (long long)file_size(out));
    }
    loaded_model_free(&m);
    return status;
}

int cmd_export(int argc, char **argv) {
    bool help = false;
    const opt_spec specs[] = {
        {"help", OPT_FLAG, &help, 0, 0, NULL, NULL, "show this help"},
        {NULL, 0, NULL, 0, 0, NULL, NULL, NULL},
    };
    const char *pos[2];
    int npos = 0;
    if (opt_parse("export", specs, argc, argv, pos, 2, &npos) != 0) {
        fprintf(stderr, "%s\n", tool_error());
        return EXIT_USAGE;
    }
    if (help) {
        printf("usage: bie export MODEL [OUTPUT]\n\n"
               "Pack the binary (1 bit per weight) and 4-bit layers of a model trained by\n"
               "`bie train` and write an inference-only model (default OUTPUT:\n"
               "MODEL-packed.safetensors). Its predictions equal the trained model's in\n"
               "evaluation mode.\n\n");
        opt_print_help(stdout, specs);
        return 0;
    }
    if (npos < 1) {
        fprintf(stderr, "bie export: missing MODEL; usage: bie export MODEL [OUTPUT]\n");
        return EXIT_USAGE;
    }
    char out[4096];
    if (npos == 2)
        snprintf(out, sizeof out, "%s", pos[1]);
    else
        default_output(pos[0], out, sizeof out);
    return export_model(pos[0], out) == 0 ? 0 : report_failure("export");
}
