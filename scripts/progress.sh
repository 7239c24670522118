# Sourced by scripts/setup.sh, build_interfaces.sh and test.sh: progress lines for the long steps of a setup.
# Every line says how long the setup has been running; a long step prints what it starts, a line every
# 15 s while it runs (its time so far and what its log says it is doing: the package pip is downloading,
# the file cmake is compiling) and its duration. Its output goes to a log, shown only when it fails.
#   PROGRESS_TAG    the prefix of the lines ("setup")
#   OXYGEN_SETUP_START  when the setup began (epoch seconds; exported, so nested scripts count from it)

export OXYGEN_SETUP_START="${OXYGEN_SETUP_START:-$(date +%s)}"
PROGRESS_TAG="${PROGRESS_TAG:-setup}"

say() {
  local t=$(($(date +%s) - OXYGEN_SETUP_START))
  printf '[%s %d:%02d] %s\n' "$PROGRESS_TAG" $((t / 60)) $((t % 60)) "$*"
}

# The last line of a step's log that says what it is doing (pip, cmake, ninja), at most 110 characters.
doing() {
  grep -aE '^ *(Collecting|Downloading|Installing|Building|Preparing|WARNING: Retrying)|^ *\[ *[0-9]+(%|/[0-9]+)\]|cmake (configure|build|install)' "$1" 2>/dev/null \
    | tail -1 | sed -E 's/^ +//; s/^Installing collected packages: (.*)/unpacking the \1/' \
    | awk '/^unpacking the / { n = split(substr($0, 15), a, ", ");
                               print "unpacking " (n == 1 ? a[1] : n " packages") " into .venv"; next } { print }' \
    | cut -c1-110
}

# run_step LABEL LOG COMMAND...: run COMMAND with its output in LOG, printing LABEL, a progress line every
# 15 s and the duration. Returns COMMAND's status. Ctrl-C stops COMMAND and everything it started.
run_step() {
  local label="$1" log="$2" start rc=0 next pid
  shift 2
  mkdir -p "$(dirname "$log")"
  start=$(date +%s)
  next=$((start + 15))
  say "$label"
  # setsid: its own process group, so that stopping it stops pip's and cmake's children too.
  setsid "$@" >"$log" 2>&1 </dev/null &
  pid=$!
  trap 'kill -TERM -- -'"$pid"' 2>/dev/null; echo; say "stopped"; exit 130' INT TERM
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (($(date +%s) >= next)); then
      say "  ... $(($(date +%s) - start)) s: $(doing "$log")"
      next=$((next + 15))
    fi
  done
  wait "$pid" || rc=$?
  trap - INT TERM
  ((rc == 0)) && say "  done ($(($(date +%s) - start)) s)"
  return "$rc"
}

# explain_pip_failure WHAT LOG: one clear message for a failed pip step (an unreachable index named as
# such), instead of pip's retries and traceback.
explain_pip_failure() {
  local what="$1" log="$2" hosts
  if grep -qaE 'NameResolutionError|Failed to resolve|Failed to establish a new connection|Temporary failure in name resolution|Network is unreachable|Connection refused|ConnectTimeout|Read timed out|SSLError|ProxyError' "$log"; then
    hosts="$(grep -aoE "host='[^']+'" "$log" | cut -d"'" -f2 | sort -u | paste -sd, -)"
    say "error: $what: cannot reach ${hosts:-the package index} (pip tried and gave up)."
    say "  Check the network and proxy (HTTPS_PROXY) or pip's index settings (pip config list). pip's log: $log"
  else
    say "error: $what failed. pip says:"
    grep -aE '^ERROR' "$log" | head -5 | cut -c1-300 | sed 's/^/    /'
    say "  pip's full log: $log"
  fi
}
