#include "options.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"

/* Edit distance (for "did you mean"), on short option names. */
static size_t edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 64;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static const opt_spec *find_spec(const opt_spec *specs, const char *name, size_t len) {
    for (const opt_spec *s = specs; s->name; s++)
        if (strlen(s->name) == len && strncmp(s->name, name, len) == 0) return s;
    return NULL;
}

static int unknown_option(const char *command, const opt_spec *specs, const char *arg) {
    const opt_spec *best = NULL;
    size_t best_d = 4; /* suggest only close names */
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(arg + 2, "="), arg + 2);
    for (const opt_spec *s = specs; s->name; s++) {
        size_t d = edit_distance(name, s->name);
        if (d < best_d) {
            best_d = d;
            best = s;
        }
    }
    if (best)
        return tool_fail("bie %s: unknown option '%s' (did you mean --%s?); see bie %s --help",
                         command, arg, best->name, command);
    return tool_fail("bie %s: unknown option '%s'; see bie %s --help", command, arg, command);
}

static bool is_choice(const char *choices, const char *value) {
    size_t n = strlen(value);
    for (const char *c = choices; *c;) {
        size_t len = strcspn(c, "|");
        if (len == n && strncmp(c, value, n) == 0) return true;
        c += len + (c[len] == '|');
    }
    return false;
}

static int set_value(const char *command, const opt_spec *s, const char *value) {
    char *end;
    errno = 0;
    switch (s->type) {
    case OPT_FLAG: return tool_fail("bie %s: --%s takes no value", command, s->name);
    case OPT_INT: {
        long long v = strtoll(value, &end, 10);
        if (!*value || *end || errno)
            return tool_fail("bie %s: --%s expects an integer, got '%s'", command, s->name, value);
        if ((double)v < s->min || (double)v > s->max)
            return tool_fail("bie %s: --%s %lld is out of range [%.0f, %.0f]", command, s->name, v,
                             s->min, s->max);
        *(int64_t *)s->target = v;
        return 0;
    }
    case OPT_DOUBLE: {
        double v = strtod(value, &end);
        if (!*value || *end || errno || !isfinite(v))
            return tool_fail("bie %s: --%s expects a number, got '%s'", command, s->name, value);
        if (v < s->min || v > s->max)
            return tool_fail("bie %s: --%s %g is out of range [%g, %g]", command, s->name, v,
                             s->min, s->max);
        *(double *)s->target = v;
        return 0;
    }
    case OPT_STRING:
        if (s->choices && !is_choice(s->choices, value))
            return tool_fail("bie %s: --%s must be one of %s, got '%s'", command, s->name,
                             s->choices, value);
        if (!s->choices && !*value)
            return tool_fail("bie %s: --%s needs a non-empty value", command, s->name);
        *(const char **)s->target = value;
        return 0;
    }
    return tool_fail("bie %s: --%s: bad option table", command, s->name);
}

int opt_parse(const char *command, const opt_spec *specs, int argc, char **argv,
              const char **positional, int max_positional, int *positional_count) {
    int npos = 0;
    bool options_done = false;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        if (options_done || arg[0] != '-' || strcmp(arg, "-") == 0) {
            if (npos >= max_positional)
                return tool_fail("bie %s: unexpected argument '%s'; see bie %s --help", command,
                                 arg, command);
            positional[npos++] = arg;
            continue;
        }
        if (strcmp(arg, "--") == 0) {
            options_done = true;
            continue;
        }
        if (arg[1] != '-')
            return tool_fail("bie %s: unknown option '%s' (options are spelled --name); see "
                             "bie %s --help",
                             command, arg, command);
        const char *eq = strchr(arg + 2, '=');
        size_t len = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        const opt_spec *s = find_spec(specs, arg + 2, len);
        if (!s) return unknown_option(command, specs, arg);
        if (s->type == OPT_FLAG) {
            if (eq) return tool_fail("bie %s: --%s takes no value", command, s->name);
            *(bool *)s->target = true;
            continue;
        }
        const char *value = eq ? eq + 1 : NULL;
        if (!value) {
            if (i + 1 >= argc)
                return tool_fail("bie %s: --%s needs a value (%s)", command, s->name,
                                 s->metavar ? s->metavar : "see --help");
            value = argv[++i];
        }
        TOOL_TRY(set_value(command, s, value));
    }
    if (positional_count) *positional_count = npos;
    return 0;
}

void opt_print_help(FILE *out, const opt_spec *specs) {
    for (const opt_spec *s = specs; s->name; s++) {
        char left[64];
        const char *metavar = s->metavar ? s->metavar : s->type == OPT_STRING ? "S" : "N";
        if (s->type == OPT_FLAG)
            snprintf(left, sizeof left, "--%s", s->name);
        else if (s->choices)
            snprintf(left, sizeof left, "--%s %s", s->name, s->choices);
        else
            snprintf(left, sizeof left, "--%s %s", s->name, metavar);
        fprintf(out, "  %-26s %s", left, s->help);
        switch (s->type) {
        case OPT_INT: fprintf(out, " (default %lld)", (long long)*(int64_t *)s->target); break;
        case OPT_DOUBLE: fprintf(out, " (default %g)", *(double *)s->target); break;
        case OPT_STRING:
            if (*(const char **)s->target) fprintf(out, " (default %s)", *(const char **)s->target);
            break;
        case OPT_FLAG: break;
        }
        fputc('\n', out);
    }
}
