/* Command-line options of the `bie` subcommands: `--name value`, `--name=value`, flags,
 * and positional arguments, described by a table so help text and parsing agree. */
#ifndef BIE_TOOL_OPTIONS_H
#define BIE_TOOL_OPTIONS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef enum opt_type {
    OPT_FLAG,   /* bool, no value */
    OPT_INT,    /* int64_t in [min, max] */
    OPT_DOUBLE, /* double in [min, max], finite */
    OPT_STRING, /* const char *; with `choices` ("a|b|c") only those words */
} opt_type;

typedef struct opt_spec {
    const char *name; /* without the leading "--" */
    opt_type type;
    void *target; /* bool *, int64_t *, double * or const char ** */
    double min, max;
    const char *choices; /* OPT_STRING: "|"-separated allowed values, or NULL */
    const char *metavar; /* shown in help: "N", "LR", "DIR" */
    const char *help;
} opt_spec;

/* Parse argv[0..argc) (the arguments after the subcommand) against `specs` (terminated by
 * an entry with name NULL). Non-option arguments go to positional[] (at most
 * max_positional; "--" ends the options). `command` names the subcommand in messages.
 * Errors (-1, tool_error): unknown option (with the closest known name), missing value,
 * a value that is not a number or out of range or not one of the choices, a value given to
 * a flag, too many positional arguments. */
int opt_parse(const char *command, const opt_spec *specs, int argc, char **argv,
              const char **positional, int max_positional, int *positional_count);

/* Print one line per option: "  --name METAVAR   help (default: current value)". */
void opt_print_help(FILE *out, const opt_spec *specs);

#endif
