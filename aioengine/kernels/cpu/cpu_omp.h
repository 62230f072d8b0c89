/* OpenMP where the compiler has it (gcc, clang with libomp); without it (Apple's clang) the kernels run on one
 * thread: the pragmas are ignored and these two answer as a team of one. */
#ifndef AIOENGINE_CPU_OMP_H
#define AIOENGINE_CPU_OMP_H
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#endif
