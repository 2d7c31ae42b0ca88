#!/bin/sh
# The scrape token comes in the environment and goes to a file only
# Prometheus reads; it is never in the image or the config.
set -eu
umask 077
printf '%s' "${BROKER_TOKEN:?set METRICS_TOKEN (BROKER_TOKEN) to a bearer token for /metrics}" > /tmp/broker_token
unset BROKER_TOKEN
exec /usr/bin/prometheus "$@"
