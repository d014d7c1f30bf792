#include "common/host_comm.hpp"

#include <algorithm>
#include <cstring>
#include <string>

namespace fastcomm {

bool OpSignature::operator==(const OpSignature& o) const {
  return std::strncmp(name, o.name, sizeof(name)) == 0 && dtype == o.dtype && redop == o.redop &&
         root == o.root && numel == o.numel && aux == o.aux;
}

std::string OpSignature::describe() const {
  std::string s = std::string(name, strnlen(name, sizeof(name)));
  s +=
      " dtype=" + std::string(dtype >= 0 ? c10::toString(static_cast<at::ScalarType>(dtype)) : "-");
  s += " numel=" + std::to_string(numel);
  if (aux) s += " out_numel=" + std::to_string(aux);
  if (root >= 0) s += " root=" + std::to_string(root);
  if (redop >= 0) s += std::string(" op=") + redOpName(static_cast<RedOp>(redop));
  return s;
}

void checkSignatureVotes(const std::vector<OpSignature>& all, const std::vector<int>& ranks,
                         const OpContext& ctx) {
  const int n = static_cast<int>(all.size());
  // The signature most members agree on is taken as the expected one.
  int best = 0, bestVotes = 0;
  for (int i = 0; i < n; ++i) {
    int votes = static_cast<int>(std::count(all.begin(), all.end(), all[i]));
    if (votes > bestVotes) best = i, bestVotes = votes;
  }
  if (bestVotes == n) return;
  std::vector<int> odd;
  std::string detail;
  for (int i = 0; i < n; ++i) {
    if (!(all[i] == all[best])) {
      odd.push_back(ranks[i]);
      detail += "; rank " + std::to_string(ranks[i]) + " called " + all[i].describe();
    }
  }
  throwCommError("fastcomm: FASTCOMM_CHECK: " + ctx.describe() + ": group rank(s) " +
                 formatRanks(odd) + " disagree with the others, which called " +
                 all[best].describe() + detail);
}

}  // namespace fastcomm
