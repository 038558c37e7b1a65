/* Threads: OpenMP for the library's own loops (see README, "Threads"). The count set here
 * is also passed to OpenBLAS so that the float GEMMs of the backward pass use the same. */
#include <stdatomic.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef BIE_HAVE_OPENBLAS_THREADS
void openblas_set_num_threads(int num_threads);
#endif

static atomic_int requested_threads; /* 0 = default */

bie_status bie_set_num_threads(int n) {
    if (n < 0) return bie_fail(BIE_ERR_INVALID_ARGUMENT, "bie_set_num_threads: n = %d < 0", n);
    atomic_store(&requested_threads, n);
#ifdef BIE_HAVE_OPENBLAS_THREADS
    openblas_set_num_threads(bie_threads());
#endif
    return BIE_OK;
}

int bie_threads(void) {
    int n = atomic_load(&requested_threads);
    if (n > 0) return n;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int bie_get_num_threads(void) { return bie_threads(); }

/* The OpenMP build of OpenBLAS sizes each call by the calling thread's OpenMP default
 * (omp_get_max_threads()), and openblas_set_num_threads() sets that default only in the thread
 * that calls bie_set_num_threads: a layer run from another thread used the default count, and
 * OpenBLAS' choice of kernel by thread count changed its gradients' last bits. The layers call
 * this before OpenBLAS, so that a requested count holds in every thread (SPEC §7). */
void bie_blas_threads(void) {
#ifdef _OPENMP
    const int n = atomic_load(&requested_threads);
    if (n > 0 && omp_get_max_threads() != n) omp_set_num_threads(n);
#endif
}
