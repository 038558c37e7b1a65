/* SPEC §7 on CUDA: N threads, each with its own stream (bie_cuda_set_stream) and its own
 * layer of every kind, run forward, backward, kernel selection and the other layer calls at
 * the same time; every result must equal a single-threaded run of the same script
 * (layer_threads.h: forward outputs bit for bit, gradients within float tolerance). Reports
 * itself skipped (77) without a GPU. Usage: test_cuda_threads [--threads N] [--rounds R]
 * [--small] */
#include "../layer_threads.h"

#ifdef BIE_TEST_CUDART
#include <cuda_runtime.h>

/* A non-blocking stream of the thread's own, made current for bie in this thread. */
static bool stream_begin(int t, void **state) {
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        fprintf(stderr, "thread %d: cudaStreamCreate failed\n", t);
        return false;
    }
    *state = s;
    return bie_cuda_set_stream(s) == BIE_OK;
}

static void stream_end(void *state) {
    if (bie_cuda_synchronize() != BIE_OK) fprintf(stderr, "synchronize: %s\n", bie_last_error());
    bie_cuda_set_stream(NULL);
    if (state) cudaStreamDestroy((cudaStream_t)state);
}
#endif

int main(int argc, char **argv) {
    if (bie_cuda_device_count() == 0) {
        printf("skipped: no CUDA device\n");
        return 77;
    }
#ifdef BIE_TEST_CUDART
    int threads = 4, rounds = 2;
    lt_ctx c = {{BIE_DEVICE_CUDA, 0}, false};
    lt_args(argc, argv, &threads, &rounds, &c.small);
    const lt_hooks streams = {stream_begin, stream_end};
    return lt_run(&c, &streams, threads, rounds);
#else
    (void)argc;
    (void)argv;
    printf("skipped: built without the CUDA runtime\n");
    return 77;
#endif
}
