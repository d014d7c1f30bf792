// FASTCOMM_CPU_AFFINITY=local: fastcomm's own busy threads (transport
// progress threads, the multi-node proxy, the collective lanes) run on this
// process's share of the host's physical cores instead of wherever the
// scheduler puts them.
//
// Why: on one host the ranks' ~10 busy threads each (8 tcp progress threads,
// the proxy, NCCL's) can outnumber the physical cores; where two share SMT
// siblings or migrate, a whole launch may run slower. Off by default: it was
// the suspect for the multi-node sweep's launch-to-launch spread, and the
// measurement (scripts/device_check.sh `spread`,
// benchmarks/results/2026-11-22-4xH200-2x2-session9.md) cleared it: slow
// launches were slow pinned or not. NCCL binds its threads to the
// GPU's NUMA node; on a one-node host that is every CPU, so this splits the
// cores between the local ranks instead.
//
// The slice: the CPUs this process may run on (sched_getaffinity at set-up),
// grouped into physical cores (sysfs package and core ids, SMT siblings kept
// together), cut into LOCAL_WORLD_SIZE equal runs of cores; local rank r takes
// run r. The launcher's LOCAL_RANK / LOCAL_WORLD_SIZE (torchrun sets them)
// say which processes share the host; without them nothing is pinned. The
// application's own threads keep their mask. scripts/pin_local_rank.py cuts
// the same slices for whole processes (a probe), and the tests check the two
// agree.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/config.hpp"

namespace fastcomm {
namespace affinity {

// (package, core) of a logical CPU, from sysfs; (-1, cpu) where it says nothing.
std::pair<int, int> sysfsCoreOf(int cpu);

// Local rank `localRank` of `localSize`'s share of the whole cores in
// `allowed` (logical CPUs, any order), grouped by `coreOf`, cores ordered by
// their lowest CPU. More ranks than cores: every rank gets all of `allowed`.
std::vector<int> sliceOfCores(const std::vector<int>& allowed, int localRank, int localSize,
                              const std::function<std::pair<int, int>(int)>& coreOf);

// Chooses the slice from cfg (FASTCOMM_CPU_AFFINITY, LOCAL_RANK,
// LOCAL_WORLD_SIZE) once per process; later calls (more groups) keep it.
// Logs the outcome at INFO.
void configure(const Config& cfg);

// Pins the calling thread to the slice, if one was chosen; else nothing.
void pinThisThread();

// The first lines of each of fastcomm's busy threads: names the calling
// thread (its first 15 characters, the kernel's limit; shown by top, gdb and
// the timeline) and pins it (pinThisThread).
void enterBusyThread(const std::string& name);

// "0,1,2,5" -> "0-2,5".
std::string compactList(const std::vector<int>& cpus);

}  // namespace affinity
}  // namespace fastcomm
