/* Option parsing of the bie subcommands, and the metrics CSV / SVG writers. */
#include <unistd.h>

#include "../test_util.h"
#include "errors.h"
#include "metrics.h"
#include "options.h"

typedef struct parsed {
    int64_t epochs;
    double lr;
    const char *model, *out;
    bool verbose;
} parsed;

static int parse(parsed *p, int argc, const char **argv, const char **pos, int *npos) {
    *p = (parsed){.epochs = 3, .lr = 0.5, .model = "cnn"};
    const opt_spec specs[] = {
        {"epochs", OPT_INT, &p->epochs, 1, 100, NULL, "N", "epochs"},
        {"lr", OPT_DOUBLE, &p->lr, 0, 10, NULL, "LR", "learning rate"},
        {"model", OPT_STRING, &p->model, 0, 0, "mlp|cnn", NULL, "preset"},
        {"out", OPT_STRING, &p->out, 0, 0, NULL, "DIR", "output"},
        {"verbose", OPT_FLAG, &p->verbose, 0, 0, NULL, NULL, "talk"},
        {NULL, 0, NULL, 0, 0, NULL, NULL, NULL},
    };
    return opt_parse("t", specs, argc, (char **)argv, pos, 1, npos);
}

static void expect_error(int argc, const char **argv, const char *fragment) {
    parsed p;
    const char *pos[1];
    int npos;
    CHECK(parse(&p, argc, argv, pos, &npos) == -1);
    CHECK(strstr(tool_error(), fragment) != NULL);
    if (!strstr(tool_error(), fragment))
        fprintf(stderr, "  message '%s' lacks '%s'\n", tool_error(), fragment);
}

static void test_options(void) {
    parsed p;
    const char *pos[1] = {NULL};
    int npos = -1;
    const char *good[] = {"--epochs", "7",   "--lr=0.25", "file",
                          "--model",  "mlp", "--verbose", "--out=a=b"};
    CHECK(parse(&p, 8, good, pos, &npos) == 0);
    CHECK(p.epochs == 7 && p.lr == 0.25 && strcmp(p.model, "mlp") == 0 && p.verbose);
    CHECK(npos == 1 && strcmp(pos[0], "file") == 0 && strcmp(p.out, "a=b") == 0);
    const char *dashdash[] = {"--", "--epochs"};
    CHECK(parse(&p, 2, dashdash, pos, &npos) == 0 && npos == 1 && strcmp(pos[0], "--epochs") == 0);
    CHECK(p.epochs == 3); /* untouched default */

    expect_error(1, (const char *[]){"--epoch"}, "did you mean --epochs");
    expect_error(1, (const char *[]){"--zzzzzzzz"}, "unknown option");
    expect_error(1, (const char *[]){"-e"}, "unknown option");
    expect_error(1, (const char *[]){"--epochs"}, "needs a value");
    expect_error(2, (const char *[]){"--epochs", "x"}, "expects an integer");
    expect_error(2, (const char *[]){"--epochs", "5x"}, "expects an integer");
    expect_error(2, (const char *[]){"--epochs", "0"}, "out of range");
    expect_error(2, (const char *[]){"--epochs", "99999999999999999999"}, "expects an integer");
    expect_error(2, (const char *[]){"--lr", "nan"}, "expects a number");
    expect_error(2, (const char *[]){"--lr", "11"}, "out of range");
    expect_error(2, (const char *[]){"--model", "resnet"}, "must be one of mlp|cnn");
    expect_error(1, (const char *[]){"--verbose=1"}, "takes no value");
    expect_error(2, (const char *[]){"a", "b"}, "unexpected argument 'b'");
    expect_error(2, (const char *[]){"--out", ""}, "non-empty");
}

static void test_metrics(void) {
    char dir[] = "/tmp/bie_test_metrics_XXXXXX";
    if (!mkdtemp(dir)) return;
    char csv[256], svg[256];
    snprintf(csv, sizeof csv, "%s/m.csv", dir);
    snprintf(svg, sizeof svg, "%s/c.svg", dir);
    epoch_metrics rows[7];
    for (int i = 0; i < 7; i++)
        rows[i] =
            (epoch_metrics){i + 1, 1.5 / (i + 1), 0.6 + 0.04 * i, 0.58 + 0.045 * i, 1e-3 / (i + 1)};
    for (size_t n = 1; n <= 7; n += 3) {
        CHECK(metrics_write_csv(csv, rows, n) == 0);
        FILE *f = fopen(csv, "r");
        char line[256];
        int lines = 0;
        CHECK(fgets(line, sizeof line, f) && strncmp(line, "epoch,train_loss,", 17) == 0);
        while (fgets(line, sizeof line, f)) {
            int epoch;
            double loss, tr, te, lr;
            CHECK(sscanf(line, "%d,%lf,%lf,%lf,%lf", &epoch, &loss, &tr, &te, &lr) == 5);
            CHECK(epoch == lines + 1 && fabs(loss - rows[lines].train_loss) < 1e-6);
            CHECK(fabs(te - rows[lines].test_acc) < 1e-6);
            lines++;
        }
        fclose(f);
        CHECK(lines == (int)n);

        CHECK(metrics_write_svg(svg, rows, n, "run <a> & \"b\"") == 0);
        f = fopen(svg, "r");
        static char text[65536];
        size_t len = fread(text, 1, sizeof text - 1, f);
        text[len] = 0;
        fclose(f);
        CHECK(strstr(text, "<svg") && strstr(text, "</svg>"));
        CHECK(strstr(text, "run &lt;a&gt; &amp; &quot;b&quot;") != NULL);
        CHECK(strstr(text, "accuracy (%)") && strstr(text, "cross-entropy"));
        int polylines = 0, circles = 0;
        for (const char *s = text; (s = strstr(s, "<polyline")); s++) polylines++;
        for (const char *s = text; (s = strstr(s, "<circle")); s++) circles++;
        CHECK(polylines == 3 && circles == 3 * (int)n);
        CHECK(strstr(text, "nan") == NULL && strstr(text, "inf") == NULL);
    }
    CHECK(metrics_write_svg(svg, rows, 0, "x") == -1);
    CHECK(metrics_write_csv("/nonexistent/dir/m.csv", rows, 1) == -1 &&
          strstr(tool_error(), "cannot create"));
    unlink(csv);
    unlink(svg);
    rmdir(dir);
}

int main(void) {
    test_options();
    test_metrics();
    return tu_finish();
}
