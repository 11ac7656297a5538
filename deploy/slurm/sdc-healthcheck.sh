#!/bin/bash
# sdc-healthcheck.sh: admit or drain this Slurm node by its sdcstudy golden check.
#
# Runs `sdcstudy golden check GOLDEN --expect-sha SHA --device all --json REPORT` (every local
# accelerator against the golden record of this node's software stack, refused unless it is
# the record whose manifest SHA-256 the fleet kept) and acts on its exit code, as the table in
# `decide` below and in deploy/README.md says: 0 PASS is logged; 1 FAIL (bits were compared and
# differ, and the check printed its FAIL verdict) drains the node with the first difference as
# the reason and exits 1; 2 INCONCLUSIVE is logged, or drains the node too when
# SDC_DRAIN_ON_INCONCLUSIVE=1; anything else is ERROR, the check could not run or could not
# report (3, 124 timeout, 126/127 command not runnable, 130/143 interrupted, 137 killed, 1
# without a FAIL verdict: a Python that stopped on an error before sdcstudy could report, a
# log that could not be opened): logged as an alert and sent to SDC_ALERT_CMD, never a drain,
# exit 0. The script never resumes a node: a node that failed once may have a
# mercurial core, so a person runs `scontrol update NodeName=... State=RESUME`.
#
# Install as `Prolog=` (before every job; a non-zero exit keeps the job off this node) or as
# `HealthCheckProgram=` (every HealthCheckInterval seconds; slurmd kills it after 60 s, so set
# SDC_TIMEOUT below that). deploy/README.md has the slurm.conf lines.
#
# Settings, from the environment or from the file $SDC_CONFIG (sourced first when readable;
# a value set there wins over the environment, because slurmd gives a prolog no environment
# of its own choosing):
#   SDC_CONFIG         settings file (default /etc/sdcstudy/healthcheck.env)
#   SDC_CMD            the sdcstudy command, split on spaces (default "sdcstudy"),
#                      e.g. "/opt/sdcstudy/.venv/bin/python -m sdcstudy"
#   SDC_MODE           check (default) | quorum (no golden record: the local devices vote)
#   SDC_GOLDEN         golden record folder (default $SDC_GOLDEN_ROOT/<stack id>)
#   SDC_GOLDEN_ROOT    where the golden folders live (default /shared/goldens)
#   SDC_STACK_ID_FILE  holds this node's stack id (default /etc/sdcstudy/stack-id)
#   SDC_EXPECT_SHA     the record's manifest SHA-256 that `golden record` printed, passed as
#                      --expect-sha (default: the contents of SDC_EXPECT_SHA_FILE)
#   SDC_EXPECT_SHA_FILE  holds it, beside the stack id where the golden folder's writers
#                      cannot change it (default /etc/sdcstudy/golden-sha256)
#   SDC_QUORUM_CONFIG  with SDC_MODE=quorum: the workload config (default: the built-in one)
#   SDC_REPORT_DIR     JSON, JUnit and log of each check (default /var/log/sdcstudy; where no
#                      file can be made there, a new folder in $TMPDIR or /tmp, with a warning;
#                      where neither can be written, the check is not run: ERROR)
#   SDC_TIMEOUT        seconds before the check is stopped and counted ERROR (exit 124)
#                      (default 600; 0 = no limit; no limit either, with a warning, where
#                      there is no `timeout` command)
#   SDC_EXTRA_ARGS     more arguments for the check, split on spaces (e.g. "--repeat 3")
#   SDC_DRAIN_ON_INCONCLUSIVE  1 = drain on INCONCLUSIVE (exit 2) too (default 0); never on
#                      ERROR
#   SDC_ALERT_CMD      run on ERROR with one argument, the message, split on spaces like
#                      SDC_CMD (e.g. a pager script); default none (syslog priority alert)
#   SDC_NODE           Slurm node name (default $SLURMD_NODENAME, else `hostname -s`)
set -u

SDC_CONFIG=${SDC_CONFIG:-/etc/sdcstudy/healthcheck.env}
# shellcheck source=/dev/null
if [ -r "$SDC_CONFIG" ]; then . "$SDC_CONFIG"; fi

SDC_CMD=${SDC_CMD:-sdcstudy}
SDC_MODE=${SDC_MODE:-check}
SDC_GOLDEN=${SDC_GOLDEN:-}
SDC_GOLDEN_ROOT=${SDC_GOLDEN_ROOT:-/shared/goldens}
SDC_STACK_ID_FILE=${SDC_STACK_ID_FILE:-/etc/sdcstudy/stack-id}
SDC_EXPECT_SHA=${SDC_EXPECT_SHA:-}
SDC_EXPECT_SHA_FILE=${SDC_EXPECT_SHA_FILE:-/etc/sdcstudy/golden-sha256}
SDC_QUORUM_CONFIG=${SDC_QUORUM_CONFIG:-}
SDC_REPORT_DIR=${SDC_REPORT_DIR:-/var/log/sdcstudy}
SDC_TIMEOUT=${SDC_TIMEOUT:-600}
SDC_EXTRA_ARGS=${SDC_EXTRA_ARGS:-}
SDC_DRAIN_ON_INCONCLUSIVE=${SDC_DRAIN_ON_INCONCLUSIVE:-0}
SDC_ALERT_CMD=${SDC_ALERT_CMD:-}
NODE=${SDC_NODE:-${SLURMD_NODENAME:-$(hostname -s)}}

TAG=sdcstudy-golden

log() {  # PRIORITY MESSAGE: to syslog when logger exists, else to stderr
    if command -v logger >/dev/null 2>&1; then
        logger -t "$TAG" -p "user.$1" -- "$2"
    else
        printf '%s: %s: %s\n' "$TAG" "$1" "$2" >&2
    fi
}

# The first device with verdict $1 in the JSON report and where it first differed (or why it
# could not be checked). Reads the node report ({"devices": [...]}) and a one-device report.
# shellcheck disable=SC2016  # a jq program: its $v and \(...) are jq's, not the shell's
JQ_DESCRIBE='
def where: [("step", "microstep", "layer", "site", "tensor") as $k
            | select(has($k)) | "\($k) \(.[$k])"] | join(", ");
[(if ((.devices // []) | length) > 0 then .devices else [.] end)[] | select(.verdict == $v)]
  as $rows
| $rows[0] // empty
| (if (.device | type) == "object" then .device.index else .device end) as $device
| (if (.first_difference | type) == "object" then (.first_difference | where) else "" end) as $at
| (if $device == null then "golden record: " else "device \($device): " end)
  + (if $at != "" then $at else (.reason // "no reason given" | tostring) end)
  + (if ($rows | length) > 1 then " (+\(($rows | length) - 1) more)" else "" end)'

describe() {  # VERDICT
    local text=""
    if command -v jq >/dev/null 2>&1; then
        text=$(jq -r --arg v "$1" "$JQ_DESCRIBE" "$REPORT" 2>/dev/null) || text=""
    fi
    if [ -z "$text" ] && command -v python3 >/dev/null 2>&1; then
        text=$(python3 - "$REPORT" "$1" 2>/dev/null <<'EOF'
import json, sys

report, verdict = json.load(open(sys.argv[1])), sys.argv[2]
rows = [r for r in report.get("devices") or [report] if r.get("verdict") == verdict]
if rows:
    row, device = rows[0], rows[0].get("device")
    device = device.get("index") if isinstance(device, dict) else device
    first = row.get("first_difference")
    at = ", ".join(f"{k} {first[k]}" for k in ("step", "microstep", "layer", "site", "tensor")
                   if k in first) if isinstance(first, dict) else ""
    more = f" (+{len(rows) - 1} more)" if len(rows) > 1 else ""
    what = "golden record" if device is None else f"device {device}"
    print(f"{what}: {at or row.get('reason') or 'no reason given'}{more}")
EOF
        ) || text=""
    fi
    # One line without quotes, short enough for a Slurm reason.
    text=$(printf '%s' "$text" | tr '\n\r"' '   ')
    printf '%s' "${text:0:200}"
}

alert() {  # MESSAGE: the check could not run or report; never a drain
    log alert "$1"
    if [ -n "$SDC_ALERT_CMD" ]; then
        local alert_cmd
        read -r -a alert_cmd <<<"$SDC_ALERT_CMD"
        "${alert_cmd[@]}" "$1" || log err "SDC_ALERT_CMD '$SDC_ALERT_CMD' failed (exit $?)"
    fi
}

drain() {  # REASON
    log err "draining $NODE: $1"
    if ! scontrol update NodeName="$NODE" State=DRAIN Reason="$1"; then
        log err "scontrol could not drain $NODE; drain it by hand (reason: $1)"
    fi
}

# --- run the check ----------------------------------------------------------------------------

why=""   # set when the check could not even start
stamp=$(date +%Y%m%dT%H%M%S)

writable() {  # DIR: DIR exists (made if need be) and this check's log can be made in it
    { mkdir -p "$1" && : >"$1/golden-$stamp-$$.log"; } 2>/dev/null
}

# Where the log cannot be opened, bash does not run the check and its exit is 1, which must
# not pass for a FAIL: another folder, or no check at all (ERROR).
if ! writable "$SDC_REPORT_DIR"; then
    wanted=$SDC_REPORT_DIR
    SDC_REPORT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/$TAG.XXXXXX" 2>/dev/null) || SDC_REPORT_DIR=""
    if [ -n "$SDC_REPORT_DIR" ] && writable "$SDC_REPORT_DIR"; then
        log warning "cannot write in $wanted: this check's files are in $SDC_REPORT_DIR"
    else
        why="no folder to write the check's log in ($wanted, nor a new one in ${TMPDIR:-/tmp})"
        SDC_REPORT_DIR=$wanted
    fi
fi
base="$SDC_REPORT_DIR/golden-$stamp-$$"
REPORT="$base.json"
read -r -a sdc_cmd <<<"$SDC_CMD"
read -r -a extra_args <<<"$SDC_EXTRA_ARGS"
limit=()
if [ "$SDC_TIMEOUT" != 0 ]; then
    if command -v timeout >/dev/null 2>&1; then
        limit=(timeout -k 30 "$SDC_TIMEOUT")
    else
        log warning "no timeout command: SDC_TIMEOUT=$SDC_TIMEOUT is not applied"
    fi
fi

case "$SDC_MODE" in
    check)
        if [ -z "$SDC_GOLDEN" ]; then
            stack_id=$( { tr -d '[:space:]' <"$SDC_STACK_ID_FILE"; } 2>/dev/null )
            if [ -n "$stack_id" ]; then
                SDC_GOLDEN="$SDC_GOLDEN_ROOT/$stack_id"
            else
                why="no golden record: SDC_GOLDEN is unset and $SDC_STACK_ID_FILE is \
unreadable or empty"
            fi
        fi
        if [ -z "$SDC_EXPECT_SHA" ] && [ -r "$SDC_EXPECT_SHA_FILE" ]; then
            SDC_EXPECT_SHA=$(tr -d '[:space:]' <"$SDC_EXPECT_SHA_FILE")
        fi
        args=(golden check "$SDC_GOLDEN")
        if [ -n "$SDC_EXPECT_SHA" ]; then
            args+=(--expect-sha "$SDC_EXPECT_SHA")
        else
            log warning "no SDC_EXPECT_SHA and no $SDC_EXPECT_SHA_FILE: a golden folder that \
was swapped or sealed again would not be noticed"
        fi ;;
    quorum)
        args=(golden quorum ${SDC_QUORUM_CONFIG:+"$SDC_QUORUM_CONFIG"}) ;;
    *)
        why="SDC_MODE=$SDC_MODE is neither check nor quorum"; args=() ;;
esac

if [ -n "$why" ]; then
    rc=3   # could not run: no verdict on the hardware
else
    log info "checking $NODE: ${sdc_cmd[*]} ${args[*]} --device all (report $REPORT)"
    # ${a[@]+"${a[@]}"}: an empty array under set -u, also in bash before 4.4 (RHEL 7).
    ${limit[@]+"${limit[@]}"} "${sdc_cmd[@]}" "${args[@]}" --device all --json "$REPORT" \
        --junit "$base.xml" ${extra_args[@]+"${extra_args[@]}"} >"$base.log" 2>&1
    rc=$?
fi

# --- decide: the check's exit code -> verdict, action, this script's exit code -----------------
# Keep deploy/README.md's table in step with this one (tests/test_deploy.py compares them).

# Only 1 (bits compared and different) drains, and 2 when asked: a check that could not run
# or report (3, a timeout, a crash, a signal) says nothing about the hardware. And 1 only with
# the check's FAIL verdict, printed before any report file is written (or a FAIL row in its
# report): a Python stopped by an error before sdcstudy's own handler (a broken install,
# "No module named ...") also exits 1, and that is a crash.
code=$rc
if [ "$rc" = 1 ] && ! grep -Eq 'golden (check|quorum) FAIL: ' "$base.log" 2>/dev/null \
        && [ -z "$(describe FAIL)" ]; then
    code=crash
fi
case "$code:$SDC_DRAIN_ON_INCONCLUSIVE" in
    0:*) verdict=PASS;         action=log;   status=0 ;;
    1:*) verdict=FAIL;         action=drain; status=1 ;;
    2:1) verdict=INCONCLUSIVE; action=drain; status=2 ;;
    2:*) verdict=INCONCLUSIVE; action=log;   status=0 ;;
    *)   verdict=ERROR;        action=alert; status=0 ;;
esac

if [ -z "$why" ]; then
    case "$code" in
        0)       why="every device passed" ;;
        124)     why="the check did not finish within $SDC_TIMEOUT s" ;;
        137)     why="the check was killed (timeout or out of memory; see $base.log)" ;;
        126|127) why="could not run '${sdc_cmd[*]}' (exit $rc)" ;;
        130|143) why="the check was interrupted (exit $rc, see $base.log)" ;;
        crash)   # the last line of its log (a traceback's ends with the error)
                 why=$(grep -v '^[[:space:]]*$' "$base.log" 2>/dev/null | tail -n 1 \
                       | cut -c 1-200)
                 why="exit 1 without a FAIL verdict, so the check stopped before it could \
report: ${why:-nothing in $base.log}" ;;
        1|2)     why=$(describe "$verdict")
                 [ -n "$why" ] || why="exit $rc, no readable report (see $base.log)" ;;
        *)       # the check's one sentence, the last error line of its log
                 why=$(grep '^sdcstudy: error: ' "$base.log" 2>/dev/null | tail -n 1 \
                       | cut -c 18-300)
                 [ -n "$why" ] || why="exit $rc (see $base.log)" ;;
    esac
fi

if [ "$action" = drain ]; then
    drain "sdcstudy golden $verdict: $why"
elif [ "$action" = alert ]; then
    alert "$NODE golden check ERROR (exit $rc, could not run or report): $why; node left as \
it is ($base.log)"
elif [ "$verdict" = PASS ]; then
    log info "$NODE PASS: $why ($REPORT)"
else
    log warning "$NODE $verdict (exit $rc): $why; node left as it is ($REPORT)"
fi
exit "$status"
