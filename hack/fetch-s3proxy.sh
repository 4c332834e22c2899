#!/usr/bin/env bash
# Fetch S3Proxy (org.gaul:s3proxy, Apache-2.0: an S3 API server on jclouds; the tests run it with a filesystem
# backend, tests/s3.py) as its jar-with-dependencies, with Maven from its configured repositories, once.
#
# The jar lands in $RLHF_CACHE/bin/s3proxy-<version>.jar, linked as $RLHF_CACHE/bin/current/s3proxy.jar; a version
# already fetched is never fetched again. Needs `mvn` to fetch and `java` (17 or newer) to run it.
# Usage: hack/fetch-s3proxy.sh            (prints the jar's path on the last line)
set -euo pipefail

S3PROXY_VERSION="${S3PROXY_VERSION:-2.9.0}"
CACHE="${RLHF_CACHE:-$HOME/.cache/rlhf-operator}"
BIN="$CACHE/bin"
JAR="$BIN/s3proxy-$S3PROXY_VERSION.jar"
mkdir -p "$BIN/current"

log() { printf '[fetch-s3proxy %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

command -v java >/dev/null || { log "java not found: S3Proxy needs a Java 17+ runtime"; exit 1; }

# One fetch at a time (concurrent test fixtures may call this).
exec 9>"$CACHE/.s3proxy.lock"
flock 9
if [ -s "$JAR" ]; then log "s3proxy $S3PROXY_VERSION cached"; else
  command -v mvn >/dev/null || { log "mvn not found: Maven fetches S3Proxy"; exit 1; }
  log "fetching s3proxy $S3PROXY_VERSION"
  tmp=$(mktemp -d "$BIN/.s3proxy.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  mvn -B -q dependency:copy "-Dartifact=org.gaul:s3proxy:$S3PROXY_VERSION:jar:jar-with-dependencies" \
    "-DoutputDirectory=$tmp" >&2
  mv "$tmp/s3proxy-$S3PROXY_VERSION-jar-with-dependencies.jar" "$JAR"
fi
ln -sfn "$JAR" "$BIN/current/s3proxy.jar"
echo "$JAR"
