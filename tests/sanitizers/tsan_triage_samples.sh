#!/bin/sh
# ctest tsan_triage_samples: scripts/tsan_triage.py on recorded reports (paths under /src/attnd).
# ours/: the use after free once found in AttendStreamReactor (an "unlock of an unlocked mutex"
# reached through libstdc++'s mutex wrappers) must fail the triage; theirs/: a race between two
# gRPC threads over gRPC's own std::function must not.
#   tsan_triage_samples.sh SOURCE_DIR
set -u
triage="$1/scripts/tsan_triage.py"
samples="$1/tests/sanitizers/triage_samples"
if python3 "$triage" --src /src/attnd "$samples/ours"; then
  echo "tsan_triage_samples: a report in attnd's code was not flagged"; exit 1
fi
python3 "$triage" --src /src/attnd "$samples/theirs" ||
  { echo "tsan_triage_samples: a third-party report was flagged"; exit 1; }
echo "tsan_triage_samples: both judged right"
