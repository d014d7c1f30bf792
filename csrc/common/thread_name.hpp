// Names fastcomm's own threads, so that top, gdb and the timeline tell them apart.
#pragma once

#include <string>

namespace fastcomm {

// Names the calling thread: the first 15 characters of `name` (the kernel's limit).
void nameThisThread(const std::string& name);

}  // namespace fastcomm
