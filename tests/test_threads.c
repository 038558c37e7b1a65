/* SPEC §7 on the CPU: N threads, each with its own layer of every kind, run forward,
 * backward, kernel selection and the other layer calls at the same time; every result must
 * equal a single-threaded run of the same script (layer_threads.h). Built with
 * ThreadSanitizer by tests/run (BIE_SANITIZE_THREAD): there the layers' OpenMP loops and
 * OpenBLAS run on one thread (bie_set_num_threads(1)), because libgomp and OpenBLAS are not
 * instrumented and their own thread pools would only give false reports, while the test's
 * threads still call the library concurrently. Usage: test_threads [--threads N]
 * [--rounds R] [--small] */
#include "layer_threads.h"

#if defined(__SANITIZE_THREAD__)
#define LT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LT_TSAN 1
#endif
#endif

int main(int argc, char **argv) {
    int threads = 4, rounds = 2;
    lt_ctx c = {{BIE_DEVICE_CPU, 0}, false};
    lt_args(argc, argv, &threads, &rounds, &c.small);
#ifdef LT_TSAN
    if (bie_set_num_threads(1) != BIE_OK) return 2;
#endif
    const lt_hooks none = {NULL, NULL};
    return lt_run(&c, &none, threads, rounds);
}
