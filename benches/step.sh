# Sourced by speed_run.sh and internode_stall_probe.sh (not run on its own).
# step NAME TIMEOUT CMD...: runs CMD under `timeout` with its output in
# $OUT/NAME.log, counts a failure in $failed, prints what the caller's
# step_summary LOG shows of the log and the exit code and seconds, runs the
# caller's step_done, and returns CMD's exit code.
step() {
  local name=$1 t=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || failed=$((failed + 1))
  step_summary "$OUT/$name.log"
  echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
  step_done
  return $rc
}
