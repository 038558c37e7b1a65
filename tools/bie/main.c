/* The `bie` command: train, export and run low-bit networks on Fashion-MNIST. */
#include <stdio.h>
#include <string.h>

#include "bie.h"
#include "commands.h"

static void print_help(FILE *out) {
    fprintf(out,
            "usage: bie COMMAND [options]\n\n"
            "Train and run binary neural networks (1-bit hidden layers) on Fashion-MNIST.\n\n"
            "commands:\n"
            "  train     train a preset (cnn or mlp); writes a model, a metrics CSV and a curve\n"
            "  export    pack a trained model's binary layers into an inference model\n"
            "  eval      test-set accuracy of a model file\n"
            "  predict   classify test images or an IDX file of images with a model file\n\n"
            "Run `bie COMMAND --help` for a command's options; `bie --version`.\n"
            "Model files are safetensors (readable by PyTorch / Hugging Face tools).\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        print_help(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        print_help(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("bie %s (CPU kernels: %s)\n", bie_version_string(), bie_cpu_kernel_set());
        return 0;
    }
    static const struct {
        const char *name;
        int (*run)(int, char **);
    } commands[] = {
        {"train", cmd_train}, {"export", cmd_export}, {"eval", cmd_eval}, {"predict", cmd_predict}};
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(cmd, commands[i].name) == 0) return commands[i].run(argc - 2, argv + 2);
    fprintf(stderr, "bie: unknown command '%s'; run `bie --help`\n", cmd);
    return EXIT_USAGE;
}
