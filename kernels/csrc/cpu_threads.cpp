// Pins the process's OpenMP compute threads (the pool torch's at::parallel_for and compiled
// step graphs run on) one per CPU. libgomp keeps the same OS thread at each team position, so
// pinning once inside a parallel region holds for every later region of that size.
#include <torch/library.h>

#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <vector>

namespace {

// Returns, for each thread of the team, the CPU it was pinned to (-1: pinning refused).
std::vector<int64_t> pin_threads(std::vector<int64_t> cpus) {
  const int64_t count = static_cast<int64_t>(cpus.size());
  std::vector<int64_t> pinned(count, -1);
  TORCH_CHECK(count > 0, "pin_threads needs at least one CPU");
  auto pin_one = [&](int index) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[index]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned[index] = cpus[index];
  };
#ifdef _OPENMP
#pragma omp parallel num_threads(static_cast<int>(count))
  pin_one(omp_get_thread_num());
#else
  pin_one(0);
#endif
  return pinned;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("pin_threads(int[] cpus) -> int[]", &pin_threads);
}
