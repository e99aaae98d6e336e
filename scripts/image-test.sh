#!/usr/bin/env bash
# `make image-test` (CI runs it): builds both images (scripts/images.sh), then runs the worker
# image the way the operator's Deployment runs it and the operator image's `crd`.
#
# Why this exists: a Dockerfile nobody has run is a guess (a missing library, an entrypoint that
# writes where the read-only root forbids it, a CA bundle that is not there). So, against the
# test broker (Apache Kafka on BROKER_PORT, via scripts/with-broker.sh) on the host network:
#   - the worker container runs as the Deployment has it: user 65532, read-only root filesystem
#     (no tmpfs either), every capability dropped, no new privileges, the config mounted
#     read-only at /etc/sessionflow, the args the operator renders (RENDERED_* below);
#   - three handlers: builtin, a real HTTP service, and the same service over HTTPS with a test
#     CA made here with openssl (mounted over the image's CA bundle); each time 10,000 records
#     over 100 sessions, SIGTERM in the middle (exit 0 within the grace period), a restart, then
#     `verify`: OK, nothing lost, no duplicate (nothing processed twice, see `scenario`); once
#     more with exactly the operator's config;
#   - /healthz, /readyz and /metrics answer from outside the container;
#   - Kafka over TLS with SASL (SCRAM-SHA-512): a node of Apache Kafka of its own
#     (scripts/kafka.sh --sasl-ssl) whose certificate's CA is given as the operator gives it
#     (ssl.ca.location in the mounted Secret, the SCRAM credentials as environment variables):
#     the image's tools create topics and load them, the worker runs the records through, and
#     `verify` reads them back, all over SASL_SSL; with the image's CA bundle only, the
#     certificate is refused and the worker stays unready;
#   - the HTTPS handler is refused when the CA is not trusted (the certificate is checked);
#   - the tools (`sessionflow`: create-topics, loadgen, lag, verify, dlq-replay) run from the
#     worker image too (`--entrypoint sessionflow`), hardened the same way;
#   - `sessionflow-operator crd` from the operator image equals crds/sessionpipeline.yaml;
#   - the OCI labels carry the version and the revision; each binary carries its dependency
#     list (cargo auditable's .dep-v0 section);
#   - each image's size is printed (the worker's aim: under 40 MB).
#
#   IMAGE_TEST_SKIP_BUILD=1   use the images already built
#   IMAGE_TEST_PORT           first of the ports the test uses on 127.0.0.1 (default
#                             BROKER_PORT+4, past the broker's own four: metrics, then +1 HTTP, +2 HTTPS, +3 TLS listener)
set -euo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
source scripts/image-lib.sh

# The worker container of the operator's Deployment (operator/src/render.rs). The test
# tests/tests/operator/image_contract.rs renders a pipeline and checks these lines against it.
RENDERED_ARGS=(--log-format json run --config /etc/sessionflow/stage.yaml)
RENDERED_CONFIG_DIR=/etc/sessionflow
RENDERED_USER=65532:65532
# terminationGracePeriodSeconds of a stage with the worker's default timeouts.
RENDERED_GRACE_SECONDS=100

if [[ -z ${IMAGE_TEST_INNER:-} ]]; then
  start=$SECONDS
  [[ -n ${IMAGE_TEST_SKIP_BUILD:-} ]] || scripts/images.sh
  IMAGE_TEST_INNER=1 scripts/with-broker.sh "$self"
  echo "image-test: OK ($((SECONDS - start)) s in all)"
  exit 0
fi

BROKERS=${SESSIONFLOW_BROKERS:?run under scripts/with-broker.sh}
base_port=${IMAGE_TEST_PORT:-$((${BROKER_PORT:-9092} + 4))}
METRICS_PORT=$base_port
HTTP_PORT=$((base_port + 1))
HTTPS_PORT=$((base_port + 2))
TLS_KAFKA_PORT=$((base_port + 3))
RUN=$(date +%s)-$$
RECORDS=10000
SESSIONS=100
work=$(mktemp -d)
chmod 755 "$work"
containers=()
pids=()
secured_kafka=0
cleanup() {
  for c in "${containers[@]}"; do pod rm -f -t 0 "$c" >/dev/null 2>&1 || true; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if ((secured_kafka)); then scripts/kafka.sh stop --port "$TLS_KAFKA_PORT" >/dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "image-test: FAILED: $*" >&2
  exit 1
}
step() { echo "== image-test: $*"; }
# shellcheck disable=SC2046 # pod_limits is a list of flags
LIMITS=($(pod_limits))
# As the Deployment's securityContext has it (the pod's runAsUser/runAsGroup, the container's
# readOnlyRootFilesystem, drop ALL, allowPrivilegeEscalation false; seccomp RuntimeDefault is
# podman's default profile).
HARDENED=(--pull=never --user "$RENDERED_USER" --read-only --read-only-tmpfs=false --cap-drop ALL
  --security-opt no-new-privileges --network host "${LIMITS[@]}")
# The tools (create-topics, loadgen, lag, verify, dlq-replay): the `sessionflow` binary beside
# the worker's in its image.
tool() { pod run --rm "${HARDENED[@]}" --entrypoint /usr/local/bin/sessionflow "$WORKER_IMAGE" "$@"; }
http_code() { curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" || true; }
metric() { # the sum of the samples of metric $1 whose labels contain $2 (0 when none)
  curl -s --max-time 2 "http://127.0.0.1:$METRICS_PORT/metrics" |
    awk -v m="$1" -v l="${2:-}" '(index($0, m "{") == 1 || index($0, m " ") == 1) && index($0, l) {
      s += $NF } END { printf "%d\n", s }'
}
wait_for() { # seconds, description, command...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@"; do
    ((SECONDS < deadline)) || fail "timed out waiting for $what"
    sleep 0.5
  done
}
ready() { [[ $(http_code "http://127.0.0.1:$METRICS_PORT/readyz") == 200 ]]; }
exited() { [[ $(pod inspect --format '{{.State.Status}}' "$1") == exited ]]; }

# --- the test CA, a server certificate for 127.0.0.1/localhost, the handler service ----------
step "test CA (openssl)"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=sessionflow image-test CA" \
  -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
  -keyout "$work/server.key" -out "$work/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >"$work/ext"
openssl x509 -req -in "$work/server.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
  -CAcreateserial -days 2 -extfile "$work/ext" -out "$work/server.crt" 2>/dev/null
mkdir -m 755 "$work/trust"
cp "$work/ca.crt" "$work/trust/ca-certificates.crt"
chmod 644 "$work/trust/ca-certificates.crt" "$work/ca.crt"

cat >"$work/handler.py" <<'PY'
# The stage service: POST → 200 with the body (the output record's value), after 1 ms of work.
import http.server, ssl, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(0.001)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
port, cert, key = int(sys.argv[1]), sys.argv[2:3], sys.argv[3:4]
class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    def handle_error(self, request, client_address):
        pass  # a connection the worker dropped when it stopped
server = Server(("127.0.0.1", port), Handler)
if cert:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert[0], key[0])
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
server.serve_forever()
PY
python3 "$work/handler.py" "$HTTP_PORT" &
pids+=($!)
python3 "$work/handler.py" "$HTTPS_PORT" "$work/server.crt" "$work/server.key" &
pids+=($!)
wait_for 10 "the HTTP service" curl -s -o /dev/null -X POST "http://127.0.0.1:$HTTP_PORT/"
wait_for 10 "the HTTPS service" curl -s -o /dev/null --cacert "$work/ca.crt" -X POST \
  "https://localhost:$HTTPS_PORT/"

# --- a stage config as the operator renders it into the ConfigMap ----------------------------
write_config() { # dir mode handler-yaml [extra kafka properties yaml]
  mkdir -m 755 -p "$1"
  cat >"$1/stage.yaml" <<YAML
brokers: $BROKERS
group: sessionflow.image-test.$2.$RUN
stage: $2
input: img-$2-$RUN
output: img-$2-$RUN.out
dlq: img-$2-$RUN.dlq
handler:
$3
metricsAddr: 0.0.0.0:$METRICS_PORT
kafka:
  fetch.wait.max.ms: "100"
  session.timeout.ms: "6000"
  heartbeat.interval.ms: "500"
${4:-}
${EXTRA_CONFIG:-}
YAML
  chmod 644 "$1/stage.yaml"
}

# --- one handler: load, run, SIGTERM mid-stream, restart, verify ----------------------------
# With `shutdownDrainQueued: true` the stop finishes what it took in, and the final commit covers
# it. With the operator's defaults (`drained=default`) a stop releases the records queued behind
# each session's current one, and the restart skips the ones finished out of order through the
# completed-offset map the final commit carries as its metadata (tests/e2e offset_map). Either
# way the restart must process nothing twice: verify's duplicates must be 0.
scenario() { # mode drained|default handler-yaml [podman args]
  local mode=$1 drain=$2 handler=$3 name=sf-image-test-$1-$RUN
  shift 3
  local in=img-$mode-$RUN extra=""
  # (at most 100 records per partition taken in: the drained stop then fits shutdownTimeoutMs
  # even with a slow service)
  [[ $drain == drained ]] && extra=$'shutdownDrainQueued: true\nmaxInFlightPerPartition: 100'
  step "$mode handler ($drain stop): $RECORDS records over $SESSIONS sessions"
  tool create-topics --brokers "$BROKERS" --partitions 8 "$in" "$in.out" "$in.dlq" >/dev/null
  tool loadgen --brokers "$BROKERS" --topic "$in" --records "$RECORDS" --sessions "$SESSIONS" \
    --seed 7 | tail -n1 | sed 's/^/  /'
  EXTRA_CONFIG=$extra write_config "$work/$mode" "$mode" "$handler"
  containers+=("$name")
  pod run -d --name "$name" "${HARDENED[@]}" -v "$work/$mode:$RENDERED_CONFIG_DIR:ro" "$@" \
    "$WORKER_IMAGE" "${RENDERED_ARGS[@]}" >/dev/null
  wait_for 60 "/readyz of the $mode worker" ready
  [[ $(http_code "http://127.0.0.1:$METRICS_PORT/healthz") == 200 ]] || fail "/healthz"
  # Read whole, then searched: piped into `grep -q`, curl could be cut off when grep had its
  # line and exit 23, which pipefail made this check's failure (it did, in a CI run).
  local metrics
  metrics=$(curl -sf "http://127.0.0.1:$METRICS_PORT/metrics") || fail "/metrics did not answer"
  grep -q '^sessionflow_records_in_total' <<<"$metrics" ||
    fail "/metrics has no sessionflow_records_in_total"
  echo "  /healthz 200, /readyz 200, /metrics answers (from outside the container)"
  # SIGTERM once a quarter of the records are out (mid-stream unless the stage outruns the poll).
  out_at_least() { (($(metric sessionflow_records_out_total) >= $1)); }
  wait_for 120 "records out of the $mode worker" out_at_least $((RECORDS / 4))
  local t0=$SECONDS
  echo "  SIGTERM with $(metric sessionflow_records_out_total) of $RECORDS records out"
  pod kill --signal TERM "$name" >/dev/null
  local deadline=$((SECONDS + RENDERED_GRACE_SECONDS))
  until exited "$name"; do
    if ((SECONDS >= deadline)); then
      pod kill --signal KILL "$name" >/dev/null 2>&1 || true
      fail "$mode worker still running ${RENDERED_GRACE_SECONDS}s (the grace period) after SIGTERM"
    fi
    sleep 0.2
  done
  local code
  code=$(pod inspect --format '{{.State.ExitCode}}' "$name")
  [[ $code == 0 ]] || { pod logs --tail 20 "$name" >&2; fail "$mode worker exited $code on SIGTERM"; }
  echo "  exit 0, $((SECONDS - t0)) s after SIGTERM (grace ${RENDERED_GRACE_SECONDS} s)"
  # The restart: the same container again (a pod restart), from the committed offsets.
  pod start "$name" >/dev/null
  wait_for 60 "/readyz of the restarted $mode worker" ready
  tool lag --brokers "$BROKERS" --group "sessionflow.image-test.$mode.$RUN" --topic "$in" \
    --wait-zero --timeout-secs 300 >/dev/null 2>&1 || fail "$mode: lag never reached 0"
  pod kill --signal TERM "$name" >/dev/null
  wait_for "$RENDERED_GRACE_SECONDS" "the $mode worker to stop" exited "$name"
  code=$(pod inspect --format '{{.State.ExitCode}}' "$name")
  [[ $code == 0 ]] || fail "restarted $mode worker exited $code on SIGTERM"
  local report
  report=$(tool verify --brokers "$BROKERS" --topic "$in.out" --input "$in" --dlq "$in.dlq" \
    --timeout-secs 60) || { echo "$report" >&2; fail "$mode: verify"; }
  echo "$report" | grep -E '^(records|duplicates|lost|order violations|verdict) ' | sed 's/^/  /'
  echo "$report" | grep -qE '^lost +0$' || fail "$mode: records lost"
  tool dlq-replay --brokers "$BROKERS" --dlq "$in.dlq" --dry-run >/dev/null ||
    fail "$mode: dlq-replay --dry-run"
  echo "$report" | grep -qE '^duplicates +0$' || fail "$mode ($drain stop): records processed twice"
  pod rm "$name" >/dev/null
}

scenario builtin drained "  builtin:
    latencyMs: 5"
scenario http drained "  http:
    url: http://127.0.0.1:$HTTP_PORT/
    timeoutMs: 5000"
# The test CA replaces the image's bundle (/etc/ssl/certs/ca-certificates.crt, SSL_CERT_FILE),
# as a ConfigMap mounted there would.
scenario https drained "  http:
    url: https://localhost:$HTTPS_PORT/
    timeoutMs: 5000" -v "$work/trust/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"
# Exactly the operator's config (no shutdownDrainQueued): exit 0 in the grace period, no loss.
scenario defaults default "  builtin:
    latencyMs: 5"

step "HTTPS handler with the image's own CA bundle: the test CA's certificate is refused"
write_config "$work/untrusted" untrusted "  http:
    url: https://localhost:$HTTPS_PORT/
    timeoutMs: 5000"
tool create-topics --brokers "$BROKERS" --partitions 1 "img-untrusted-$RUN" \
  "img-untrusted-$RUN.out" "img-untrusted-$RUN.dlq" >/dev/null
tool loadgen --brokers "$BROKERS" --topic "img-untrusted-$RUN" --records 1 --sessions 1 >/dev/null
name=sf-image-test-untrusted-$RUN
containers+=("$name")
pod run -d --name "$name" "${HARDENED[@]}" -v "$work/untrusted:$RENDERED_CONFIG_DIR:ro" \
  "$WORKER_IMAGE" "${RENDERED_ARGS[@]}" >/dev/null
wait_for 60 "/readyz of the untrusted worker" ready
refused() { (($(metric sessionflow_handler_duration_seconds_count 'outcome="transient"') >= 3)); }
wait_for 60 "failed handler calls in the untrusted worker" refused
[[ $(metric sessionflow_records_out_total) == 0 ]] || fail "an HTTPS call succeeded with an untrusted CA"
echo "  $(metric sessionflow_handler_duration_seconds_count 'outcome="transient"') calls failed, 0 records out"
pod rm -f -t 0 "$name" >/dev/null

step "Kafka over TLS + SASL (SCRAM-SHA-512) from the worker image"
# A node of Apache Kafka of its own whose client listener speaks SASL_SSL with a certificate of a
# CA made by scripts/kafka.sh, and a SCRAM user.
scripts/kafka.sh start --port "$TLS_KAFKA_PORT" --sasl-ssl >/dev/null
secured_kafka=1
secure=$(scripts/kafka.sh secure-dir --port "$TLS_KAFKA_PORT")
scram_user=$(sed -n 's/^sasl.username=//p' "$secure/client.properties")
scram_password=$(sed -n 's/^sasl.password=//p' "$secure/client.properties")
# The Secret the operator mounts at /etc/sessionflow/kafka-tls, the credentials it passes as
# environment variables, and the properties it renders.
mkdir -m 755 "$work/kafka-tls-secret"
cp "$secure/ca.pem" "$work/kafka-tls-secret/ca.crt"
chmod 644 "$work/kafka-tls-secret/ca.crt"
SECRET=(-v "$work/kafka-tls-secret:$RENDERED_CONFIG_DIR/kafka-tls:ro"
  -e "SESSIONFLOW_SASL_USERNAME=$scram_user" -e "SESSIONFLOW_SASL_PASSWORD=$scram_password")
SECURED_BROKERS=127.0.0.1:$TLS_KAFKA_PORT
secured_tool() { # subcommand args…: the image's tools against the secured node
  local command=$1
  shift
  pod run --rm "${HARDENED[@]}" "${SECRET[@]}" --entrypoint /usr/local/bin/sessionflow \
    "$WORKER_IMAGE" "$command" --brokers "$SECURED_BROKERS" -X security.protocol=SASL_SSL \
    -X sasl.mechanism=SCRAM-SHA-512 -X "ssl.ca.location=$RENDERED_CONFIG_DIR/kafka-tls/ca.crt" "$@"
}
kafka_tls() { # mode ssl.ca.location: a worker on the secured node, started and left running
  write_config "$work/$1" "$1" "  builtin: {}" "  security.protocol: SASL_SSL
  sasl.mechanisms: SCRAM-SHA-512
  ssl.ca.location: $2"
  sed -i "s|^brokers: .*|brokers: $SECURED_BROKERS|" "$work/$1/stage.yaml"
  mkdir -m 755 "$work/$1/kafka-tls" # the mount point, as the kubelet makes it
  containers+=("sf-image-test-$1-$RUN")
  pod run -d --name "sf-image-test-$1-$RUN" "${HARDENED[@]}" \
    -v "$work/$1:$RENDERED_CONFIG_DIR:ro" "${SECRET[@]}" "$WORKER_IMAGE" "${RENDERED_ARGS[@]}" \
    >/dev/null
}
# With the CA of the mounted Secret: records go through the whole stage, verified.
in=img-kafkatls-$RUN
secured_tool create-topics --partitions 4 "$in" "$in.out" "$in.dlq" >/dev/null
secured_tool loadgen --topic "$in" --records 1000 --sessions 20 --seed 7 >/dev/null
kafka_tls kafkatls "$RENDERED_CONFIG_DIR/kafka-tls/ca.crt"
wait_for 60 "/readyz of the worker on SASL_SSL" ready
secured_tool lag --group "sessionflow.image-test.kafkatls.$RUN" --topic "$in" --wait-zero \
  --timeout-secs 120 >/dev/null 2>&1 || fail "Kafka over SASL_SSL: lag never reached 0"
report=$(secured_tool verify --topic "$in.out" --input "$in" --dlq "$in.dlq" --timeout-secs 60) ||
  { echo "$report" >&2; fail "Kafka over SASL_SSL: verify"; }
grep -qE '^verdict +OK' <<<"$report" || { echo "$report" >&2; fail "Kafka over SASL_SSL: verify"; }
echo "  CA from the mounted Secret: 1000 records through the stage, verify OK"
pod rm -f -t 0 "sf-image-test-kafkatls-$RUN" >/dev/null
# With the image's CA bundle only, the node's certificate is refused: librdkafka says so, and
# the worker stays unready.
kafka_tls kafkatls-untrusted /etc/ssl/certs/ca-certificates.crt
refused() { pod logs "sf-image-test-kafkatls-untrusted-$RUN" 2>&1 | grep -q 'certificate verify failed'; }
wait_for 60 "librdkafka to refuse the node's certificate" refused
ready && fail "a worker that cannot verify the node's certificate is ready"
echo "  the image's CA bundle only: certificate verify failed, /readyz $(http_code "http://127.0.0.1:$METRICS_PORT/readyz")"
pod rm -f -t 0 "sf-image-test-kafkatls-untrusted-$RUN" >/dev/null

step "operator image: crd"
pod run --rm "${HARDENED[@]}" "$OPERATOR_IMAGE" crd >"$work/crd.yaml"
diff -u crds/sessionpipeline.yaml "$work/crd.yaml" || fail "the operator image's CRD differs from crds/"
echo "  identical to crds/sessionpipeline.yaml"

step "labels and dependency lists"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
for image in "$WORKER_IMAGE" "$OPERATOR_IMAGE"; do
  label() { pod image inspect --format "{{index .Labels \"org.opencontainers.image.$1\"}}" "$image"; }
  [[ $(label version) == "$version" ]] || fail "$image: version label $(label version)"
  [[ $(label revision) =~ ^[0-9a-f]{40}(-dirty)?$ ]] || fail "$image: revision label $(label revision)"
  [[ -n $(label source) ]] || fail "$image: no source label"
  bins=${image##*/}
  bins=${bins%%:*}
  # The worker image carries the tools' binary too.
  [[ $image == "$WORKER_IMAGE" ]] && bins="$bins sessionflow"
  ctr=$(bah from --quiet --pull=never "$image")
  mnt=$(bah mount "$ctr")
  deps=""
  for bin in $bins; do
    n=$(python3 - "$mnt/usr/local/bin/$bin" <<'PY'
# cargo auditable's .dep-v0 section: zlib-compressed JSON of the dependency tree.
import json, subprocess, sys, tempfile, zlib
with tempfile.NamedTemporaryFile() as out:
    subprocess.run(["objcopy", "--dump-section", f".dep-v0={out.name}", sys.argv[1], "/dev/null"],
                   check=True)
    data = open(out.name, "rb").read()
names = {p["name"] for p in json.loads(zlib.decompress(data))["packages"]}
assert {"rdkafka", "tokio"} <= names, names
print(len(names))
PY
    ) || fail "$image: no readable dependency list in $bin"
    deps="$deps $bin: $n"
  done
  bah umount "$ctr" >/dev/null
  bah rm "$ctr" >/dev/null
  echo "  $image: version $(label version), revision $(label revision), crates listed in .dep-v0:$deps"
done

step "sizes"
for image in "$WORKER_IMAGE" "$OPERATOR_IMAGE"; do
  bytes=$(image_bytes "$image")
  awk -v i="$image" -v b="$bytes" 'BEGIN { printf "  %s: %.1f MB (%d bytes)\n", i, b / 1e6, b }'
done
bytes=$(image_bytes "$WORKER_IMAGE")
((bytes < 40000000)) || echo "  *** the worker image is over the 40 MB aim ***"
