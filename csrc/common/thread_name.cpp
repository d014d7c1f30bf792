#include "common/thread_name.hpp"

#include <pthread.h>

namespace fastcomm {

void nameThisThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace fastcomm
