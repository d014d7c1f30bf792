// The settings table (common/config.hpp), from which tests/test_config.py
// renders the README's environment table and checks that the two agree.
#include <pybind11/stl.h>

#include "common/config.hpp"
#include "testing/bindings.hpp"

namespace py = pybind11;

namespace fastcomm {
namespace testing {

void bindConfig(py::module_& m) {
  m.def(
      "config_settings",
      [] {
        py::list out;
        for (const SettingInfo& s : settingsTable()) {
          py::dict d;
          d["variable"] = s.variable;
          d["tier"] = tierName(s.tier);
          d["default"] = s.defaultText;
          d["meaning"] = s.meaning;
          out.append(d);
        }
        return out;
      },
      "Every FASTCOMM_* setting: variable, tier (agreed / local / debug), default, meaning.");
  m.def(
      "config_from_env", [] { return Config::fromEnv().describe(); },
      "This process's settings as the process group would read them (raises on a bad value).");
}

}  // namespace testing
}  // namespace fastcomm
