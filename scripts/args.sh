# Sourced first by every scripts/*.sh, with its arguments: -h or --help prints the script's header
# comment and exits 0 before anything runs. NO_ARGS=1 (set by a script whose settings come from
# the environment): any argument is refused, exit 2.
case ${1:-} in -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
if [ "${NO_ARGS:-0}" = 1 ] && [ $# -gt 0 ]; then
  echo "$(basename "$0"): no arguments (settings come from the environment; --help)" >&2
  exit 2
fi
