# shellcheck shell=bash disable=SC2154
# Sourced by the bounded GPU scripts of kernels/bench (*_h200.sh): each step under `timeout`
# within the script's time budget, one line per step in the status table, a few words per log.
# The sourcing script sets budget (seconds in all), t0 (its start, date +%s), status (the table's
# path) and may set step_reserve (seconds kept for what follows the steps; default 10).

left() { echo $((budget - ($(date +%s) - t0))); }

# What a log says, in a few words: gtest's counts, compute-sanitizer's error summary, a timeout,
# the first mbarrier wait that trapped (the debugging build).
summary_of() {
  local log=$1 rc=$2 s=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then s="TIMED OUT (hang?); "; fi
  s+=$(grep -hoE '^\[==========\] [0-9]+ tests? from [0-9]+ test suites? ran' "$log" 2>/dev/null |
       awk '{n += $2} END {if (n) printf "%d ran; ", n}')
  s+=$(grep -hoE '^\[  PASSED  \] [0-9]+' "$log" 2>/dev/null | awk '{n += $4} END {if (NR) printf "%d passed; ", n}')
  s+=$(grep -hoE '^\[  SKIPPED \] [0-9]+' "$log" 2>/dev/null | awk '{n += $4} END {if (NR) printf "%d skipped; ", n}')
  s+=$(grep -hoE '^\[  FAILED  \] [0-9]+ tests?' "$log" 2>/dev/null | awk '{n += $4} END {if (NR) printf "%d FAILED; ", n}')
  s+=$(grep -hoE 'ERROR SUMMARY: [0-9]+ errors?' "$log" 2>/dev/null | sort -u | tr '\n' ';')
  s+=$(grep -hoE 'MbarWait: no completion[^,]*' "$log" 2>/dev/null | head -n 1)
  echo "${s:-rc $rc}"
}

# step NAME LIMIT_S LOG CMD...: CMD under timeout (LIMIT_S, or what is left of the budget less the
# reserve), its output to LOG, one line to the status table; returns CMD's status (124: timed out,
# 99: skipped for want of time).
step() {
  local name=$1 limit=$2 log=$3 reserve=${step_reserve:-10}
  shift 3
  local l
  l=$(($(left) - reserve))
  if [ "$l" -lt $((reserve + 5)) ]; then
    printf '%s\tskipped\t0\tnot enough time left\n' "$name" >>"$status"
    return 99
  fi
  [ "$limit" -gt "$l" ] && limit=$l
  local s rc
  s=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - s))" "$(summary_of "$log" "$rc")" >>"$status"
  return $rc
}
