/* One CPU for each thread of the calling thread's OpenMP team: thread i of a team of `threads` runs on
 * cpus[i] from now on (the calling thread is thread 0). The runtime keeps a team's threads for the next
 * parallel region of the same size, so the placement holds for every later one the caller starts.
 *
 * Returns 0; 1 when the team had fewer threads than asked; 2 when the kernel refused an affinity
 * (the threads placed so far stay so).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

int cb_pin_team(const int *cpus, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_num_threads() != threads) {
#pragma omp atomic write
            failed = 1;
        } else {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[omp_get_thread_num()], &set);
            if (sched_setaffinity(0, sizeof set, &set) != 0) {
#pragma omp atomic write
                failed = 2;
            }
        }
    }
    return failed;
}
