#!/usr/bin/env bash
# The test command: sets up .venv (torch + fastcomm) and runs the test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k all_reduce`.
export FASTCOMM_BUILD_TESTING=1 # torchext._testing: bindings only the tests use
source "$(dirname "$0")/env.sh"
"$PY" -m pytest -q -ra tests "$@"
