#!/bin/sh
# Renders envoy-config/envoy.yaml (a template with ${NAME} placeholders) from the environment
# and execs Envoy on the result. Used as the entrypoint of the compose `envoy` service, whose
# official image has sh and awk but no envsubst.
#
#   render-envoy.sh TEMPLATE OUTPUT [envoy args...]
#
# FILTER_CONFIG may be given as a file instead (FILTER_CONFIG_FILE): its JSON is turned into
# one YAML double-quoted string, as the template expects. With NATIVE_AGENTS (a JSON object,
# pool -> ["ip:port", ...]) the file is wrapped as the native module's config instead:
# {"filter": <file>, "agents": <NATIVE_AGENTS>} (envoy-native.yaml). Placeholders are replaced literally
# (no regex, no shell evaluation); comment lines are copied as they are; a placeholder whose
# variable is unset stops the start-up with its name, rather than starting a broken Envoy.
# With RENDER_ONLY=1 it renders and exits (used by tests/e2e/tests/deploy_compose.rs).
set -eu

template=$1
output=$2
shift 2

if [ -n "${FILTER_CONFIG_FILE:-}" ]; then
    # JSON -> one line -> YAML double-quoted scalar (escape backslashes, then quotes).
    json=$(cat "$FILTER_CONFIG_FILE")
    if [ -n "${NATIVE_AGENTS:-}" ]; then
        json="{\"filter\": $json, \"agents\": $NATIVE_AGENTS}"
    fi
    FILTER_CONFIG=\"$(printf '%s' "$json" | tr '\n\r\t' '   ' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')\"
    export FILTER_CONFIG
fi

awk '
/^[ \t]*#/ { print; next }
{
    line = $0
    out = ""
    while ((i = index(line, "${")) > 0) {
        rest = substr(line, i + 2)
        j = index(rest, "}")
        if (j == 0) break
        name = substr(rest, 1, j - 1)
        if (!(name in ENVIRON)) {
            printf "render-envoy: %s is used on line %d but not set\n", name, NR > "/dev/stderr"
            failed = 1
            exit 2
        }
        out = out substr(line, 1, i - 1) ENVIRON[name]
        line = substr(rest, j + 1)
    }
    print out line
}
' "$template" > "$output"

if [ "${RENDER_ONLY:-0}" = "1" ]; then
    exit 0
fi
exec envoy -c "$output" "$@"
