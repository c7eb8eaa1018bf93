#!/usr/bin/env bash
# The main job: sets up and builds expseg, then runs the A/B study of both backends on every
# scenario and on the two shipped training traces (ResNet-50 and GPT-2), on the GPU when one is
# usable and on the simulated device otherwise, and writes the picture to expseg-study.html.
# Arguments go to `expseg study` (e.g. --device sim, --html FILE); relative paths in them are read
# from the directory the script is run from, as the command's own would be.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# Only the command and the library it links: the tests and benchmarks are most of a full build.
(cd "$root" && tools/setup.sh && EXPSEG_BUILD_TARGETS=tools/expseg tools/build.sh build)
exec "$root/build/tools/expseg" study "$@"
